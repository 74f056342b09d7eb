"""A split of an OUT on a store, read through a bounded local cache that the ranks of a node share.

The split is read in blocks (tokpipe.data.blocks: a block's windows, in the order a store can serve). A block is
fetched once by ranged GETs (each If-Match the ETag first seen: read/maps.py StoreFile) into a file of the cache,
`<block>.blk`: its windows' tokens (seq_len * windows + 1: the last window's last token is the next block's first),
then where documents start in them (int64, from the block's first token: each file's start and each document's end).
A file is written under a temporary name and renamed, so a block in the cache is whole; the fetch of a block is under
an flock of `<block>.fetch`, so that of the ranks of a node that want it at once one fetches it and the others find
it there: a node fetches a block once an epoch, not once a rank.

A reader maps the blocks of the buffer it reads (no descriptor kept) and fetches the next buffer's meanwhile, in
FETCHERS threads; once it reads into the next buffer, it unmaps the blocks behind and removes them from the cache.
Ranks in lockstep (DDP) read one buffer at a time: one that removes a block another still reads takes nothing from
it, since a mapped file stays readable when it is removed. So the cache holds two buffers (`cache_size`,
Geometry.fitted), and three at a moment where a rank that lags still maps the buffer before; a rank that lags
further fetches a block again.

Windows are read as TokenFiles reads them (read/files.py): one row gather a batch from a view of the process's
memory over the maps (a block's first token at its `shift`), and one search of the places documents start, every
mapped block's merged.

Where documents start: a split of at most MERGED documents keeps them all in memory, as TokenFiles does; for a
larger one, `index.bin` in the cache holds, for each block, the number of documents that end before it (where its
ends are in the split's .idx files), made once a cache by streaming the .idx files (8 bytes a document, ~0.2% of the
tokens' bytes at 1,000 tokens a document) under an flock as a block is, and read by every later reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tokpipe.data.blocks import Geometry
from tokpipe.errors import Unavailable
from tokpipe.layout.meta import OutputError
from tokpipe.layout.records import IDX_DTYPE
from tokpipe.read.files import MERGED, UNMAPPED, TokenFiles, within
from tokpipe.read.maps import LocalFile, array_at, identity

FETCHERS = 8  # GETs in flight: SeaweedFS here served 1 MiB ranges at 360 MB/s to 4 threads, 400 to 8
ENDS_READ = 1 << 20  # document ends streamed at a time while the index is made (8 MB)


class BlockCache:
    """The blocks of one split's windows of seq_len (its TokenFiles on a store) as `geometry` cuts them, through the
    cache folder `folder` (one per split's tokens and geometry: Sequences names it)."""

    def __init__(self, files: TokenFiles, seq_len: int, geometry: Geometry, folder: Path):
        self.files, self.seq_len, self.geometry, self.folder = files, seq_len, geometry, folder
        self.dtype = files.dtype
        folder.mkdir(parents=True, exist_ok=True)
        _forget_before_boot(folder)
        # where documents start: of a split of at most MERGED documents, all in memory (TokenFiles' rule: 16 MB
        # at most); of a larger one, which of its ends each block takes (index.bin), GET with the block
        self._split_places = files.merged() if files.documents <= MERGED else None
        self._first_doc = None if self._split_places is not None else self._index()
        self._fetches: dict[int, Future] = {}
        self._maps: dict[int, np.ndarray] = {}  # block -> its tokens, mapped
        self._places: dict[int, np.ndarray] = {}  # block -> where documents start in it, as indexes of the view
        self._shift = np.full(geometry.blocks, UNMAPPED, dtype=np.int64)  # its first token's address / itemsize
        self._low = self._high = 0  # every map so far lay in [low, high)
        self._view: np.ndarray | None = None  # the memory from low to high as windows of seq_len + 1
        self._merged: np.ndarray | None = None  # every mapped block's places, sorted
        self._read_before: set[int] | None = None  # the blocks of the buffer read before (keep)
        self._lock = threading.RLock()  # of _fetches (a fetch done at once calls back in the thread that asked)

    # -- reading ------------------------------------------------------------------------------------------------

    def read(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """These windows' tokens (B, seq_len + 1) int64 and document starts (offsets, bounds), fetching any block
        not in the cache first. A fetch that fails raises (nothing is left half made)."""
        blocks, within_block = np.divmod(windows, self.geometry.per_block)
        shifts = self._shift[blocks]
        if shifts.min(initial=0) == UNMAPPED:  # (np.unique of none cost 6 us a batch)
            for b in np.unique(blocks[shifts == UNMAPPED]).tolist():
                self._map(b)
            shifts = self._shift[blocks]
        starts = shifts + within_block * self.seq_len
        tokens = self._windows()[starts - self._low // self.dtype.itemsize].astype(np.int64)
        places = self._places_merged()
        at = np.searchsorted(places, np.concatenate([starts, starts + self.seq_len + 1]))
        return tokens, *within(places, at, starts)

    def _windows(self) -> np.ndarray:
        if self._view is None:
            step = self.dtype.itemsize
            memory = array_at(self._low, ((self._high - self._low) // step,), self.dtype)
            shape = (max(len(memory) - self.seq_len, 0), self.seq_len + 1)
            self._view = np.lib.stride_tricks.as_strided(memory, shape, (step, step))
        return self._view

    def _places_merged(self) -> np.ndarray:
        if self._merged is None:
            placed = [self._places[b] for b in sorted(self._places, key=self._shift.__getitem__)]
            self._merged = np.concatenate(placed) if placed else np.zeros(0, np.int64)
        return self._merged

    def _map(self, b: int) -> None:
        """Block b mapped and placed in the view (fetched first, where the cache does not hold it)."""
        for _ in range(3):  # removed between its fetch and its map by a rank ahead: fetched again
            try:
                self._fetched(b)
            except Unavailable as e:
                raise type(e)(f"{e}; block {b} of the split not fetched: the loader did not move") from None
            try:
                tokens, places = self._open(b)
                break
            except (FileNotFoundError, OutputError):
                continue
        else:
            raise OSError(f"block {b} was removed from {self.folder} as often as it was fetched: another run reads it")
        step = self.dtype.itemsize
        address = tokens.ctypes.data
        self._maps[b], self._shift[b] = tokens, address // step
        self._places[b] = places + address // step
        self._merged = None
        if not self._low <= address < address + tokens.nbytes <= self._high:
            self._low = min(self._low, address) if self._high else address
            self._high = max(self._high, address + tokens.nbytes)
            self._view = None

    def _open(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's tokens, mapped, and its places, read; FileNotFoundError where the cache does not hold it."""
        path = self._path(b)
        status = os.stat(path)
        file = LocalFile(path, status.st_size, identity(status))
        count = self._tokens_of(b)
        first = _aligned(count * self.dtype.itemsize) // IDX_DTYPE.itemsize
        if status.st_size < first * IDX_DTYPE.itemsize or status.st_size % IDX_DTYPE.itemsize:
            path.unlink(missing_ok=True)  # not a block this geometry writes: fetched again
            raise FileNotFoundError(path)
        places = file.array(IDX_DTYPE, first, (status.st_size // IDX_DTYPE.itemsize) - first)
        return file.mapped(self.dtype)[:count], places

    # -- the buffers kept ---------------------------------------------------------------------------------------

    def keep(self, now: np.ndarray, ahead: np.ndarray) -> None:
        """The blocks of the buffer read now mapped (fetched first where the cache does not hold them), those of the
        next fetched into the cache meanwhile; the blocks of the buffer read before unmapped and removed from the
        cache, and at the first call every block but these, and their temporary and lock files (a loader killed
        before left them).

        Only the buffer this rank leaves is removed: a rank that removed every block but its own two removed those a
        rank ahead was fetching for its next buffer (a rank that opens, or lags a buffer). Mapped at once, not as
        windows need them: a rank that moves on first removes them from the cache, and a block mapped stays readable
        (one that a rank had not mapped yet was fetched again: 1.14x the split's bytes an epoch, against 1.00). A
        block that cannot be fetched now is asked again, and its error raised, by the read that needs it: keep
        raises nothing, so a batch read is never lost after the position moved."""
        read, wanted = set(now.tolist()), set(now.tolist()) | set(ahead.tolist())
        for b in [b for b in self._maps if b not in read]:
            del self._maps[b], self._places[b]
            self._shift[b] = UNMAPPED
            self._merged = None
        with contextlib.suppress(OSError):  # (a cache folder removed meanwhile: the fetches make it again)
            if self._read_before is None:
                for path in self.folder.iterdir():
                    stem = path.name.partition(".")[0]
                    if path.suffix in (".blk", ".tmp", ".fetch") and stem.isdigit() and int(stem) not in wanted:
                        path.unlink(missing_ok=True)
            else:
                for b in self._read_before - wanted:
                    self._path(b).unlink(missing_ok=True)
        self._read_before = read
        for b in now.tolist() + ahead.tolist():
            self._fetched(b, wait=False)
        for b in now[self._shift[now] == UNMAPPED].tolist():
            with contextlib.suppress(OSError, OutputError):
                self._map(b)

    # -- fetching -----------------------------------------------------------------------------------------------

    def _fetched(self, b: int, wait: bool = True) -> None:
        """Block b in the cache: fetched in a fetch thread where it is not; with `wait`, until it is, fetched in this
        thread where it is not under way (taken back from the fetch threads' queue, where it waits behind blocks of
        this cache or another's: the process's fetch threads are all its caches'). A fetch that failed raises where it
        is waited for, and is asked again by the next call."""
        with self._lock:
            future = self._fetches.get(b)
            if wait and future is not None and not future.done() and not future.running():
                del self._fetches[b]  # (before it is cancelled: _forget, called then, leaves it)
                future = None if future.cancel() else self._fetches.setdefault(b, future)
            if future is None or (future.done() and future.exception() is not None and wait):
                if self._path(b).exists():
                    return
                if wait:
                    future = None
                else:
                    future = self._fetches[b] = _FETCHERS.submit(self._fetch, b)
                    future.add_done_callback(lambda f, b=b: self._forget(b, f))
        if future is None:
            self._fetch(b)
        elif wait:
            future.result()

    def _forget(self, b: int, future: Future) -> None:
        with self._lock:
            if self._fetches.get(b) is future and future.exception() is None:
                del self._fetches[b]

    def _fetch(self, b: int) -> None:
        """Block b fetched into the cache by one process of those that want it (the flock of <b>.fetch)."""
        path = self._path(b)
        self.folder.mkdir(parents=True, exist_ok=True)  # (removed since the loader opened: made again)
        with _flocked(self.folder / f"{b}.fetch"):
            if path.exists():
                return
            start = b * self.geometry.per_block * self.seq_len
            stop = start + self._tokens_of(b)
            tokens = self.files.read(start, stop)
            if self._split_places is not None:
                first, last = np.searchsorted(self._split_places, [start, stop]).tolist()
                places = self._split_places[first:last]
            else:
                last = min(int(self._first_doc[b + 1]) + 1, self.files.documents)
                ends = self.files.read(int(self._first_doc[b]), last, ends=True)
                places = np.concatenate([self.files.starts[:-1], ends])  # each file's start, each document's end
                places = np.unique(places[(places >= start) & (places < stop)])
            places = places - start
            data = tokens.tobytes()
            _write(path, [data, bytes(_aligned(len(data)) - len(data)), places.astype(IDX_DTYPE).tobytes()])

    def _tokens_of(self, b: int) -> int:
        """Block b's tokens: its windows' seq_len each, and the last one's last token."""
        g = self.geometry
        return min(g.per_block, g.windows - b * g.per_block) * self.seq_len + 1

    def _path(self, b: int) -> Path:
        return self.folder / f"{b}.blk"

    def _index(self) -> np.ndarray:
        """For each block, the documents that end before its first token, and then all of them: block b's places
        take the ends from its entry to the next one's, and that one too (it may end on b's last token)."""
        path = self.folder / "index.bin"
        with _flocked(self.folder / "index.fetch"):
            if not path.exists():
                g, files = self.geometry, self.files
                firsts = np.arange(g.blocks, dtype=np.int64) * g.per_block * self.seq_len
                ended = np.zeros(g.blocks + 1, dtype=np.int64)  # ends between block b - 1's first token and b's
                for first in range(0, files.documents, ENDS_READ):
                    ends = files.read(first, min(first + ENDS_READ, files.documents), ends=True)
                    ended += np.bincount(np.searchsorted(firsts, ends, side="right"), minlength=g.blocks + 1)
                index = np.append(np.cumsum(ended)[: g.blocks], files.documents)
                _write(path, [index.astype("<i8").tobytes()])
        return np.frombuffer(path.read_bytes(), dtype="<i8")


def _new_fetchers() -> None:
    """The process's fetch threads, which all its caches share (a pool a cache: a Mixture of 400 groups on a store
    held 400 threads, and up to 8 each); started as fetches come, and made again in a forked child (which has none
    of the parent's threads)."""
    global _FETCHERS
    _FETCHERS = ThreadPoolExecutor(FETCHERS, thread_name_prefix="tokpipe-fetch")


_new_fetchers()
os.register_at_fork(after_in_child=_new_fetchers)


def _aligned(n: int) -> int:
    return -(-n // IDX_DTYPE.itemsize) * IDX_DTYPE.itemsize


def _write(path: Path, pieces: list[bytes]) -> None:
    """A cache file written whole: under a temporary name, then renamed. Not fsynced (it cost 15% of a fetch thread's
    time here): a file that a power loss may have torn was written before the machine's boot, and is removed. Its
    temporary file removed meanwhile (a loader that opened and cleared the cache): written again."""
    for _ in range(3):
        temporary = path.with_name(f"{path.stem}.{secrets.token_hex(4)}.tmp")
        with open(temporary, "wb") as f:
            for piece in pieces:
                f.write(piece)
        try:
            os.rename(temporary, path)
            return
        except FileNotFoundError:
            continue
    raise OSError(f"cannot write {path}: its temporary file was removed as often as it was written")


def _forget_before_boot(folder: Path) -> None:
    """The files of the cache written before this machine's boot removed: only a power loss or a crash of the
    machine tears a file written whole and renamed, and either is followed by a boot."""
    try:
        booted = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return  # no /proc (not Linux): nothing is removed
    for path in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):  # another rank's since the listing: a `.fetch` lock, a `.tmp`
            if path.stat().st_mtime < booted:
                path.unlink()


@contextlib.contextmanager
def _flocked(path: Path):
    """An flock held on a lock file while a block (or the index) is made; the file removed after."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)

"""The one reader of a split's token files (TokenFiles): a finished split's one file, --no-concat's files, its
groups', or what an unfinished OUT's records cover (placed parts, shards' own files), read as one stream of
tokens and one of document ends, any number of files, with no descriptor held, a bounded number of maps, each
file checked whenever it is mapped or read (maps.py, the one place its bytes are touched; on a store, ranged
GETs). The loader reads windows and document starts through it; open_output, verify, inspect, report and export
ranges (file_range), a range's bytes (token_bytes: verify's hashing) or tokens and ends at given places.

Files: a --no-concat split is one file per shard (SlimPajama: ~59k), and a batch of 64 windows in a seeded order
reads ~64 of them. Making a map and dropping it costs 14-28 us (open, fstat, mmap, close, the first page's fault,
munmap), reading a window from a kept one ~1.3: so a file once read stays mapped, up to MAPS maps, the kernel's
vm.max_map_count less RESERVED for the rest of the process (61,434 at the common 65,530); past that the least
recently read eighth is dropped. Keeping 64 (before issue 47) mapped nearly every file again every batch on a split
of 300 (257-483 batches/s against ~21,000 concatenated). Reading a window with pread instead took 9 us with its
open and close (0.15-0.18x the concatenated split's rate, against 0.53-0.57x here), 3.7 us with a descriptor kept
(which `ulimit -n` caps).

Windows: one row gather a batch, whatever files it reads. `_view()` is the process's memory from the lowest address
a map has had to the highest, as an array of the split's dtype, and its windows the seq_len + 1 tokens from every
address on: a window is row (its start in the stream + its file's shift, the file's first token's address /
itemsize less the file's place in the stream) less the view's first. Only rows wholly in a mapped file are read,
under the lock that drops maps, so nothing between the maps is touched; a window across files' ends (one in six
where files hold one document each, seq_len 512) is read token by token from the view, each token from its own
file's map, in a second gather. The loader's token maps are madvise(MADV_RANDOM): a window faults in its own pages,
not the kernel's 128 KB readahead around each (the other readers read files from start to end: theirs read ahead).

Document ends: a binary search of an .idx probes ~log2(documents) entries; cold, each new page it touches is a read
(2-4 a search beyond the window's own, measured at issue 28). For a file of more than SMALL documents, every
SPARSE-th end is kept in memory (1/512 of the .idx: 380 KB at 10^11 tokens, read once when the file is first
searched); a search finds its block of SPARSE ends there, then within the block (one 4 KB page: ends are 8 bytes
from offset 0) compares with the 8 ends that close its sub-blocks of 64, then with the sub-block's 64: one page a
key, ~30 us a batch of 64 windows. That is per file a batch touches; a split of at most MERGED documents (16 MB of
ends) instead keeps every place a document starts, all files' merged (each file's start, each end), in memory, and
maps no .idx: one search a batch whatever files it touches (~16 us a batch of 64, 7 files or one).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.layout.meta import SplitFile
from tokpipe.layout.records import IDX_DTYPE
from tokpipe.read.maps import LocalFile, StoreFile, array_at, each_file, kernel_max_maps, recorded, seen_all

RESERVED = 4096  # maps left to the rest of the process: Python with numpy holds ~200, torch on CUDA a few 1,000
SPARSE = 512  # ends per block: one 4 KB page of an .idx
MERGED = 1 << 21  # a split of at most this many documents keeps their ends in memory (16 MB), merged
SMALL = 64 * SPARSE  # an .idx of at most 64 pages is searched whole: ~5 us a batch against ~30 us by blocks
SUB_BLOCKS = np.arange(1, 8) * (SPARSE // 8) - 1  # the last end of each sub-block of a block but the last
IN_SUB_BLOCK = np.arange(SPARSE // 8 - 1)
UNMAPPED = -(1 << 62)  # a file's shift while it is not mapped: its windows' rows come out negative
MAPS = max(kernel_max_maps() - RESERVED, 1024)  # the most maps a split holds (tokens and, searched file by file, ends)


@dataclass(frozen=True)
class TokenFile:
    """One file of a split, read: the whole split, or (--no-concat, an unfinished run) one shard's part."""

    name: str  # its path relative to OUT (SplitFile.name)
    tokens: np.ndarray  # read-only, mapped
    ends: np.ndarray  # document ends, counted from the file's first token


class TokenFiles:
    """The token files of a split (or of one group of it), in order, read as one stream of tokens: the one reader
    of a split's files, for every reader of OUT (the loader, open_output, verify, inspect, export)."""

    def __init__(
        self, out: Path, files: list[SplitFile], dtype: np.dtype, windows: bool = False, local=None, found=None
    ):
        """`windows`: read in windows at random places (the loader's): its token maps are madvise(MADV_RANDOM).
        `local`: each file's tokens and ends as first seen, where another reader recorded them (joined); `found`:
        where a caller looked them up already (maps.seen_all, by name: verify's)."""
        out = out if isinstance(out, Path) else Path(out)  # as given: a reader's copy of a store's records holds it
        self.out, self.dtype, self.entries, self.random = out, np.dtype(dtype), files, windows
        found = found or ({} if local else seen_all(out, [name for f in files for name in (f.bin, f.idx)]))
        self._local = local or [self._recorded(f, found) for f in files]  # each file's tokens and ends, as first seen
        self.paths = [(tokens.path, ends.path) for tokens, ends in self._local]
        self.starts = np.cumsum([0] + [f.tokens for f in files])  # one entry per file
        self.ends = self.starts[1:]  # where each file's tokens end in the stream
        self.tokens = int(self.starts[-1])
        self.firsts = np.cumsum([0] + [f.documents for f in files])  # each file's first document in the stream
        self.documents = int(self.firsts[-1])
        self._tokens: dict[int, np.ndarray] = {}  # file -> its tokens, mapped
        self._ends: dict[int, np.ndarray] = {}  # file -> its document ends, mapped (where searched file by file)
        self._used = np.zeros(len(files), np.int64)  # when each file was last read: the least recent are dropped
        self._reads = 0
        self._dropping = len(files) * (1 if self.documents <= MERGED else 2) > MAPS  # (else no read is timed)
        self._holding = int(np.count_nonzero(np.diff(self.starts)))  # files that hold a token: each mapped once read
        self._shift = np.full(len(files), UNMAPPED)  # its first token's address / itemsize less its stream place
        self._low = self._high = 0  # every map so far lay in [low, high): the view's addresses
        self._views: dict[int, np.ndarray] = {}  # seq_len -> the view's windows of seq_len + 1 (0: its tokens)
        self._sparse: dict[int, np.ndarray] = {}  # kept when the file's maps are dropped
        self._merged: np.ndarray | None = None
        self._lock = threading.Lock()  # the maps and the view change under it, and windows are read under it

    def _recorded(self, f: SplitFile, found: dict) -> tuple[LocalFile | StoreFile, LocalFile | StoreFile]:
        """A file's tokens and ends as first seen, of the sizes OUT's records give them (on this machine, or on a
        store: maps.recorded)."""
        itemsize, growing = self.dtype.itemsize, f.growing
        size, said = (f.token_offset + f.tokens) * itemsize, f"{f.tokens:,} tokens of {itemsize} bytes"
        tokens = recorded(self.out, f.bin, size, said, growing, found.get(f.bin))
        size, said = (f.doc_offset + f.documents) * IDX_DTYPE.itemsize, f"{f.documents:,} document ends of 8 bytes"
        return tokens, recorded(self.out, f.idx, size, said, growing, found.get(f.idx))

    @classmethod
    def joined(cls, parts: list[TokenFiles]) -> TokenFiles:
        """The files of several streams (of one OUT or several) one after another."""
        files, local = [f for part in parts for f in part.entries], [local for part in parts for local in part._local]
        return cls(parts[0].out, files, parts[0].dtype, parts[0].random, local)

    def files_of(self, first: int, stop: int) -> TokenFiles:
        """Its files [first, stop) as a reader of their own, as first seen here (a group's of a split)."""
        return TokenFiles(self.out, self.entries[first:stop], self.dtype, self.random, self._local[first:stop])

    def __len__(self) -> int:
        return len(self.paths)

    def maps(self) -> int:
        """The maps this split holds now (at most MAPS)."""
        return len(self._tokens) + len(self._ends)

    def _touch(self, files: np.ndarray) -> None:
        """Under the lock: these files' tokens mapped, marked as read now."""
        self._read_now(files)
        for f in files[self._shift[files] == UNMAPPED].tolist():
            if self.ends[f] > self.starts[f]:  # an empty file holds no window: nothing to map
                self._map_tokens(f)

    def _map_tokens(self, f: int) -> None:
        """Under the lock: file f's tokens mapped and placed in the view."""
        self._make_room()
        first = self.entries[f].token_offset
        tokens = self._local[f][0].mapped(self.dtype, self.random, first)[: self.entries[f].tokens]
        self._tokens[f] = tokens
        address, step = tokens.ctypes.data, self.dtype.itemsize
        self._shift[f] = address // step - self.starts[f]
        if not self._low <= address < address + tokens.nbytes <= self._high:
            self._low = min(self._low, address) if self._high else address
            self._high = max(self._high, address + tokens.nbytes)
            self._views = {}

    def _read_now(self, *files) -> None:
        """Under the lock: these files (file numbers or arrays of them) marked as read now, where maps may be
        dropped (a scatter into 8 bytes a file, a few us a batch at 60,000 files, for nothing else)."""
        if self._dropping:
            self._reads += 1
            for f in files:
                self._used[f] = self._reads

    def _make_room(self) -> None:
        """Under the lock: the least recently read eighth of the files mapped dropped, when MAPS maps are held
        (their maps close with their last reference)."""
        if self.maps() < MAPS:
            return
        held = np.array(sorted(self._tokens.keys() | self._ends.keys()), dtype=np.int64)
        count = len(held) // 8 + 1
        for f in held[np.argpartition(self._used[held], count - 1)[:count]].tolist():
            self._drop(f)

    def _drop(self, f: int) -> None:
        """Under the lock: file f's maps let go (an array over one keeps it until the array goes)."""
        self._tokens.pop(f, None)
        self._ends.pop(f, None)
        self._shift[f] = UNMAPPED

    def release(self, f: int) -> None:
        """File f's maps let go, by a reader that reads each file once (verify): its pages leave the process's
        memory then, not when MAPS maps are held (60,000 files checked held 1 GB of them)."""
        with self._lock:
            self._drop(f)

    def file_tokens(self, f: int) -> np.ndarray:
        """File f's tokens, mapped (a reference keeps the map while its maps are dropped)."""
        with self._lock:
            self._touch(np.array([f]))
            return self._tokens.get(f, np.zeros(0, self.dtype))

    def file_ends(self, f: int) -> np.ndarray:
        """File f's document ends, counted from its first token: mapped."""
        with self._lock:
            self._read_now(f)
            if f not in self._ends:
                self._make_room()
                file = self.entries[f]
                if file.token_offset:  # a part of a file being assembled (one shard's): read, counted from it
                    self._ends[f] = self._read_ends(f)
                else:
                    self._ends[f] = self._local[f][1].mapped(IDX_DTYPE, first=file.doc_offset)[: file.documents]
            return self._ends[f]

    def file_range(self, f: int, first: int, stop: int, ends: bool = False) -> np.ndarray:
        """File f's tokens (or document ends, counted from its first token) [first, stop): a slice of its map, or
        on a store a ranged GET (no split file of a store's is held whole)."""
        which = self._local[f][ends]
        if not isinstance(which, StoreFile):
            return (self.file_ends(f) if ends else self.file_tokens(f))[first:stop]
        if ends:
            return self._read_ends(f, first, max(stop - first, 0))
        return which.array(self.dtype, self.entries[f].token_offset + first, max(stop - first, 0))

    def _read_ends(self, f: int, first: int = 0, count: int | None = None) -> np.ndarray:
        """File f's document ends [first, first + count) (all from first), read, counted from its first token."""
        file = self.entries[f]
        count = file.documents - first if count is None else count
        ends = self._local[f][1].array(IDX_DTYPE, file.doc_offset + first, count)
        return ends - file.token_offset if file.token_offset else ends

    def file(self, f: int) -> TokenFile:
        return TokenFile(self.entries[f].name, self.file_tokens(f), self.file_ends(f))

    def token_bytes(self, f: int, start: int, stop: int, buffer: bytearray) -> Iterator[memoryview]:
        """Bytes [start, stop) of file f's tokens, from its first token, read a view of `buffer` at a time."""
        first = self.entries[f].token_offset * self.dtype.itemsize
        return self._local[f][0].read(first + start, first + stop, buffer)

    def _view(self, seq_len: int) -> np.ndarray:
        """Under the lock: the memory from low to high as tokens (seq_len 0), or its windows of seq_len + 1
        tokens from every token on, row r from its token r (as_strided costs ~7 us: made once per view)."""
        if seq_len not in self._views:
            step = self.dtype.itemsize
            if not seq_len:
                shape = ((self._high - self._low) // step,)
                self._views[0] = array_at(self._low, shape, self.dtype)
            else:
                shape = (max(len(self._view(0)) - seq_len, 0), seq_len + 1)
                self._views[seq_len] = np.lib.stride_tricks.as_strided(self._view(0), shape, (step, step))
        return self._views[seq_len]

    def read(self, start: int, stop: int, ends: bool = False) -> np.ndarray:
        """Tokens [start, stop) of the stream (`ends`: document ends, counted from its start), across files where they
        cross from one into the next."""
        firsts, spans = self.firsts if ends else self.starts, []
        f = int(np.searchsorted(firsts, start, side="right")) - 1
        while start < stop:
            last = min(stop, int(firsts[f + 1]))
            spans.append((f, start - int(firsts[f]), last - int(firsts[f])))
            start, f = last, f + 1
        pieces = each_file(self.out, lambda span: self.file_range(*span, ends), spans)  # (a store's: GETs at once)
        if ends:
            pieces = [piece + int(self.starts[f]) for piece, (f, _, _) in zip(pieces, spans)]
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, IDX_DTYPE if ends else self.dtype)

    def gather(self, at: np.ndarray, ends: bool = False) -> np.ndarray:
        """The tokens at positions `at` of the stream (`ends`: the ends of documents `at`, counted from its start),
        gathered file by file: a step per file they are in, never one per position."""
        if len(self) == 1:  # an ndarray's gather (a memmap's took twice as long)
            return self.file_ends(0)[at] if ends else self.file_tokens(0)[at]
        firsts = self.firsts if ends else self.starts
        which = np.searchsorted(firsts, at, side="right") - 1
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(self) + 1))
        found = np.empty(len(at), dtype=IDX_DTYPE if ends else self.dtype)
        for f in np.flatnonzero(np.diff(bounds)).tolist():
            picked = order[bounds[f] : bounds[f + 1]]
            local = at[picked] - firsts[f]
            found[picked] = self.file_ends(f)[local] + self.starts[f] if ends else self.file_tokens(f)[local]
        return found

    def by_file(self, starts: np.ndarray, width: int) -> tuple[list[tuple[int, np.ndarray]], np.ndarray]:
        """The rows whose `width` tokens from `starts` lie in one file, per file, and the rows that cross."""
        if len(self.paths) == 1:
            return [(0, np.arange(len(starts)))], np.zeros(0, np.int64)
        first = np.searchsorted(self.starts, starts, side="right") - 1
        last = np.searchsorted(self.starts, starts + width - 1, side="right") - 1
        inside = np.flatnonzero(first == last)
        order = inside[np.argsort(first[inside], kind="stable")]
        files, cuts = np.unique(first[order], return_index=True)
        groups = list(zip(files.tolist(), np.split(order, cuts[1:])))
        return groups, np.flatnonzero(first != last)

    def windows(self, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """The seq_len + 1 tokens from each of `starts`, as an int64 (B, seq_len + 1): one gather from the
        view, every file they read mapped first. A batch of more files than MAPS // 4 is read a part of that
        many files at a time (_in_parts)."""
        if len(self.paths) == 1:  # a valid window lies in the file
            with self._lock:
                if self._shift[0] == UNMAPPED:
                    self._touch(np.zeros(1, np.int64))
                shift = self._shift[0] - self._low // self.dtype.itemsize
                return self._view(seq_len)[starts + shift].astype(np.int64)
        first = self.ends.searchsorted(starts, "right")  # the file each window starts in
        return self._gather(starts, first, seq_len, whole=True)

    def _gather(self, starts, first, seq_len, whole=False) -> np.ndarray:
        """windows() of a batch (`whole`: in parts where it reads more files than MAPS // 4, as only a split of
        more files can) or of one part (none dropped here), under the lock, every file mapped first: a window in
        one file is a row of the view's windows, all in one row gather (those across files' ends in place of one
        that is not, then read token by token: _across), the file each of those ends in searched for them alone
        (for every window: ~5 us a batch of 64, its keys unsorted). Once every file holding a token is mapped, no
        row is negative: none is checked (numpy's min, sum or max ~2 us each; a few values' through a list ~1)."""
        room = self.ends[first] - starts  # its tokens in its first file: no more than seq_len, it crosses its end
        across = (room <= seq_len).nonzero()[0]
        last = self.ends.searchsorted(starts[across] + seq_len, "right")
        if whole and len(self) > MAPS // 4 and len(starts) + sum((last - first[across]).tolist()) > max(MAPS // 4, 1):
            return self._in_parts(starts, first, seq_len)
        with self._lock:
            while True:
                rows = starts + self._shift[first] - self._low // self.dtype.itemsize
                mapped = len(self._tokens) == self._holding
                if not len(across) and (mapped or rows.min(initial=0) >= 0):  # every file mapped, none across
                    self._read_now(first)
                    return self._view(seq_len)[rows].astype(np.int64)
                tokens = self._across(starts[across], room[across], first[across], last, seq_len)
                if mapped or (rows.min(initial=0) >= 0 and tokens.min(initial=0) >= 0):  # every file mapped
                    break
                self._touch(np.union1d(first, _spanned(first[across], last)))
            self._read_now(first, last)
            if len(across) == len(starts):
                out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
            else:
                rows[across] = rows[room.argmax()]  # a window in one file: the one with the most room there
                out = self._view(seq_len)[rows].astype(np.int64)
            out[across] = self._view(0)[tokens]
            return out

    def _across(self, starts, room, first, last, seq_len) -> np.ndarray:
        """Under the lock: the view's index of each token of these windows across files' ends, its stream place plus
        its file's shift (the first file's, one more past each end: an empty file's skipped), negative where unmapped.
        7 numpy calls for the first end, 6 for each further one (a step of shifts added past each took 11 and 15)."""
        columns = np.arange(seq_len + 1)
        files = first[:, None] + (columns >= room[:, None])
        for j in range(1, max((last - first).tolist(), default=0)):  # a window's last file's end lies past it
            files += columns >= (self.ends[np.minimum(first + j, last)] - starts)[:, None]
        return (starts - self._low // self.dtype.itemsize)[:, None] + columns + self._shift[files]

    def _in_parts(self, starts, first, seq_len) -> np.ndarray:
        """windows() of a batch that reads more files than MAPS // 4: a part of that many files at a time, by
        the file they start in, and a window across that many files or more (tiny files) piece by piece."""
        out, group = np.empty((len(starts), seq_len + 1), dtype=np.int64), max(MAPS // 4, 1)
        crossed = self.ends.searchsorted(starts + seq_len, "right") - first  # the files' ends each crosses
        for row in np.flatnonzero(crossed >= group).tolist():
            out[row] = self.read(int(starts[row]), int(starts[row]) + seq_len + 1)
        rows = np.flatnonzero(crossed < group)
        part = np.searchsorted(_spanned(first[rows], first[rows] + crossed[rows]), first[rows]) // group
        order = np.argsort(part, kind="stable")
        for some in np.split(rows[order], np.flatnonzero(np.diff(part[order])) + 1):
            out[some] = self._gather(starts[some], first[some], seq_len)
        return out

    def doc_starts(self, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Where documents start in the seq_len + 1 tokens from each of `starts`, as (offsets, bounds): row
        j's are offsets[bounds[j]:bounds[j + 1]], ascending. They are each file's start and each document's
        end (a document starts where the one before ends; a file holds whole documents), each place once."""
        if not len(starts):
            return np.zeros(0, np.int64), np.zeros(1, np.int64)
        if self.documents <= MERGED:  # one search for the whole batch, whatever files it touches
            places = self.merged()
            return within(places, np.searchsorted(places, np.concatenate([starts, starts + seq_len + 1])), starts)
        groups, crossing = self.by_file(starts, seq_len + 1)
        if len(groups) == 1 and not crossing.size and starts.all():  # one file, no window at its start
            f = groups[0][0]
            found, bounds = self._ends_in(f, starts - int(self.starts[f]), seq_len)
            repeated = found[1:] == found[:-1]  # (rarely, also one row's last and the next row's first)
            return (found, bounds) if not repeated.any() else _unrepeated(found, bounds, repeated)
        rows, found = [], []
        for f, members in groups:
            local = starts[members] - int(self.starts[f])
            in_file, bounds = self._ends_in(f, local, seq_len)
            rows += [np.repeat(members, np.diff(bounds)), members[local == 0]]
            found += [in_file, np.zeros(len(rows[-1]), np.int64)]  # a file's start starts a document
        for row in crossing.tolist():  # a window across a file boundary: a few per file
            start = int(starts[row])
            f = int(np.searchsorted(self.starts, start, side="right")) - 1
            while f < len(self.paths) and self.starts[f] <= start + seq_len:
                ends, base = self.file_ends(f), int(self.starts[f])
                a, b = np.searchsorted(ends, [start - base, start + seq_len - base + 1])
                places = ends[a:b] + (base - start)
                rows.append(np.full(len(places) + (base >= start), row))
                found.append(np.concatenate([[base - start], places]) if base >= start else places)
                f += 1
        rows, found = np.concatenate(rows), np.concatenate(found)
        order = np.lexsort((found, rows))
        rows, found = rows[order], found[order]
        bounds = np.searchsorted(rows, np.arange(len(starts) + 1))
        repeated = found[1:] == found[:-1]
        return (found, bounds) if not repeated.any() else _unrepeated(found, bounds, repeated)

    def _ends_in(self, f: int, local: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """For windows of file f from `local` (counted from its first token): its document ends in them,
        counted from their window's start, window by window, as (found, bounds): window j's are
        found[bounds[j]:bounds[j + 1]]."""
        ends = self.file_ends(f)
        return within(ends, self._search(f, ends, np.concatenate([local, local + seq_len + 1])), local)

    def merged(self) -> np.ndarray:
        """Every place a document starts, in the stream: each file's start and each document's end, sorted,
        each once (read whole, at most MERGED of them)."""
        if self._merged is None:
            ends = each_file(self.out, lambda f: self._read_ends(f) + int(self.starts[f]), list(range(len(self))))
            self._merged = np.unique(np.concatenate([self.starts[:-1], *ends]))
        return self._merged

    def _sparse_ends(self, f: int) -> np.ndarray:
        """Every SPARSE-th end of file f (the last of each full block), read in 32 MB pieces: read, not
        mapped, so its pages stay reclaimable instead of in this process's maps."""
        sparse = np.empty(self.entries[f].documents // SPARSE, dtype=np.int64)
        piece = SPARSE * 8192
        for first in range(0, len(sparse) * SPARSE, piece):
            ends = self._read_ends(f, first, min(piece, len(sparse) * SPARSE - first))
            sparse[first // SPARSE : (first + len(ends)) // SPARSE] = ends[SPARSE - 1 :: SPARSE]
        return sparse

    def _search(self, f: int, ends: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """np.searchsorted(ends, keys) of file f's ends, reading one page of its ends a key: the block of SPARSE ends
        from the sparse ends in memory, then in it the 8 ends that close its sub-blocks of 64, then the
        sub-block's 64."""
        if f not in self._sparse:  # read the first time (two threads may both read it: the same ends)
            self._sparse[f] = self._sparse_ends(f) if len(ends) > SMALL else None
        sparse = self._sparse[f]
        if sparse is None:  # a small .idx: its pages stay in memory after a few batches
            return np.searchsorted(ends, keys)
        position, column, last = np.searchsorted(sparse, keys) * SPARSE, keys[:, None], len(ends) - 1
        for step, probes in ((SPARSE // 8, SUB_BLOCKS), (1, IN_SUB_BLOCK)):
            found = ends[np.minimum(position[:, None] + probes, last)]  # past the end: the last end, >= every key
            position += step * np.count_nonzero(found < column, axis=1)
        return position


def _spanned(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Every file from first[j] to last[j], for each j, sorted, each once."""
    if np.array_equal(first, last):
        return np.unique(first)
    width = last - first + 1
    return np.unique(np.repeat(first - np.cumsum(width) + width, width) + np.arange(int(width.sum())))


def within(ends: np.ndarray, at: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ends from at[j] to at[B + j] (B = len(starts)), less starts[j], row j after row j, as (found,
    bounds): row j's are found[bounds[j]:bounds[j + 1]]."""
    first, counts = at[: len(starts)], at[len(starts) :] - at[: len(starts)]
    bounds = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    picked = np.arange(bounds[-1]) + np.repeat(first - bounds[:-1], counts)
    return ends[picked] - np.repeat(starts, counts), bounds


def _unrepeated(found: np.ndarray, bounds: np.ndarray, repeated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Without the places a row holds twice (an empty document's end repeats the one before it)."""
    repeated[bounds[(bounds > 0) & (bounds < len(found))] - 1] = False  # a row's first repeats no other row's
    keep = np.concatenate([[True], ~repeated])
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    return found[keep], kept_before[bounds]

"""A split's token files as a loader reads them: windows and document ends, any number of files with a
bounded number open, and beyond RAM about one page of the .idx read per window.

Files: a --no-concat split is one file per shard (SlimPajama: ~59k). Mapping every file up front, as
tokpipe.read.output does for readers that look at a few, holds two descriptors and two maps a file: 4,006
descriptors for 2,000 files (`ulimit -n 1024` refuses them) and past the kernel's 65,530 maps at 59k.
Here a file is mapped when a batch first reads it, and the least recently read is dropped once
OPEN_FILES are mapped; sizes are checked against meta up front, with stat alone.

Windows: one row gather a batch, whatever files it reads. The span is a view (as_strided) of the tokens
from the lowest mapped file's first token to the highest's last, through whatever lies between the maps;
its rows are the seq_len + 1 tokens from each token on, and a window is row (its file's place in the span
+ its start in the file). Only rows that lie wholly in a mapped file are read, under the lock that drops
maps, so nothing between the maps is touched: a window across a file's end (a few per file) is read piece
by piece, and a batch over files not mapped maps them, OPEN_FILES at a time. A batch of 7 files costs a
few numpy calls more than one of one file (49 us against 33), where a gather and a scatter per file
cost ~5 us each (68 us). Token maps are madvise(MADV_RANDOM): a window faults in its own pages, not the
kernel's 128 KB readahead around each.

Document ends: a binary search of an .idx probes ~log2(documents) entries; cold, each new page it
touches is a read (2-4 a search beyond the window's own, measured at issue 28). For a file of more
than SMALL documents, every SPARSE-th end is kept in memory (1/512 of the .idx: 380 KB at 10^11
tokens, read once when the file is first read); a search finds its block of SPARSE ends there, then
within the block (one 4 KB page: ends are 8 bytes from offset 0) compares with the 8 ends that close its
sub-blocks of 64, then with the sub-block's 64: one page a key, ~30 us a batch of 64 windows. That is
per file a batch touches; a split of at most MERGED documents (16 MB of ends) instead keeps every place
a document starts, all files' merged (each file's start, each end), in memory: one search a batch
whatever files it touches (~16 us a batch of 64, 7 files or one).
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.out.records import IDX_DTYPE

OPEN_FILES = 64  # 128 maps and descriptors at most: a tenth of the common `ulimit -n` of 1024
SPARSE = 512  # ends per block: one 4 KB page of an .idx
MERGED = 1 << 21  # a split of at most this many documents keeps their ends in memory (16 MB), merged
SMALL = 64 * SPARSE  # an .idx of at most 64 pages is searched whole: ~5 us a batch against ~30 us by blocks
SUB_BLOCKS = np.arange(1, 8) * (SPARSE // 8) - 1  # the last end of each sub-block of a block but the last
IN_SUB_BLOCK = np.arange(SPARSE // 8 - 1)
UNMAPPED = -(1 << 62)  # a file's shift while it is not mapped: its windows' rows come out negative


@dataclass(frozen=True)
class Span:
    """The tokens from the lowest mapped file's first to the highest's last, whatever lies between the maps: a
    view made with as_strided from `file`'s array (which keeps that map), read only where a mapped file lies."""

    file: int
    low: int  # its first and past its last address
    high: int
    tokens: np.ndarray
    rows: dict  # seq_len -> its windows from every token on


class TokenFiles:
    """The token files of a split (or of one group of it), in order, read as one stream of tokens."""

    def __init__(self, entries: list[tuple[Path, Path, int, int]], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        for bin_path, idx_path, tokens, documents in entries:
            _check_size(bin_path, tokens * self.dtype.itemsize, f"{tokens:,} tokens of {self.dtype.itemsize} bytes")
            _check_size(idx_path, documents * IDX_DTYPE.itemsize, f"{documents:,} document ends of 8 bytes")
        self.entries = entries
        self.paths = [(bin_path, idx_path) for bin_path, idx_path, _, _ in entries]
        self.starts = np.cumsum([0] + [tokens for _, _, tokens, _ in entries])  # one entry per file
        self.ends = self.starts[1:]  # where each file's tokens end in the stream
        self.tokens = int(self.starts[-1])
        self.documents = sum(documents for _, _, _, documents in entries)
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # file -> its tokens and ends, mapped
        self._used = np.zeros(len(entries), np.int64)  # when each file was last read: the least recent is dropped
        self._reads = 0
        self._shift = np.full(len(entries), UNMAPPED)  # a token's row in the span less its place in the stream
        self._span: Span | None = None
        self._sparse: dict[int, np.ndarray] = {}  # kept when the file's maps are dropped
        self._merged: np.ndarray | None = None
        self._lock = threading.Lock()  # the maps and the span change under it, and windows are read under it

    @classmethod
    def joined(cls, parts: list[TokenFiles]) -> TokenFiles:
        """The files of several streams one after another."""
        return cls([e for part in parts for e in part.entries], parts[0].dtype)

    def __len__(self) -> int:
        return len(self.paths)

    def _file(self, f: int) -> tuple[np.ndarray, np.ndarray]:
        """File f's tokens and document ends, mapped."""
        with self._lock:
            return self._mapped(f)

    def _mapped(self, f: int) -> tuple[np.ndarray, np.ndarray]:
        """Under the lock: file f mapped (the least recently read file's maps dropped once OPEN_FILES are), and
        placed in the span."""
        self._reads += 1
        self._used[f] = self._reads
        if f in self._open:
            return self._open[f]
        if len(self._open) >= OPEN_FILES:
            self._drop(min(self._open, key=self._used.__getitem__))
        bin_path, idx_path = self.paths[f]
        tokens, ends = mapped = _map(bin_path, self.dtype, random=True), _map(idx_path, IDX_DTYPE)
        if f not in self._sparse:
            self._sparse[f] = _sparse_ends(idx_path, len(ends)) if len(ends) > SMALL else None
        self._open[f] = mapped
        if len(tokens):  # an empty file holds no window: it has no place in the span
            address = tokens.ctypes.data
            span = self._span
            if span is None or not (span.low <= address and address + tokens.nbytes <= span.high):
                self._respan()
            else:
                self._shift[f] = (address - span.low) // self.dtype.itemsize - self.starts[f]
        return mapped

    def _drop(self, f: int) -> None:
        """Under the lock: file f's maps dropped (they close with their last reference)."""
        del self._open[f]
        self._shift[f] = UNMAPPED
        if self._span is not None and self._span.file == f:  # the span holds its map: made again without it
            self._respan()

    def _respan(self) -> None:
        """Under the lock: the span made again over every mapped file's tokens, and their places in it."""
        self._shift[:] = UNMAPPED
        mapped = {f: tokens.ctypes.data for f, (tokens, _) in self._open.items() if len(tokens)}
        if not mapped:
            self._span = None
            return
        first = min(mapped, key=mapped.get)
        low, step = mapped[first], self.dtype.itemsize
        high = max(address + self._open[f][0].nbytes for f, address in mapped.items())
        tokens = np.lib.stride_tricks.as_strided(self._open[first][0], ((high - low) // step,), (step,))
        self._span = Span(first, low, high, tokens, {})
        for f, address in mapped.items():
            self._shift[f] = (address - low) // step - self.starts[f]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, across files where they cross from one into the next."""
        pieces = []
        f = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            base = int(self.starts[f])
            piece = self._file(f)[0][start - base : stop - base]
            pieces.append(piece)
            start += len(piece)
            f += 1
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

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
        """The seq_len + 1 tokens from each of `starts`, as an int64 (B, seq_len + 1): one row gather from the
        span, when every file the batch reads lies in it."""
        if not len(starts):
            return np.zeros((0, seq_len + 1), np.int64)
        if len(self.paths) == 1:  # a valid window lies in the file
            with self._lock:
                self._mapped(0)
                return self._rows(seq_len)[starts].astype(np.int64)
        f = np.searchsorted(self.ends, starts, side="right")
        inside = self.ends[f] - starts > seq_len
        if inside.all():
            with self._lock:
                rows = starts + self._shift[f]
                if rows.min() >= 0:  # every file mapped
                    self._reads += 1
                    self._used[f] = self._reads
                    return self._rows(seq_len)[rows].astype(np.int64)
        out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
        for row in np.flatnonzero(~inside).tolist():  # a window across a file's end (a few per file): piece by piece
            out[row] = self.read(int(starts[row]), int(starts[row]) + seq_len + 1)
        inside = np.flatnonzero(inside)
        files = np.unique(f[inside])
        for first in range(0, len(files), OPEN_FILES):  # OPEN_FILES mapped at a time
            some = files[first : first + OPEN_FILES]
            rows = inside[np.isin(f[inside], some)]
            with self._lock:
                for g in some.tolist():
                    self._mapped(g)
                out[rows] = self._rows(seq_len)[starts[rows] + self._shift[f[rows]]]
        return out

    def _rows(self, seq_len: int) -> np.ndarray:
        """Under the lock: the span's windows of seq_len + 1 tokens from every token on, row r from its token r
        (made once per span: as_strided costs ~7 us)."""
        span, step = self._span, self.dtype.itemsize
        if seq_len not in span.rows:
            shape = (max(len(span.tokens) - seq_len, 0), seq_len + 1)
            span.rows[seq_len] = np.lib.stride_tricks.as_strided(span.tokens, shape, (step, step))
        return span.rows[seq_len]

    def doc_starts(self, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Where documents start in the seq_len + 1 tokens from each of `starts`, as (offsets, bounds): row
        j's are offsets[bounds[j]:bounds[j + 1]], ascending. They are each file's start and each document's
        end (a document starts where the one before ends; a file holds whole documents), each place once."""
        if not len(starts):
            return np.zeros(0, np.int64), np.zeros(1, np.int64)
        if self.documents <= MERGED:  # one search for the whole batch, whatever files it touches
            places = self.merged()
            return _within(places, np.searchsorted(places, np.concatenate([starts, starts + seq_len + 1])), starts)
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
                ends, base = self._file(f)[1], int(self.starts[f])
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
        ends = self._file(f)[1]
        return _within(ends, self._search(f, ends, np.concatenate([local, local + seq_len + 1])), local)

    def merged(self) -> np.ndarray:
        """Every place a document starts, in the stream: each file's start and each document's end, sorted,
        each once (read whole, at most MERGED of them)."""
        if self._merged is None:
            ends = [np.fromfile(idx, IDX_DTYPE) + start for (_, idx), start in zip(self.paths, self.starts.tolist())]
            self._merged = np.unique(np.concatenate([self.starts[:-1], *ends]))
        return self._merged

    def _search(self, f: int, ends: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """np.searchsorted(ends, keys) of file f's ends, reading one page of its ends a key: the block of SPARSE ends
        from the sparse ends in memory, then in it the 8 ends that close its sub-blocks of 64, then the
        sub-block's 64."""
        sparse = self._sparse[f]
        if sparse is None:  # a small .idx: its pages stay in memory after a few batches
            return np.searchsorted(ends, keys)
        position, column, last = np.searchsorted(sparse, keys) * SPARSE, keys[:, None], len(ends) - 1
        for step, probes in ((SPARSE // 8, SUB_BLOCKS), (1, IN_SUB_BLOCK)):
            found = ends[np.minimum(position[:, None] + probes, last)]  # past the end: the last end, >= every key
            position += step * np.count_nonzero(found < column, axis=1)
        return position


def _within(ends: np.ndarray, at: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _sparse_ends(idx_path: Path, documents: int) -> np.ndarray:
    """Every SPARSE-th end of an .idx (the last of each full block), read in 32 MB pieces: read, not
    mapped, so its pages stay reclaimable instead of in this process's maps."""
    sparse = np.empty(documents // SPARSE, dtype=np.int64)
    piece = SPARSE * 8192
    with open(idx_path, "rb") as f:
        for first in range(0, len(sparse) * SPARSE, piece):
            ends = np.fromfile(f, dtype=IDX_DTYPE, count=min(piece, len(sparse) * SPARSE - first))
            sparse[first // SPARSE : (first + len(ends)) // SPARSE] = ends[SPARSE - 1 :: SPARSE]
    return sparse


def _check_size(path: Path, size: int, what: str) -> None:
    try:
        found = path.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"{path} is missing though meta lists it: the output is damaged (tokpipe verify)") from None
    if found != size:
        raise ValueError(
            f"{path} holds {found:,} bytes, meta says {what}: the file is not the one meta describes (tokpipe verify)"
        )


def _map(path: Path, dtype: np.dtype, random: bool = False) -> np.ndarray:
    """A read-only array over the file (a plain ndarray: slicing an np.memmap costs 2x, its __array_finalize__)."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:  # mmap cannot map an empty file
            return np.zeros(0, dtype)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if random:
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)

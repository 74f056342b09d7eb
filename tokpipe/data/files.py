"""A split's token files as a loader reads them: windows and document ends, any number of files with a
bounded number open, and beyond RAM about one page of the .idx read per window.

Files: a --no-concat split is one file per shard (SlimPajama: ~59k). Mapping every file up front, as
tokpipe.read.output does for readers that look at a few, holds two descriptors and two maps a file: 4,006
descriptors for 2,000 files (`ulimit -n 1024` refuses them) and past the kernel's 65,530 maps at 59k.
Here a file is mapped when a batch first reads it, and the least recently read is dropped once
OPEN_FILES are mapped; sizes are checked against meta up front, with stat alone.

Windows: window i starts at token i*seq_len (in a Mixture's files joined, from its source's first
token), so a file's windows are the rows of a strided view of its tokens (row stride seq_len, row length
seq_len + 1) and a batch is one row gather per file it touches, each into its rows of the batch (one
searchsorted and one argsort group them): a gather is 2.4x the rate of a fancy-index gather of every
token (26,000 against 11,000 batches of 64 x 513 a second), and each more file a batch touches costs
~5 us (a gather and a scatter of its rows: 7 files 59 us a batch, one 27 us). Token maps are
madvise(MADV_RANDOM): a window faults in its own pages, not the kernel's 128 KB readahead around each.

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
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tokpipe.out.records import IDX_DTYPE

OPEN_FILES = 64  # 128 maps and descriptors at most: a tenth of the common `ulimit -n` of 1024
SPARSE = 512  # ends per block: one 4 KB page of an .idx
MERGED = 1 << 21  # a split of at most this many documents keeps their ends in memory (16 MB), merged
SMALL = 64 * SPARSE  # an .idx of at most 64 pages is searched whole: ~5 us a batch against ~30 us by blocks
SUB_BLOCKS = np.arange(1, 8) * (SPARSE // 8) - 1  # the last end of each sub-block of a block but the last
IN_SUB_BLOCK = np.arange(SPARSE // 8 - 1)


class TokenFiles:
    """The token files of a split (or of one group of it), in order, read as one stream of tokens."""

    def __init__(self, entries: list[tuple[Path, Path, int, int]], dtype: np.dtype, origins=None):
        self.dtype = np.dtype(dtype)
        for bin_path, idx_path, tokens, documents in entries:
            _check_size(bin_path, tokens * self.dtype.itemsize, f"{tokens:,} tokens of {self.dtype.itemsize} bytes")
            _check_size(idx_path, documents * IDX_DTYPE.itemsize, f"{documents:,} document ends of 8 bytes")
        self.entries = entries
        self.paths = [(bin_path, idx_path) for bin_path, idx_path, _, _ in entries]
        self.starts = np.cumsum([0] + [tokens for _, _, tokens, _ in entries])  # one entry per file
        self.tokens = int(self.starts[-1])
        self.documents = sum(documents for _, _, _, documents in entries)
        # Where the windows of each file's stream start: 0, or in a Mixture's joined files, its source's first token.
        self.origins = np.zeros(len(entries), np.int64) if origins is None else np.asarray(origins, np.int64)
        self._open: OrderedDict[int, tuple[np.ndarray, np.ndarray, dict]] = OrderedDict()
        self._sparse: dict[int, np.ndarray] = {}  # kept when the file's maps are dropped
        self._grid: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per seq_len: each file's first window, count
        self._merged: np.ndarray | None = None
        self._lock = threading.Lock()

    @classmethod
    def joined(cls, parts: list[TokenFiles]) -> TokenFiles:
        """The files of several streams one after another, each stream's windows counted from its first token."""
        bases = np.cumsum([0] + [part.tokens for part in parts[:-1]])
        origins = np.concatenate([np.full(len(part), base) for part, base in zip(parts, bases)])
        return cls([e for part in parts for e in part.entries], parts[0].dtype, origins)

    def __len__(self) -> int:
        return len(self.paths)

    def _file(self, f: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """File f's tokens, document ends and its windows' strided views by seq_len, mapped (the least
        recently read file's maps dropped)."""
        with self._lock:
            if f in self._open:
                self._open.move_to_end(f)
                return self._open[f]
        bin_path, idx_path = self.paths[f]
        tokens, ends = _map(bin_path, self.dtype, random=True), _map(idx_path, IDX_DTYPE)
        sparse = _sparse_ends(idx_path, len(ends)) if len(ends) > SMALL and f not in self._sparse else None
        with self._lock:
            self._sparse.setdefault(f, sparse)
            mapped = self._open[f] = tokens, ends, {}
            while len(self._open) > OPEN_FILES:
                self._open.popitem(last=False)  # its maps close with their last reference
        return mapped

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

    def grid(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Per file, where its first window starts (windows start every seq_len from its stream's origin) and
        how many windows lie wholly inside it."""
        if seq_len not in self._grid:
            first = self.origins - (self.origins - self.starts[:-1]) // seq_len * seq_len
            self._grid[seq_len] = first, np.maximum(self.starts[1:] - first - 1, 0) // seq_len
        return self._grid[seq_len]

    def windows(self, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """The seq_len + 1 tokens from each of `starts` (window starts), as an int64 (B, seq_len + 1): one
        row gather per file the batch touches, each into its rows of the batch."""
        first, counts = self.grid(seq_len)
        if len(self.paths) == 1:
            return self._view(0, seq_len)[(starts - int(first[0])) // seq_len].astype(np.int64)
        out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
        f = np.searchsorted(self.starts, starts, side="right") - 1
        row = (starts - first[f]) // seq_len
        f[row >= counts[f]] = -1  # a window across a file's end (a few per file): read piece by piece
        order = np.argsort(f, kind="stable")
        files, row = f[order], row[order]
        cuts = [0, *(np.flatnonzero(files[1:] != files[:-1]) + 1).tolist(), len(starts)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            if b == a:  # no rows
                continue
            if files[a] >= 0:
                out[order[a:b]] = self._view(int(files[a]), seq_len)[row[a:b]]
                continue
            for r in order[a:b].tolist():
                out[r] = self.read(int(starts[r]), int(starts[r]) + seq_len + 1)
        return out

    def _view(self, f: int, seq_len: int) -> np.ndarray:
        """File f's windows: the rows of a strided view of its tokens (made once per map: as_strided costs ~7 us)."""
        tokens, _, views = self._file(f)
        if seq_len not in views:
            first, counts = self.grid(seq_len)
            skip, step = int(first[f] - self.starts[f]), tokens.itemsize
            views[seq_len] = np.lib.stride_tricks.as_strided(
                tokens[skip:], (int(counts[f]), seq_len + 1), (seq_len * step, step)
            )
        return views[seq_len]

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

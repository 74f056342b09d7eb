"""The order a store can serve: an epoch's windows taken a buffer of blocks at a time.

A split read from a store (tokpipe.data.cache) is fetched in blocks of `per_block` consecutive windows by ranged
GETs into a local cache of a few buffers. A global permutation of the windows would read every block anew for
each window (a GET of a block per window of 1 KB); this order reads each block once an epoch instead:

- block b holds windows [b * per_block, (b + 1) * per_block) (the last one fewer);
- epoch e's blocks come in a seeded order, Permutation(blocks, epoch_seed(seed, e)) (a local OUT's windows come in
  Permutation(windows, epoch_seed(seed, e))), taken `buffer` blocks at a time;
- the windows of buffer j come in a seeded order of their own, Permutation(its windows, epoch_seed(that, j, "buffer")).

So position p of the epoch's order is a window of buffer j while p falls in j's windows, and every window comes once
an epoch. The ranks split the positions as for a local OUT (rank r of W: r, r + W, ...), so ranks in lockstep read
the same buffer at the same time: the ranks of a node share its blocks in one cache. How shuffled that is, measured
against a global permutation and MosaicML's py1e, is in docs/trainers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokpipe.data.permutation import Permutation, epoch_seed

MAX_BLOCK = 16 << 20  # a block's bytes at most: S3 serves ranged GETs of 8-16 MB at its full rate a connection
# A block is a quarter of the cache (2 a buffer, the one read and the one fetched) until MAX_BLOCK, then a buffer holds
# more of them: a GET costs ~2 ms of botocore's CPU whatever its size (SeaweedFS here, 8 threads: 256 KiB GETs 130
# MB/s, 1 MiB 400, 4 MiB 770-870), so a small cache cut finer is fetched slower than it is read.
BLOCKS_IN_CACHE = 4


@dataclass(frozen=True)
class Geometry:
    """How a split of `windows` windows is cut for a store: blocks of `per_block` windows, `buffer` blocks a buffer."""

    windows: int
    per_block: int
    buffer: int

    @classmethod
    def fitted(cls, windows: int, seq_len: int, itemsize: int, cache_size: int) -> Geometry:
        """Blocks of a quarter of the cache (at most MAX_BLOCK), a buffer of half of it: the buffer being read and
        the next one, fetched meanwhile, fill the cache."""
        window = seq_len * itemsize
        per_block = max(1, min(cache_size // BLOCKS_IN_CACHE, MAX_BLOCK) // window)
        return cls(windows, per_block, max(1, cache_size // 2 // (per_block * window)))

    @property
    def blocks(self) -> int:
        return -(-self.windows // self.per_block)

    def counts(self) -> np.ndarray:
        """Each block's windows."""
        counts = np.full(self.blocks, self.per_block, dtype=np.int64)
        counts[-1] = self.windows - self.per_block * (self.blocks - 1)
        return counts

    def as_state(self) -> dict:
        return {"block": self.per_block, "buffer": self.buffer}


class BlockOrder:
    """Epoch e's order of the windows, a buffer of blocks at a time (the module's docstring). Holds an epoch's
    block order (one int64 a block: 5 MB for the 600,000 blocks of 16 MB of 10 TB of tokens), two epochs at most."""

    def __init__(self, geometry: Geometry, seed: int):
        self.geometry, self.seed = geometry, seed
        self._counts = geometry.counts()
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Epoch e's blocks in order, the windows before each of them (and all: blocks + 1), and before each
        buffer (and all)."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            g = self.geometry
            order = Permutation(g.blocks, epoch_seed(self.seed, epoch))[np.arange(g.blocks, dtype=np.int64)]
            before = np.concatenate([[0], np.cumsum(self._counts[order])])
            self._epochs[epoch] = (order, before, np.append(before[: -1 : g.buffer], g.windows))
        return self._epochs[epoch]

    def windows(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The windows at these positions of epoch e's order (any positions, in any number of buffers)."""
        order, before, buffer_before = self._epoch(epoch)
        buffers = np.searchsorted(buffer_before, positions, side="right") - 1
        placed = np.empty(len(positions), dtype=np.int64)  # each position's place in the blocks laid out in order
        for j in np.unique(buffers).tolist():
            at = np.flatnonzero(buffers == j)
            first, n = int(buffer_before[j]), int(buffer_before[j + 1] - buffer_before[j])
            shuffled = Permutation(n, epoch_seed(epoch_seed(self.seed, epoch), j, "buffer"))
            placed[at] = first + shuffled[positions[at] - first]
        i = np.searchsorted(before, placed, side="right") - 1
        return order[i] * self.geometry.per_block + (placed - before[i])

    def buffer_of(self, epoch: int, position: int) -> int:
        return int(np.searchsorted(self._epoch(epoch)[2], position, side="right")) - 1

    def positions_of(self, epoch: int, buffer: int) -> tuple[int, int]:
        """The positions [first, stop) of buffer j of epoch e."""
        before = self._epoch(epoch)[2]
        return int(before[buffer]), int(before[buffer + 1])

    def blocks_of(self, epoch: int, buffer: int) -> np.ndarray:
        g = self.geometry
        return self._epoch(epoch)[0][buffer * g.buffer : (buffer + 1) * g.buffer]

    def after(self, epoch: int, buffer: int) -> tuple[int, int]:
        """The buffer that comes after buffer j of epoch e: the next one, or the next epoch's first."""
        return (epoch, buffer + 1) if (buffer + 1) * self.geometry.buffer < self.geometry.blocks else (epoch + 1, 0)

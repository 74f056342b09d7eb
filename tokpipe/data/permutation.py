"""A seeded bijection of range(n) that holds no index array: a keyed Feistel network, cycle-walked.

The Qwen3 incident log's loader needed a shuffled order of every window and `torch.randperm` over them
ran out of memory (8 bytes a window: 10 GB for a 2.5 TB split of 1-token windows, 40 GB with int64
indices of 4x as many). Here an order costs six 64-bit round keys whatever n is.

x in range(4**k), the smallest power of 4 >= n, splits into two k-bit halves; six Feistel rounds,
each mixing one half into the other with splitmix64's finalizer under a round key, permute
range(4**k). A value that lands at n or above is encrypted again (cycle walking) until it lands
below n: that stays a bijection of range(n), and since 4**k < 4n, takes fewer than 4 passes on average.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6  # Luby-Rackoff: 4 make a pseudo-random permutation; 2 more for margin at ~30% more time
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every output bit depends on every input bit (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """p = Permutation(n, seed): p[i] is i's image in a bijection of range(n), an int for an int and an
    int64 array for an integer array. Different seeds give unrelated orders."""

    def __init__(self, n: int, seed: int):
        if n < 0:
            raise ValueError(f"Permutation of {n} elements: n must be >= 0")
        self.n, self.seed = int(n), int(seed)
        self.half = max(1, (max(self.n, 2) - 1).bit_length() + 1) // 2  # bits of a half: 4**half >= n
        self.mask = np.uint64((1 << self.half) - 1)
        digest = hashlib.blake2b(f"tokpipe.data.Permutation {self.seed}".encode(), digest_size=8 * ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def __len__(self) -> int:
        return self.n

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << half) | right

    def __getitem__(self, i):
        scalar = np.ndim(i) == 0
        x = np.asarray(i)
        if x.dtype.kind not in "iu":
            raise TypeError(f"Permutation indices must be integers, not {x.dtype}")
        if x.size and (x.min() < 0 or x.max() >= self.n):
            bad = x.min() if x.min() < 0 else x.max()
            raise IndexError(f"index {int(bad)} is out of range for a Permutation of {self.n}")
        y = self._encrypt(x.astype(np.uint64).reshape(-1))
        outside = np.flatnonzero(y >= self.n)
        while outside.size:  # only the values still outside range(n) take another pass
            y[outside] = self._encrypt(y[outside])
            outside = outside[y[outside] >= self.n]
        return int(y[0]) if scalar else y.astype(np.int64).reshape(x.shape)

    def __repr__(self) -> str:
        return f"Permutation({self.n}, seed={self.seed})"

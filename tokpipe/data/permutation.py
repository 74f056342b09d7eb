"""A seeded bijection of range(n) that holds no index array: a keyed Feistel network, cycle-walked.

The Qwen3 incident log's loader needed a shuffled order of every window and `torch.randperm` over them
ran out of memory (an int64 a window: 5 GB for the 625 million windows of 2,048 tokens in 1.28 T
tokens, on every rank). Here an order costs six 64-bit round keys whatever n is.

x in range(2**b), the smallest power of 2 >= n, splits into a high and a low half (b - b//2 and b//2
bits); six rounds mix one half into the other in turn (an unbalanced Feistel network, each round
invertible), with splitmix64's multiply-xorshift under a round key. A value that lands at n or above is
encrypted again (cycle walking) until it lands below n: that stays a bijection of range(n), and since
2**b < 2n, takes fewer than 2 passes on average.

An array lookup's cost is mostly per numpy call (~50 us a pass here, 70 us over 4,096 values): callers
look up many at once (Sequences takes 16,384 of a rank's windows at a time). Where n is just above a
power of 2, half the values need a second pass, a quarter a third...: at n = 16,615, 4,096 lookups took
12 passes (0.85 ms); the last few values now walk on in Python integers (0.47 ms). A single index takes
that path too: ~4 us against numpy's ~135 us (six rounds of numpy calls on one element), the same image.

Where x has at most TABLE_BITS bits (n up to 16.7 M), a half holds at most 4,096 values: each round's
function of every value is computed once, as a table, and a round is a lookup and an xor (16,384
lookups at n = 16,615: 0.75 ms against 1.6). Permutation.orders does the same for many seeds at once:
the whole orders of a split of few windows, for its next epochs.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tokpipe.data.arguments import integer

WALK_IN_PYTHON = 8  # the last values of a cycle walk go on one at a time (~4 us a pass each)
TABLE_BITS = 24  # up to here, rounds by table lookups: tables of 6 x 2^12 values (196 KB) at most
ROUNDS = 6  # each half mixed into the other 3 times: Luby-Rackoff's 4 balanced rounds, with margin
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2 = np.uint64(31), np.uint64(29)


class Permutation:
    """p = Permutation(n, seed): p[i] is i's image in a bijection of range(n), an int for an int and an
    int64 array for an integer array. Different seeds give unrelated orders."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = integer(n, "Permutation's n"), integer(seed, "Permutation's seed", None)
        self.bits = bits = max(2, (self.n - 1).bit_length())
        self.shift = np.uint64(bits // 2)  # the low half's bits
        self.low_mask = np.uint64((1 << (bits // 2)) - 1)
        self.high_mask = np.uint64((1 << (bits - bits // 2)) - 1)
        self.keys = np.frombuffer(_round_keys([self.seed]), dtype="<u8").astype(np.uint64)
        self._table = None  # of a small n (bits <= TABLE_BITS): the rounds' functions, made on the first lookup
        self._key_pairs = tuple(zip(self.keys[0::2].tolist(), self.keys[1::2].tolist()))  # the scalar path's

    def __len__(self) -> int:
        return self.n

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        if self.bits <= TABLE_BITS:  # x as int64
            if self._table is None:
                self._table = self._tables(self.keys[None])
            return self._through(self._table, x)
        high, low = x >> self.shift, x & self.low_mask
        for i, key in enumerate(self.keys):
            source = low if i % 2 == 0 else high
            z = (source ^ key) * _M1  # splitmix64's finalizer (its first xorshift only mixes the key)
            z ^= z >> _S1
            z *= _M2
            z ^= z >> _S2
            if i % 2 == 0:
                high ^= z & self.high_mask
            else:
                low ^= z & self.low_mask
        return (high << self.shift) | low

    def _encrypt_int(self, x: int) -> int:
        """_encrypt of one value, cycle-walked, in Python integers (masked to 64 bits as uint64 wraps)."""
        shift, low_mask, high_mask = int(self.shift), int(self.low_mask), int(self.high_mask)
        m1, m2, s1, s2, wrap = int(_M1), int(_M2), int(_S1), int(_S2), (1 << 64) - 1
        while True:
            high, low = x >> shift, x & low_mask
            for even, odd in self._key_pairs:
                z = ((low ^ even) * m1) & wrap
                z = ((z ^ (z >> s1)) * m2) & wrap
                high ^= (z ^ (z >> s2)) & high_mask
                z = ((high ^ odd) * m1) & wrap
                z = ((z ^ (z >> s1)) * m2) & wrap
                low ^= (z ^ (z >> s2)) & low_mask
            x = (high << shift) | low
            if x < self.n:
                return x

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            if not 0 <= i < self.n:
                raise IndexError(f"index {int(i)} is out of range for a Permutation of {self.n}")
            return self._encrypt_int(int(i))
        scalar = np.ndim(i) == 0
        x = np.asarray(i)
        if x.dtype.kind not in "iu":
            raise TypeError(f"Permutation indices must be integers, not {x.dtype}")
        if x.size and (x.min() < 0 or x.max() >= self.n):
            bad = x.min() if x.min() < 0 else x.max()
            raise IndexError(f"index {int(bad)} is out of range for a Permutation of {self.n}")
        y = self._encrypt(x.astype(np.int64 if self.bits <= TABLE_BITS else np.uint64).reshape(-1))
        outside = np.flatnonzero(y >= self.n)
        while outside.size > WALK_IN_PYTHON:  # only the values still outside range(n) take another pass
            y[outside] = self._encrypt(y[outside])
            outside = outside[y[outside] >= self.n]
        for i in outside.tolist():  # a pass costs ~50 us of numpy calls however few values it has
            y[i] = self._encrypt_int(int(y[i]))
        return int(y[0]) if scalar else y.astype(np.int64).reshape(x.shape)

    @classmethod
    def orders(cls, n: int, seeds: list[int]) -> np.ndarray:
        """Row k: Permutation(n, seeds[k])[np.arange(n)], for every seed at once, where n is small (its
        power of 2 times len(seeds) a few 10^4 at most): every value of range(2**b) through each seed's
        tables (_tables), then the values at n or above walk on by lookups in the result."""
        p = cls(n, 0)
        keys = np.frombuffer(_round_keys(seeds), dtype="<u8").reshape(len(seeds), ROUNDS)
        domain = np.tile(np.arange(1 << p.bits, dtype=np.int64), (len(seeds), 1))
        encrypted = p._through(p._tables(keys), domain).reshape(-1)
        images = encrypted.reshape(len(seeds), -1)[:, :n].copy()
        flat, width = images.reshape(-1), 1 << p.bits
        outside = np.flatnonzero(flat >= n)
        while outside.size:
            flat[outside] = encrypted[outside // n * width + flat[outside]]
            outside = outside[flat[outside] >= n]
        return images

    def _tables(self, keys: np.ndarray) -> np.ndarray:
        """A round mixes one half's value into the other, and a half of b <= TABLE_BITS bits holds few
        values: round i's function of every value, for each row of keys, as an int64 (len(keys), ROUNDS,
        2**high bits), made by one pass of numpy calls."""
        z = (np.arange(int(self.high_mask) + 1, dtype=np.uint64) ^ keys[:, :, None]) * _M1  # _encrypt's rounds
        z ^= z >> _S1
        z *= _M2
        z ^= z >> _S2
        z[:, 0::2] &= self.high_mask
        z[:, 1::2] &= self.low_mask
        return z.astype(np.int64)

    def _through(self, tables: np.ndarray, x: np.ndarray) -> np.ndarray:
        """_encrypt of x (int64, one row per row of tables) by table lookups: a lookup and an xor a round
        against the arithmetic's 8 numpy calls (16,384 values: 0.30 ms a pass against 0.50)."""
        size = tables.shape[2]
        rows = np.arange(len(tables))[:, None] * size
        high, low = x >> int(self.shift), x & int(self.low_mask)
        for i in range(ROUNDS):
            table = tables[:, i].reshape(-1)
            if i % 2 == 0:
                high ^= table[rows + low] if len(tables) > 1 else table[low]
            else:
                low ^= table[rows + high] if len(tables) > 1 else table[high]
        return (high << int(self.shift)) | low

    def __repr__(self) -> str:
        return f"Permutation({self.n}, seed={self.seed})"


def epoch_seeds(seed: int, epochs: range, what: str = "epoch") -> list[int]:
    """Each epoch's seed (`what` "buffer": each buffer's of an epoch, tokpipe.data.blocks): the blake2b of
    "tokpipe.data {what} {seed} {epoch}", its common prefix hashed once
    (0.43 us an epoch against 0.88: a split of 20 windows passes an epoch every 20 of its rows)."""
    prefix, seeds = hashlib.blake2b(f"tokpipe.data {what} {seed} ".encode(), digest_size=8), []
    for epoch in epochs:
        digest = prefix.copy()
        digest.update(b"%d" % epoch)
        seeds.append(int.from_bytes(digest.digest(), "little"))
    return seeds


def epoch_seed(seed: int, epoch: int, what: str = "epoch") -> int:
    return epoch_seeds(seed, range(epoch, epoch + 1), what)[0]


def _round_keys(seeds: list[int]) -> bytes:
    """Each seed's round keys, one after another: the blake2b of "tokpipe.data.Permutation {seed}", its common
    prefix hashed once."""
    prefix, keys = hashlib.blake2b(b"tokpipe.data.Permutation ", digest_size=8 * ROUNDS), []
    for seed in seeds:
        digest = prefix.copy()
        digest.update(b"%d" % seed)
        keys.append(digest.digest())
    return b"".join(keys)

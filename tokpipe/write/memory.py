"""A worker's memory, bounded: the encoder's word cache dropped in time (shard.py asks before each encode)."""

from __future__ import annotations

import functools
import os

from tokpipe.inputs.encoders import drop_encoder, encoder

BATCH_HEADROOM = 64 << 20  # least room the word cache gets before it is dropped


def resident_bytes() -> int:
    """This process's RSS now, less its shared pages (Linux); 0 where /proc is missing, which turns the memory
    limit off. Not the shared pages: on Ray they include the object store's, which a worker maps and touches
    when it returns a shard's buffered parts, and which are not its to keep down."""
    try:
        resident, shared = os.pread(_statm(os.getpid()), 128, 0).split()[1:3]
        return (int(resident) - int(shared)) * PAGE
    except OSError:
        return 0


PAGE = os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _statm(pid: int) -> int:
    """This process's statm, opened once a `pid` and read again with pread (a fork opens its own: /proc/self is the
    opener's): opening it for each look was 5-7% of a worker's time on 20,000 two-document shards (py-spy; 11 us
    against 2 us a look here)."""
    return os.open("/proc/self/statm", os.O_RDONLY)


class MemoryGuard:
    """Keeps a worker process under `limit` bytes of RSS by dropping the encoder's word cache in time.

    gigatoken caches every distinct pretoken it has encoded and never evicts (~85 bytes each): a worker
    that reads hashes, handles and session ids for hours grows until the node kills it. Dropping the
    encoder frees the cache; the next batch reloads it (~0.4 s) and re-misses the words it had cached.
    The ids are the same either way.

    The cache is let grow to a third of the room between the floor (the RSS just after the encoder
    was loaded) and the limit, not to the limit: its hash table doubles when full, and while it
    rehashes the old and the new table are both alive, a spike of up to ~0.85x the cache within one
    batch (measured: RSS 633 -> 905 MiB in one batch, a 1,188 MiB peak). An encoder whose memory stops
    growing by itself (fastokens) keeps its working set: dropped at a third, it paid its load and a cold
    cache again every few shards for memory it took straight back. One guard per process, since the cache
    outlives the shard that filled it.
    """

    def __init__(self, limit: int, backend: str, tokenizer_json: str):
        self.limit, self.backend, self.tokenizer_json = limit, backend, tokenizer_json
        self.resets = 0
        self.floor: int | None = None  # RSS with a freshly loaded encoder, less what it held beside
        self.held = 0  # bytes held beside the cache for all encodes until set back (a pack's earlier shards' parts)

    def encoder(self, beside: int = 0):
        """The encoder, its cache dropped first if the process is past its room; `beside`: bytes it holds that
        are not the cache (a shard's buffered parts)."""
        beside += self.held
        if self.limit and self.floor is not None and resident_bytes() - beside > self.floor + self._room():
            drop_encoder(self.backend, self.tokenizer_json)
            self.resets += 1
            self.floor = None
        enc = encoder(self.backend, self.tokenizer_json)
        if self.floor is None:
            self.floor = resident_bytes() - beside
        return enc

    def _room(self) -> int:
        """What the encoder (loaded: the floor was taken after it) may grow past its floor: a third of what is
        left to the limit for a cache that grows with what it reads (see above); all of it but a batch's
        headroom for one that stops growing by itself (Encoder.bounded_cache), dropped only when the worker would
        otherwise reach its limit. No reference to it is kept here: drop_encoder could not free one still held."""
        left = self.limit - self.floor
        bounded = encoder(self.backend, self.tokenizer_json).bounded_cache
        return max(left - BATCH_HEADROOM if bounded else left // 3, BATCH_HEADROOM)


@functools.cache
def memory_guard(limit: int, backend: str, tokenizer_json: str) -> MemoryGuard:
    """The process's guard for that encoder and limit (shard.EncodeSpec's memory_limit, backend, tokenizer)."""
    return MemoryGuard(limit, backend, tokenizer_json)

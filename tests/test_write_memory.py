"""memory: a worker stays under its limit by dropping the encoder's word cache, not the tokens it holds."""

import gc
import weakref

import numpy as np
from helpers import EXAMPLE_CACHE, QWEN3
from helpers import read_shard as read
from helpers import shard_spec as spec_for

from tokpipe.inputs.manifest import build_manifest
from tokpipe.write.memory import MemoryGuard
from tokpipe.write.shard import tokenize_shard

HOLDOUT = list(build_manifest(EXAMPLE_CACHE).shards())[-1]


def test_a_worker_over_its_memory_limit_drops_the_encoder_cache_and_writes_the_same_bytes(tmp_path, monkeypatch):
    import tokpipe.inputs.encoders
    import tokpipe.write.memory
    from tokpipe.inputs.encoders import encoder

    spec = spec_for(QWEN3, batch_bytes=64 << 10, memory_limit=512 << 20)
    tokenize_shard(HOLDOUT, tmp_path / "unbounded", spec_for(QWEN3, memory_limit=0))
    # RSS as a long-tail corpus grows it: 40 MiB more at each look (a look per batch), given back when the
    # cache is dropped.
    grown = [0]

    def resident_bytes() -> int:
        grown[0] += 40 << 20
        return (300 << 20) + grown[0]

    def drop_encoder(*args) -> None:
        grown[0] = 0
        tokpipe.inputs.encoders.drop_encoder(*args)

    monkeypatch.setattr(tokpipe.write.memory, "resident_bytes", resident_bytes)
    monkeypatch.setattr(tokpipe.write.memory, "drop_encoder", drop_encoder)
    before = encoder(spec.backend, spec.tokenizer_json)
    result = tokenize_shard(HOLDOUT, tmp_path / "bounded", spec)
    assert result.encoder_resets >= 3 and encoder(spec.backend, spec.tokenizer_json) is not before
    for a, b in zip(read(tmp_path / "unbounded", HOLDOUT, np.uint32), read(tmp_path / "bounded", HOLDOUT, np.uint32)):
        assert np.array_equal(a, b)


class _StandIn:
    """An encoder as the guard sees it, loaded and dropped as encoders.encoder and drop_encoder do."""

    def __init__(self, bounded_cache: bool):
        self.bounded_cache = bounded_cache


def _guard_over_rss(monkeypatch, bounded_cache: bool) -> tuple[MemoryGuard, list, list, list]:
    """A guard of 768 MiB over an encoder stand-in and an RSS the test sets: (guard, [rss], drops, freed). For
    each drop, freed says whether the dropped encoder was freed then: one the guard still held would not be,
    and a worker would hold two encoders while the next one loads."""
    import tokpipe.write.memory

    loaded, dropped, freed = {}, [], []

    def drop_encoder(*args) -> None:
        gone = weakref.ref(loaded.pop(args))
        gc.collect()
        dropped.append(args)
        freed.append(gone() is None)

    monkeypatch.setattr(tokpipe.write.memory, "encoder", lambda *args: loaded.setdefault(args, _StandIn(bounded_cache)))
    monkeypatch.setattr(tokpipe.write.memory, "drop_encoder", drop_encoder)
    rss = [300 << 20]
    monkeypatch.setattr(tokpipe.write.memory, "resident_bytes", lambda: rss[0])
    return MemoryGuard(768 << 20, "gigatoken", "tokenizer.json"), rss, dropped, freed


def test_the_tokens_a_shard_buffers_are_no_reason_to_drop_the_cache(monkeypatch):
    """A shard's buffered parts (up to a quarter of the limit) are work, not cache: `beside` leaves them out."""
    guard, rss, dropped, freed = _guard_over_rss(monkeypatch, bounded_cache=False)
    guard.encoder()  # the floor: 300 MiB; the cache's room: a third of the 468 MiB left, 156 MiB
    rss[0] += 192 << 20  # a full buffer of tokens
    guard.encoder(beside=192 << 20)
    assert dropped == [] and guard.resets == 0
    guard.encoder(beside=0)  # the same RSS as cache: past its room
    assert dropped == [("gigatoken", "tokenizer.json")] and guard.resets == 1 and freed == [True]


def test_an_encoder_whose_memory_stops_growing_keeps_it_until_the_limit_nears(monkeypatch):
    """fastokens' RSS rises ~220 MiB over its first shards and stays there: no reason to drop it, and each drop
    cost its load and a cold cache again. It is dropped only past the limit less a batch's headroom."""
    guard, rss, dropped, freed = _guard_over_rss(monkeypatch, bounded_cache=True)
    guard.encoder()  # the floor: 300 MiB; the room: 768 - 300 - 64 = 404 MiB
    rss[0] += 404 << 20
    guard.encoder()
    assert dropped == [] and guard.resets == 0
    rss[0] += 1 << 20
    guard.encoder()
    assert dropped == [("gigatoken", "tokenizer.json")] and guard.resets == 1 and freed == [True]

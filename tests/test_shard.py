"""shard: one shard -> .bin/.idx equal to the reference; checkpoints make any interruption harmless."""

from pathlib import Path

import numpy as np
import pytest

from conftest import EXAMPLE_CACHE, QWEN3, QWEN3_EOS, Crash, crash_in_batch, reference_tokens
from tokpipe.manifest import build_manifest
from tokpipe.shard import Checkpoint, EncodeSpec, ShardFiles, to_dtype, tokenize_shard
from tokpipe.tokenizer import load_tokenizer_info

SHARDS = list(build_manifest(EXAMPLE_CACHE).shards())
HOLDOUT = SHARDS[-1]


def spec_for(tokenizer_dir, backend="gigatoken", **kw) -> EncodeSpec:
    info = load_tokenizer_info(tokenizer_dir)
    return EncodeSpec(info.path, backend, info.eos_id, info.vocab_size, info.dtype, **kw)


def read(out, shard, dtype):
    files = ShardFiles.of(out, shard)
    return np.fromfile(files.bin, dtype=dtype), np.fromfile(files.idx, dtype="<i8")


@pytest.mark.parametrize("backend, read_ahead", [("gigatoken", False), ("gigatoken", True), ("hf", False)])
def test_qwen3_shard_is_the_reference_in_uint32(tmp_path, backend, read_ahead):
    result = tokenize_shard(HOLDOUT, tmp_path, spec_for(QWEN3, backend, read_ahead=read_ahead))
    tokens, ends = read(tmp_path, HOLDOUT, np.uint32)
    assert np.array_equal(tokens, reference_tokens([Path(HOLDOUT.path)], QWEN3 / "tokenizer.json", QWEN3_EOS))
    assert tokens.max() >= 65536  # the ids uint16 would have wrapped are really there
    assert result.checkpoint.done and result.checkpoint.tokens == len(tokens)
    assert result.checkpoint.documents == len(ends) == 136 and result.checkpoint.skipped == {"empty_text": 3}
    assert result.checkpoint.lines == 139
    assert np.all(tokens[ends - 1] == QWEN3_EOS) and ends[-1] == len(tokens)


def test_small_vocab_shard_is_the_reference_in_uint16(tmp_path, small_tokenizer):
    spec = spec_for(small_tokenizer, "hf")
    assert spec.dtype == "uint16"
    tokenize_shard(HOLDOUT, tmp_path, spec)
    tokens, _ = read(tmp_path, HOLDOUT, np.uint16)
    expected = reference_tokens([Path(HOLDOUT.path)], small_tokenizer / "tokenizer.json", spec.eos_id, np.uint16)
    assert np.array_equal(tokens, expected)
    assert (tmp_path / "shards" / "validation" / f"{HOLDOUT.key}.bin").stat().st_size == 2 * len(expected)


def test_an_id_that_does_not_fit_is_an_error_never_a_wrap(tmp_path):
    with pytest.raises(OverflowError, match="151643 does not fit uint16"):
        to_dtype(np.array([5, 151643], dtype=np.uint32), "uint16")
    wrong = spec_for(QWEN3).__class__(**{**spec_for(QWEN3).__dict__, "dtype": "uint16"})
    with pytest.raises(OverflowError):
        tokenize_shard(HOLDOUT, tmp_path, wrong)


@pytest.mark.parametrize("read_ahead", [False, True])
def test_interrupted_shard_resumes_to_identical_bytes(tmp_path, read_ahead):
    spec = spec_for(QWEN3, batch_bytes=64 << 10, checkpoint_interval=0.0)
    whole_dir, cut_dir = tmp_path / "whole", tmp_path / "cut"
    tokenize_shard(HOLDOUT, whole_dir, spec)

    # With read_ahead the crash comes while the next batch is already read: that one was never checkpointed.
    with pytest.raises(Crash):
        tokenize_shard(HOLDOUT, cut_dir, EncodeSpec(**{**spec.__dict__, "read_ahead": read_ahead}), on_batch=crash_in_batch(5))
    files = ShardFiles.of(cut_dir, HOLDOUT)
    ckpt = Checkpoint.load(files.checkpoint)
    assert not ckpt.done and 0 < ckpt.lines < 139
    # Bytes written after the last checkpoint (a crash between write and checkpoint) are cut and redone.
    with open(files.bin, "ab") as f:
        f.write(np.arange(1000, dtype=np.uint32).tobytes())
    result = tokenize_shard(HOLDOUT, cut_dir, spec)
    assert result.resumed_tokens == ckpt.tokens and result.redone_tokens >= 1000
    for a, b in zip(read(whole_dir, HOLDOUT, np.uint32), read(cut_dir, HOLDOUT, np.uint32)):
        assert np.array_equal(a, b)
    assert Checkpoint.load(files.checkpoint) == Checkpoint.load(ShardFiles.of(whole_dir, HOLDOUT).checkpoint)


def test_finished_shard_is_not_redone(tmp_path):
    spec = spec_for(QWEN3)
    tokenize_shard(HOLDOUT, tmp_path, spec)
    calls = []
    result = tokenize_shard(HOLDOUT, tmp_path, spec, on_batch=lambda *a: calls.append(a))
    assert calls == [] and result.checkpoint.done and result.redone_tokens == 0


def test_a_write_error_stops_the_shard_and_a_rerun_completes_identically(tmp_path, monkeypatch):
    import errno
    import os

    spec = spec_for(QWEN3, batch_bytes=64 << 10, checkpoint_interval=0.0)
    tokenize_shard(HOLDOUT, tmp_path / "whole", spec)
    real_fsync, calls = os.fsync, []

    def disk_fills_up(fd):
        calls.append(fd)
        if len(calls) > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr("tokpipe.shard.os.fsync", disk_fills_up)
    with pytest.raises(OSError, match="No space left"):
        tokenize_shard(HOLDOUT, tmp_path / "full", spec)
    monkeypatch.setattr("tokpipe.shard.os.fsync", real_fsync)  # space freed
    result = tokenize_shard(HOLDOUT, tmp_path / "full", spec)
    assert result.resumed_tokens > 0
    for a, b in zip(read(tmp_path / "whole", HOLDOUT, np.uint32), read(tmp_path / "full", HOLDOUT, np.uint32)):
        assert np.array_equal(a, b)


def test_a_worker_over_its_memory_limit_drops_the_encoder_cache_and_writes_the_same_bytes(tmp_path, monkeypatch):
    import tokpipe.shard
    from tokpipe.tokenizer import encoder

    spec = spec_for(QWEN3, batch_bytes=64 << 10, memory_limit=512 << 20)
    tokenize_shard(HOLDOUT, tmp_path / "unbounded", spec_for(QWEN3, memory_limit=0))
    # RSS as a long-tail corpus grows it: 100 MiB more per batch, whatever the cache holds.
    rss = iter(range(300 << 20, 1 << 40, 100 << 20))
    monkeypatch.setattr(tokpipe.shard, "resident_bytes", lambda: next(rss))
    before = encoder(spec.backend, spec.tokenizer_json)
    result = tokenize_shard(HOLDOUT, tmp_path / "bounded", spec)
    assert result.encoder_resets >= 3 and encoder(spec.backend, spec.tokenizer_json) is not before
    for a, b in zip(read(tmp_path / "unbounded", HOLDOUT, np.uint32), read(tmp_path / "bounded", HOLDOUT, np.uint32)):
        assert np.array_equal(a, b)

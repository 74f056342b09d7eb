"""parquet: Parquet shards give the same tokens as the same documents in JSONL; every row is accounted for;
resumes land mid-row-group; broken files fail by name."""

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import QWEN3, REPO, Crash, assert_out_is, crash_in_batch, tokpipe
from tokpipe.errors import SourceError
from tokpipe.finalize import finalize
from tokpipe.manifest import build_manifest
from tokpipe.runner import RunOptions
from tokpipe.shard import Checkpoint, ShardFiles, tokenize_shard
from tokpipe.source import read_batches
from tokpipe.tokenizer import load_tokenizer_info
from test_runner import start, wait_for

PARQUET_CACHE = REPO / "examples" / "hf-cache-parquet"
MANIFEST = build_manifest(PARQUET_CACHE)
INFO = load_tokenizer_info(QWEN3)
ROW_GROUP = 64  # rows per row group in the example (examples/make_parquet_example.py --row-group 64)


def write_parquet(path: Path, column, name: str = "text", row_group: int = 2) -> str:
    pq.write_table(pa.table({name: column}), path, row_group_size=row_group)
    return str(path)


def test_the_parquet_example_gives_the_bytes_of_the_same_documents_in_jsonl(tmp_path, example_reference):
    assert [(s.split, s.relpath) for s in MANIFEST.shards()] == [
        ("train", "data/train-00000-of-00002.parquet"),
        ("train", "data/train-00001-of-00002.parquet"),
        ("validation", "data/validation-00000-of-00001.parquet"),
    ]
    spec = RunOptions().encode_spec(INFO, "gigatoken")
    for shard in MANIFEST.shards():
        tokenize_shard(shard, tmp_path, spec)
    meta = finalize(tmp_path, MANIFEST, INFO, "text")
    assert_out_is(tmp_path, example_reference)  # the reference reads the JSONL example by hand
    rows = sum(pq.ParquetFile(s.path).metadata.num_rows for s in MANIFEST.shards() if s.split == "train")
    assert meta["splits"]["train"]["lines"] == rows == 295 and meta["splits"]["train"]["skipped"] == {"empty_text": 2}


def test_every_row_is_a_document_or_a_counted_skip(tmp_path):
    batches = list(read_batches(write_parquet(tmp_path / "a.parquet", ["one", None, "", "two", None]), batch_bytes=1))
    assert [t for b in batches for t in b.texts] == ["one", "two"]
    assert sum(b.lines for b in batches) == 5 and batches[-1].end_offset == 5
    skipped = sum((b.skipped for b in batches), start=type(batches[0].skipped)())
    assert skipped == {"text_not_string": 2, "empty_text": 1}
    assert [entry for b in batches for entry in b.skip_log] == [(2, "text_not_string"), (3, "empty_text"), (5, "text_not_string")]
    numbers = list(read_batches(write_parquet(tmp_path / "n.parquet", pa.array([1, 2, 3]))))
    assert numbers[0].texts == [] and numbers[0].skipped == {"text_not_string": 3} and numbers[0].lines == 3


def test_a_missing_text_column_fails_naming_the_file_and_the_column(tmp_path):
    path = write_parquet(tmp_path / "body.parquet", ["x"], name="body")
    with pytest.raises(SourceError, match=r"body\.parquet: no column 'text' \(it has body\): pass --text-field"):
        list(read_batches(path))
    assert list(read_batches(path, "body"))[0].texts == ["x"]


def test_a_truncated_parquet_file_fails_naming_the_file(tmp_path):
    whole = Path(MANIFEST.source[0].path).read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole[: len(whole) * 6 // 10])
    with pytest.raises(SourceError, match=r"cut\.parquet: not a readable Parquet file .* re-download it"):
        list(read_batches(str(cut)))


def test_a_shard_interrupted_inside_a_row_group_resumes_to_identical_bytes(tmp_path):
    shard = MANIFEST.source[1]
    spec = RunOptions().encode_spec(INFO, "gigatoken")
    small = type(spec)(**{**spec.__dict__, "batch_bytes": 16 << 10, "checkpoint_interval": 0.0})
    tokenize_shard(shard, tmp_path / "whole", small)
    with pytest.raises(Crash):
        tokenize_shard(shard, tmp_path / "cut", small, on_batch=crash_in_batch(6))
    ckpt = Checkpoint.load(ShardFiles.of(tmp_path / "cut", shard).checkpoint)
    assert 0 < ckpt.lines and ckpt.lines % ROW_GROUP  # the checkpoint is inside a row group
    tokenize_shard(shard, tmp_path / "cut", spec)
    for name in ("bin", "idx"):
        assert getattr(ShardFiles.of(tmp_path / "cut", shard), name).read_bytes() == getattr(ShardFiles.of(tmp_path / "whole", shard), name).read_bytes()


@pytest.fixture
def parquet_copy(tmp_path) -> Path:
    """The example's Parquet shards as a plain folder (same relative paths)."""
    for shard in MANIFEST.shards():
        target = tmp_path / "data" / shard.relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shard.path, target)
    return tmp_path / "data"


def test_kill_9_mid_file_at_one_worker_then_two_workers_gives_identical_bytes(parquet_copy, tmp_path, example_reference):
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert tokpipe("manifest", "--dataset-dir", parquet_copy, "-o", manifest).returncode == 0
    proc = start(manifest, out, "--workers", "1", "--checkpoint-interval", "0.2", "--backend", "hf")
    checkpoints = out / "shards" / "train"
    wait_for(lambda: any(0 < json.loads(p.read_text())["lines"] and not json.loads(p.read_text())["done"] for p in checkpoints.glob("*.json")) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun = tokpipe("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, "--workers", "2")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, example_reference)
    assert tokpipe("verify", out, "--sample", "50").returncode == 0


def test_a_cut_parquet_shard_fails_by_name_and_skip_failed_finalizes_without_it(parquet_copy, tmp_path):
    cut = parquet_copy / "data" / "train-00001-of-00002.parquet"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size * 6 // 10])
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert tokpipe("manifest", "--dataset-dir", parquet_copy, "-o", manifest).returncode == 0
    failing = tokpipe("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out)
    assert failing.returncode == 1 and "Traceback" not in failing.stderr
    assert "FAILED data/train-00001-of-00002.parquet: SourceError:" in failing.stderr and "not a readable Parquet file" in failing.stderr
    skipping = tokpipe("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, "--skip-failed")
    assert skipping.returncode == 0, skipping.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert list(meta["excluded"]) == ["data/train-00001-of-00002.parquet"] and meta["splits"]["validation"]["documents"] == 136

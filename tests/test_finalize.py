"""finalize: split files assembled from shards in any order, surviving a crash at any point, to the reference bytes."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from helpers import EXAMPLE_CACHE, QWEN3, assert_out_is

from tokpipe.finalize import Assembler, finalize, place
from tokpipe.layout import ShardFiles
from tokpipe.manifest import build_manifest
from tokpipe.options import RunOptions
from tokpipe.shard import tokenize_shard
from tokpipe.tokenizer import load_tokenizer_info

MANIFEST = build_manifest(EXAMPLE_CACHE)
INFO = load_tokenizer_info(QWEN3)
OPTIONS = RunOptions()


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """OUT with every shard of the example tokenized and nothing assembled. Copy before changing it."""
    out = tmp_path_factory.mktemp("tokenized") / "out"
    spec = OPTIONS.encode_spec(INFO, "gigatoken")
    for shard in MANIFEST.shards():
        tokenize_shard(shard, out, spec)
    return out


@pytest.fixture
def out(tokenized, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(tokenized, copy)
    return copy


def listed(out, stem) -> list[str]:
    return [json.loads(line)["shard"] for line in (out / f"{stem}.parts.tmp").read_text().splitlines()]


def test_parts_copied_in_any_order_are_listed_in_split_order(out, example_reference):
    assembler = Assembler(out, MANIFEST, 4)
    parts = assembler.ready()
    assert [(p.stem, p.seq) for p in parts] == [("train", 0), ("train", 1), ("val", 0)]
    assert parts[1].token_offset == parts[0].record["tokens"] and parts[1].doc_offset == parts[0].record["documents"]
    second, first = parts[1], parts[0]
    assembler.placed([second], place(out, [second], 4))
    assert listed(out, "train") == []  # on disk, but the part before it is not yet: a crash now recopies it
    assembler.placed([first], place(out, [first], 4))
    assert listed(out, "train") == ["train/chunk1/example_train_0.jsonl.zst", "train/chunk1/example_train_1.jsonl.zst"]
    assembler.placed([parts[2]], place(out, [parts[2]], 4))
    assert assembler.complete
    finalize(out, MANIFEST, INFO, OPTIONS, assembler=assembler)
    assert_out_is(out, example_reference)
    assert not list(out.glob("*.tmp"))


def test_a_rerun_keeps_what_was_listed_and_recopies_what_was_not(out, example_reference):
    first_run = Assembler(out, MANIFEST, 4)
    train_0, train_1, _ = first_run.ready()
    first_run.placed([train_0], place(out, [train_0], 4))
    place(out, [train_1], 4)  # copied, then killed before it was listed
    with open(out / "train.parts.tmp", "ab") as f:
        f.write(b'{"shard": "train/chunk1/exa')  # and a line cut by the crash
    rerun = Assembler(out, MANIFEST, 4)
    assert [(p.stem, p.seq) for p in rerun.ready()] == [("train", 1), ("val", 0)]
    assert listed(out, "train") == ["train/chunk1/example_train_0.jsonl.zst"]  # the cut line is gone


def test_a_rerun_finishes_an_assembly_killed_midway_to_the_reference(out, example_reference):
    first_run = Assembler(out, MANIFEST, 4)
    train_0, *_ = first_run.ready()
    first_run.placed([train_0], place(out, [train_0], 4))
    (out / "train.bin.tmp").open("ab").write(b"\xff" * 1000)  # stray bytes past what is listed
    finalize(out, MANIFEST, INFO, OPTIONS)  # a new process: assembles the rest here
    assert_out_is(out, example_reference)


def test_a_listed_shard_that_is_no_longer_first_in_the_split_is_copied_again(out, example_reference):
    first_run = Assembler(out, MANIFEST, 4)
    train_0, train_1, _ = first_run.ready()
    place(out, [train_1], 4)
    # As if an earlier layout (before an append, or with train_0 excluded) had put train_1 first.
    (out / "train.parts.tmp").write_text(json.dumps(train_1.record) + "\n")
    assert [(p.stem, p.seq) for p in Assembler(out, MANIFEST, 4).ready()] == [("train", 0), ("train", 1), ("val", 0)]
    finalize(out, MANIFEST, INFO, OPTIONS)
    assert_out_is(out, example_reference)


def test_every_range_carries_the_checksums_of_the_worker_that_wrote_it(out):
    meta = finalize(out, MANIFEST, INFO, OPTIONS)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint32)
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    start, first_doc = 0, 0
    for line in (out / "train.parts").read_text().splitlines():
        record = json.loads(line)
        span = tokens[start : start + record["tokens"]]
        relative_ends = ends[first_doc : first_doc + record["documents"]] - start
        assert hashlib.sha256(span.tobytes()).hexdigest() == record["sha256"]
        assert hashlib.sha256(relative_ends.astype("<i8").tobytes()).hexdigest() == record["idx_sha256"]
        start, first_doc = start + record["tokens"], first_doc + record["documents"]
    assert start == meta["splits"]["train"]["tokens"] == len(tokens)
    assert meta["splits"]["train"]["parts_sha256"] == hashlib.sha256((out / "train.parts").read_bytes()).hexdigest()


def test_shards_finished_by_an_earlier_tokpipe_are_hashed_when_placed(out, tokenized):
    # Checkpoints written before workers hashed their shards have no sha256.
    for shard in MANIFEST.shards():
        path = ShardFiles.of(out, shard).checkpoint
        ckpt = json.loads(path.read_text())
        del ckpt["sha256"], ckpt["idx_sha256"]
        path.write_text(json.dumps(ckpt))
    finalize(out, MANIFEST, INFO, OPTIONS)
    fresh = finalize(tokenized, MANIFEST, INFO, OPTIONS)
    assert (out / "train.parts").read_bytes() == (tokenized / "train.parts").read_bytes()
    assert json.loads((out / "meta.json").read_text())["splits"] == fresh["splits"]


def test_an_unfinished_shard_stops_finalize_and_skip_failed_leaves_it_out(out):
    holdout = list(MANIFEST.shards())[-1]
    checkpoint = ShardFiles.of(out, holdout).checkpoint
    checkpoint.write_text(json.dumps({**json.loads(checkpoint.read_text()), "done": False}))
    with pytest.raises(RuntimeError, match="example_holdout_0.jsonl.zst is unfinished"):
        finalize(out, MANIFEST, INFO, OPTIONS)
    meta = finalize(out, MANIFEST, INFO, OPTIONS, excluded={holdout.relpath: "SourceError: truncated"})
    assert meta["splits"]["validation"]["tokens"] == 0 and (out / "val.bin").stat().st_size == 0
    assert meta["excluded"] == {holdout.relpath: "SourceError: truncated"}

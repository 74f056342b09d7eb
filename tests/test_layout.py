"""How documents are laid out: BOS and/or EOS around each, and a validation split held out by hash."""

import json
import shutil

import numpy as np
import pytest
from conftest import (
    EXAMPLE_CACHE,
    QWEN3,
    QWEN3_EOS,
    build_out,
    held_out_texts,
    is_held_out,
    reference_texts,
    reference_tokens,
    snapshot_files,
    tokpipe,
)

from tokpipe.inspect import BOS_MARK, inspect
from tokpipe.options import RunOptions
from tokpipe.verify import verify, verify_sample

IM_START = 151644  # Qwen3's <|im_start|>; its tokenizer_config names no bos_token
SNAPSHOT = next(EXAMPLE_CACHE.glob("datasets--*/snapshots/*"))
TRAIN, HOLDOUT = snapshot_files(SNAPSHOT, "train"), snapshot_files(SNAPSHOT, "validation")


def tokens(out, stem):
    return np.fromfile(out / f"{stem}.bin", dtype=np.uint32)


def failed(out):
    return [c.name for c in verify(out) if not c.ok]


@pytest.fixture(scope="module")
def bos_out(tmp_path_factory):
    return build_out(
        tmp_path_factory.mktemp("bos") / "out", QWEN3, options=RunOptions(bos=True, bos_token="<|im_start|>")
    )


def test_bos_then_text_then_eos_for_every_document(bos_out):
    reference = reference_tokens(TRAIN, QWEN3 / "tokenizer.json", QWEN3_EOS, bos_id=IM_START)
    assert np.array_equal(tokens(bos_out, "train"), reference)
    meta = json.loads((bos_out / "meta.json").read_text())
    assert (
        meta["delimiters"] == {"bos": True, "eos": True}
        and meta["bos_token_id"] == IM_START
        and meta["bos_token"] == "<|im_start|>"
    )
    ends = np.fromfile(bos_out / "train.idx", dtype="<i8")
    assert ends[-1] == len(reference) and tokens(bos_out, "train")[np.concatenate([[0], ends[:-1]])].tolist() == [
        IM_START
    ] * len(ends)
    assert failed(bos_out) == [] and all(c.ok for c in verify_sample(bos_out, 50))
    checks = [c.name for c in verify(bos_out)]
    assert "train: every document starts with BOS" in checks and "train: BOS count == documents" in checks


def test_bos_without_eos_places_no_eos_anywhere(tmp_path):
    out = build_out(tmp_path / "out", QWEN3, options=RunOptions(bos=True, bos_token="<|im_start|>", no_eos=True))
    assert np.array_equal(
        tokens(out, "train"), reference_tokens(TRAIN, QWEN3 / "tokenizer.json", None, bos_id=IM_START)
    )
    assert not np.any(tokens(out, "train") == QWEN3_EOS) and not np.any(tokens(out, "val") == QWEN3_EOS)
    assert failed(out) == [] and "train: no EOS anywhere (--no-eos)" in [c.name for c in verify(out)]
    assert all(c.ok for c in verify_sample(out, 20))
    result = inspect(out, n=2, window=10_000, seed=1)  # longer than any document here: each window crosses a start
    assert result.ok and any(BOS_MARK in text for text in result.texts)
    assert "share of BOS (id 151644)" in [c.name for c in result.flags]


def test_verify_names_a_document_that_lost_its_bos(bos_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(bos_out, out)
    ends = np.fromfile(out / "val.idx", dtype="<i8")
    damaged = np.memmap(out / "val.bin", dtype=np.uint32, mode="r+")
    damaged[ends[4]] = 42
    damaged.flush()
    assert failed(out) == [
        "validation: sha256 matches meta",
        "validation: BOS count == documents",
        "validation: every document starts with BOS",
    ]


def test_delimiters_nobody_could_split_or_a_bos_the_tokenizer_lacks_are_refused(tmp_path):
    manifest = tmp_path / "m.json"
    assert tokpipe("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", manifest).returncode == 0
    run = ("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", tmp_path / "out")
    no_bos = tokpipe(*run, "--bos")
    assert (
        no_bos.returncode == 2
        and "names no bos_token" in no_bos.stderr
        and "--bos-token" in no_bos.stderr
        and "Traceback" not in no_bos.stderr
    )
    nothing = tokpipe(*run, "--no-eos")
    assert nothing.returncode == 2 and "add --bos" in nothing.stderr
    unknown = tokpipe(*run, "--bos", "--bos-token", "<|no such token|>")
    assert unknown.returncode == 2 and "not in the tokenizer's vocabulary" in unknown.stderr


def test_a_resume_with_other_delimiters_is_refused_and_an_earlier_run_json_is_the_same_run(
    bos_out, finished_example, tmp_path
):
    out = tmp_path / "bos"
    shutil.copytree(bos_out, out)
    other = tokpipe("run", "--manifest", out / "manifest.json", "--tokenizer", QWEN3, "--out", out)
    assert (
        other.returncode == 2
        and "delimiters: was {'bos': True, 'eos': True}, now {'bos': False, 'eos': True}" in other.stderr
    )
    # An OUT of tokpipe 0.1, unfinished: its run.json has no delimiters or val_fraction, meaning EOS only.
    old = tmp_path / "old"
    shutil.copytree(finished_example, old)
    run = json.loads((old / "run.json").read_text())
    del run["delimiters"], run["val_fraction"]
    (old / "run.json").write_text(json.dumps(run))
    (old / "meta.json").unlink()
    again = tokpipe("run", "--manifest", old / "manifest.json", "--tokenizer", QWEN3, "--out", old)
    assert again.returncode == 0, again.stderr
    assert json.loads((old / "meta.json").read_text())["delimiters"] == {"bos": False, "eos": True}


def test_val_fraction_holds_out_train_documents_chosen_by_their_text(tmp_path):
    out = build_out(tmp_path / "out", QWEN3, options=RunOptions(val_fraction=0.2))
    tokenizer = QWEN3 / "tokenizer.json"
    kept = reference_tokens(TRAIN, tokenizer, QWEN3_EOS, texts=held_out_texts(0.2, False))
    # val.bin: each shard's part in manifest order, train/ before validation/: the held-out train
    # documents, then the holdout shard.
    val = np.concatenate(
        [
            reference_tokens(TRAIN, tokenizer, QWEN3_EOS, texts=held_out_texts(0.2, True)),
            reference_tokens(HOLDOUT, tokenizer, QWEN3_EOS),
        ]
    )
    assert np.array_equal(tokens(out, "train"), kept) and np.array_equal(tokens(out, "val"), val)
    meta = json.loads((out / "meta.json").read_text())
    train, validation = meta["splits"]["train"], meta["splits"]["validation"]
    held = sum(is_held_out(t, 0.2) for path in TRAIN for t in reference_texts(path))
    assert 0 < held < 293 and meta["val_fraction"] == 0.2
    assert train["held_out"] == validation["held_in"] == held and train["documents"] + held == 293
    assert train["documents"] + train["held_out"] + sum(train["skipped"].values()) == train["lines"] == 295
    assert failed(out) == [] and all(c.ok for c in verify_sample(out, 500))


def test_val_fraction_makes_a_validation_split_when_the_dataset_has_none(tmp_path):
    from tokpipe.finalize import finalize
    from tokpipe.manifest import build_manifest
    from tokpipe.shard import tokenize_shard
    from tokpipe.tokenizer import load_tokenizer_info

    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    for i, path in enumerate(TRAIN):
        shutil.copy(path, data / f"part-{i}.jsonl.zst")
    manifest, info, options = (
        build_manifest(tmp_path / "data"),
        load_tokenizer_info(QWEN3),
        RunOptions(val_fraction=0.5),
    )
    out = tmp_path / "out"
    for shard in manifest.shards():
        tokenize_shard(shard, out, options.encode_spec(info, "gigatoken"))
    meta = finalize(out, manifest, info, options)
    assert list(meta["splits"]) == ["train", "validation"] and meta["splits"]["validation"]["file"] == "val.bin"
    assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == 293


def test_an_unfinished_run_is_inspected_with_its_held_out_documents_in_val(tmp_path):
    from tokpipe.manifest import build_manifest, write_manifest
    from tokpipe.runner.identity import record_run
    from tokpipe.shard import tokenize_shard
    from tokpipe.tokenizer import load_tokenizer_info

    # A dataset with no validation split, tokenized with --val-fraction and not finalized: val.bin is yet to be.
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    for i, path in enumerate(TRAIN):
        shutil.copy(path, data / f"part-{i}.jsonl.zst")
    manifest, info, options, out = (
        build_manifest(tmp_path / "data"),
        load_tokenizer_info(QWEN3),
        RunOptions(val_fraction=0.2),
        tmp_path / "out",
    )
    out.mkdir()
    record_run(out, manifest, info, options)
    write_manifest(manifest, out / "manifest.json")
    for shard in manifest.shards():
        tokenize_shard(shard, out, options.encode_spec(info, "gigatoken"))
    held = sum(is_held_out(t, 0.2) for path in TRAIN for t in reference_texts(path))
    val = inspect(out, split="val", n=1, seed=0)
    assert not val.source.finished and val.source.documents == held and val.source.split == "validation"
    assert inspect(out, split="train", n=1, seed=0).source.documents == 293 - held

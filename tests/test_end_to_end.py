"""The whole job as a user runs it: manifest -> run (embedded Ray) -> verify, byte-exact to the reference."""

import json
import pickle

import numpy as np
import pytest
from conftest import EXAMPLE_CACHE, QWEN3, QWEN3_EOS, SHARED_CACHE, reference_tokens, snapshot_files, tokpipe

SHARED_SNAPSHOT = next(iter(SHARED_CACHE.glob("datasets--*/snapshots/*")), None)


def run_pipeline(tmp_path, dataset_dir, workers="2"):
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    steps = [
        ("manifest", "--dataset-dir", dataset_dir, "-o", manifest),
        ("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, "--workers", workers),
        ("verify", out),
    ]
    results = [tokpipe(*step) for step in steps]
    for step, result in zip(steps, results):
        assert result.returncode == 0, f"tokpipe {step[0]} failed:\n{result.stdout}\n{result.stderr}"
    return out, results


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    return run_pipeline(tmp_path_factory.mktemp("example"), EXAMPLE_CACHE)


def test_example_bins_are_the_reference(example_run):
    out, _ = example_run
    snapshot = next(EXAMPLE_CACHE.glob("datasets--*/snapshots/*"))
    for split, stem in (("train", "train"), ("validation", "val")):
        expected = reference_tokens(snapshot_files(snapshot, split), QWEN3 / "tokenizer.json", QWEN3_EOS)
        got = np.fromfile(out / f"{stem}.bin", dtype=np.uint32)
        assert np.array_equal(got, expected), split


def test_meta_tells_a_trainer_how_to_read_the_bins(example_run):
    out, _ = example_run
    with open(out / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 151669
    assert meta["eos_token_id"] == QWEN3_EOS and meta["eos_token"] == "<|endoftext|>" and meta["bos_token_id"] is None
    assert meta["tokenizer"].startswith("qwen3@sha256:") and len(meta["tokenizer_sha256"]) == 64
    train = meta["splits"]["train"]
    assert train["file"] == "train.bin" and meta["splits"]["validation"]["file"] == "val.bin"
    assert train["documents"] == 293 and train["lines"] == 295 and train["skipped"] == {"empty_text": 2}
    tokens = np.memmap(out / train["file"], dtype=meta["dtype"], mode="r")
    assert len(tokens) == train["tokens"]
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    assert len(ends) == train["documents"] and np.all(tokens[ends - 1] == QWEN3_EOS)


def test_run_reports_the_effective_vocab_and_a_summary(example_run):
    _, (_, run, verify) = example_run
    assert (
        "vocab_size 151,669" in run.stdout
        and "eos '<|endoftext|>' = 151643" in run.stdout
        and "dtype uint32" in run.stdout
    )
    assert "3 shards" in run.stdout and "backend fastokens" in run.stdout
    assert "train:" in run.stdout and "293 documents" in run.stdout
    assert "phases: plan" in run.stdout and "| tokenize" in run.stdout and "| finalize" in run.stdout
    assert (
        run.stderr.strip().splitlines()[-1].startswith("[tokpipe] 100.0% of 1.1 MiB read")
    )  # a finished run read it all
    assert "all" in verify.stdout and "FAIL" not in verify.stdout


def test_status_and_inspect_of_a_ray_run(example_run):
    out, _ = example_run
    run = json.loads((out / "run.json").read_text())
    assert run["tokenizer_path"] == str((QWEN3 / "tokenizer.json").resolve()) and run["options"] == {"workers": 2}
    status = tokpipe("status", out)
    assert status.returncode == 0 and f"next: tokpipe verify {out}" in status.stdout
    inspect = tokpipe("inspect", out, "-n", "1")
    assert inspect.returncode == 0 and "all 6 checks hold" in inspect.stdout


def test_rerun_of_a_finished_out_is_a_quick_no_op(example_run, tmp_path):
    out, _ = example_run
    before = (out / "train.bin").stat().st_mtime_ns
    result = tokpipe("run", "--manifest", out / "manifest.json", "--tokenizer", QWEN3, "--out", out)
    assert result.returncode == 0 and "already finished" in result.stdout
    assert (out / "train.bin").stat().st_mtime_ns == before


@pytest.mark.skipif(SHARED_SNAPSHOT is None, reason="the project's shared data is not beside this checkout")
def test_shared_corpus_is_byte_identical_to_the_reference(tmp_path):
    out, _ = run_pipeline(tmp_path, SHARED_CACHE)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == 8_506_971
    assert meta["splits"]["validation"]["tokens"] == 768_493
    for split, stem in (("train", "train"), ("validation", "val")):
        expected = reference_tokens(snapshot_files(SHARED_SNAPSHOT, split), QWEN3 / "tokenizer.json", QWEN3_EOS)
        assert np.array_equal(np.fromfile(out / f"{stem}.bin", dtype=np.uint32), expected), split

"""The whole job as a user runs it, README's example: manifest -> run (on its own: tokenized in the driver,
an embedded Ray started only if that takes long) -> verify, byte-exact to the reference; what run, verify,
status and inspect say about it, line by line; a rerun of a finished OUT is a no-op. The project's shared
corpus (when present beside the checkout, and asked for with TOKPIPE_TESTS_SHARED=1) goes the same way on
the session's Ray."""

import json
import os
import pickle
import re

import numpy as np
import pytest
from helpers import (
    EMBEDDED_RAY_2_WORKERS,
    EXAMPLE_CACHE,
    QWEN3,
    QWEN3_EOS,
    SHARED_CACHE,
    TRAIN_DOCUMENTS,
    TRAIN_LINES,
    cli,
    reference_tokens,
    snapshot_files,
    tokpipe,
)

from tokpipe.inputs.tokenizer import load_tokenizer_info

SHARED_SNAPSHOT = next(iter(SHARED_CACHE.glob("datasets--*/snapshots/*")), None)


def run_pipeline(tmp_path, dataset_dir, workers="2", ray=None):
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    steps = [
        ("manifest", "--dataset-dir", dataset_dir, "-o", manifest),
        ("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, "--workers", workers),
        ("verify", out),
    ]
    results = [tokpipe(*step, ray=ray) for step in steps]
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
    assert (
        train["documents"] == TRAIN_DOCUMENTS
        and train["lines"] == TRAIN_LINES
        and train["skipped"] == {"empty_text": 2}
    )
    tokens = np.memmap(out / train["file"], dtype=meta["dtype"], mode="r")
    assert len(tokens) == train["tokens"]
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    assert len(ends) == train["documents"] and np.all(tokens[ends - 1] == QWEN3_EOS)


def test_run_reports_the_effective_vocab_and_a_summary(example_run):
    out, (_, run, verify) = example_run
    meta = json.loads((out / "meta.json").read_text())
    train, val = meta["splits"]["train"], meta["splits"]["validation"]
    tokenizer_id = load_tokenizer_info(QWEN3).id
    expected = [
        re.escape(
            f"tokenizer {tokenizer_id}: vocab_size 151,669 (len(tokenizer), added tokens included), "
            "eos '<|endoftext|>' = 151643, dtype uint32"
        ),
        re.escape("manifest tokpipe-realdata/slimpajama-mini: 3 shards, 1.1 MiB; 0 done, 0 partial, 3 to start"),
        r"backend fastokens: fastokens matched tokenizers on \d+ texts \([\d,]+ chars of sample\)",
        r"disk: output projected at [\d.]+ [kMGT]?B \([\d.]+ tokens per input byte so far x 1\.1 MB of input x 4 "
        r"bytes\); [\d.]+ [kMGT]?B still to write, [\d.,]+ [kMGT]?B free on OUT's file system: fits",
        EMBEDDED_RAY_2_WORKERS,
        re.escape(
            f"train: {train['tokens']:,} tokens, 293 documents, 2 lines skipped (empty_text 2) -> {out / 'train.bin'}"
        ),
        re.escape(
            f"validation: {val['tokens']:,} tokens, 136 documents, 3 lines skipped (empty_text 3) -> {out / 'val.bin'}"
        ),
        r"phases: plan [\d.]+s \| tokenize [\d.]+s, [\d.]+ MB of input read \([\d.]+ MB/s\), workers busy \d+% "
        r"\(\d+ x [\d.]+s, [\d.]+s on shards\) \| finalize .+",
        r"done in [\d.]+s \([\d.]+M tokens/s overall\); meta: "
        + re.escape(f"{out / 'meta.pkl'}. Next: tokpipe verify {out}"),
    ]
    lines = run.stdout.splitlines()
    assert len(lines) == len(expected), run.stdout
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    # The progress bar's last state, on stderr: a finished run read it all.
    assert run.stderr.strip().splitlines()[-1].startswith("[tokpipe] 100.0% of 1.1 MiB read")
    checks = verify.stdout.splitlines()
    assert checks[-1] == "all 33 checks hold" and all(line.startswith("ok    ") for line in checks[:-1])
    assert len(checks) == 34 and "FAIL" not in verify.stdout


def test_status_and_inspect_of_a_ray_run(example_run):
    out, _ = example_run
    run = json.loads((out / "run.json").read_text())
    assert run["tokenizer_path"] == str((QWEN3 / "tokenizer.json").resolve()) and run["options"] == {"workers": 2}
    status = cli("status", out)
    assert status.returncode == 0
    assert status.stdout.splitlines() == [
        f"{out}: finished",
        "shards: 3 done, 0 partial, 0 pending, 0 failed (of 3)",
        "  train       2/2 done          859,703 tokens           293 documents",
        "  validation  1/1 done          303,964 tokens           136 documents",
        "committed: 1,163,667 tokens, 429 documents; 100.0% of 1.1 MiB read",
        f"next: tokpipe verify {out}",
    ]
    inspect = cli("inspect", out, "-n", "1")
    assert inspect.returncode == 0 and inspect.stdout.splitlines()[-1] == "all 6 checks hold"


def test_rerun_of_a_finished_out_is_a_quick_no_op(example_run, tmp_path):
    out, _ = example_run
    before = (out / "train.bin").stat().st_mtime_ns
    result = tokpipe("run", "--manifest", out / "manifest.json", "--tokenizer", QWEN3, "--out", out)
    assert result.returncode == 0
    assert result.stdout == (
        f"{out} is already finished ({out / 'meta.json'}); nothing to do. Check it with: tokpipe verify {out}\n"
    )
    assert (out / "train.bin").stat().st_mtime_ns == before


@pytest.mark.skipif(SHARED_SNAPSHOT is None, reason="the project's shared data is not beside this checkout")
@pytest.mark.skipif(
    os.environ.get("TOKPIPE_TESTS_SHARED") != "1",
    reason="the shared corpus (40 MB, 9.3M tokens: ~50 s on 2 cores) runs with TOKPIPE_TESTS_SHARED=1",
)
def test_shared_corpus_is_byte_identical_to_the_reference(tmp_path, ray_address):
    """Opt-in: runs only with TOKPIPE_TESTS_SHARED=1 and the project's shared data beside the checkout
    (../shared/data/hf-cache, which a clean CI clone lacks); otherwise skipped."""
    out, _ = run_pipeline(tmp_path, SHARED_CACHE, ray=ray_address)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == 8_506_971
    assert meta["splits"]["validation"]["tokens"] == 768_493
    for split, stem in (("train", "train"), ("validation", "val")):
        expected = reference_tokens(snapshot_files(SHARED_SNAPSHOT, split), QWEN3 / "tokenizer.json", QWEN3_EOS)
        assert np.array_equal(np.fromfile(out / f"{stem}.bin", dtype=np.uint32), expected), split

"""source/batch.py, the one place a line is counted: every case real corpora throw at us, in one run of
`tokpipe run`. Nothing crashes, nothing is lost silently: every line is a document, a counted skip
(with its reason, logged with its line number) or a counted repair.

The corpus below has one shard per kind of trouble. The truncated download fails by name, and so does a shard
that is not JSON Lines (a CSV file; a Git LFS pointer, the manifest refuses); with --skip-failed the rest finalizes,
byte-identical to the reference on the same corpus without them, and every line read is accounted for as a document
or a counted skip.

The runs use the 600-id tokenizer with Qwen3's chat delimiters added as special tokens (chat_tokenizer): the
special-token strings of the dirty lines are then as special as in Qwen3, whose load (~1.8 CPU-s a run) and
uint32 ids are not the subject here.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import (
    CSV_LINES,
    EXAMPLE_CACHE,
    built_once,
    checkpoints,
    cli,
    pzstd_frames,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    run_args,
    tokpipe,
    write_jsonl,
)
from tokenizers import Tokenizer

from tokpipe.inputs.manifest import build_manifest, write_manifest

DIRTY_LINES = [
    b'\xef\xbb\xbf{"text": "starts with a BOM"}\r',  # BOM at the start of the file, CRLF endings
    b"\r",  # blank
    b"   ",  # blank
    b'{"text": "crlf line"}\r',
    b"not json at all",
    b'{"text": "unterminated',
    b'{"title": "no text field"}',
    b'{"text": null}',
    b'{"text": 42}',
    b'{"text": ["a", "b"]}',
    b'["text", "an array, not an object"]',
    b'{"text": ""}',
    b'{"text": "bad \xff\xfe utf8 bytes"}',  # invalid UTF-8: replaced, kept
    b'{"text": "lone \\ud800 surrogate and \\udfff too"}',  # lone surrogate escapes: one U+FFFD each
    b'{"text": "escaped nul \\u0000 inside"}',
    b'{"text": "specials as text <|endoftext|> <|im_start|>user <think>x</think> <|im_end|>"}',
    b'{"text": "a valid pair \\ud83d\\ude00"}',
]
LAST_LINE = b'{"text": "last line without a newline"}'


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return built_once(tmp_path_factory, "dirty/data", _write_corpus)


def _write_corpus(root):
    real = next(EXAMPLE_CACHE.rglob("example_holdout_0.jsonl.zst")).read_bytes()
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    (root / "train" / "a_real.jsonl.zst").write_bytes(real)
    (root / "train" / "b_dirty.jsonl.zst").write_bytes(
        b"\n".join(DIRTY_LINES) + b"\n" + LAST_LINE
    )  # plain JSONL named .zst
    (root / "train" / "c_zero_bytes.jsonl.zst").write_bytes(b"")
    (root / "train" / "d_empty_stream.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b""))
    write_jsonl(root / "train" / "e_gzip.jsonl.gz", reference_lines(real)[:20], "gzip")
    huge = json.dumps({"text": "word " * 1_000_000}), json.dumps({"text": "a" + " " * 1_000_000 + "b"})
    write_jsonl(root / "train" / "f_huge.jsonl.zst", list(huge), "zstd")
    whole = zstandard.ZstdCompressor().compress(b"\n".join(reference_lines(real)[:50]) + b"\n")
    (root / "train" / "g_truncated.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    pzstd = [b"\n".join(reference_lines(real)[start : start + 10]) + b"\n" for start in (60, 70)]  # 20 documents
    (root / "train" / "h_pzstd.jsonl.zst").write_bytes(pzstd_frames(pzstd))
    write_jsonl(root / "train" / "i_csv.jsonl.zst", CSV_LINES)
    write_jsonl(root / "validation" / "v.jsonl", reference_lines(real)[50:60])


def reference_lines(zst: bytes) -> list[bytes]:
    return zstandard.ZstdDecompressor().stream_reader(zst).read().splitlines()


@pytest.fixture(scope="session")
def chat_tokenizer(small_tokenizer, tmp_path_factory) -> Path:
    """The 600-id tokenizer with <|im_start|> and <|im_end|> added as special tokens (ids 600, 601)."""
    return built_once(tmp_path_factory, "dirty/tokenizer", lambda folder: _add_chat_specials(small_tokenizer, folder))


def _add_chat_specials(small_tokenizer: Path, folder: Path) -> None:
    shutil.copytree(small_tokenizer, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))


def ids(tokenizer: Path, *tokens: str) -> list[int]:
    return [reference_tokenizer(tokenizer / "tokenizer.json").token_to_id(token) for token in tokens]


@pytest.fixture(scope="session")
def runs(corpus, chat_tokenizer, tmp_path_factory):
    """The corpus run once as it is, then with --skip-failed, for the whole test run (in every xdist worker
    that comes to this module, each time it comes back, this was 5 s): OUT, and each run's exit and output."""
    work = built_once(tmp_path_factory, "dirty/runs", lambda work: _run_twice(corpus, chat_tokenizer, work))
    saved = [json.loads((work / f"{name}.json").read_text()) for name in ("first", "skip_failed")]
    return work / "out", *(subprocess.CompletedProcess(**result) for result in saved)


def _run_twice(corpus, tokenizer, work) -> None:
    work.mkdir()
    write_manifest(build_manifest(corpus), work / "m.json")
    args = ("run", "--manifest", work / "m.json", "--tokenizer", tokenizer, "--out", work / "out", "--workers", "2")
    for name, extra in (("first", ()), ("skip_failed", ("--skip-failed",))):
        result = tokpipe(*args, *extra)
        fields = {"args": list(map(str, result.args)), "returncode": result.returncode}
        (work / f"{name}.json").write_text(json.dumps(fields | {"stdout": result.stdout, "stderr": result.stderr}))


def test_truncated_download_fails_by_name_and_nothing_is_finalized(runs):
    out, first, _ = runs
    assert first.returncode == 1
    assert "FAILED train/g_truncated.jsonl.zst: SourceError:" in first.stderr and "truncated download" in first.stderr
    assert "Traceback" not in first.stderr + first.stdout


def test_a_shard_that_is_not_json_lines_fails_by_name_saying_so(runs, corpus):
    _, first, _ = runs
    assert (
        f"FAILED train/i_csv.jsonl.zst: SourceError: {corpus / 'train' / 'i_csv.jsonl.zst'}: 3 of the 3 lines"
        " read are not JSON objects (invalid_json 3, not_object 0): it is neither JSON Lines nor a JSON array of"
        " objects or texts (CSV? rows as lists? a Git LFS pointer?), or in a compression tokpipe does not read (it"
        " reads zstd, gzip, bz2 and xz), or binary"
    ) in first.stderr.splitlines()


def test_a_shard_gone_since_the_manifest_fails_alone_and_a_dataset_gone_is_refused(tmp_path, small_tokenizer):
    # Each was "[Errno 2] No such file or directory: ...; fix the cause and rerun the same command": the whole run
    # stopped, and the same command could only stop again.
    data, out = tmp_path / "data", tmp_path / "out"
    for name in ("a", "b"):
        write_jsonl(data / "train" / f"{name}.jsonl", [json.dumps({"text": f"document {name}"})])
    write_manifest(build_manifest(data), tmp_path / "m.json")
    (data / "train" / "b.jsonl").unlink()
    result = tokpipe(*run_args(tmp_path / "m.json", out, tokenizer=small_tokenizer))
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if not line.startswith("[tokpipe]")] == [
        f"FAILED train/b.jsonl: SourceError: {data / 'train' / 'b.jsonl'} is not there: the dataset moved or changed"
        " since the manifest was made; put it back, or make the manifest again (`tokpipe manifest`): one of the same"
        " files elsewhere resumes OUT",
        "1 shard failed; the rest are kept. Fix the cause and rerun the same command to retry them.",
    ]
    assert [c["done"] for c in checkpoints(out)] == [True]  # a.jsonl's, kept
    data.rename(tmp_path / "moved")  # or renamed, or its file system not mounted
    refused = cli(*run_args(tmp_path / "m.json", out, tokenizer=small_tokenizer))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"tokpipe run: error: the manifest's dataset {data} is not there (moved, renamed, or its file system not"
        " mounted): put it back, or make the manifest again where it is (`tokpipe manifest`): one of the same files"
        " resumes OUT\n",
    )


def test_alone_in_a_dataset_a_shard_that_is_not_json_lines_is_not_blamed_on_the_text_field(tmp_path, small_tokenizer):
    data = tmp_path / "data"
    write_jsonl(data / "train" / "a.jsonl.zst", CSV_LINES)
    write_manifest(build_manifest(data), tmp_path / "m.json")
    result = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if not line.startswith("[tokpipe]")] == [
        f"FAILED train/a.jsonl.zst: SourceError: {data / 'train' / 'a.jsonl.zst'}: 3 of the 3 lines read are not JSON"
        " objects (invalid_json 3, not_object 0): it is neither JSON Lines nor a JSON array of objects or texts (CSV?"
        " rows as lists? a Git LFS pointer?), or"
        " in a compression tokpipe does not read (it reads zstd, gzip, bz2 and xz), or binary",
        "1 shard failed; the rest are kept. Fix the cause and rerun the same command to retry them.",
    ]
    assert "--text-field" not in result.stdout + result.stderr


def test_skip_failed_finalizes_the_rest_byte_identical_to_the_reference(runs, corpus, chat_tokenizer):
    out, _, second = runs
    assert second.returncode == 0, second.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert list(meta["excluded"]) == ["train/g_truncated.jsonl.zst", "train/i_csv.jsonl.zst"]
    failed = ("g_truncated.jsonl.zst", "i_csv.jsonl.zst")
    train_files = sorted(p for p in (corpus / "train").iterdir() if p.name not in failed)
    tokenizer, [eos] = chat_tokenizer / "tokenizer.json", ids(chat_tokenizer, "<|endoftext|>")
    expected = reference_tokens(train_files, tokenizer, eos, np.uint16)
    assert np.array_equal(np.fromfile(out / "train.bin", dtype=np.uint16), expected)
    assert np.array_equal(
        np.fromfile(out / "val.bin", dtype=np.uint16),
        reference_tokens([corpus / "validation" / "v.jsonl"], tokenizer, eos, np.uint16),
    )
    verify = cli("verify", out)
    assert verify.returncode == 0
    assert (
        "ok    note: 2 shards excluded by --skip-failed  (train/g_truncated.jsonl.zst, train/i_csv.jsonl.zst)"
        in verify.stdout.splitlines()
    )


def test_every_line_is_a_document_or_a_counted_skip(runs, corpus):
    out, _, _ = runs
    train = json.loads((out / "meta.json").read_text())["splits"]["train"]
    real_docs = len(reference_texts(corpus / "train" / "a_real.jsonl.zst"))
    assert train["skipped"] == {
        "blank": 2,
        "empty_text": 1 + 3,
        "invalid_json": 2,
        "no_text": 1,
        "not_object": 1,
        "text_not_string": 3,
    }
    assert train["repaired"] == {"bom": 1, "invalid_utf8": 1, "lone_surrogate": 1}
    assert train["documents"] == real_docs + 8 + 20 + 2 + 20
    assert train["lines"] == real_docs + 3 + len(DIRTY_LINES) + 1 + 20 + 2 + 20
    assert train["documents"] + sum(train["skipped"].values()) == train["lines"]


def test_skips_are_logged_with_shard_and_line(runs):
    out, _, _ = runs
    log = json.loads((out / "logs" / "skipped.json").read_text())
    dirty = next(e for e in log["shards"] if e["shard"] == "train/b_dirty.jsonl.zst")
    assert dirty["first"][:3] == [[2, "blank"], [3, "blank"], [5, "invalid_json"]]
    assert dirty["documents"] + sum(dirty["skipped"].values()) == dirty["lines"] == len(DIRTY_LINES) + 1


def test_special_token_strings_in_documents_are_text(runs, chat_tokenizer):
    out, _, _ = runs
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    eos, *chat = ids(chat_tokenizer, "<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert chat == [600, 601]  # in its vocabulary: the strings could have become these ids
    eos_at = np.flatnonzero(tokens == eos)
    assert np.array_equal(eos_at + 1, ends)  # EOS only where tokpipe put it
    assert not np.isin(tokens, chat).any()  # <|im_start|>, <|im_end|> never as ids

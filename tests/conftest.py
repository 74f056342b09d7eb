"""Shared test fixtures, and the independent reference that tokpipe's bytes are compared against.

The reference is written from DESIGN.md alone, in the most obvious way, sharing no code with tokpipe:
files in sorted path order per split, lines through io.TextIOWrapper and json.loads, the text
encoded by `tokenizers.Tokenizer` with `encode_special_tokens = True` and no added special tokens,
EOS appended.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CACHE = REPO / "examples" / "hf-cache"
QWEN3 = REPO / "examples" / "tokenizers" / "qwen3"
SHARED_CACHE = REPO.parent / "shared" / "data" / "hf-cache"
QWEN3_EOS = 151643


def reference_texts(path: Path, text_field: str = "text") -> list[str]:
    """Document texts of one shard file, the way a careful user would read them by hand."""
    raw = path.read_bytes()
    if raw[:4] == b"\x28\xb5\x2f\xfd":
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    elif raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    texts = []
    for line in io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8-sig", errors="replace"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get(text_field), str) and obj[text_field]:
            # A lone surrogate from a JSON escape ("\ud800") is not text: one U+FFFD each, per DESIGN.
            texts.append("".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in obj[text_field]))
    return texts


def reference_tokens(
    paths: list[Path],
    tokenizer_json: Path,
    eos_id: int | None,
    dtype=np.uint32,
    bos_id: int | None = None,
    texts=reference_texts,
) -> np.ndarray:
    """Each document's ids, with BOS before (bos_id) and EOS after (eos_id None: none).
    `texts` reads a shard's documents."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True
    out = []
    for path in paths:
        for enc in tok.encode_batch(texts(path), add_special_tokens=False):
            out.extend(([] if bos_id is None else [bos_id]) + enc.ids + ([] if eos_id is None else [eos_id]))
    return np.array(out, dtype=dtype)


def is_held_out(text: str, fraction: float) -> bool:
    """README's rule: a document goes to val.bin when the blake2b-64 of its UTF-8 text, little-endian,
    is below fraction * 2**64."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") < fraction * 2**64


def held_out_texts(fraction: float, held: bool):
    """For reference_tokens: a shard's documents that --val-fraction sends to val.bin (held) or keeps."""
    return lambda path: [t for t in reference_texts(path) if is_held_out(t, fraction) == held]


def snapshot_files(snapshot: Path, split_folder: str) -> list[Path]:
    """A split's shard files in plain string order of their path, symlinks (or pointer files) followed."""
    files = sorted(p for p in (snapshot / split_folder).rglob("*.jsonl*"))
    resolved = []
    for p in files:
        if not p.is_symlink() and p.stat().st_size < 512 and p.read_bytes().startswith(b"../"):
            p = (p.parent / p.read_text().strip()).resolve()  # a symlink stored as a text file
        resolved.append(p.resolve())
    return resolved


def tokpipe(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a separate process, exit code and output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tokpipe.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE of 600 ids trained here, so the uint16 path is real. eos <|endoftext|>."""
    folder = tmp_path_factory.mktemp("small_tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = reference_texts(next((EXAMPLE_CACHE).rglob("example_holdout_0.jsonl.zst")))
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def write_jsonl(path: Path, lines: list[bytes | str], compression: str = "none") -> Path:
    data = b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)
    if compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    elif compression == "gzip":
        data = gzip.compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def build_out(out: Path, tokenizer: Path, backend: str = "fastokens", options=None) -> Path:
    """OUT as `tokpipe run` leaves it (manifest.json, run.json, shards, split files, meta), built stage
    by stage without Ray."""
    from tokpipe.finalize import finalize
    from tokpipe.manifest import build_manifest, write_manifest
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import record_run
    from tokpipe.shard import tokenize_shard
    from tokpipe.tokenizer import load_tokenizer_info

    options = options or RunOptions()
    manifest = build_manifest(EXAMPLE_CACHE)
    info = load_tokenizer_info(tokenizer, options.eos, options.bos_token)
    out.mkdir(parents=True)
    record_run(out, manifest, info, options)
    write_manifest(manifest, out / "manifest.json")
    spec = options.encode_spec(info, backend)
    for shard in manifest.shards():
        tokenize_shard(shard, out, spec)
    finalize(out, manifest, info, options)
    return out


@pytest.fixture(scope="session")
def finished_example(tmp_path_factory) -> Path:
    """A finished OUT of the shipped example with Qwen3 (uint32), built without Ray (fast). Copy before changing it."""
    return build_out(tmp_path_factory.mktemp("finished") / "out", QWEN3)


@pytest.fixture(scope="session")
def finished_small(tmp_path_factory, small_tokenizer) -> Path:
    """The same with the 600-id tokenizer: a uint16 OUT. Copy before changing it."""
    return build_out(tmp_path_factory.mktemp("finished_small") / "out", small_tokenizer, backend="hf")


class Crash(Exception):
    pass


def crash_in_batch(n: int):
    """An `on_batch` callback that raises Crash in batch n: after its bytes are written, before they
    are checkpointed."""
    seen = []

    def on_batch(*_):
        seen.append(1)
        if len(seen) == n:
            raise Crash()

    return on_batch


@pytest.fixture
def out(finished_example, tmp_path) -> Path:
    """A copy of finished_example that a test may damage."""
    copy = tmp_path / "out"
    shutil.copytree(finished_example, copy)
    return copy


@pytest.fixture(scope="session")
def killed_example(tmp_path_factory) -> Path:
    """An OUT as `kill -9` leaves it mid-run: the first train shard done, the second partial (with bytes
    written after its last checkpoint), the validation shard never started; run with --workers 2
    --checkpoint-interval 1. Copy before changing it."""
    from tokpipe.manifest import build_manifest, write_manifest
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import record_run
    from tokpipe.shard import tokenize_shard
    from tokpipe.tokenizer import load_tokenizer_info

    out = tmp_path_factory.mktemp("killed") / "out"
    out.mkdir()
    manifest = build_manifest(EXAMPLE_CACHE)
    info = load_tokenizer_info(QWEN3)
    record_run(out, manifest, info, RunOptions(workers=2, checkpoint_interval=1.0))
    write_manifest(manifest, out / "manifest.json")
    spec = replace(RunOptions().encode_spec(info, "gigatoken"), batch_bytes=64 << 10, checkpoint_interval=0.0)
    first, second, *_ = manifest.shards()
    tokenize_shard(first, out, spec)
    with pytest.raises(Crash):
        tokenize_shard(second, out, spec, on_batch=crash_in_batch(3))
    return out


@pytest.fixture(scope="session")
def example_reference() -> dict[str, np.ndarray]:
    """The reference tokens of the shipped example, per output file stem (train, val)."""
    snapshot = next(EXAMPLE_CACHE.glob("datasets--*/snapshots/*"))
    return {
        stem: reference_tokens(snapshot_files(snapshot, split), QWEN3 / "tokenizer.json", QWEN3_EOS)
        for split, stem in (("train", "train"), ("validation", "val"))
    }


def plain_copy_of_example(dest: Path) -> Path:
    """The example's shards as a plain folder (same relative paths, so the same reference bytes)."""
    snapshot = next(EXAMPLE_CACHE.glob("datasets--*/snapshots/*"))
    for link in snapshot.rglob("*.jsonl.zst"):
        target = dest / link.relative_to(snapshot)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(link.read_bytes())
    return dest


def assert_out_is(out: Path, reference: dict[str, np.ndarray]) -> None:
    for stem, expected in reference.items():
        got = np.fromfile(out / f"{stem}.bin", dtype=expected.dtype)
        assert np.array_equal(got, expected), f"{stem}.bin differs from the reference"

"""Checks on a finished OUT. Every check is named; `verify` passes only when all hold.

meta.pkl is read with a restricted unpickler (plain containers and scalars only): a hostile
meta.pkl executes nothing, it is reported.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
from dataclasses import asdict, dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tokpipe.finalize import HASH_CHUNK, hash_range

SCAN_CHUNK = 1 << 26  # tokens per read while scanning a split file


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; a tokpipe meta holds only plain values")


def load_meta_pkl(path: str | os.PathLike) -> dict:
    """meta.pkl without executing anything it may contain."""
    with open(path, "rb") as f:
        meta = _PlainUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(meta, dict):
        raise pickle.UnpicklingError(f"meta.pkl holds a {type(meta).__name__}, not a dict")
    return meta


def _scan(tokens: np.ndarray, eos_id: int) -> tuple[int, int]:
    """(max id, EOS count) of a token file, a chunk at a time so memory stays flat."""
    top, eos = 0, 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[start : start + SCAN_CHUNK]
        top = max(top, int(chunk.max()))
        eos += int(np.count_nonzero(chunk == eos_id))
    return top, eos


def verify(out: str | os.PathLike) -> list[Check]:
    out = Path(out)
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str = "") -> bool:
        checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    try:
        meta = load_meta_pkl(out / "meta.pkl")
    except FileNotFoundError:
        check("meta.pkl present", False, f"{out / 'meta.pkl'} is missing: the run has not finished (tokpipe status {out})")
        return checks
    except Exception as e:
        check("meta.pkl readable", False, f"{type(e).__name__}: {e}")
        return checks
    try:
        meta_json = json.loads((out / "meta.json").read_text())
    except (FileNotFoundError, ValueError) as e:
        check("meta.json present", False, f"{type(e).__name__}: {e}")
        return checks
    if not check("meta.pkl == meta.json", meta == meta_json, "" if meta == meta_json else "the two metas differ"):
        return checks

    try:
        dtype = np.dtype(meta["dtype"])
        vocab_size, eos_id = int(meta["vocab_size"]), int(meta["eos_token_id"])
        splits = dict(meta["splits"])
    except (KeyError, TypeError, ValueError) as e:
        check("meta well-formed", False, f"{type(e).__name__}: {e}")
        return checks
    limit = np.iinfo(dtype).max + 1 if dtype.kind == "u" else 0
    check("dtype holds vocab", vocab_size <= limit, f"{meta['dtype']} holds ids < {limit}; vocab_size {vocab_size}")
    check("eos id in vocab", 0 <= eos_id < vocab_size, f"eos {eos_id}, vocab {vocab_size}")

    for split, info in splits.items():
        _verify_split(out, split, info, dtype, vocab_size, eos_id, check)
    if meta.get("excluded"):
        # Not a failure: the user chose --skip-failed. But nobody should mistake the output for the whole corpus.
        check(f"note: {len(meta['excluded'])} shards excluded by --skip-failed", True, ", ".join(meta["excluded"]))
    return checks


def _verify_split(out: Path, split: str, info: dict, dtype: np.dtype, vocab_size: int, eos_id: int, check) -> None:
    path = out / info["file"]
    tokens_expected, docs_expected = int(info["tokens"]), int(info["documents"])
    if "lines" in info:
        skipped = sum(info.get("skipped", {}).values())
        check(f"{split}: documents + skipped == lines", docs_expected + skipped == info["lines"], f"{docs_expected:,} + {skipped:,} vs {info['lines']:,}")
    if not check(f"{split}: file present", path.is_file(), str(path)):
        return
    size = path.stat().st_size
    n = size // dtype.itemsize
    if size != tokens_expected * dtype.itemsize:
        other = next((d for d in ("uint16", "uint32", "int32", "int64") if d != dtype.name and size == tokens_expected * np.dtype(d).itemsize), None)
        if size == 0:
            detail = f"the file is empty; meta says {tokens_expected:,} tokens"
        elif other:
            detail = f"{size:,} bytes hold {tokens_expected:,} tokens of {other}, but meta says dtype {dtype.name}"
        elif size % dtype.itemsize:
            detail = f"{size:,} bytes is not a whole number of {dtype.name} tokens: the file was cut"
        else:
            detail = f"file {n:,} tokens, meta {tokens_expected:,}"
        check(f"{split}: size matches meta ({tokens_expected:,} {dtype.name})", False, detail)
        return
    check(f"{split}: size matches meta ({tokens_expected:,} {dtype.name})", True)
    tokens = np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
    with ThreadPoolExecutor(1) as pool:
        # sha256 on a second core while numpy scans on this one (both release the GIL).
        digest = pool.submit(_sha256, path) if "sha256" in info else None
        top, eos = _scan(tokens, eos_id) if n else (0, 0)
        if digest is not None:
            check(f"{split}: sha256 matches meta", digest.result() == info["sha256"], "" if digest.result() == info["sha256"] else "the token bytes changed since finalize")
    check(f"{split}: ids < vocab_size", top < vocab_size, f"max id {top:,}, vocab_size {vocab_size:,}")
    check(f"{split}: EOS count == documents", eos == docs_expected, f"EOS {eos:,}, documents {docs_expected:,}")

    idx_path = out / info.get("idx", Path(info["file"]).with_suffix(".idx").name)
    if not check(f"{split}: idx present", idx_path.is_file(), str(idx_path)):
        return
    idx_size = idx_path.stat().st_size
    if not check(f"{split}: idx entries == documents", idx_size == 8 * docs_expected, f"{idx_size / 8:,.0f} entries, {docs_expected:,} documents"):
        return
    ends = np.fromfile(idx_path, dtype="<i8")
    if "idx_sha256" in info:
        idx_ok = hashlib.sha256(ends.tobytes()).hexdigest() == info["idx_sha256"]
        check(f"{split}: idx sha256 matches meta", idx_ok, "" if idx_ok else "the index changed since finalize")
    increasing = bool(np.all(np.diff(ends) > 0)) and (len(ends) == 0 or ends[0] > 0)
    check(f"{split}: idx strictly increasing", increasing)
    last = int(ends[-1]) if len(ends) else 0
    check(f"{split}: idx ends at token count", last == n, f"last end {last:,}, tokens {n:,}")
    if increasing and last == n and len(ends):
        at_ends = np.asarray(tokens[ends - 1])
        check(f"{split}: every document ends with EOS", bool(np.all(at_ends == eos_id)), f"{int(np.count_nonzero(at_ends != eos_id))} do not")


def verify_sample(out: str | os.PathLike, k: int, seed: int = 0, tokenizer: str | None = None) -> list[Check]:
    """Re-tokenize k random documents from the source with `tokenizers` (the DESIGN reference) and
    compare them with their span in the bins: an independent check of the backend and of the offsets."""
    from tokenizers import Tokenizer

    from tokpipe.manifest import load_manifest
    from tokpipe.shard import Checkpoint, ShardFiles
    from tokpipe.source import read_batches
    from tokpipe.tokenizer import tokenizer_json_path

    out = Path(out)
    meta = load_meta_pkl(out / "meta.pkl")
    json_path = tokenizer_json_path(tokenizer or meta["tokenizer_path"])
    if hashlib.sha256(json_path.read_bytes()).hexdigest() != meta["tokenizer_sha256"]:
        return [Check("sample: tokenizer is the run's", False, f"{json_path} is not the tokenizer this run used (sha256 differs); pass --tokenizer")]
    reference = Tokenizer.from_file(str(json_path))
    reference.encode_special_tokens = True
    manifest = load_manifest(out / "manifest.json")
    excluded = meta.get("excluded", {})

    # Every document of the output as (split, shard, number within shard, number within split).
    population = []
    for split in manifest.counts:
        base = 0
        for shard in (s for s in manifest.shards(split) if s.relpath not in excluded):
            documents = Checkpoint.load(ShardFiles.of(out, shard).checkpoint).documents
            population.append((split, shard, base, documents))
            base += documents
    total = sum(p[3] for p in population)
    wanted = sorted(random.Random(seed).sample(range(total), min(k, total)))
    starts = np.cumsum([0] + [p[3] for p in population])  # first document of each shard, over all splits
    picks: dict[int, list[tuple[int, int]]] = {}  # population index -> [(doc in shard, doc in split)]
    for doc in wanted:
        i = int(np.searchsorted(starts, doc, side="right")) - 1
        picks.setdefault(i, []).append((doc - int(starts[i]), population[i][2] + doc - int(starts[i])))

    dtype = np.dtype(meta["dtype"])
    results: dict[str, list[int]] = {}
    mismatches: dict[str, list[str]] = {}
    for i, docs in picks.items():
        split, shard, _, _ = population[i]
        info = meta["splits"][split]
        tokens = np.memmap(out / info["file"], dtype=dtype, mode="r")
        ends = np.memmap(out / info["idx"], dtype="<i8", mode="r")
        needed = dict(docs)
        seen = 0
        for batch in read_batches(shard.path, meta["text_field"]):
            for text in batch.texts:
                if seen in needed:
                    d = needed[seen]
                    start = int(ends[d - 1]) if d else 0
                    expected = reference.encode(text, add_special_tokens=False).ids + [meta["eos_token_id"]]
                    got = tokens[start : int(ends[d])]
                    results.setdefault(split, []).append(d)
                    if len(got) != len(expected) or not np.array_equal(got, expected):
                        mismatches.setdefault(split, []).append(f"document {d} ({shard.relpath}, its document {seen})")
                seen += 1
            if seen > max(needed):
                break
    return [
        Check(f"{split}: {len(docs)} sampled documents re-tokenized by tokenizers match", not mismatches.get(split), "; ".join(mismatches.get(split, [])[:5]))
        for split, docs in results.items()
    ]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        hasher = hashlib.sha256()
        hash_range(f.fileno(), 0, os.fstat(f.fileno()).st_size, hasher, bytearray(HASH_CHUNK))
    return hasher.hexdigest()


def report(checks: list[Check]) -> str:
    lines = [f"{'ok  ' if c.ok else 'FAIL'}  {c.name}" + (f"  ({c.detail})" if c.detail else "") for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{failed} of {len(checks)} checks FAILED" if failed else f"all {len(checks)} checks hold")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> str:
    return json.dumps({"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}, indent=1)

"""Finished shards -> OUT/<stem>.bin, .idx and .parts per split, then meta.pkl, then meta.json (last: it marks a finished run).

A split file is assembled in place, not concatenated at the end: a shard's tokens go to their offset
as soon as that offset is known, i.e. once every shard before it in the split is done. So the done
prefix of each split is assembled while later shards still tokenize (the runner sends the copies to
Ray tasks on every node), and when the last shard is done only the last few copies remain.

While a split is assembled, OUT/<stem>.bin.tmp and .idx.tmp receive the copies, and
OUT/<stem>.parts.tmp lists, in split order, the shards whose bytes are in them: one JSON line per
shard with its token and document counts, its accounting and the sha256 of its ranges (computed by
the worker that wrote the shard). A line is appended only after its copy is fsynced, so after a
crash the list describes a prefix of what is on disk; a rerun keeps the prefix that is still the
start of the split in manifest order and copies the rest again, to the same offsets: the same bytes.
At the end the three files are renamed, then meta.pkl and meta.json are written. The .parts file
stays: `verify` checks every range against its sha256 on all cores, and no pass over a whole split
file ever runs on one core.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from tokpipe import __version__
from tokpipe.durability import HASH_CHUNK, fsync_dir, hash_range, write_atomic, write_json_atomic
from tokpipe.manifest import Manifest, Shard
from tokpipe.shard import IDX_DTYPE, Checkpoint, ShardFiles
from tokpipe.tokenizer import TokenizerInfo

COPY_CHUNK = 1 << 30
COPY_BATCH_BYTES = 1 << 30  # of tokens per copy task: one fsync covers many small shards


def split_file_stem(split: str) -> str:
    return "val" if split == "validation" else split


@dataclass(frozen=True)
class Part:
    """A shard's documents (or those it held out) and where they go: split file `stem`, at token and document offsets."""

    stem: str
    seq: int  # its place among the split's parts
    bin: str  # the shard's files
    idx: str
    token_offset: int
    doc_offset: int
    record: dict  # its line in <stem>.parts (_part says which fields)


def _part(stem: str, seq: int, files: ShardFiles, shard: Shard, ckpt: Checkpoint, held: bool, token_offset: int, doc_offset: int) -> Part:
    """A shard's part for split file `stem`: its documents, or (held) those it held out for val.bin.

    The accounting (lines, skips, repairs) goes with a shard's own part; `held_out` there counts the
    documents it sent to val.bin instead, `held_in` on the held-out part the documents val.bin got."""
    if held:
        record = {"shard": shard.relpath, "part": "held-out", "tokens": ckpt.val_tokens, "documents": ckpt.val_documents, "held_in": ckpt.val_documents}
        record.update(sha256=ckpt.val_sha256, idx_sha256=ckpt.val_idx_sha256)
        return Part(stem, seq, str(files.val_bin), str(files.val_idx), token_offset, doc_offset, record)
    record = {"shard": shard.relpath, "tokens": ckpt.tokens, "documents": ckpt.documents, "lines": ckpt.lines, "held_out": ckpt.val_documents}
    record.update(skipped=ckpt.skipped, repaired=ckpt.repaired, sha256=ckpt.sha256, idx_sha256=ckpt.idx_sha256)
    if ckpt.skip_log:
        record["first_skipped"] = ckpt.skip_log
    return Part(stem, seq, str(files.bin), str(files.idx), token_offset, doc_offset, record)


def sources(manifest: Manifest, stem: str, val_fraction: float) -> Iterator[tuple[Shard, bool]]:
    """What split file `stem` is made of, in manifest order: (shard, whether it is the shard's held-out part).

    A split's own shards; for val.bin with --val-fraction, also the held-out part of every train shard."""
    for shard in manifest.shards():
        if split_file_stem(shard.split) == stem:
            yield shard, False
        elif val_fraction and stem == "val" and shard.split == "train":
            yield shard, True


def output_splits(manifest: Manifest, val_fraction: float) -> list[str]:
    """The splits written: the dataset's, and validation when --val-fraction makes one."""
    splits = list(manifest.counts)
    if val_fraction and "train" in splits and "validation" not in splits:
        splits.append("validation")
    return splits


def _copy_range(src_path: str, dst_fd: int, length: int, dst_offset: int) -> None:
    """Write the first `length` bytes of src at `dst_offset` of dst, in the kernel, not through Python objects."""
    with open(src_path, "rb") as src:
        done = 0
        try:
            while done < length:
                copied = os.copy_file_range(src.fileno(), dst_fd, min(length - done, COPY_CHUNK), done, dst_offset + done)
                if copied == 0:
                    raise RuntimeError(f"{src_path} ended {length - done} bytes before its checkpoint says it does")
                done += copied
        except OSError:  # file systems without copy_file_range: through a buffer, in pieces
            buffer = bytearray(HASH_CHUNK)
            while done < length:
                got = os.preadv(src.fileno(), [memoryview(buffer)[: min(len(buffer), length - done)]], done)
                if got == 0:
                    raise RuntimeError(f"{src_path} ended {length - done} bytes before its checkpoint says it does") from None
                os.pwrite(dst_fd, memoryview(buffer)[:got], dst_offset + done)
                done += got


def place(out: str | os.PathLike, parts: list[Part], itemsize: int) -> list[dict]:
    """Copy parts of one split to their offsets, fsync, and return their records (checksums filled in).

    Plain Python: the runner runs it in Ray tasks on every node of a cluster (OUT is on storage they
    all see) or in threads of the driver on one machine; finalize runs it for what is left.
    Idempotent: a part copied twice is the same bytes.
    """
    out = Path(out)
    stem = parts[0].stem
    records = []
    with open(out / f"{stem}.bin.tmp", "r+b") as bin_f, open(out / f"{stem}.idx.tmp", "r+b") as idx_f:
        for part in parts:
            record = dict(part.record)
            _copy_range(part.bin, bin_f.fileno(), record["tokens"] * itemsize, part.token_offset * itemsize)
            relative = np.fromfile(part.idx, dtype=IDX_DTYPE, count=record["documents"])
            os.pwrite(idx_f.fileno(), memoryview(relative + part.token_offset), part.doc_offset * IDX_DTYPE.itemsize)
            if record["sha256"] is None:  # a shard finished by an earlier tokpipe, which hashed only whole files
                bin_hash = hashlib.sha256()
                with open(part.bin, "rb") as src:
                    hash_range(src.fileno(), 0, record["tokens"] * itemsize, bin_hash, bytearray(HASH_CHUNK))
                record.update(sha256=bin_hash.hexdigest(), idx_sha256=hashlib.sha256(memoryview(relative)).hexdigest())
            records.append(record)
        for f in (bin_f, idx_f):
            os.fdatasync(f.fileno())
    return records


@dataclass
class _Split:
    """The assembly of one split file: what is scheduled, and what is on disk and listed in .parts.tmp."""

    stem: str
    shards: Iterator[tuple[Shard, bool]]  # sources() of the split file, after the head
    head: tuple[Shard, bool] | None = None  # the next shard (and part) to schedule
    scheduled: int = 0  # parts handed out
    tokens: int = 0  # offsets of the next part
    documents: int = 0
    listed: int = 0  # parts in .parts.tmp (fsynced, in order)
    waiting: dict[int, dict] = field(default_factory=dict)  # seq -> record of parts copied before an earlier one

    @classmethod
    def start(cls, stem: str, shards: Iterator[tuple[Shard, bool]]) -> _Split:
        return cls(stem, shards, next(shards, None))

    def advance(self) -> None:
        self.head = next(self.shards, None)


class Assembler:
    """Decides which shard goes where in its split file, and keeps the list of what is there (.parts.tmp).

    Feed it finished shards (`done`), hand what `ready` returns to `place` (anywhere, any order, in
    batches), report what came back (`placed`); `finish` when `complete`.
    """

    def __init__(self, out: str | os.PathLike, manifest: Manifest, itemsize: int, val_fraction: float = 0.0):
        self.out, self.itemsize, self.val_fraction = Path(out), itemsize, val_fraction
        # Done shards not yet scheduled (the few that finished out of order), with how many parts still need them.
        self.finished: dict[str, tuple[Checkpoint, int]] = {}
        self.splits = [self._resume(manifest, split_file_stem(split)) for split in output_splits(manifest, val_fraction)]

    def _paths(self, stem: str) -> tuple[Path, Path, Path]:
        return tuple(self.out / f"{stem}.{ext}.tmp" for ext in ("bin", "idx", "parts"))

    def _resume(self, manifest: Manifest, stem: str) -> _Split:
        """Keep what an earlier attempt assembled, if it is still the start of the split; else start empty."""
        bin_tmp, idx_tmp, parts_tmp = self._paths(stem)
        state = _Split.start(stem, sources(manifest, stem, self.val_fraction))
        kept = []
        if bin_tmp.exists() and idx_tmp.exists() and parts_tmp.exists():
            for line in parts_tmp.read_bytes().splitlines():
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:  # a line cut by the crash: its fsync never returned
                    break
                if state.head is None or (record.get("shard"), record.get("part") == "held-out") != (state.head[0].relpath, state.head[1]):
                    break  # the split changed before this shard (an append, a shard excluded or back)
                kept.append(record)
                state.tokens += record["tokens"]
                state.documents += record["documents"]
                state.advance()
            if bin_tmp.stat().st_size < state.tokens * self.itemsize or idx_tmp.stat().st_size < state.documents * IDX_DTYPE.itemsize:
                kept = []  # cut since they were listed: trust none of it
        if not kept:
            state = _Split.start(stem, sources(manifest, stem, self.val_fraction))
            for path in (bin_tmp, idx_tmp):
                open(path, "wb").close()
        write_atomic(parts_tmp, b"".join(orjson.dumps(r) + b"\n" for r in kept))
        state.scheduled = state.listed = len(kept)
        return state

    def done(self, shard: Shard, ckpt: Checkpoint) -> None:
        """A shard finished in this run (its checkpoint as its task returned it)."""
        self.finished[shard.relpath] = (ckpt, 2 if self.val_fraction and shard.split == "train" else 1)

    def _checkpoint(self, shard: Shard) -> Checkpoint | None:
        if shard.relpath not in self.finished:
            return Checkpoint.load(ShardFiles.of(self.out, shard).checkpoint)
        ckpt, uses = self.finished.pop(shard.relpath)
        if uses > 1:  # its other part has yet to be scheduled
            self.finished[shard.relpath] = (ckpt, uses - 1)
        return ckpt

    def ready(self, excluded: frozenset[str] = frozenset()) -> list[Part]:
        """Parts whose offsets are now known: each split's next shards, while they are done (or excluded)."""
        parts = []
        for s in self.splits:
            while s.head is not None:
                shard, held = s.head
                if shard.relpath in excluded:
                    s.advance()
                    continue
                ckpt = self._checkpoint(shard)
                if ckpt is None or not ckpt.done:
                    break
                part = _part(s.stem, s.scheduled, ShardFiles.of(self.out, shard), shard, ckpt, held, s.tokens, s.documents)
                parts.append(part)
                s.scheduled += 1
                s.tokens += part.record["tokens"]
                s.documents += part.record["documents"]
                s.advance()
        return parts

    def placed(self, parts: list[Part], records: list[dict]) -> None:
        """Parts are on disk (fsynced): list them in .parts.tmp, in split order, as far as no part is missing."""
        for part, record in zip(parts, records):
            s = next(s for s in self.splits if s.stem == part.stem)
            s.waiting[part.seq] = record
        for s in self.splits:
            lines = []
            while s.listed in s.waiting:
                lines.append(orjson.dumps(s.waiting.pop(s.listed)) + b"\n")
                s.listed += 1
            if lines:
                with open(self._paths(s.stem)[2], "ab") as f:
                    f.write(b"".join(lines))
                    f.flush()
                    os.fsync(f.fileno())

    @property
    def complete(self) -> bool:
        return all(s.head is None and s.listed == s.scheduled for s in self.splits)

    def place_here(self, excluded: frozenset[str]) -> None:
        """Place whatever is left, in this process (all of it without Ray; nothing after a run that placed it)."""
        parts = self.ready(excluded)
        batch, size = [], 0
        for part in parts + [None]:
            if batch and (part is None or part.stem != batch[0].stem or size >= COPY_BATCH_BYTES):
                self.placed(batch, place(self.out, batch, self.itemsize))
                batch, size = [], 0
            if part is not None:
                batch.append(part)
                size += part.record["tokens"] * self.itemsize
        if not self.complete:
            head = next((s.head for s in self.splits if s.head is not None), None)
            raise RuntimeError(f"cannot finalize: shard {head[0].relpath} is unfinished" if head else "cannot finalize: parts handed out to copy were never placed")

    def finish(self) -> dict[str, dict]:
        """Cut, fsync and rename every split's files; returns meta's `splits` (in manifest order of splits)."""
        entries = {}
        for s in self.splits:
            bin_tmp, idx_tmp, parts_tmp = self._paths(s.stem)
            for path, length in ((bin_tmp, s.tokens * self.itemsize), (idx_tmp, s.documents * IDX_DTYPE.itemsize)):
                with open(path, "r+b") as f:
                    f.truncate(length)  # bytes beyond: copies of a layout that changed since
                    os.fsync(f.fileno())
            entries[s.stem] = _split_entry(s.stem, parts_tmp)
            for path in (bin_tmp, idx_tmp, parts_tmp):
                os.replace(path, path.with_suffix(""))
        fsync_dir(self.out)
        return entries


def _split_entry(stem: str, parts_path: Path) -> dict:
    """meta's entry for a split, summed from its parts list."""
    entry = {"file": f"{stem}.bin", "idx": f"{stem}.idx", "parts": f"{stem}.parts", "tokens": 0, "documents": 0, "lines": 0, "held_out": 0, "held_in": 0}
    skipped, repaired, shards = Counter(), Counter(), 0
    raw = parts_path.read_bytes()
    for record in map(orjson.loads, raw.splitlines()):
        for key in ("tokens", "documents", "lines", "held_out", "held_in"):
            entry[key] += record.get(key, 0)
        skipped.update(record.get("skipped", {}))
        repaired.update(record.get("repaired", {}))
        shards += record.get("part") != "held-out"
    entry.update(skipped=dict(sorted(skipped.items())), repaired=dict(sorted(repaired.items())), shards=shards)
    entry["parts_sha256"] = hashlib.sha256(raw).hexdigest()
    return entry


def read_parts(path: Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        for line in f:
            yield orjson.loads(line)


def _write_skip_log(out: Path, splits: dict[str, dict]) -> None:
    """OUT/logs/skipped.json: per shard with skips or repairs, their counts and the first lines skipped."""
    entries = []
    for entry in splits.values():
        for r in read_parts(out / entry["parts"]):
            if r.get("skipped") or r.get("repaired"):
                fields = {k: r[k] for k in ("shard", "lines", "documents", "skipped", "repaired")}
                entries.append(json.dumps({**fields, "first": r.get("first_skipped", [])}))
    (out / "logs").mkdir(exist_ok=True)
    write_atomic(out / "logs" / "skipped.json", ('{"shards": [' + ",".join("\n" + e for e in entries) + "\n]}\n").encode())


def finalize(
    out: str | os.PathLike,
    manifest: Manifest,
    info: TokenizerInfo,
    text_field: str,
    excluded: dict[str, str] | None = None,
    assembler: Assembler | None = None,
    *,
    bos: bool = False,
    eos: bool = True,
    val_fraction: float = 0.0,
) -> dict:
    """Finish assembling every split in manifest order and write meta; returns the meta dict.

    `assembler` is the run's, whose copy tasks placed (nearly) everything while shards tokenized;
    without one, everything is placed here. `excluded` (relpath -> error) are failed shards left out
    on purpose (`run --skip-failed`); meta records them, so a partial output is never mistaken for a whole one.
    `bos`, `eos` and `val_fraction` say how the run wrote documents, for meta.
    """
    out = Path(out)
    (out / "meta.json").unlink(missing_ok=True)  # OUT is unfinished while its split files change
    excluded = excluded or {}
    assembler = assembler or Assembler(out, manifest, np.dtype(info.dtype).itemsize, val_fraction)
    assembler.place_here(frozenset(excluded))
    stems = assembler.finish()
    splits = {split: stems[split_file_stem(split)] for split in output_splits(manifest, val_fraction)}
    _write_skip_log(out, splits)
    meta = {
        "dtype": info.dtype,
        "vocab_size": info.vocab_size,
        "eos_token_id": info.eos_id,
        "eos_token": info.eos_token,
        "bos_token_id": info.bos_id,
        "bos_token": info.bos_token,
        "delimiters": {"bos": bos, "eos": eos},
        "val_fraction": val_fraction,
        "tokenizer": info.id,
        "tokenizer_sha256": info.sha256,
        "tokenizer_path": info.path,
        "text_field": text_field,
        "splits": splits,
        "excluded": dict(sorted(excluded.items())),
        "manifest_sha256": manifest.fingerprint,
        "tokpipe_version": __version__,
    }
    write_atomic(out / "meta.pkl", pickle.dumps(meta, protocol=4))
    write_json_atomic(out / "meta.json", meta)
    return meta


def load_meta_json(out: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(out) / "meta.json").read_text())
    except FileNotFoundError:
        return None

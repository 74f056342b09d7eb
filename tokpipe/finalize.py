"""Finished shards -> OUT/<stem>.bin, .idx and .parts per split, then meta.pkl, then meta.json (last:
it marks a finished run).

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
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from tokpipe._version import __version__
from tokpipe.durability import HASH_CHUNK, copy_range, fsync_dir, hash_range, own_inode, write_atomic
from tokpipe.errors import UserError
from tokpipe.layout import (
    IDX_DTYPE,
    SKIPPED,
    Checkpoint,
    Part,
    ShardFiles,
    assembly_files,
    log_file,
    output_splits,
    part_record,
    parts_line,
    remove_placed_leftovers,
    sources,
    split_entry,
    split_file_stem,
    write_meta,
    write_skip_log,
)
from tokpipe.manifest import Manifest, Shard
from tokpipe.options import RunOptions
from tokpipe.tokenizer import TokenizerInfo

COPY_BATCH_BYTES = 1 << 30  # of tokens per copy task: one fsync covers many small shards


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
            copy_range(part.bin, bin_f.fileno(), record["tokens"] * itemsize, part.token_offset * itemsize)
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
    waiting: dict[int, tuple[Part, dict]] = field(default_factory=dict)  # seq -> parts placed before an earlier one

    @classmethod
    def start(cls, stem: str, shards: Iterator[tuple[Shard, bool]]) -> _Split:
        return cls(stem, shards, next(shards, None))

    def advance(self) -> None:
        self.head = next(self.shards, None)


class Assembler:
    """Decides which shard goes where in its split file, and keeps the list of what is there (.parts.tmp).

    Feed it finished shards (`done`), hand what `ready` returns to `place` (anywhere, any order, in
    batches), report what came back (`placed`); `finish` when `complete`.

    Tokens are kept once: a part's own files are removed as soon as its line in .parts.tmp is
    fsynced (its bytes were fsynced in the split file before). Its checkpoint stays, with the
    checksums and accounting that resume, status and verify read. With --no-concat (`opts.no_concat`)
    nothing is copied: a split is its parts' own files, listed in order, and they stay.
    """

    def __init__(self, out: str | os.PathLike, manifest: Manifest, itemsize: int, opts: RunOptions = RunOptions()):
        self.out, self.itemsize = Path(out), itemsize
        self.val_fraction, self.concat = opts.val_fraction, not opts.no_concat
        # Done shards not yet scheduled (the few that finished out of order), with how many parts still need them.
        self.finished: dict[str, tuple[Checkpoint, int]] = {}
        self.placed_tokens = 0  # copied into the split files by this process's placements, and listed
        self.lost: list[str] = []  # shards tokenized again: their placed files were gone, their place not kept
        self.splits = [
            self._resume(manifest, split_file_stem(split)) for split in output_splits(manifest, self.val_fraction)
        ]

    def _resume(self, manifest: Manifest, stem: str) -> _Split:
        """Keep what an earlier attempt assembled, if it is still the start of the split; else start empty."""
        bin_tmp, idx_tmp, parts_tmp = assembly_files(self.out, stem)
        for tmp in (parts_tmp, bin_tmp, idx_tmp)[: 3 if self.concat else 1]:
            # A split finished by an earlier finalize (fully, or killed between its renames), that this
            # run extends (an append, an excluded shard back): its placed shards' files are gone, so
            # it is the start to keep.
            if not tmp.exists() and tmp.with_suffix("").exists():
                (self.out / "meta.json").unlink(missing_ok=True)  # OUT is unfinished while its split files change
                os.replace(tmp.with_suffix(""), tmp)
        state = _Split.start(stem, sources(manifest, stem, self.val_fraction))
        kept = []
        if parts_tmp.exists() and (not self.concat or bin_tmp.exists() and idx_tmp.exists()):
            for line in parts_tmp.read_bytes().splitlines():
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:  # a line cut by the crash: its fsync never returned
                    break
                if state.head is None or (record.get("shard"), record.get("part") == "held-out") != (
                    state.head[0].relpath,
                    state.head[1],
                ):
                    break  # the split changed before this shard (an append, a shard excluded or back)
                kept.append(record)
                state.tokens += record["tokens"]
                state.documents += record["documents"]
                state.advance()
            if self.concat and (
                bin_tmp.stat().st_size < state.tokens * self.itemsize
                or idx_tmp.stat().st_size < state.documents * IDX_DTYPE.itemsize
            ):
                kept = []  # cut since they were listed: trust none of it
        if not kept:
            state = _Split.start(stem, sources(manifest, stem, self.val_fraction))
            if self.concat:
                for path in (bin_tmp, idx_tmp):
                    path.unlink(missing_ok=True)  # a new empty file, not a truncate: see own_inode
                    open(path, "xb").close()
        elif self.concat:
            for path in (bin_tmp, idx_tmp):
                own_inode(path)  # the split is written in place from here on
        write_atomic(parts_tmp, b"".join(map(parts_line, kept)))
        state.scheduled = state.listed = len(kept)
        if self.concat:
            self._tokenize_again(sources(manifest, stem, self.val_fraction), len(kept))
        return state

    def _tokenize_again(self, parts: Iterator[tuple[Shard, bool]], kept: int) -> None:
        """Shards done whose placed files are gone but whose place in the split was not kept (the split
        changed before them, or its file was cut): their checkpoints go, so this run tokenizes them again."""
        for shard, held in itertools.islice(parts, kept, None):
            files = ShardFiles.of(self.out, shard)
            if (files.val_bin if held else files.bin).exists():
                continue
            ckpt = Checkpoint.load(files.checkpoint)
            if ckpt is not None and ckpt.done:
                files.checkpoint.unlink()
                self.lost.append(shard.relpath)

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
                files = ShardFiles.of(self.out, shard)
                bin_path, idx_path = (files.val_bin, files.val_idx) if held else (files.bin, files.idx)
                record = part_record(shard, ckpt, held)
                if not self.concat:  # the part's files are the split's: meta lists them
                    record.update(bin=str(bin_path.relative_to(self.out)), idx=str(idx_path.relative_to(self.out)))
                part = Part(s.stem, s.scheduled, s.tokens, s.documents, record, str(bin_path), str(idx_path))
                parts.append(part)
                s.scheduled += 1
                s.tokens += part.tokens
                s.documents += part.documents
                s.advance()
        return parts

    def placed(self, parts: list[Part], records: list[dict]) -> None:
        """Parts are on disk (fsynced): list them in .parts.tmp, in split order, as far as no part is
        missing; then the listed parts' own files go (with --no-concat they are the split: they stay)."""
        for part, record in zip(parts, records):
            s = next(s for s in self.splits if s.stem == part.stem)
            s.waiting[part.seq] = (part, record)
        for s in self.splits:
            listed = []
            while s.listed in s.waiting:
                listed.append(s.waiting.pop(s.listed))
                s.listed += 1
            if listed:
                with open(assembly_files(self.out, s.stem)[2], "ab") as f:
                    f.write(b"".join(parts_line(record) for _, record in listed))
                    f.flush()
                    os.fsync(f.fileno())
                if self.concat:
                    self.placed_tokens += sum(record["tokens"] for _, record in listed)
                    for part, _ in listed:
                        Path(part.bin).unlink(missing_ok=True)
                        Path(part.idx).unlink(missing_ok=True)

    @property
    def complete(self) -> bool:
        return all(s.head is None and s.listed == s.scheduled for s in self.splits)

    def place_here(self, excluded: frozenset[str]) -> None:
        """Place whatever is left, in this process (all of it without Ray; nothing after a run that placed it)."""
        self.place_ready(excluded)
        if not self.complete:
            head = next((s.head for s in self.splits if s.head is not None), None)
            raise RuntimeError(
                f"cannot finalize: shard {head[0].relpath} is unfinished"
                if head
                else "cannot finalize: parts handed out to copy were never placed"
            )

    def place_ready(self, excluded: frozenset[str] = frozenset()) -> None:
        """Place, in this process, the parts whose place is known now."""
        parts = self.ready(excluded)
        batch, size = [], 0
        for part in parts + [None]:
            if batch and (part is None or part.stem != batch[0].stem or size >= COPY_BATCH_BYTES):
                self.placed(batch, place(self.out, batch, self.itemsize) if self.concat else [p.record for p in batch])
                batch, size = [], 0
            if part is not None:
                batch.append(part)
                size += part.record["tokens"] * self.itemsize

    def finish(self, excluded: frozenset[str]) -> dict[str, dict]:
        """Cut, fsync and rename every split's files; returns meta's `splits` (in manifest order of splits).
        Shard token files that a crash left behind after their part was listed go too (not those of
        `excluded` shards: a rerun resumes them)."""
        entries = {}
        for s in self.splits:
            bin_tmp, idx_tmp, parts_tmp = assembly_files(self.out, s.stem)
            renamed = [parts_tmp]
            if self.concat:
                for path, length in (
                    (bin_tmp, s.tokens * self.itemsize),
                    (idx_tmp, s.documents * IDX_DTYPE.itemsize),
                ):
                    with open(path, "r+b") as f:
                        f.truncate(length)  # bytes beyond: copies of a layout that changed since
                        os.fsync(f.fileno())
                renamed += [bin_tmp, idx_tmp]
            entries[s.stem] = split_entry(s.stem, parts_tmp, self.concat)
            for path in renamed:
                os.replace(path, path.with_suffix(""))
        fsync_dir(self.out)
        if self.concat:
            remove_placed_leftovers(self.out, excluded)
        return entries


def _refuse_empty_splits(out: Path, splits: dict[str, dict], text_field: str) -> None:
    """A split whose lines were read but none became a document is no success (a code dataset with its
    text under `content` read as `text`): one line, and no meta, so OUT stays unfinished. A split with no
    lines at all (its only shard failed and was excluded, an empty file) is not refused."""
    empty = []
    for name, s in splits.items():
        own_documents = s["documents"] - s["held_in"] + s["held_out"]  # those its lines became, wherever they went
        if s["lines"] > 0 and own_documents == 0:
            why = ", ".join(f"{reason} {n:,}" for reason, n in s["skipped"].items())
            empty.append(f"split {name}: {s['lines']:,} lines read, none became a document (skipped: {why})")
    if empty:
        raise UserError(
            f"{'; '.join(empty)}: is the text in another field than {text_field!r}? Rerun with --text-field FIELD "
            f"and a new --out; the first skipped lines are in {log_file(out, SKIPPED)}"
        )


def finalize(
    out: str | os.PathLike,
    manifest: Manifest,
    info: TokenizerInfo,
    opts: RunOptions,
    excluded: dict[str, str] | None = None,
    assembler: Assembler | None = None,
) -> dict:
    """Finish assembling every split in manifest order and write meta; returns the meta dict.

    `assembler` is the run's, whose copy tasks placed (nearly) everything while shards tokenized;
    without one, everything is placed here. `excluded` (relpath -> error) are failed shards left out
    on purpose (`run --skip-failed`); meta records them, so a partial output is never mistaken for a whole one.
    `opts` are the run's: how it wrote documents, for meta.
    """
    out = Path(out)
    (out / "meta.json").unlink(missing_ok=True)  # OUT is unfinished while its split files change
    excluded = excluded or {}
    assembler = assembler or Assembler(out, manifest, np.dtype(info.dtype).itemsize, opts)
    assembler.place_here(frozenset(excluded))
    stems = assembler.finish(frozenset(excluded))
    splits = {split: stems[split_file_stem(split)] for split in output_splits(manifest, opts.val_fraction)}
    write_skip_log(out, splits)
    _refuse_empty_splits(out, splits, opts.text_field)
    meta = {
        "dtype": info.dtype,
        "vocab_size": info.vocab_size,
        "eos_token_id": info.eos_id,
        "eos_token": info.eos_token,
        "bos_token_id": info.bos_id,
        "bos_token": info.bos_token,
        "delimiters": opts.delimiters,
        "val_fraction": opts.val_fraction,
        "concat": not opts.no_concat,
        "tokenizer": info.id,
        "tokenizer_sha256": info.sha256,
        "tokenizer_repo_id": info.repo_id,  # ORG/NAME and its commit, for a tokenizer from the HF cache
        "tokenizer_revision": info.revision,
        "tokenizer_path": info.path,
        "text_field": opts.text_field,
        "splits": splits,
        "excluded": dict(sorted(excluded.items())),
        "manifest_sha256": manifest.fingerprint,
        "tokpipe_version": __version__,
    }
    write_meta(out, meta)
    return meta

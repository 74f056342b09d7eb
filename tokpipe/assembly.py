"""Finished shards -> their split files, assembled in place while later shards still tokenize.

A split file is assembled in place, not concatenated at the end: a shard's tokens go to their offset
as soon as that offset is known, i.e. once every shard before it in the split is done. So the done
prefix of each split is assembled while later shards still tokenize (the runner sends the writes to
Placer actors on the nodes that hold the tokens), and when the last shard is done only the last few remain.
This module decides what goes where; place.py writes it.

While a split is assembled, OUT/<stem>.bin.tmp and .idx.tmp receive the parts, and
OUT/<stem>.parts.tmp lists, in split order, the shards whose bytes are in them: one JSON line per
shard with its token and document counts, its accounting and the sha256 of its ranges (computed by
the worker that encoded the shard). A line is appended only after its bytes are fsynced, so after a
crash the list describes a prefix of what is on disk; a rerun keeps that prefix where it is still the
start of the split in manifest order, and the parts after it that match their checksums, and writes
the rest again, to the same offsets: the same bytes.
With --group-by each group of a split has such a file (OUT/<stem>/<group>.bin.tmp), and the one
parts list of the split says which part went into which. `finalize` renames them when all is placed.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tokpipe.durability import HASH_CHUNK, fsync_dir, own_inode
from tokpipe.errors import too_many_groups
from tokpipe.manifest import Manifest, Shard
from tokpipe.out.files import Out, split_file_stem
from tokpipe.out.records import (
    IDX_DTYPE,
    MAX_GROUPS,
    Checkpoint,
    Part,
    is_held_part,
    part_record,
    parts_line,
    split_entry,
)
from tokpipe.out.run import OutputSpec, output_splits, sources
from tokpipe.place import is_in_place, place

COPY_BATCH_BYTES = 1 << 30  # of tokens per placing call: one fsync covers many small shards


@dataclass
class _Split:
    """The assembly of one split file (with --group-by, of its groups' files): what is scheduled, and what
    is on disk and listed in .parts.tmp."""

    stem: str
    shards: Iterator[tuple[Shard, bool]]  # sources() of the split file, after the head
    head: tuple[Shard, bool] | None = None  # the next shard (and part) to schedule
    # With --group-by, once the head is done: its parts still to schedule (None: its accounting line, then
    # its groups in value order), and its checkpoint.
    head_parts: list[str | None] | None = None
    head_ckpt: Checkpoint | None = None
    head_buffered: object = None  # the parts the head kept in memory (Assembler.done), if it did
    scheduled: int = 0  # parts handed out
    offsets: dict[str | None, tuple[int, int]] = field(default_factory=dict)  # file (group) -> tokens, documents
    listed: int = 0  # parts in .parts.tmp (fsynced, in order)
    waiting: dict[int, tuple[Part, dict]] = field(default_factory=dict)  # seq -> parts placed before an earlier one

    @classmethod
    def start(cls, stem: str, shards: Iterator[tuple[Shard, bool]]) -> _Split:
        return cls(stem, shards, next(shards, None))

    def advance(self) -> None:
        self.head, self.head_parts, self.head_ckpt, self.head_buffered = next(self.shards, None), None, None, None

    def add(self, group: str | None, record: dict) -> tuple[int, int]:
        """A part goes next in its file: returns its offsets there."""
        tokens, documents = self.offsets.get(group, (0, 0))
        self.offsets[group] = (tokens + record["tokens"], documents + record["documents"])
        return tokens, documents


class Assembler:
    """Decides which shard goes where in its split file, and keeps the list of what is there (.parts.tmp).

    `resume` first; then feed it finished shards (`done`), hand what `ready` returns to `place` (anywhere, any order, in
    batches), report what came back (`placed`); `finish` when `complete`.

    Tokens are kept once: a part's own files are removed as soon as its line in .parts.tmp is
    fsynced (its bytes were fsynced in the split file before). Its checkpoint stays, with the
    checksums and accounting that resume, status and verify read. With --no-concat (not `spec.concat`)
    nothing is copied: a split is its parts' own files, listed in order, and they stay.

    With --group-by a shard has a part per group, each copied into its group's file of the split at
    that file's offset; one parts list per split holds them all, a shard's in value order.
    """

    def __init__(self, out: str | os.PathLike, itemsize: int, spec: OutputSpec = OutputSpec()):
        self.out, self.itemsize = Out(out), itemsize
        self.val_fraction, self.concat, self.group_by = spec.val_fraction, spec.concat, spec.group_by
        self.values: dict[str, set[str]] = {}  # split stem -> the groups met (--group-by), for MAX_GROUPS
        # Done shards not yet scheduled (those that finished out of order), with how many parts still need them
        # and the parts they kept in memory.
        self.finished: dict[str, tuple[Checkpoint, int, object]] = {}
        self.placed_tokens = 0  # copied into the split files by this process's placements, and listed
        self.lost: list[str] = []  # shards tokenized again: their placed files were gone, their place not kept
        self.splits: list[_Split] = []  # by `resume`

    def resume(self, manifest: Manifest) -> None:
        """Take up OUT's split files where an earlier attempt left them, before anything is tokenized or
        placed: a split finalized before is renamed back to .tmp (and meta.json goes), the listed parts that
        are still the start of their split are kept, the rest of the files is made anew, and the checkpoints
        of shards whose placed files are gone but whose place was not kept go (`lost`: tokenized again)."""
        self.splits = [
            self._resume(manifest, split_file_stem(split)) for split in output_splits(manifest, self.val_fraction)
        ]

    def _expand(self, state: _Split, ckpt: Checkpoint) -> list[str | None]:
        """The parts of the head source, done: its one part; with --group-by its accounting line and groups."""
        if self.group_by is None:
            return [None]
        held = state.head[1]
        self._meet(state.stem, ckpt.val_groups if held else ckpt.groups)
        return list(ckpt.val_groups) if held else [None, *ckpt.groups]

    def _meet(self, stem: str, groups) -> None:
        """Refuse a split that has more groups than MAX_GROUPS, as soon as its done shards show it."""
        values = self.values.setdefault(stem, set())
        values.update(groups)
        if len(values) > MAX_GROUPS:
            raise too_many_groups(self.group_by, f"split {stem}", values, MAX_GROUPS)

    def _files(self, stem: str, offsets: dict) -> dict[str | None, tuple[Path, Path]]:
        """The split's files being assembled: its one file, or (--group-by) those of the groups in `offsets`."""
        groups = [g for g in offsets if g is not None] if self.group_by is not None else [None]
        return {g: self.out.assembly(stem, g)[:2] for g in groups}

    def _resume(self, manifest: Manifest, stem: str) -> _Split:
        """Keep what an earlier attempt assembled, if it is still the start of the split; else start empty."""
        parts_tmp = self.out.assembly(stem)[2]
        self.out.reopen(stem, self.concat, self.group_by is not None)
        state = _Split.start(stem, sources(manifest, stem, self.val_fraction))
        kept = self._kept(parts_tmp, state) if parts_tmp.exists() else []
        if kept and self.concat and self._cut(state):
            kept = []  # cut since they were listed: trust none of it
        if not kept:
            state = _Split.start(stem, sources(manifest, stem, self.val_fraction))
        if self.concat and self.group_by is None:
            kept += self._recover(state)
        if self.concat:
            self._prepare_files(state, bool(kept))
        self.out.start_parts_list(stem, b"".join(map(parts_line, kept)))
        state.scheduled = state.listed = len(kept)
        if self.concat:
            self._tokenize_again(manifest, state, len(kept))
        return state

    def _kept(self, parts_tmp: Path, state: _Split) -> list[dict]:
        """The records of .parts.tmp that are still the start of the split, in order; `state` is advanced
        past them."""
        kept = []
        for line in parts_tmp.read_bytes().splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:  # a line cut by the crash: its fsync never returned
                break
            if not self._head_known(state):
                break
            group = state.head_parts[0] if state.head_parts else None
            if (record.get("shard"), is_held_part(record), record.get("group")) != (
                state.head[0].relpath,
                state.head[1],
                group,
            ):
                break  # the split changed before this shard (an append, a shard excluded or back)
            kept.append(record)
            state.add(group, record)
            if state.head_parts:
                state.head_parts.pop(0)
            if not state.head_parts:
                state.advance()
        return kept

    def _head_known(self, state: _Split) -> bool:
        """Whether there is a head whose parts are known (with --group-by, once its checkpoint is done)."""
        while state.head is not None and state.head_parts is None and self.group_by is not None:
            ckpt = Checkpoint.of(self.out.root, state.head[0])
            if ckpt is None or not ckpt.done:
                break
            state.head_ckpt, state.head_parts = ckpt, self._expand(state, ckpt)
            if not state.head_parts:  # a held-out source with no documents: no part at all
                state.advance()
        return state.head is not None and (self.group_by is None or state.head_parts is not None)

    def _recover(self, state: _Split) -> list[dict]:
        """The parts written into place after the listed ones but not yet listed when the run stopped (a shard
        that buffered its tokens has no other copy of them): kept, in order, as far as each one's checkpoint is
        done and its bytes in the split file match the checksums the worker took; `state` is advanced past them.
        (With --group-by such parts are tokenized again.)"""
        bin_tmp, idx_tmp, _ = self.out.assembly(state.stem)
        if not (bin_tmp.exists() and idx_tmp.exists()):
            return []
        recovered, buffer = [], bytearray(HASH_CHUNK)
        with open(bin_tmp, "rb") as bin_f, open(idx_tmp, "rb") as idx_f:
            while state.head is not None:
                shard, held = state.head
                files = self.out.shard(shard)
                ckpt = Checkpoint.load(files.checkpoint)
                if ckpt is None or not ckpt.done or files.part(held, None)[0].exists():
                    break  # not done, or in its own files still: placed from them as usual
                record = part_record(shard, ckpt, held)
                if not is_in_place(bin_f, idx_f, record, *state.offsets.get(None, (0, 0)), self.itemsize, buffer):
                    break
                recovered.append(record)
                state.add(None, record)
                state.advance()
        return recovered

    def _cut(self, state: _Split) -> bool:
        """Whether a file being assembled is shorter than the parts listed in it."""
        return any(
            not bin_tmp.exists()
            or not idx_tmp.exists()
            or bin_tmp.stat().st_size < state.offsets.get(g, (0, 0))[0] * self.itemsize
            or idx_tmp.stat().st_size < state.offsets.get(g, (0, 0))[1] * IDX_DTYPE.itemsize
            for g, (bin_tmp, idx_tmp) in self._files(state.stem, state.offsets).items()
        )

    def _prepare_files(self, state: _Split, kept: bool) -> None:
        """The files the split is assembled into from here: those of the kept parts, else new empty ones."""
        if not kept and self.group_by is None:
            self.out.new_assembly_files(state.stem)
        if self.group_by is not None:  # group files of no kept part: a rerun's are made anew
            keep = {path for pair in self._files(state.stem, state.offsets).values() for path in pair}
            for path in self.out.group_assembly_files(state.stem):
                if path not in keep:
                    path.unlink()
        if kept:
            for pair in self._files(state.stem, state.offsets).values():
                for path in pair:
                    own_inode(path)  # the split is written in place from here on

    def _tokenize_again(self, manifest: Manifest, state: _Split, kept: int) -> None:
        """Shards done whose placed files are gone but whose place in the split was not kept (the split
        changed before them, or its file was cut): their checkpoints go, so this run tokenizes them again.
        The head's parts already kept (--group-by) stay kept: tokenized again, its other parts are the same."""
        rest = sources(manifest, state.stem, self.val_fraction)
        if self.group_by is None:
            rest = itertools.islice(rest, kept, None)
        else:
            rest = itertools.dropwhile(lambda source: source != state.head, rest)
        for shard, held in rest:
            files = self.out.shard(shard)
            ckpt = Checkpoint.load(files.checkpoint)
            if ckpt is None or not ckpt.done:
                continue
            if self.group_by is None:
                needed = [files.part(held, None)[0]]
            else:  # of the head, only its parts not kept yet
                head = (shard, held) == state.head and state.head_parts is not None
                groups = state.head_parts if head else ckpt.val_groups if held else ckpt.groups
                needed = [files.part(held, g)[0] for g in groups if g is not None]
            if all(path.exists() for path in needed):
                continue
            files.checkpoint.unlink()
            self.lost.append(shard.relpath)
            if (shard, held) == state.head:
                state.head_ckpt = None  # its parts wait for it to be done again

    def done(self, shard: Shard, ckpt: Checkpoint, buffered: object = None) -> None:
        """A shard finished in this run (its checkpoint as its task returned it); `buffered`: the parts it kept
        in memory (ShardResult.buffered, or on Ray the reference to them), to be written into place."""
        if self.group_by is not None:
            self._meet(split_file_stem(shard.split), ckpt.groups)
            if ckpt.val_groups:
                self._meet("val", ckpt.val_groups)
        self.finished[shard.relpath] = (ckpt, 2 if self.val_fraction and shard.split == "train" else 1, buffered)

    def _checkpoint(self, shard: Shard) -> tuple[Checkpoint | None, object]:
        """The shard's checkpoint, and its buffered parts if it kept them in memory (None: in its own files)."""
        if shard.relpath not in self.finished:
            return Checkpoint.load(self.out.shard(shard).checkpoint), None
        ckpt, uses, buffered = self.finished.pop(shard.relpath)
        if uses > 1:  # its other part has yet to be scheduled
            self.finished[shard.relpath] = (ckpt, uses - 1, buffered)
        return ckpt, buffered

    def ready(self, excluded: frozenset[str] = frozenset()) -> list[Part]:
        """Parts whose offsets are now known: each split's next shards, while they are done (or excluded)."""
        parts = []
        for s in self.splits:
            while s.head is not None:
                shard, held = s.head
                if s.head_parts is None and shard.relpath in excluded:
                    s.advance()
                    continue
                if s.head_ckpt is None:
                    ckpt, s.head_buffered = self._checkpoint(shard)
                    if ckpt is None or not ckpt.done:
                        break
                    s.head_ckpt = ckpt
                    if s.head_parts is None:
                        s.head_parts = self._expand(s, ckpt)
                parts += [self._part(s, shard, held, group) for group in s.head_parts]
                s.advance()
        return parts

    def _part(self, s: _Split, shard: Shard, held: bool, group: str | None) -> Part:
        """The head's part of `group` (None: its one part, or with --group-by its accounting line), next in its file."""
        files = self.out.shard(shard)
        if group is None and self.group_by is not None:  # the accounting line: no file
            bin_path = idx_path = None
        else:
            bin_path, idx_path = files.part(held, group)
        record = part_record(shard, s.head_ckpt, held, group, self.group_by is not None)
        if not self.concat and bin_path is not None:  # the part's files are the split's: meta lists them
            record.update(bin=str(bin_path.relative_to(self.out.root)), idx=str(idx_path.relative_to(self.out.root)))
        if self.concat and group is not None and group not in s.offsets:  # a group's first part
            self.out.new_assembly_files(s.stem, group)
        seq, (tokens, documents) = s.scheduled, s.add(group, record)
        s.scheduled += 1
        if s.head_buffered is not None:
            key = (held, group)
            buffered = (s.head_buffered, key) if bin_path is not None else None
            checkpoint = (str(files.checkpoint), s.head_ckpt)
            return Part(s.stem, seq, tokens, documents, record, buffered=buffered, checkpoint=checkpoint)
        where = (str(bin_path), str(idx_path)) if bin_path is not None else ("", "")
        return Part(s.stem, seq, tokens, documents, record, *where)

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
                self.out.list_parts(s.stem, b"".join(parts_line(record) for _, record in listed))
                if self.concat:
                    self.placed_tokens += sum(record["tokens"] for _, record in listed)
                    for part, _ in listed:
                        if part.bin:
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
                self.placed(
                    batch, place(self.out.root, batch, self.itemsize) if self.concat else [p.record for p in batch]
                )
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
            parts_tmp = self.out.assembly(s.stem)[2]
            assembled = []
            if self.concat:
                for group, (bin_tmp, idx_tmp) in self._files(s.stem, s.offsets).items():
                    tokens, documents = s.offsets.get(group, (0, 0))
                    for path, length in ((bin_tmp, tokens * self.itemsize), (idx_tmp, documents * IDX_DTYPE.itemsize)):
                        with open(path, "r+b") as f:
                            f.truncate(length)  # bytes beyond: copies of a layout that changed since
                            os.fsync(f.fileno())
                    assembled += [bin_tmp, idx_tmp]
            entries[s.stem] = split_entry(s.stem, parts_tmp, self.concat, self.group_by is not None)
            self.out.finish_split(s.stem, assembled, self.group_by is not None)
        fsync_dir(self.out.root)
        if self.concat:
            self.out.remove_placed_leftovers(excluded)
        return entries

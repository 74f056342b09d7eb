"""Finished shards -> OUT/<stem>.bin, .idx and .parts per split, then meta.pkl, then meta.json (last:
it marks a finished run).

In a folder (`finalize`), what tokpipe.write.assembly has not placed yet is placed here; then each split's files are
renamed from their .tmp names, and meta.pkl and meta.json are written. On a store (`finalize_stored`), the last parts
go into segments (write/stored.py), each split file is composed from its segments on the server, its .idx made from
theirs, then meta.pkl and meta.json, and the segments go. The .parts file stays: `verify` checks every range against
its sha256 on all cores, and no pass over a whole split file ever runs on one core.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokpipe._version import __version__
from tokpipe.durability import write_atomic
from tokpipe.errors import UserError
from tokpipe.fmt import plural
from tokpipe.inputs.manifest import Manifest
from tokpipe.inputs.tokenizer import TokenizerInfo
from tokpipe.layout.files import SKIPPED, Layout, LayoutWriter, split_file_stem
from tokpipe.layout.meta import Delimiters, Meta, SplitEntry
from tokpipe.layout.records import part_record, parts_line, read_parts, split_entry
from tokpipe.layout.run import WriteSpec, output_splits, sources
from tokpipe.layout.stored import part_name
from tokpipe.write.assembly import Assembler
from tokpipe.write.stored import StoreAssembly, compose_split


def write_skip_log(out: Path, splits: dict[str, SplitEntry]) -> None:
    """OUT/logs/skipped.json, from the split files' parts lists."""
    entries = []
    for entry in splits.values():
        for r in read_parts(out / entry.parts):
            if r.get("skipped") or r.get("repaired"):
                fields = {k: r[k] for k in ("shard", "lines", "documents", "skipped", "repaired")}
                # the shard's documents, wherever they went (its own part's count without --group-by; with it,
                # the accounting line has none of its own): lines = documents + skipped + held out
                fields["documents"] = r["lines"] - sum(r["skipped"].values()) - r.get("held_out", 0)
                entries.append(json.dumps({**fields, "first": r.get("first_skipped", [])}))
    path = Layout(out).log(SKIPPED)
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, ('{"shards": [' + ",".join("\n" + e for e in entries) + "\n]}\n").encode())


def refuse_empty_splits(out: Path, splits: dict[str, SplitEntry], text_field: str) -> None:
    """A split whose lines were read but none became a document is no success (a code dataset with its
    text under `content` read as `text`): one line, and no meta, so OUT stays unfinished. A split with no
    lines at all (its only shard failed and was excluded, an empty file) is not refused."""
    empty = []
    for name, s in splits.items():
        own_documents = s.documents - s.held_in + s.held_out  # those its lines became, wherever they went
        if s.lines > 0 and own_documents == 0:
            why = ", ".join(f"{reason} {n:,}" for reason, n in s.skipped.items())
            empty.append(f"split {name}: {plural(s.lines, 'line')} read, none became a document (skipped: {why})")
    if empty:
        raise UserError(
            f"{'; '.join(empty)}: is the text in another field than {text_field!r}? Rerun with --text-field FIELD "
            f"and a new --out; the first skipped lines are in {Layout(out).log(SKIPPED)}"
        )


def finalize(
    out: str | os.PathLike,
    manifest: Manifest,
    info: TokenizerInfo,
    spec: WriteSpec,
    excluded: dict[str, str] | None = None,
    assembler: Assembler | None = None,
) -> dict:
    """Finish assembling every split in manifest order and write meta; returns meta's dict.

    `assembler` is the run's, whose Placer actors placed (nearly) everything while shards tokenized;
    without one, everything is placed here. `excluded` (relpath -> error) are failed shards left out
    on purpose (`run --skip-failed`); meta records them, so a partial output is never mistaken for a whole one.
    `spec`: what the run's options say of its files and meta.
    """
    out = Path(out)
    LayoutWriter(out).unfinish()
    excluded = excluded or {}
    if assembler is None:
        assembler = Assembler(out, np.dtype(info.dtype).itemsize, spec)
        assembler.resume(manifest)
    assembler.place_here(frozenset(excluded))
    stems = assembler.finish(frozenset(excluded))
    splits = {split: stems[split_file_stem(split)] for split in output_splits(manifest, spec.val_fraction)}
    write_skip_log(out, splits)
    refuse_empty_splits(out, splits, spec.text_field)
    meta = meta_of(info, spec, splits, excluded, manifest)
    LayoutWriter(out).write_meta(meta)
    return meta


def meta_of(
    info: TokenizerInfo, spec: WriteSpec, splits: dict[str, SplitEntry], excluded: dict[str, str], manifest: Manifest
) -> dict:
    """meta as a run writes it: the tokenizer, what surrounds each document, the splits, what was left out."""
    return Meta(
        info.dtype,
        info.vocab_size,
        info.eos_id,
        splits,
        eos_token=info.eos_token,
        bos_token_id=info.bos_id,
        bos_token=info.bos_token,
        delimiters=Delimiters(**spec.delimiters),
        val_fraction=spec.val_fraction,
        concat=spec.concat,
        tokenizer=info.id,
        tokenizer_sha256=info.sha256,
        tokenizer_repo_id=info.repo_id,
        tokenizer_revision=info.revision,
        tokenizer_path=info.path,
        text_field=spec.text_field,
        group_by=spec.group_by,
        excluded=dict(sorted(excluded.items())),
        manifest_sha256=manifest.fingerprint,
        tokpipe_version=__version__,
    ).as_dict()


def finalize_stored(
    assembly: StoreAssembly,
    manifest: Manifest,
    info: TokenizerInfo,
    spec: WriteSpec,
    excluded: dict[str, str],
    say: Callable[[str], None],
) -> dict:
    """finalize for an OUT on a store (write/stored.py): the last parts into segments (with --skip-failed, past the
    shards left out), the split files composed on the server (`say`ing it first: a copy a segment, ~15 min for 60,000
    at a cloud store's pace, which the run's last progress line left silent), then meta.pkl and meta.json, last; then
    the segments removed (the split files hold their bytes). First the uploads left open this run aborted: a finished
    run leaves none."""
    assembly.place_ready(frozenset(excluded))  # a run without Ray: the split files' last segments
    assembly.abort_uploads()
    if spec.concat:
        made = sum(len(segments) for segments in assembly.made.values())
        say(f"finalizing: composing the split files from their {made:,} segments on the store (a copy each)")
    out, layout = assembly.out, assembly.out.layout
    splits = {}
    for split in output_splits(manifest, spec.val_fraction):
        stem = split_file_stem(split)
        raw = _parts_list(assembly, stem, frozenset(excluded))
        if spec.concat:
            compose_split(assembly, stem)
        out.bucket.put(out.of_local(layout.parts(stem)), raw)
        layout.parts(stem).write_bytes(raw)  # skipped.json is made from it
        splits[split] = split_entry(stem, raw, spec)
    write_skip_log(out.work, splits)
    refuse_empty_splits(out.work, splits, spec.text_field)
    out.bucket.put(out.of_local(layout.log(SKIPPED)), layout.log(SKIPPED).read_bytes())  # OUT's before meta, as on disk
    meta = meta_of(info, spec, splits, excluded, manifest)
    assembly.checkpoints.compact(manifest)
    assembly.lease_check()
    out.bucket.put(out.of_local(layout.meta_pkl), pickle.dumps(meta, protocol=4))
    out.bucket.put(out.of_local(layout.meta_json), json.dumps(meta).encode())
    out.bucket.delete_many(out.leftovers(spec.concat))
    return meta


def _parts_list(assembly: StoreAssembly, stem: str, excluded: frozenset[str]) -> bytes:
    """A split's parts list, as on disk: its sources' lines in order, from their checkpoints."""
    out, spec = assembly.out, assembly.spec
    walk = sources(assembly.manifest, stem, spec.val_fraction)
    listed = [(shard, held) for shard, held in walk if shard.relpath not in excluded]
    lines = []
    for (shard, held), ckpt in zip(listed, assembly.checkpoints.of([shard for shard, _ in listed])):
        for group in ckpt.line_groups(held):
            record = part_record(shard, ckpt, (held, group))
            if not spec.concat and ckpt.part((held, group)) is not None:
                name = out.name(out.segment(stem, group, part_name(shard, (held, group))))
                record.update(bin=f"{name}.bin", idx=f"{name}.idx")
            lines.append(parts_line(record))
    return b"".join(lines)

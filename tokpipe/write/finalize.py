"""Finished shards -> OUT/<stem>.bin, .idx and .parts per split, then meta.pkl, then meta.json (last:
it marks a finished run).

What tokpipe.write.assembly has not placed yet is placed here; then each split's files are renamed from
their .tmp names, and meta.pkl and meta.json are written. The .parts file stays: `verify` checks
every range against its sha256 on all cores, and no pass over a whole split file ever runs on one core.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tokpipe._version import __version__
from tokpipe.durability import write_atomic
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import Manifest
from tokpipe.inputs.tokenizer import TokenizerInfo
from tokpipe.layout.files import SKIPPED, Layout, LayoutWriter, split_file_stem
from tokpipe.layout.meta import Delimiters, Meta, SplitEntry
from tokpipe.layout.records import read_parts
from tokpipe.layout.run import WriteSpec, output_splits
from tokpipe.write.assembly import Assembler
from tokpipe.write.stored import StoreAssembly


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
            empty.append(f"split {name}: {s.lines:,} lines read, none became a document (skipped: {why})")
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
    meta = Meta(
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
    )
    return meta.as_dict()


def finalize_stored(
    assembly: StoreAssembly, manifest: Manifest, info: TokenizerInfo, spec: WriteSpec, excluded: dict[str, str]
) -> dict:
    """finalize for an OUT on a store (write/stored.py): the last parts into segments (with --skip-failed, past the
    shards left out), the split files composed on the server, then meta.pkl and meta.json, last."""
    assembly.place_ready(frozenset(excluded))  # a run without Ray: the split files' last segments
    splits = assembly.finish(frozenset(excluded))
    write_skip_log(assembly.out.work, splits)
    refuse_empty_splits(assembly.out.work, splits, spec.text_field)
    meta = meta_of(info, spec, splits, excluded, manifest)
    assembly.lease_check()
    assembly.write_meta(meta)
    return meta

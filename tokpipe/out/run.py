"""What a run is, as OUT records it (run.json), and which split files it writes, made of which shards."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.out.files import Out, damaged, load_json, split_file_stem

RUN_FORMAT = 1
# Kept in run.json beside the identity but never compared: where this run found its tokenizer (a
# folder that moved holds the same tokenizer; its sha256 is in the identity) and the options it was
# given. `tokpipe status` prints the resume command from them, `tokpipe inspect` decodes with that tokenizer.
LAST_RUN_KEYS = ("tokenizer_path", "options")
# What a run.json written before these entries existed meant by their absence.
IDENTITY_DEFAULTS = {"delimiters": {"bos": False, "eos": True}, "val_fraction": 0.0, "concat": True, "group_by": None}


@dataclass(frozen=True)
class OutputSpec:
    """What a run's options say of its output's files and meta, as plain values: what the write path (the
    assembly, finalize) needs of them. The runner makes it from RunOptions (`RunOptions.output`)."""

    text_field: str = "text"
    delimiters: dict = field(default_factory=lambda: dict(IDENTITY_DEFAULTS["delimiters"]))  # meta's
    val_fraction: float = 0.0
    concat: bool = True  # False: --no-concat, a split is its parts' own files
    group_by: str | None = None


def load_run(out: Out) -> dict:
    """run.json, or {} before a run recorded one. Damaged, it is refused: it alone says what OUT's tokens were
    made from, so a run could no longer refuse other inputs there."""
    try:
        return load_json(out.run_json) or {}
    except ValueError as e:
        fix = (
            "it records what OUT's tokens were made from; remove it and rerun the command that made OUT with the same"
            " inputs (nothing can check them without it), or start over in a new --out"
        )
        raise damaged(out.run_json, e, fix) from None


def finished_with(meta: dict | None, manifest: Manifest) -> bool:
    """Whether a meta (None: OUT is not finished) is that of this manifest's run, every shard in it: a rerun of
    it has nothing to do."""
    return meta is not None and meta.get("manifest_sha256") == manifest.fingerprint and not meta.get("excluded")


def output_splits(manifest: Manifest, val_fraction: float) -> list[str]:
    """The splits written: the dataset's, and validation when --val-fraction makes one."""
    splits = list(manifest.counts)
    if val_fraction and "train" in splits and "validation" not in splits:
        splits.append("validation")
    return splits


def sources(manifest: Manifest, stem: str, val_fraction: float) -> Iterator[tuple[Shard, bool]]:
    """What split file `stem` is made of, in manifest order: (shard, whether it is the shard's held-out part).

    A split's own shards; for val.bin with --val-fraction, also the held-out part of every train shard."""
    for shard in manifest.shards():
        if split_file_stem(shard.split) == stem:
            yield shard, False
        elif val_fraction and stem == "val" and shard.split == "train":
            yield shard, True


def delimiters(meta: dict) -> dict:
    """What a meta or run.json says the run placed around documents (an earlier tokpipe's: EOS only)."""
    return meta.get("delimiters", IDENTITY_DEFAULTS["delimiters"])

"""What a run is, as OUT records it (run.json: `RunRecord`), and which split files it writes, made of which shards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.layout.files import Layout, damaged, load_json, split_file_stem
from tokpipe.layout.meta import Delimiters, Meta

RUN_FORMAT = 1
# Kept in run.json beside the identity but never compared: where this run found its tokenizer (a
# folder that moved holds the same tokenizer; its sha256 is in the identity) and the options it was
# given. `tokpipe status` prints the resume command from them, `tokpipe inspect` decodes with that tokenizer.
LAST_RUN_KEYS = ("tokenizer_path", "options")
# What a run.json written before these entries existed meant by their absence.
IDENTITY_DEFAULTS = {"delimiters": {"bos": False, "eos": True}, "val_fraction": 0.0, "concat": True, "group_by": None}
# Begins run.log's line of what stopped a run, the error it said (runner/driver.py), which `tokpipe status` says.
STOPPED = "stopped: "
# run.log's lines (runner/progress.py RunLog) begin with the local time; a traceback's lines after one do not.
LOG_TIME = "%Y-%m-%d %H:%M:%S"
_STAMP = len(time.strftime(LOG_TIME, time.gmtime(0)))


def log_line(message: str) -> str:
    """A line of run.log: the time, then `message`."""
    return f"{time.strftime(LOG_TIME)} {message}\n"


def stopped_note(lines: list[str]) -> str | None:
    """What stopped the run whose run.log ends in `lines`, where it said: its last line of its own (a traceback's
    lines follow an unexpected error's), if it is a STOPPED one. None: a kill -9, a crash, a machine lost."""
    for line in reversed(lines):
        try:
            time.strptime(line[:_STAMP], LOG_TIME)
        except ValueError:
            continue
        message = line[_STAMP + 1 :]
        return message.removeprefix(STOPPED) if message.startswith(STOPPED) else None
    return None


@dataclass(frozen=True)
class WriteSpec:
    """What a run's options say of its output's files and meta, as plain values: what the write path (the
    assembly, finalize) needs of them. The runner makes it from RunOptions (`RunOptions.output`)."""

    text_field: str = "text"
    delimiters: dict = field(default_factory=lambda: dict(IDENTITY_DEFAULTS["delimiters"]))  # meta's
    val_fraction: float = 0.0
    concat: bool = True  # False: --no-concat, a split is its parts' own files
    group_by: str | None = None


# run.json's keys after the first three: an earlier tokpipe's may lack one, whose absence the field's default means.
_OPTIONAL = ("eos_token", "bos_token_id", "tokenizer", "tokenizer_sha256", "text_field", "val_fraction", "concat")
_OPTIONAL += ("group_by", "tokenizer_path", "options")


@dataclass(frozen=True)
class RunRecord:
    """run.json: the identity of the run that made OUT (what its bytes depend on: a rerun with another is refused
    once OUT holds a token), and, beside it, where that run found its tokenizer and the options it was given
    (`tokpipe status` prints the resume command from them, `tokpipe inspect` decodes with that tokenizer). A key
    an earlier tokpipe did not write means what its absence meant (IDENTITY_DEFAULTS)."""

    dtype: str
    vocab_size: int
    eos_token_id: int
    eos_token: str | None = None
    bos_token_id: int | None = None
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None
    text_field: str = "text"
    delimiters: Delimiters = Delimiters()
    val_fraction: float = 0.0
    concat: bool = True
    group_by: str | None = None
    tokenizer_path: str | None = None
    options: dict = field(default_factory=dict)  # the options given other than their defaults, by RunOptions field
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # as read: its identity, key by key

    @classmethod
    def of(cls, raw: dict) -> RunRecord:
        known = {k: raw[k] for k in _OPTIONAL if k in raw}
        head = str(raw["dtype"]), int(raw["vocab_size"]), int(raw["eos_token_id"])
        return cls(*head, delimiters=Delimiters.of(raw.get("delimiters")), raw=raw, **known)

    def identity(self) -> dict:
        """The identity as recorded, key by key, what a key's absence meant in its place: what a rerun's is compared
        with (runner/identity.py)."""
        return {**IDENTITY_DEFAULTS, **{k: v for k, v in self.raw.items() if k not in LAST_RUN_KEYS}}

    @property
    def bos_placed(self) -> int | None:
        """The BOS id, where the run places BOS before every document."""
        return self.bos_token_id if self.delimiters.bos else None


def load_run(out: Layout) -> RunRecord | None:
    """run.json, None before a run recorded one. Damaged, it is refused: it alone says what OUT's tokens were
    made from, so a run could no longer refuse other inputs there."""
    try:
        found = load_json(out.run_json)
        return None if found is None else RunRecord.of(found)
    except (KeyError, TypeError, ValueError) as e:  # not JSON; JSON, but not a run's record
        fix = (
            "it records what OUT's tokens were made from; remove it and rerun the command that made OUT with the same"
            " inputs (nothing can check them without it), or start over in a new --out"
        )
        raise damaged(out.run_json, e, fix) from None


def finished_with(meta: Meta | None, manifest: Manifest) -> bool:
    """Whether a meta (None: OUT is not finished) is that of this manifest's run, every shard in it: a rerun of
    it has nothing to do."""
    return meta is not None and meta.manifest_sha256 == manifest.fingerprint and not meta.excluded


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

"""Every rule of OUT's files, in the one module that every writer and reader of OUT imports.

OUT/run.json                     what the run is (its identity), where its tokenizer was, the options given
OUT/manifest.json                the manifest's copy that the run (and status, verify --sample) reads
OUT/.lock                        flock-ed by the live run, holding "pid N on HOST"
OUT/shards/<split>/<key>.bin     a shard's tokens; .idx its document ends (from the shard's start);
                                 .json its checkpoint; .lock held by the worker writing it
OUT/shards/train/held-out/<key>  the .bin/.idx of what a train shard held out for val.bin (--val-fraction)
OUT/shards/<split>/[held-out/]groups/<group>/<key>   with --group-by: a shard's part of one group
OUT/<stem>.bin, .idx, .parts     a split file (stem: train, val, test), its document ends, and its
                                 parts list: one JSON line per part, with its counts and checksums
OUT/<stem>/<group>.bin, .idx     with --group-by: a group's file of the split (the .parts lists them all)
OUT/<stem>.*.tmp                 the same three while the split is assembled (<stem>/<group>.*.tmp)
OUT/meta.pkl, OUT/meta.json      written last, meta.json last of all: its presence marks a finished run
OUT/logs/                        run.log, progress.json, failed.json, skipped.json, stall dumps (below),
                                 node-check.txt (a cluster run's token that every node reads back)
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import pickle
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from tokpipe.durability import write_atomic, write_json_atomic
from tokpipe.errors import UserError
from tokpipe.manifest import Manifest, Shard

IDX_DTYPE = np.dtype("<i8")  # document ends, cumulative token counts

RUN_FORMAT = 1
# Kept in run.json beside the identity but never compared: where this run found its tokenizer (a
# folder that moved holds the same tokenizer; its sha256 is in the identity) and the options it was
# given. `tokpipe status` prints the resume command from them, `tokpipe inspect` decodes with that tokenizer.
LAST_RUN_KEYS = ("tokenizer_path", "options")
# What a run.json written before these entries existed meant by their absence.
IDENTITY_DEFAULTS = {"delimiters": {"bos": False, "eos": True}, "val_fraction": 0.0, "concat": True, "group_by": None}


# --group-by: a split may have at most this many groups, since each has files of its own in every
# shard and in the split (a field with one value per document, an id or a url, would make a file per document).
MAX_GROUPS = 1000
GROUP_COUNTS = ("tokens", "documents", "text_bytes")  # of a group, in meta: text_bytes are its texts' UTF-8
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def group_stem(value: str) -> str:
    """A group's file name: the value itself when it is a safe name, else with every other character `_` (64 kept,
    no leading dot) and 8 hex digits of its sha256, so no two values share files; meta keeps the value."""
    stem = _UNSAFE.sub("_", value)[:64].lstrip(".")
    if stem == value and value:
        return value
    return f"{stem}-{hashlib.sha256(value.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def group_file(out: Path, stem: str, group: str | None) -> Path:
    """A split's file, without its suffix: OUT/<stem>, or a group's OUT/<stem>/<group>."""
    return out / stem if group is None else out / stem / group_stem(group)


def split_file_stem(split: str) -> str:
    return "val" if split == "validation" else split


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


# -- one shard's files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardFiles:
    bin: Path
    idx: Path
    checkpoint: Path
    lock: Path
    val_bin: Path  # its held-out documents: in a folder of their own, so no shard's key can collide
    val_idx: Path

    @classmethod
    def of(cls, out: str | os.PathLike, shard: Shard) -> ShardFiles:
        base = Path(out) / "shards" / shard.split / shard.key
        held = base.parent / "held-out" / base.name
        own = (base.with_name(base.name + ext) for ext in (".bin", ".idx", ".json", ".lock"))
        return cls(*own, *(held.with_name(held.name + ext) for ext in (".bin", ".idx")))

    def part(self, held: bool, group: str | None) -> tuple[Path, Path]:
        """The .bin/.idx of a part: the shard's documents or those it held out; with --group-by a group's."""
        if group is None:
            return (self.val_bin, self.val_idx) if held else (self.bin, self.idx)
        base = (self.val_bin if held else self.bin).parent / "groups" / group_stem(group) / self.bin.name[:-4]
        return base.with_name(base.name + ".bin"), base.with_name(base.name + ".idx")


@dataclass
class Checkpoint:
    """How far a shard got. Everything here is covered by fsynced .bin/.idx bytes."""

    lines: int = 0  # input lines consumed = documents + sum(skipped)
    offset: int = 0  # decompressed input bytes consumed
    source_pos: int = 0  # bytes of the shard file read (compressed), for progress only
    documents: int = 0
    tokens: int = 0  # delimiters included
    skipped: dict[str, int] = field(default_factory=dict)
    repaired: dict[str, int] = field(default_factory=dict)
    skip_log: list[list] = field(default_factory=list)  # first [line, reason] pairs, capped
    done: bool = False
    # Of the shard's .bin and .idx (ends counted from the shard's start), set when done: finalize
    # records them per part and verify checks them, so no pass over the whole output is sequential.
    sha256: str | None = None
    idx_sha256: str | None = None
    # The documents of a train shard held out for val.bin (--val-fraction), in files of their own.
    val_documents: int = 0
    val_tokens: int = 0
    val_sha256: str | None = None
    val_idx_sha256: str | None = None
    # With --group-by: each group's part, value -> {tokens, documents, and when done sha256, idx_sha256},
    # in value order; the counts above are then their sums (and sha256 None: there is no one file).
    groups: dict[str, dict] = field(default_factory=dict)
    val_groups: dict[str, dict] = field(default_factory=dict)  # its held-out documents' parts, the same way
    # For `tokpipe report`: decompressed input bytes consumed (Batch.text_bytes summed), and seconds
    # spent, summed over attempts (an interrupted attempt counts up to its last checkpoint).
    text_bytes: int = 0
    seconds: float = field(default=0.0, compare=False)  # not content: two runs of the same shard differ here

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    @classmethod
    def of(cls, out: str | os.PathLike, shard: Shard) -> Checkpoint | None:
        return cls.load(ShardFiles.of(out, shard).checkpoint)


# -- parts lists and split files ---------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A shard's documents in a split file (or those a train shard held out for val.bin), at its offsets there.
    `record` is its line in <stem>.parts; `bin`, `idx` the shard's own files, or `buffered` the memory it is in."""

    stem: str
    seq: int  # its place among the split's parts
    token_offset: int
    doc_offset: int
    record: dict
    bin: str = ""
    idx: str = ""
    # A buffered shard's parts (on Ray, the reference to them) with this part's key; its checkpoint (path,
    # Checkpoint), written once placed: nothing on disk covered the shard before (shard.ShardResult.buffered).
    buffered: tuple | None = None
    checkpoint: tuple[str, Checkpoint] | None = None

    @property
    def name(self) -> str:
        return self.record["shard"]

    @property
    def group(self) -> str | None:
        return self.record.get("group")

    @property
    def tokens(self) -> int:
        return self.record["tokens"]

    @property
    def documents(self) -> int:
        return self.record["documents"]

    @property
    def token_end(self) -> int:
        return self.token_offset + self.tokens

    @property
    def doc_end(self) -> int:
        return self.doc_offset + self.documents


def part_record(shard: Shard, ckpt: Checkpoint, held: bool, group: str | None = None, grouped: bool = False) -> dict:
    """A part's line in <stem>.parts: a shard's documents, or (held) those it held out for val.bin.

    The accounting (lines, skips, repairs) goes with a shard's own part; `held_out` there counts the
    documents it sent to val.bin instead, `held_in` on the held-out part the documents val.bin got.
    With --group-by (`grouped`) a shard's documents are in one part per group, each line naming its
    `group`; the accounting then has a line of its own before them, with no group and no tokens."""
    if group is not None:
        counts = (ckpt.val_groups if held else ckpt.groups)[group]
        record = {"shard": shard.relpath, "group": group} | ({"part": "held-out"} if held else {})
        record |= {k: counts[k] for k in GROUP_COUNTS} | ({"held_in": counts["documents"]} if held else {})
        return record | {"sha256": counts.get("sha256"), "idx_sha256": counts.get("idx_sha256")}
    if held:
        record = {
            "shard": shard.relpath,
            "part": "held-out",
            "tokens": ckpt.val_tokens,
            "documents": ckpt.val_documents,
            "held_in": ckpt.val_documents,
        }
        record.update(sha256=ckpt.val_sha256, idx_sha256=ckpt.val_idx_sha256)
        return record
    record = {
        "shard": shard.relpath,
        "tokens": 0 if grouped else ckpt.tokens,
        "documents": 0 if grouped else ckpt.documents,
        "lines": ckpt.lines,
        "held_out": ckpt.val_documents,
    }
    record.update(skipped=ckpt.skipped, repaired=ckpt.repaired, sha256=ckpt.sha256, idx_sha256=ckpt.idx_sha256)
    if ckpt.skip_log:
        record["first_skipped"] = ckpt.skip_log
    return record


def is_held_part(record: dict) -> bool:
    return record.get("part") == "held-out"


def parts_line(record: dict) -> bytes:
    return orjson.dumps(record) + b"\n"


def read_parts(path: Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        for line in f:
            yield orjson.loads(line)


def parts_of(stem: str, raw: bytes) -> list[Part]:
    """The parts listed in a .parts file's bytes, at the offsets their order gives them in their file
    (the split's, or their group's)."""
    parts, offsets = [], {}
    for seq, record in enumerate(map(orjson.loads, raw.splitlines())):
        tokens, documents = offsets.get(record.get("group"), (0, 0))
        parts.append(Part(stem, seq, tokens, documents, record))
        offsets[record.get("group")] = (tokens + record["tokens"], documents + record["documents"])
    return parts


def assembly_files(out: Path, stem: str, group: str | None = None) -> tuple[Path, Path, Path]:
    """A split's .bin, .idx (or its group's) and .parts while it is assembled; renamed without .tmp when done."""
    base = group_file(out, stem, group)
    return base.with_name(base.name + ".bin.tmp"), base.with_name(base.name + ".idx.tmp"), out / f"{stem}.parts.tmp"


def _file_entry(out_name: str, concat: bool) -> dict:
    return {"file": f"{out_name}.bin", "idx": f"{out_name}.idx"} if concat else {"files": []}


def split_entry(stem: str, parts_path: Path, concat: bool, grouped: bool = False) -> dict:
    """meta's entry for a split, summed from its parts list. A split of --no-concat has no file of its
    own: `files` lists its parts' files in order (their lines in the parts list name them).

    With --group-by (`grouped`), `groups` holds each group's entry, in the order of their values: its
    tokens and documents, and its file (or files) as a split's; the split has none of its own."""
    entry = {} if grouped else _file_entry(stem, concat)
    groups: dict[str, dict] = {}
    entry |= {
        "parts": f"{stem}.parts",
        "tokens": 0,
        "documents": 0,
        "lines": 0,
        "held_out": 0,
        "held_in": 0,
    }
    skipped, repaired, shards = Counter(), Counter(), 0
    raw = parts_path.read_bytes()
    for record in map(orjson.loads, raw.splitlines()):
        for key in ("tokens", "documents", "lines", "held_out", "held_in"):
            entry[key] += record.get(key, 0)
        into = entry
        if grouped and "group" in record:
            name = str(group_file(Path(), stem, record["group"]))
            into = groups.setdefault(record["group"], _file_entry(name, concat) | dict.fromkeys(GROUP_COUNTS, 0))
            for key in GROUP_COUNTS:
                into[key] += record[key]
        if not concat and (not grouped or "group" in record):
            into["files"].append({k: record[k] for k in ("bin", "idx", "tokens", "documents")})
        skipped.update(record.get("skipped", {}))
        repaired.update(record.get("repaired", {}))
        shards += not is_held_part(record) and "group" not in record
    entry.update(skipped=dict(sorted(skipped.items())), repaired=dict(sorted(repaired.items())), shards=shards)
    if grouped:
        entry["groups"] = dict(sorted(groups.items()))
    entry["parts_sha256"] = hashlib.sha256(raw).hexdigest()
    return entry


def split_files(out: Path, entry: dict) -> list[tuple[Path, Path, int, int]]:
    """The files a finished split is read from, in order: (tokens, document ends, tokens, documents).
    One for a concatenated split; its parts' own files for a split of --no-concat; with --group-by,
    those of each group in turn, in meta's order (their values')."""
    if "groups" in entry:
        return [f for group in entry["groups"].values() for f in split_files(out, group)]
    if "files" in entry:
        return [(out / f["bin"], out / f["idx"], int(f["tokens"]), int(f["documents"])) for f in entry["files"]]
    idx = entry.get("idx", Path(entry["file"]).with_suffix(".idx").name)  # tokpipe 0.1 did not name it
    return [(out / entry["file"], out / idx, int(entry["tokens"]), int(entry["documents"]))]


# -- meta --------------------------------------------------------------------------------------------


def write_meta(out: Path, meta: dict) -> None:
    """meta.pkl, then meta.json: the last file a run writes, so its presence marks a finished run."""
    write_atomic(out / "meta.pkl", pickle.dumps(meta, protocol=4))
    write_json_atomic(out / "meta.json", meta)


def load_meta_json(out: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(out) / "meta.json").read_text())
    except FileNotFoundError:
        return None


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; a tokpipe meta holds only plain values")


def load_meta_pkl(path: str | os.PathLike) -> dict:
    """meta.pkl without executing anything it may contain: plain containers and scalars only."""
    with open(path, "rb") as f:
        meta = _PlainUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(meta, dict):
        raise pickle.UnpicklingError(f"meta.pkl holds a {type(meta).__name__}, not a dict")
    return meta


def out_folder(out: str | os.PathLike, *, new_ok: bool = False) -> Path:
    """OUT as a command names it: a folder (for `run`, `new_ok`, one it may create). A UserError (one line,
    exit 2) when the path, or a folder above it, is a file, or when a reader's OUT does not exist."""
    out = Path(out)
    found = next(p for p in (out, *out.parents) if p.exists())  # "/" or "." at the last
    if not found.is_dir():
        above = "" if found == out else f" (on the way to {out})"
        raise UserError(f"{found} is a file, not a folder{above}: OUT is a folder, a new one or a tokpipe run's")
    if found != out and not new_ok:
        raise UserError(f"{out} does not exist: give the --out folder of a tokpipe run")
    return out


# -- run.json, the lock, logs --------------------------------------------------------------------------


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def load_run(out: Path) -> dict:
    """run.json, or {} before a run recorded one."""
    return load_json(out / "run.json") or {}


def lock_out(out: Path):
    """Hold OUT for this run. The kernel drops the lock when the process dies, so a killed run never blocks."""
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        raise UserError(
            f"{out} is in use by another tokpipe run ({holder}); wait for it to finish or stop it"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {os.uname().nodename}")
    f.flush()
    return f


def lock_holder(lock: Path) -> str | None:
    """What the process holding a flock wrote in the file ("pid N on HOST" for OUT/.lock), or None if none holds it.

    Tested by taking the lock shared without waiting and dropping it at once: only a run or worker
    starting in that same microsecond could find it taken (a run says so and can be rerun; a worker waits).
    """
    try:
        f = open(lock, "rb")
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().decode("utf-8", "replace").strip() or "a process"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


# OUT/logs/ holds these, and a stack dump per stalled shard (stall_dump).
RUN_LOG = "run.log"  # the effective configuration, shard failures, stalls, the outcome
PROGRESS = "progress.json"  # rewritten every 2 s while shards run: rate, ETA, shard counts
FAILED = "failed.json"  # the last run's failures, shard relpath -> error
REFUSED = "refused.json"  # the refusal of a run that stopped before OUT held a token (runner/identity.py)
SKIPPED = "skipped.json"  # per shard with skips or repairs: their counts and the first lines skipped
SERIES = "series.jsonl"  # a compact time series of the run's progress, for `tokpipe report` (series.py)


def log_file(out: str | os.PathLike, name: str) -> Path:
    return Path(out) / "logs" / name


def stall_dump(out: str | os.PathLike, shard: Shard) -> Path:
    return log_file(out, f"stall-{shard.split}-{shard.key}.txt")


def node_check_file(out: str | os.PathLike, who: str | None = None) -> Path:
    """The token a cluster run's driver writes for its nodes to read back (runner/nodes.py); with
    `who` (a node, a worker), the file it writes, fsyncs and removes to prove it can write under OUT."""
    return log_file(out, "node-check.txt" if who is None else f"node-check-{who}.tmp")

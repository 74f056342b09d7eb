"""A shard's checkpoint: how far it got, and where that is. A file of its own (OUT/shards/<split>/<key>.json),
written by its worker as it goes; or, for a shard whose tokens waited in memory until their place was known, an
entry of a file of the checkpoints placed together (OUT/shards/<split>/placed/), written once their bytes are."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from tokpipe.durability import write_all_atomic
from tokpipe.inputs.manifest import Shard
from tokpipe.layout.files import Layout, PartKey, ShardFiles, damaged, load_json, rerun

# The checkpoint's format: 2 holds a shard's parts in `parts`, each by its key. 1 (no `format` field) held the
# held-out documents in val_* fields beside the groups; a checkpoint of it is converted when loaded (_format_1).
CHECKPOINT_FORMAT = 2


@dataclass
class PartCounts:
    """A shard's part as its checkpoint counts it: its documents that go to one file (of its split, or held out
    for val.bin; with --group-by, a group's), and once the shard is done the sha256 of its .bin and of its document
    ends (counted from its start): finalize records them per part, so verify checks ranges on all cores."""

    held: bool = False
    group: str | None = None
    tokens: int = 0  # delimiters included
    documents: int = 0
    text_bytes: int = 0  # of its texts, UTF-8: counted in a group's part (meta's per group), 0 in another
    sha256: str | None = None
    idx_sha256: str | None = None

    @property
    def key(self) -> PartKey:
        return self.held, self.group


@dataclass
class Checkpoint:
    """How far a shard got. Everything here is covered by fsynced .bin/.idx bytes."""

    format: int = CHECKPOINT_FORMAT
    lines: int = 0  # input lines consumed = documents + held out + sum(skipped)
    offset: int = 0  # decompressed input bytes consumed
    source_pos: int = 0  # bytes of the shard file read (compressed), for progress only
    # zstd of several frames: where the frame that `offset` lies in begins, in the file and decompressed
    # (TextBatch.frame): a resume decodes from there, not from the file's start (a shard on a store: a ranged GET)
    frame_source_pos: int = 0
    frame_offset: int = 0
    # Of its own documents, those in its split: its own parts' sums (of what it held out for val.bin: counts(True)).
    documents: int = 0
    tokens: int = 0  # delimiters included
    skipped: dict[str, int] = field(default_factory=dict)
    repaired: dict[str, int] = field(default_factory=dict)
    skip_log: list[list] = field(default_factory=list)  # first [line, reason] pairs, capped
    done: bool = False
    # Its parts, in key order: its own documents, then those it held out; a group's in value order. Without
    # --group-by a shard has its own part from its start (and, holding out, its held-out one); with it, a part
    # per group it met.
    parts: list[PartCounts] = field(default_factory=list)
    # For `tokpipe report`: decompressed input bytes consumed (TextBatch.text_bytes summed), and seconds
    # spent, summed over attempts (an interrupted attempt counts up to its last checkpoint).
    text_bytes: int = 0
    seconds: float = field(default=0.0, compare=False)  # not content: two runs of the same shard differ here

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        """The checkpoint at `path` (OUT/shards/<split>/<key>.json), None where the shard has none; one of format 1,
        converted. A damaged one is refused, by the run too: the shard's tokens it covers are on the same storage."""
        try:
            found = load_json(path)
            return None if found is None else cls.parse(found)
        except (ValueError, TypeError) as e:  # not JSON; fields no checkpoint has
            raise damaged(path, e, f"remove it and {rerun(path.parents[2])}: the shard is tokenized again") from None

    @classmethod
    def of(cls, out: str | os.PathLike, shard: Shard) -> Checkpoint | None:
        return cls.load(ShardFiles.of(out, shard).checkpoint)

    def encoded(self) -> bytes:
        """The checkpoint's file, as `load` reads it. orjson takes 1 us where asdict and json took 50, once a shard:
        on 20,000 two-document shards, a CPU-s of the Placer's."""
        return orjson.dumps(self)

    @classmethod
    def parse(cls, raw: dict) -> Checkpoint:
        """A checkpoint from its JSON: ValueError or TypeError where it is none."""
        raw = raw if "format" in raw else _format_1(raw)
        if raw["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"a checkpoint of format {raw['format']}; this tokpipe reads {CHECKPOINT_FORMAT} and 1")
        return cls(**{**raw, "parts": [PartCounts(**part) for part in raw.get("parts", [])]})

    def part(self, key: PartKey) -> PartCounts | None:
        """The shard's part of this key, None where it has none (with --group-by, a group it did not meet, or its
        own documents: they are in its groups' parts). By an index of its parts, made again where they were replaced
        (they are, never changed in place): the assembler and finalize look up each group of each shard, and a scan
        each made a run of 2,000 groups in 8 shards tokenize in 8.9-10.1 s (5.3-6.6 now), its finalize on a store
        46 s (27)."""
        index = self.__dict__.get("_by_key")
        if index is None or index[0] is not self.parts:
            index = self.__dict__["_by_key"] = (self.parts, {part.key: part for part in self.parts})
        return index[1].get(key)

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_by_key"}  # an index, made again

    def source_parts(self, held: bool) -> list[PartCounts]:
        """The shard's parts in one source of a split file (layout/run.py's `sources`): its own documents' (in its
        split), or (held) those it held out for val.bin."""
        return [part for part in self.parts if part.held == held]

    def counts(self, held: bool) -> tuple[int, int]:
        """The tokens and documents of a source's parts."""
        parts = self.source_parts(held)
        return sum(part.tokens for part in parts), sum(part.documents for part in parts)

    def line_groups(self, held: bool) -> list[str | None]:
        """The groups of a source's lines in its split's parts list, in order: its own source begins with the
        shard's accounting line (None), which is its part's line where the shard has one part there (without
        --group-by); then a line per part. The one place that says which lines a shard has."""
        groups = [part.group for part in self.source_parts(held)]
        return groups if held or None in groups else [None, *groups]

    def group_parts(self, split: str) -> Iterator[tuple[str, PartCounts]]:
        """The parts of the shard's groups (--group-by), each with the split it goes to: its own, or (held out)
        validation."""
        for part in self.parts:
            if part.group is not None:
                yield ("validation" if part.held else split), part


def _format_1(raw: dict) -> dict:
    """A checkpoint of format 1 as format 2. It held its own part's counts in its own fields (with --group-by,
    their sums, and the parts in `groups`), and those of what it held out in val_* fields (and `val_groups`). A
    part is made only where those say it has one: with counts, or the checksums of a done shard (or, written
    before shards were hashed, no sha256 field at all: no --group-by, no held-out documents then), so a shard
    resumed has the parts of one never interrupted."""
    raw, hashed = dict(raw), "sha256" in raw
    held = {k: raw.pop(f"val_{k}", v) for k, v in (("documents", 0), ("tokens", 0), ("sha256", None))}
    held["idx_sha256"] = raw.pop("val_idx_sha256", None)
    groups, val_groups = raw.pop("groups", {}), raw.pop("val_groups", {})
    own = {"documents": raw.get("documents", 0), "tokens": raw.get("tokens", 0)}
    own |= {"sha256": raw.pop("sha256", None), "idx_sha256": raw.pop("idx_sha256", None)}
    parts = [PartCounts(False, group, **counts) for group, counts in groups.items()]
    if not groups and (own["tokens"] or own["documents"] or own["sha256"] is not None or not hashed):
        parts.append(PartCounts(False, None, **own))
    parts += [PartCounts(True, group, **counts) for group, counts in val_groups.items()]
    if not val_groups and (held["tokens"] or held["documents"] or held["sha256"] is not None):
        parts.append(PartCounts(True, None, **held))
    return raw | {"format": CHECKPOINT_FORMAT, "parts": [asdict(part) for part in parts]}


class Checkpoints:
    """OUT's checkpoints as the start of a run (or status, report, verify --sample) asks for them, shard after shard
    of its manifest: a shard's own file, else its entry in a file of those placed from memory together (`placed`).
    Each split's folders are listed once, and a shard's own checkpoint read only where the listing names one: opening
    each of 20,000 new shards' took 0.5 s of a run's start in the recovery of the split files and again in its plan.
    A checkpoint written after the listing is not seen: the shard's task reads its own, and returns at once."""

    def __init__(self, out: str | os.PathLike):
        self.out = Layout(out)
        self.listed: dict[str, tuple[set[str], dict[str, str]]] = {}  # split -> own files' names, key -> placed file
        self.read: tuple[Path | None, dict] = (None, {})  # the placed file read last: a pack's shards are in one

    def of(self, shard: Shard) -> Checkpoint | None:
        names, placed = self._listing(shard.split)
        # Names compared as strings, a Path made only for a checkpoint that exists: pathlib per shard was 1.7 of
        # the driver's 13.6 CPU-s on 20,000 two-document shards (py-spy).
        if ShardFiles.checkpoint_name(shard.key) in names and (found := Checkpoint.of(self.out.root, shard)):
            return found
        if shard.key not in placed:
            return None
        path = self.out.placed(shard.split, placed[shard.key])
        if self.read[0] != path:
            self.read = path, _load_placed(path)
        raw = self.read[1].get(shard.key)
        return None if raw is None else _parsed(raw, path)

    def done(self, shard: Shard) -> bool:
        ckpt = self.of(shard)
        return ckpt is not None and ckpt.done

    def forget(self, shards: list[Shard]) -> None:
        """These shards' checkpoints removed (they are tokenized again): their own files, and their entries in placed
        files, each such file written again once (without them) whatever number of them it held."""
        gone: dict[tuple[str, str], set[str]] = {}  # (split, placed file) -> the keys it loses
        for shard in shards:
            self.out.shard(shard).checkpoint.unlink(missing_ok=True)
            if (digest := self._listing(shard.split)[1].pop(shard.key, None)) is not None:
                gone.setdefault((shard.split, digest), set()).add(shard.key)
        for (split, digest), keys in gone.items():
            path = self.out.placed(split, digest)
            rest = {key: raw for key, raw in _load_placed(path).items() if key not in keys}
            if rest:  # the others in a file of their own before this one goes: a kill leaves both, not neither
                self.listed[split][1].update(dict.fromkeys(rest, write_placed(self.out, {split: rest})[split]))
            path.unlink()
        self.read = (None, {})

    def _listing(self, split: str) -> tuple[set[str], dict[str, str]]:
        if split not in self.listed:
            placing, placed = self.out.placed(split), {}
            for name in sorted(os.listdir(placing)) if placing.is_dir() else []:
                if name.endswith(".json"):
                    placed |= dict.fromkeys(_load_placed(placing / name), name.removesuffix(".json"))
            folder = placing.parent
            self.listed[split] = (set(os.listdir(folder)) if folder.is_dir() else set()), placed
        return self.listed[split]


def write_placed(out: Layout, checkpoints: dict[str, dict[str, Checkpoint | dict]]) -> dict[str, str]:
    """The checkpoints of shards placed together (split -> key -> checkpoint), a file a split (`placed_file`),
    written as durability.write_all_atomic writes. One file and one fsync a placing, not one
    a shard: a checkpoint took ~170 us of CPU written as a file of its own (64 at once, fsynced on threads), ~3 us as
    one of 64 in a file. Returns each split's file's digest."""
    files, digests = {}, {}
    for split, by_key in checkpoints.items():
        digests[split], data = placed_file(by_key)
        files[out.placed(split, digests[split])] = data
        out.placed(split).mkdir(parents=True, exist_ok=True)
    write_all_atomic(files)
    return digests


def placed_file(checkpoints: dict[str, Checkpoint | dict]) -> tuple[str, bytes]:
    """A file of checkpoints placed together, by key (its name, its bytes): on disk and on a store alike. Named by
    the blake2b of its keys, not of its bytes: placing the same shards again (a rerun) writes the same names, whatever
    their seconds say."""
    names = "\n".join(checkpoints).encode()
    return hashlib.blake2b(names, digest_size=8).hexdigest(), orjson.dumps(checkpoints)


def _load_placed(path: Path) -> dict:
    return load_json(path, f"remove it and {rerun(path.parents[3])}: its shards are tokenized again") or {}


def _parsed(raw: dict, path: Path) -> Checkpoint:
    try:
        return Checkpoint.parse(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise damaged(path, e, f"remove it and {rerun(path.parents[3])}: its shards are tokenized again") from None

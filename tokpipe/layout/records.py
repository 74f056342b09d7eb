"""What OUT's records hold: a shard's checkpoint and its parts, the lines of a parts list, meta's entry for a
split summed from them, and the files an unfinished split is read from."""

from __future__ import annotations

import hashlib
import io
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.layout.files import Layout, PartKey, ShardFiles, damaged, load_json, rerun, split_bin_name
from tokpipe.layout.meta import SplitEntry, SplitFile
from tokpipe.layout.run import WriteSpec, sources

IDX_DTYPE = np.dtype("<i8")  # document ends, cumulative token counts

# --group-by: a split may have at most this many groups, since each has files of its own in every
# shard and in the split (a field with one value per document, an id or a url, would make a file per document).
MAX_GROUPS = 1000
GROUP_COUNTS = ("tokens", "documents", "text_bytes")  # of a group, in meta: text_bytes are its texts' UTF-8


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
        own documents: they are in its groups' parts)."""
        return next((part for part in self.parts if part.key == key), None)

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


# -- parts lists and split files ---------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A shard's documents in a split file (or those a train shard held out for val.bin), at its offsets there.
    `record` is its line in <stem>.parts; `bin`, `idx` the shard's own files, or `buffered` the memory it is in,
    or (`moved_from` its token and document offsets there) the split file as it was before shards were added
    before it (write/assembly/moving.py)."""

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
    moved_from: tuple[int, int] | None = None

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

    def at_start(self) -> Part:
        """The part alone in a file of its own (--no-concat): from the file's first token."""
        return replace(self, token_offset=0, doc_offset=0)

    @property
    def token_end(self) -> int:
        return self.token_offset + self.tokens

    @property
    def doc_end(self) -> int:
        return self.doc_offset + self.documents


def part_record(shard: Shard, ckpt: Checkpoint, key: PartKey) -> dict:
    """The line in <stem>.parts of a shard's part: the one of this key (held out, group).

    A group's line names its `group` and counts its texts' bytes; a held-out part's says so (`part`), and
    `held_in` counts the documents its file got. The shard's accounting (lines, skips, repairs, and `held_out`,
    the documents it sent to val.bin) goes on the line of key (False, None): its own part's, or with --group-by,
    where its own documents are in its groups' parts, a line of its own before theirs, with no tokens."""
    held, group = key
    part = ckpt.part(key) or PartCounts(held, group)
    accounting = key == (False, None)
    record = {"shard": shard.relpath} | ({"group": group} if group is not None else {})
    record |= ({"part": "held-out"} if held else {}) | {"tokens": part.tokens, "documents": part.documents}
    record |= {"text_bytes": part.text_bytes} if group is not None else {}
    record |= {"held_in": part.documents} if held else {}
    if accounting:
        record |= {"lines": ckpt.lines, "held_out": ckpt.counts(True)[1], "skipped": ckpt.skipped}
        record["repaired"] = ckpt.repaired
    record |= {"sha256": part.sha256, "idx_sha256": part.idx_sha256}
    if accounting and ckpt.skip_log:
        record["first_skipped"] = ckpt.skip_log
    return record


def is_held_part(record: dict) -> bool:
    return record.get("part") == "held-out"


def record_key(record: dict) -> PartKey:
    """The key of the part a parts list's line is of (a shard's accounting line: (False, None))."""
    return is_held_part(record), record.get("group")


def parts_line(record: dict) -> bytes:
    return orjson.dumps(record) + b"\n"


def read_parts(source: Path | bytes, sha256: str | None = None, torn: str = "refuse") -> Iterator[dict]:
    """The records of a parts list, a line at a time: the one reader of `<stem>.parts` (its path, or its bytes: an
    OUT on a store's), of `<stem>.parts.tmp` while it is written and of a moved split's source list. `sha256`:
    meta's, for a finished split's, checked once it is read. `torn` says what a line that does not parse is:
    - "refuse": damage, refused in one line with its fix (a finished list's, or a reader's of any);
    - "cut": as "refuse", but a last line without its newline is no record (a list being written, read by a
      reader: a crash cut it before its fsync returned, so its part is not listed);
    - "stop": where the records end, as far as they are whole (the rerun's: what follows is placed again)."""
    path = source if isinstance(source, Path) else Path("<stem>.parts")
    if path.name.endswith(".tmp"):
        fix = f"{rerun(path.parent)}: it keeps the parts listed before the damaged line and places the others again"
    else:
        fix = f"remove {Layout(path.parent).meta_json} and {rerun(path.parent)}: it lists the split's parts again"
    hasher = hashlib.sha256()
    with open(source, "rb") if isinstance(source, Path) else io.BytesIO(source) as f:
        for line in f:
            hasher.update(line)
            if torn != "refuse" and not line.endswith(b"\n"):
                return
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                if torn == "stop":
                    return
                raise damaged(path, e, fix) from None
            yield record
    if sha256 is not None and hasher.hexdigest() != sha256:
        raise damaged(path, ValueError("its sha256 is not the one meta records"), fix)


def listed_parts(out: Layout, stem: str) -> list[Part]:
    """The parts listed so far in a split's parts list being assembled (none before it is begun), whole lines
    only (read_parts' "cut")."""
    path = out.assembly(stem)[2]
    return parts_of(stem, read_parts(path, torn="cut")) if path.exists() else []


def parts_of(stem: str, records: Iterable[dict]) -> list[Part]:
    """The parts a parts list's records (read_parts) list, at the offsets their order gives them in their file
    (the split's, or their group's)."""
    parts, offsets = [], {}
    for seq, record in enumerate(records):
        tokens, documents = offsets.get(record.get("group"), (0, 0))
        parts.append(Part(stem, seq, tokens, documents, record))
        offsets[record.get("group")] = (tokens + record["tokens"], documents + record["documents"])
    return parts


def split_entry(stem: str, parts_path: Path, spec: WriteSpec) -> SplitEntry:
    """meta's entry for a split, summed from its parts list, laid out as the run's options say. A split of
    --no-concat has no file of its own: `files` lists its parts' files in order (their lines name them).

    With --group-by, `groups` holds each group's entry, in the order of their values: its tokens and
    documents, and its file (or files) as a split's; the split has none of its own."""
    return split_entry_of(stem, parts_path.read_bytes(), spec)


def split_entry_of(stem: str, raw: bytes, spec: WriteSpec) -> SplitEntry:
    """split_entry of a parts list's bytes (an OUT on a store: the list made in memory)."""
    counts = dict.fromkeys(("tokens", "documents", "lines", "held_out", "held_in"), 0)
    groups: dict[str, dict] = {}  # value -> its counts and files
    own: list[SplitFile] = []
    skipped, repaired, shards = Counter(), Counter(), 0
    for record in read_parts(raw):
        for key in counts:
            counts[key] += record.get(key, 0)
        files = own
        if "group" in record:
            into = groups.setdefault(record["group"], dict.fromkeys(GROUP_COUNTS, 0) | {"files": []})
            for key in GROUP_COUNTS:
                into[key] += record[key]
            files = into["files"]
        if "bin" in record:  # --no-concat: the part's own files (not a grouped shard's accounting line: it has none)
            files.append(SplitFile(record["bin"], record["idx"], record["tokens"], record["documents"]))
        skipped.update(record.get("skipped", {}))
        repaired.update(record.get("repaired", {}))
        shards += record_key(record) == (False, None)
    entries = None
    if spec.group_by is not None:
        name = Layout(Path()).split
        entries = {value: _entry(str(name(stem, value)), spec.concat, **g) for value, g in sorted(groups.items())}
    return _entry(
        stem,
        spec.concat,
        files=own,
        groups=entries,
        parts=f"{stem}.parts",
        **counts,
        skipped=dict(sorted(skipped.items())),
        repaired=dict(sorted(repaired.items())),
        shards=shards,
        parts_sha256=hashlib.sha256(raw).hexdigest(),
    )


def _entry(name: str, concat: bool, files: list[SplitFile], **fields) -> SplitEntry:
    """A split's (or a group's) entry, named `name` in OUT: its one file, or (--no-concat) its parts' `files`."""
    if concat and fields.get("groups") is None:
        files = [SplitFile(split_bin_name(name), f"{name}.idx", fields["tokens"], fields["documents"])]
    return SplitEntry(files=tuple(files), concat=concat, **fields)


def _placed(out: Layout, stem: str) -> dict[tuple[str, PartKey], SplitFile]:
    """The parts of a split in its file, by shard and part key: those listed in its parts list being assembled;
    or where a finalize stopped before meta.json (its files renamed, its parts list first), all."""
    renamed = not out.assembly(stem)[2].exists() and out.parts(stem).exists()
    placed = {}
    for part in parts_of(stem, read_parts(out.parts(stem))) if renamed else listed_parts(out, stem):
        paths = [path if path.is_file() else path.with_suffix("") for path in out.assembly(stem, part.group)[:2]]
        if part.tokens and paths[0].is_file():
            bin_name, idx_name = (str(path.relative_to(out.root)) for path in paths)
            at = {"token_offset": part.token_offset, "doc_offset": part.doc_offset, "growing": True, "placed": True}
            placed[part.name, record_key(part.record)] = SplitFile(
                bin_name, idx_name, part.tokens, part.documents, **at
            )
    return placed


def unfinished_files(out: Layout, manifest: Manifest, stem: str, val_fraction: float) -> list[SplitFile]:
    """What an unfinished OUT holds of a split, as far as its records cover it: each part of the split in order
    (with --val-fraction, val's include the train shards' held-out ones; with --group-by, a shard has a part per
    group), in the split file being assembled where its parts list lists it (placed), else in the shard's own
    files, as far as its checkpoint covers them (a live worker may be appending beyond). Files still written."""
    placed = _placed(out, stem)
    files = []
    for shard, held in sources(manifest, stem, val_fraction):
        paths = out.shard(shard)
        ckpt = Checkpoint.load(paths.checkpoint) or Checkpoint()
        for part in ckpt.source_parts(held):
            if (shard.relpath, part.key) in placed:  # copied into the split file, its own files gone
                files.append(placed[shard.relpath, part.key])
            elif part.tokens:
                names = (str(path.relative_to(out.root)) for path in paths.part(part.key))
                files.append(SplitFile(*names, part.tokens, part.documents, growing=True))
    return files

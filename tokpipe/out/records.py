"""What OUT's records hold: a shard's checkpoint and its parts, the lines of a parts list, meta's entry for a
split summed from them, and the files an unfinished split is read from."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.out.files import Out, ShardFiles, damaged, load_json, rerun, split_bin_name
from tokpipe.out.meta import SplitEntry, SplitFile
from tokpipe.out.run import sources

IDX_DTYPE = np.dtype("<i8")  # document ends, cumulative token counts

# --group-by: a split may have at most this many groups, since each has files of its own in every
# shard and in the split (a field with one value per document, an id or a url, would make a file per document).
MAX_GROUPS = 1000
GROUP_COUNTS = ("tokens", "documents", "text_bytes")  # of a group, in meta: text_bytes are its texts' UTF-8


@dataclass
class Checkpoint:
    """How far a shard got. Everything here is covered by fsynced .bin/.idx bytes."""

    lines: int = 0  # input lines consumed = documents + sum(skipped)
    offset: int = 0  # decompressed input bytes consumed
    source_pos: int = 0  # bytes of the shard file read (compressed), for progress only
    # zstd of several frames: where the frame that `offset` lies in begins, in the file and decompressed
    # (TextBatch.frame): a resume decodes from there, not from the file's start (a shard on a store: a ranged GET)
    frame_source_pos: int = 0
    frame_offset: int = 0
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
    # For `tokpipe report`: decompressed input bytes consumed (TextBatch.text_bytes summed), and seconds
    # spent, summed over attempts (an interrupted attempt counts up to its last checkpoint).
    text_bytes: int = 0
    seconds: float = field(default=0.0, compare=False)  # not content: two runs of the same shard differ here

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        """The checkpoint at `path` (OUT/shards/<split>/<key>.json), None where the shard has none. A damaged
        one is refused, by the run too: the shard's tokens it covers are on the same storage."""
        try:
            found = load_json(path)
            return None if found is None else cls(**found)
        except (ValueError, TypeError) as e:  # not JSON; fields no checkpoint has
            raise damaged(path, e, f"remove it and {rerun(path.parents[2])}: the shard is tokenized again") from None

    @classmethod
    def of(cls, out: str | os.PathLike, shard: Shard) -> Checkpoint | None:
        return cls.load(ShardFiles.of(out, shard).checkpoint)

    def parts(self, held: bool, grouped: bool) -> dict[str | None, tuple[int, int]]:
        """The shard's parts in a split file, in order, with their counts: group (None without --group-by) ->
        (tokens, documents). `held`: the parts of the documents it held out for val.bin. The one place
        that says which parts a shard has (a grouped shard's accounting line is a record, not a part)."""
        if grouped:
            return {g: (c["tokens"], c["documents"]) for g, c in (self.val_groups if held else self.groups).items()}
        return {None: (self.val_tokens, self.val_documents) if held else (self.tokens, self.documents)}

    def groups_by_split(self, split: str) -> tuple[tuple[str, dict[str, dict]], ...]:
        """The counts of the shard's groups, by the split they go to: its own (`split`), then validation's."""
        return (split, self.groups), ("validation", self.val_groups)


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


def read_parts(path: Path, sha256: str | None = None) -> Iterator[dict]:
    """The records of a split's parts list, a line at a time; `sha256`: meta's, for a finished split's, checked
    once it is read (a list cut at a line's end parses). Damaged, it is refused: a rerun lists the parts again."""
    fix = f"remove {Out(path.parent).meta_json} and {rerun(path.parent)}: it lists the split's parts again"
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for line in f:
            hasher.update(line)
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise damaged(path, e, fix) from None
    if sha256 is not None and hasher.hexdigest() != sha256:
        raise damaged(path, ValueError("its sha256 is not the one meta records"), fix)


def listed_parts(out: Out, stem: str) -> list[Part]:
    """The parts listed so far in a split's parts list being assembled (none before it is begun), whole lines
    only: a line a crash cut short was never fsynced, so its part is not placed."""
    path = out.assembly(stem)[2]
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    try:
        return parts_of(stem, raw[: raw.rfind(b"\n") + 1])
    except orjson.JSONDecodeError as e:
        fix = f"{rerun(out.root)}: it keeps the parts listed before the damaged line and places the others again"
        raise damaged(path, e, fix) from None


def parts_of(stem: str, raw: bytes) -> list[Part]:
    """The parts listed in a .parts file's bytes, at the offsets their order gives them in their file
    (the split's, or their group's)."""
    parts, offsets = [], {}
    for seq, record in enumerate(map(orjson.loads, raw.splitlines())):
        tokens, documents = offsets.get(record.get("group"), (0, 0))
        parts.append(Part(stem, seq, tokens, documents, record))
        offsets[record.get("group")] = (tokens + record["tokens"], documents + record["documents"])
    return parts


def split_entry(stem: str, parts_path: Path, concat: bool, grouped: bool = False) -> SplitEntry:
    """meta's entry for a split, summed from its parts list. A split of --no-concat has no file of its
    own: `files` lists its parts' files in order (their lines in the parts list name them).

    With --group-by (`grouped`), `groups` holds each group's entry, in the order of their values: its
    tokens and documents, and its file (or files) as a split's; the split has none of its own."""
    counts = dict.fromkeys(("tokens", "documents", "lines", "held_out", "held_in"), 0)
    groups: dict[str, dict] = {}  # value -> its counts and files
    own: list[SplitFile] = []
    skipped, repaired, shards = Counter(), Counter(), 0
    raw = parts_path.read_bytes()
    for record in map(orjson.loads, raw.splitlines()):
        for key in counts:
            counts[key] += record.get(key, 0)
        files = own
        if grouped and "group" in record:
            into = groups.setdefault(record["group"], dict.fromkeys(GROUP_COUNTS, 0) | {"files": []})
            for key in GROUP_COUNTS:
                into[key] += record[key]
            files = into["files"]
        if not concat and (not grouped or "group" in record):
            files.append(SplitFile(record["bin"], record["idx"], record["tokens"], record["documents"]))
        skipped.update(record.get("skipped", {}))
        repaired.update(record.get("repaired", {}))
        shards += not is_held_part(record) and "group" not in record
    entries = None
    if grouped:
        entries = {
            value: _entry(str(Out(Path()).split(stem, value)), concat, **g) for value, g in sorted(groups.items())
        }
    return _entry(
        stem,
        concat,
        files=[] if grouped else own,
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


def _placed(out: Out, stem: str) -> dict[tuple[str, bool, str | None], SplitFile]:
    """The parts of a split in its file, by (shard, held out, group): those listed in its parts list being
    assembled; or where a finalize stopped before meta.json (its files renamed, its parts list first), all."""
    renamed = not out.assembly(stem)[2].exists() and out.parts(stem).exists()
    placed = {}
    for part in parts_of(stem, out.parts(stem).read_bytes()) if renamed else listed_parts(out, stem):
        paths = [path if path.is_file() else path.with_suffix("") for path in out.assembly(stem, part.group)[:2]]
        if part.tokens and paths[0].is_file():
            bin_name, idx_name = (str(path.relative_to(out.root)) for path in paths)
            at = {"token_offset": part.token_offset, "doc_offset": part.doc_offset, "growing": True, "placed": True}
            placed[part.name, is_held_part(part.record), part.group] = SplitFile(
                bin_name, idx_name, part.tokens, part.documents, **at
            )
    return placed


def unfinished_files(out: Out, manifest: Manifest, stem: str, val_fraction: float, grouped: bool) -> list[SplitFile]:
    """What an unfinished OUT holds of a split, as far as its records cover it: each part of the split in order
    (with --val-fraction, val's include the train shards' held-out ones; with --group-by, a shard has a part per
    group), in the split file being assembled where its parts list lists it (placed), else in the shard's own
    files, as far as its checkpoint covers them (a live worker may be appending beyond). Files still written."""
    placed = _placed(out, stem)
    files = []
    for shard, held in sources(manifest, stem, val_fraction):
        paths = out.shard(shard)
        ckpt = Checkpoint.load(paths.checkpoint) or Checkpoint()
        for group, (tokens, documents) in ckpt.parts(held, grouped).items():
            if (shard.relpath, held, group) in placed:  # copied into the split file, its own files gone
                files.append(placed[shard.relpath, held, group])
            elif tokens:
                names = (str(path.relative_to(out.root)) for path in paths.part(held, group))
                files.append(SplitFile(*names, tokens, documents, growing=True))
    return files

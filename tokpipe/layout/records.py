"""What OUT's records hold: a shard's parts, the lines of a parts list, meta's entry for a split summed from them,
and the files an unfinished split is read from (a shard's checkpoint: checkpoints.py)."""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints, PartCounts
from tokpipe.layout.files import Layout, PartKey, damaged, rerun, split_bin_name
from tokpipe.layout.meta import SplitEntry, SplitFile
from tokpipe.layout.run import WriteSpec, sources
from tokpipe.layout.stored import SEGMENTS, SOURCES, Segment, indexed_segments, stored_of

IDX_DTYPE = np.dtype("<i8")  # document ends, cumulative token counts
PART_KEYS = frozenset(("shard", "tokens", "documents"))  # of every line of a parts list (part_record)

# --group-by: a split may have at most this many groups, since each has files of its own in every
# shard and in the split (a field with one value per document, an id or a url, would make a file per document).
# FineWeb-2's `language` has over 1,000 values (1,868 language-script pairs): 2,000 groups ran under ulimit -n 1024,
# 13 s for 5 MB (verify 2.1 s, report 18.6 s); in a split's first 16 MiB (runner/sample.py) 4,096 ids are documents
# of up to ~4 KB each, so a field of one value per document is still refused before any token.
MAX_GROUPS = 4096
GROUP_COUNTS = ("tokens", "documents", "text_bytes")  # of a group, in meta: text_bytes are its texts' UTF-8


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
    # A buffered shard's parts (on Ray, the reference to them) with this part's key; its checkpoint (split, key,
    # Checkpoint), written once placed: nothing on disk covered the shard before (shard.ShardResult.buffered).
    buffered: tuple | None = None
    checkpoint: tuple[str, str, Checkpoint] | None = None
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


def record_key(record: dict) -> PartKey:
    """The key of the part a parts list's line is of (a shard's accounting line: (False, None))."""
    return record.get("part") == "held-out", record.get("group")


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
                if type(record) is not dict or not PART_KEYS <= record.keys():  # JSON, but no part's record
                    raise ValueError(f"a line that is no part's record: {line[:60].decode(errors='replace')!r}")
            except ValueError as e:  # orjson's JSONDecodeError too
                if torn == "stop":
                    return
                raise damaged(path, e, fix) from None
            yield record
    if sha256 is not None and hasher.hexdigest() != sha256:
        raise damaged(path, ValueError("its sha256 is not the one meta records"), fix)


def parts_of(stem: str, records: Iterable[dict]) -> Iterator[Part]:
    """The parts a parts list's records (read_parts) list, one at a time, at the offsets their order gives them in
    their file (the split's, or their group's)."""
    offsets = {}
    for seq, record in enumerate(records):
        tokens, documents = offsets.get(record.get("group"), (0, 0))
        yield Part(stem, seq, tokens, documents, record)
        offsets[record.get("group")] = (tokens + record["tokens"], documents + record["documents"])


def split_entry(stem: str, raw: bytes, spec: WriteSpec) -> SplitEntry:
    """meta's entry for a split, summed from its parts list's bytes (an OUT on a store's: the list made in memory),
    laid out as the run's options say. A split of --no-concat has no file of its own: `files` lists its parts'
    files in order (their lines name them).

    With --group-by, `groups` holds each group's entry, in the order of their values: its tokens and
    documents, and its file (or files) as a split's; the split has none of its own."""
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
    counts |= {"skipped": dict(sorted(skipped.items())), "repaired": dict(sorted(repaired.items())), "shards": shards}
    sha256 = hashlib.sha256(raw).hexdigest()
    return _entry(stem, spec.concat, own, groups=entries, parts=f"{stem}.parts", parts_sha256=sha256, **counts)


def _entry(name: str, concat: bool, files: list[SplitFile], **fields) -> SplitEntry:
    """A split's (or a group's) entry, named `name` in OUT: its one file, or (--no-concat) its parts' `files`."""
    if concat and fields.get("groups") is None:
        files = [SplitFile(split_bin_name(name), f"{name}.idx", fields["tokens"], fields["documents"])]
    return SplitEntry(files=tuple(files), concat=concat, **fields)


def _placed(out: Layout, stem: str) -> dict[tuple[str, PartKey], SplitFile]:
    """The parts of a split in its file, by shard and part key: those listed so far in its parts list being
    assembled (none before it is begun; whole lines only, read_parts' "cut"); or where a finalize stopped before
    meta.json (its files renamed, its parts list first), all."""
    renamed = not out.assembly(stem)[2].exists()
    listing = out.parts(stem) if renamed else out.assembly(stem)[2]
    records = read_parts(listing, torn="refuse" if renamed else "cut") if listing.exists() else ()
    placed = {}
    for part in parts_of(stem, records):
        paths = [path if path.is_file() else path.with_suffix("") for path in out.assembly(stem, part.group)[:2]]
        if part.tokens and paths[0].is_file():
            names = (str(path.relative_to(out.root)) for path in paths)
            at = {"token_offset": part.token_offset, "doc_offset": part.doc_offset, "growing": True, "placed": True}
            placed[part.name, record_key(part.record)] = SplitFile(*names, part.tokens, part.documents, **at)
    return placed


def _sourced(root: Path, stem: str) -> dict[tuple[str, PartKey], SplitFile]:
    """For a reader's copy of an OUT on a store that shards are appended to: the finished parts of a split in the split
    files the append moved to sources/ (runner/storage.py Prefix._append), by shard and part key, each a range of
    its file, until the append's segments hold them."""
    found, listed = {}, root / SOURCES / f"{stem}.parts"
    for part in parts_of(stem, read_parts(listed)) if listed.is_file() else ():
        key = record_key(part.record)
        base = Layout(SOURCES).split(stem, key[1])
        at = {"token_offset": part.token_offset, "doc_offset": part.doc_offset, "growing": True, "placed": True}
        found[part.name, key] = SplitFile(f"{base}.bin", f"{base}.idx", part.tokens, part.documents, **at)
    return found


def unfinished_files(root: Path, manifest: Manifest, stem: str, val_fraction: float) -> tuple[list[SplitFile], int]:
    """What an unfinished OUT (a reader's: layout/stored.py reader_out) holds of a split, as far as its records cover
    it: each part of the split in order (with --val-fraction, val's include the train shards' held-out ones; with
    --group-by, a shard has a part per group), in the split file being assembled where its parts list lists it
    (placed), else in the shard's own files, as far as its checkpoint covers them (a live worker may be appending
    beyond). Files still written. On a store, the parts of checkpointed shards in their segments, and those a failed
    shard kept (write/stored.py keep) in their shard's own files. With them, how many shards they are of."""
    out, on_store = Layout(root), stored_of(root) is not None
    placed = {**_sourced(root, stem), **segment_parts(root, stem)} if on_store else _placed(out, stem)
    checkpoints = Checkpoints(root)
    files, shards = [], 0
    for shard, held in sources(manifest, stem, val_fraction):
        paths, before = out.shard(shard), len(files)
        ckpt = checkpoints.of(shard) or Checkpoint()
        for part in ckpt.source_parts(held):
            if (shard.relpath, part.key) in placed:  # copied into the split file, its own files gone
                files.append(placed[shard.relpath, part.key])
            elif part.tokens and (not on_store or paths.checkpoint.is_file()):  # on a store: a kept part's
                names = (str(path.relative_to(out.root)) for path in paths.part(part.key))
                files.append(SplitFile(*names, part.tokens, part.documents, growing=True))
        shards += len(files) > before
    return files, shards


def segment_parts(out: Path, stem: str) -> dict[tuple[str, PartKey], SplitFile]:
    """For a reader's copy of an unfinished OUT on a store (reader_out): the parts of a split its committed segments
    hold, by shard and part key, each a range of its segment (its record, in an index object or its .json copied with
    the records, says what each holds; its .bin, the commit, is in the copy's listing). A part is read only where its
    shard is checkpointed: its segment is committed then, unless it was done before an append, whose segments take it
    anew."""
    found, committed = {}, getattr(out, "listed", None)
    records = (Segment.parse(record.read_bytes()) for record in (out / SEGMENTS / stem).rglob("*.json"))
    for segment in {**indexed_segments(out), **{segment.name: segment for segment in records}}.values():
        tokens, documents = 0, 0
        if segment.stem != stem or (committed is not None and f"{segment.name}.bin" not in committed):
            continue
        for e in segment.entries:
            # "growing": its segment is checked to hold at least the part, since other parts follow it there
            at = {"token_offset": tokens, "doc_offset": documents, "placed": True, "growing": True}
            names = f"{segment.name}.bin", f"{segment.name}.idx"
            found[e.shard, (e.held, e.group)] = SplitFile(*names, e.tokens, e.documents, **at)
            tokens, documents = tokens + e.tokens, documents + e.documents
    return found

"""The parts of an OUT on a store (layout/stored.py) gathered into segments, and a segment's upload: each token
uploaded once, into a segment of at least SEGMENT_BYTES (a split file's last segment may be shorter), so that
finalize can compose the split file from its segments on the server (store.compose: every source but the last at
least MIN_PART).

What a segment holds is decided by the driver from the parts' counts alone (`Gatherer`, in split order): a part
joins its file's open segment, which is closed once it holds SEGMENT_BYTES. A large part that comes with no segment
open is a segment of its own: for a corpus of large shards, nearly every part, uploaded from the node whose object
store holds it (runner/copies.py) and never moved. Segments are uploaded in parallel, in any order
(write/stored.py upload_segment): the order of a split file's segments is the order of their first parts.

A segment is three objects: its .json (the parts it holds), its .idx (its documents' ends, counted from its first
token) and its .bin (its tokens), written in that order: the .bin, a create-only PUT (or a multipart upload
completed create-only), is the commit. A .json or .idx without its .bin was never committed (a rerun removes it). A
segment's key is its first part's (a function of split, shard and part), and the gathering starts over from the
same part on a rerun, so that an attempt that commits the same key commits the same bytes, and of two exactly one
commit succeeds (`Exists`: the other's stands). The driver writes the records of the segments it commits again,
INDEX_EVERY to an index object (`SegmentIndex`), which a rerun reads instead of a .json each.

A part waits for its upload in its worker's memory, then its node's object store (Buffered); past --shard-buffer a
large one waits in files of its node (Spilled), which only that node's Placer reads.

With --no-concat nothing is gathered: every part is a segment of its own, its file in meta.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokpipe.inputs.manifest import Shard
from tokpipe.layout.checkpoints import Checkpoint, PartCounts
from tokpipe.layout.files import ShardFiles
from tokpipe.layout.records import IDX_DTYPE, parts_of, read_parts, record_key
from tokpipe.layout.run import WriteSpec
from tokpipe.layout.stored import SEGMENT_BYTES, Entry, Segment, StoredOut, index_record, indexed

# A kept part's tokens are read in ranged GETs of this many bytes into a file of the node's (Kept.arrays).
KEPT_READ_BYTES = 16 << 20
# The records of the segments a run commits are written again into index objects, this many to one: a rerun GETs those,
# and the .json of a segment committed since alone (benchmarks/resume.py, 3,200 segments: 8.2 s a GET each, 0.17 s
# from their 50 index objects; for 2.5 TB of tokens, 500,000 segments, 21 min of a rerun's start against 27 s).
INDEX_EVERY = 64


# A part's tokens and its document ends (counted from the part's start), as the arrays they were encoded in.
Buffered = tuple[list[np.ndarray], list[np.ndarray]]


@dataclass(frozen=True)
class Spilled:
    """A large part of a shard of an OUT on a store, moved past --shard-buffer out of the worker's memory into files
    of its node (EncodeSpec.spill). The largest part of its segment, so that node's Placer uploads it
    (runner/copies.py) and then removes them; no checkpoint covers them (a lost node loses them as it loses its
    object store's). Only a part of at least SEGMENT_BYTES: the small ones, gathered from other nodes, stay in
    memory."""

    bin: str
    idx: str
    dtype: str

    def arrays(self) -> Buffered:
        return [_mapped(self.bin, self.dtype)], [_mapped(self.idx, IDX_DTYPE)]

    def remove(self) -> None:
        for path in (self.bin, self.idx):
            Path(path).unlink(missing_ok=True)


def _mapped(path: str, dtype) -> np.ndarray:
    """A file's array, read from the page cache as it is uploaded (a large part is never copied whole)."""
    return np.memmap(path, dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


@dataclass(frozen=True)
class Kept:
    """A done shard's part held in objects of OUT on the store, whence a segment takes it instead of tokenizing the
    shard again: its own files' keys (shards/<split>/...<key>.bin, .idx), where a run that ended with a shard
    before it failed kept it (write/stored.py keep), or its range of a split file as it was before shards were appended
    (sources/<stem>.bin: `start` and `tokens` of it, its ends from `doc_start`, counted from the file's start). Its
    tokens are read in ranges into a file of this node's (a part may be larger than a process should hold), its
    ends in one. Such objects go once OUT is finished (write/finalize.py)."""

    out: StoredOut
    bin: str
    idx: str
    dtype: str
    start: int = 0
    tokens: int | None = None  # None: the whole object
    doc_start: int = 0
    documents: int | None = None

    def arrays(self) -> Buffered:
        itemsize = np.dtype(self.dtype).itemsize
        size, at = None if self.tokens is None else self.tokens * itemsize, self.start * itemsize
        # A file of no name (O_TMPFILE): an error or a kill -9 midway leaves nothing on the node, where a named one
        # stayed (a part may be gigabytes); its pages stay while mapped, and go when the upload drops them.
        with tempfile.TemporaryFile(prefix="tokpipe-kept-") as tokens:
            while size is None or tokens.tell() < size:
                want = KEPT_READ_BYTES if size is None else min(KEPT_READ_BYTES, size - tokens.tell())
                if not (data := self.out.bucket.read(self.bin, at, at + want)[0]):
                    break
                tokens.write(data)
                at += len(data)
            tokens.flush()
            mapped = np.memmap(tokens, self.dtype, mode="r") if tokens.tell() else np.zeros(0, self.dtype)
        if self.documents is None:
            raw = self.out.bucket.get(self.idx)[0]
        else:
            end = (self.doc_start + self.documents) * 8
            raw = self.out.bucket.read(self.idx, self.doc_start * 8, end)[0] if self.documents else b""
        ends = np.frombuffer(raw, dtype=IDX_DTYPE) - self.start
        return [mapped], [ends]


@dataclass
class HeldParts:
    """Finished parts held in objects of OUT on the store, which a rerun's segments take instead of tokenizing their
    shards again (segments.Kept): the parts a run that a failed shard stopped kept, or that waited on Ray for a segment
    still gathering (`kept`, by its shard's files' keys, write/stored.py keep), and the ranges of a finished OUT's split
    files that an append copied to sources/ (`sourced`, runner/storage.py Prefix._append: ~200 bytes a part, each
    dropped as the walk takes it)."""

    out: StoredOut
    spec: WriteSpec
    dtype: str
    checkpoints: Callable[[list[Shard]], list[Checkpoint]]  # done shards', own or placed (StoredCheckpoints.of)
    kept: set[tuple[str, str]] = field(default_factory=set)  # (split, key) of the shards with parts kept
    sourced: dict[tuple[str, bool], list[tuple[PartCounts, Kept]]] = field(default_factory=dict)  # (relpath, held)
    moved: dict[str, int] = field(default_factory=dict)  # stem -> finished shards taken from its sources

    def note(self, key: str) -> bool:
        """A key of OUT's listing: whether it is one of these (a kept part's, a source's)."""
        if key.startswith(self.out.sources):
            if key.endswith(".parts"):
                self._sources(key)
            return True
        if key.startswith(self.out.checkpoints) and key.endswith((".bin", ".idx")):
            name = self.out.name(key).split("/")
            self.kept.add((name[1], name[-1].removesuffix(".bin").removesuffix(".idx")))
            return True
        return False

    def _sources(self, parts_key: str) -> None:
        """Where each finished part of a split file an append moved (Prefix._append) is: its range of the file."""
        stem = parts_key.removeprefix(self.out.sources).removesuffix(".parts")
        for part in parts_of(stem, read_parts(self.out.bucket.get(parts_key)[0])):
            held, group = record_key(part.record)
            if self.spec.group_by is not None and group is None:
                continue  # a shard's accounting line alone: its documents are in its groups' parts
            base = self.out.sources + self.out.name(self.out.of_local(self.out.layout.split(stem, group)))
            bounds = (part.token_offset, part.tokens, part.doc_offset, part.documents)
            where = Kept(self.out, f"{base}.bin", f"{base}.idx", self.dtype, *bounds)
            counts = PartCounts(held, group, part.tokens, part.documents)
            if (part.name, held) not in self.sourced:
                self.moved[stem] = self.moved.get(stem, 0) + 1
            self.sourced.setdefault((part.name, held), []).append((counts, where))

    def take(self, shard: Shard, held: bool) -> tuple[list[PartCounts], dict]:
        """A done shard's parts of one source, and where each is held (none: they are in committed segments)."""
        if (shard.relpath, held) in self.sourced:
            found = self.sourced.pop((shard.relpath, held))
            return [counts for counts, _ in found], {counts.key: where for counts, where in found}
        if (shard.split, shard.key) not in self.kept:
            return [], {}
        # Its parts in committed segments are passed over, whatever objects of its files a keep left: those of one
        # killed before the checkpoint, the shard then tokenized again and checkpointed with its segments.
        parts = self.checkpoints([shard])[0].source_parts(held)
        return parts, kept_parts(self.out, self.dtype, shard, [p.key for p in parts])


def kept_parts(out: StoredOut, dtype: str, shard: Shard, keys: list) -> dict:
    """Where a kept shard's parts are (write/stored.py keep): its own files' keys, by part key."""
    files = ShardFiles.of(out.work, shard)
    return {key: Kept(out, *map(out.of_local, files.part(key)), dtype) for key in keys}


def spill_large(parts, spec, shard, files: ShardFiles | None) -> ShardFiles:
    """A shard's buffered parts (write/shard.py PartWriter) of at least SEGMENT_BYTES of tokens into files of this
    node's, in a folder of this attempt's (a retry's never meets them), under spec.spill; the folders of the OUT's
    earlier runs go (a run killed leaves them on nodes the driver's cleaning never sees). Returns the attempt's
    files."""
    itemsize = np.dtype(spec.dtype).itemsize
    large = [p for p in parts if p.buffered is not None and p.tokens * itemsize >= SEGMENT_BYTES]
    if not large:
        return files
    root = Path(tempfile.gettempdir()) / spec.spill
    if files is None:
        for earlier in root.parent.iterdir() if root.parent.is_dir() else []:
            if earlier != root:
                shutil.rmtree(earlier, ignore_errors=True)
        files = ShardFiles.of(root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}", shard)
    for part in large:
        part.spill(*files.part(part.key))
    return files


def part_arrays(value: Buffered | Spilled | Kept) -> Buffered:
    """A buffered part's tokens and ends, in memory, in its node's files, or kept on the store."""
    return value.arrays() if isinstance(value, Spilled | Kept) else value


@dataclass
class ClosedSegment:
    """A segment to upload, and where each of its parts' tokens are (`sources`, one per entry: write/stored.py's
    PartTokens)."""

    segment: Segment
    sources: list


@dataclass
class _Open:
    """A file's segment being gathered: its first part's name (the segment's), parts' entries, sources, token bytes."""

    first: str
    entries: list[Entry] = field(default_factory=list)
    sources: list = field(default_factory=list)
    nbytes: int = 0


class Gatherer:
    """Gathers each split file's parts, given in split order, into segments, each closed once it is large enough
    (`add`) or its file has no more parts (`end`); each returns the segments just closed, to upload. No token
    passes through it: a part's size is its count of tokens."""

    def __init__(self, out: StoredOut, concat: bool, itemsize: int):
        self.out, self.concat, self.itemsize = out, concat, itemsize
        self.open: dict[tuple[str, str | None], _Open] = {}

    def add(self, stem: str, name: str, entry: Entry, source) -> list[ClosedSegment]:
        """A part, the next of its file (stem, entry.group): `name` its part name, `source` where its tokens are."""
        file = (stem, entry.group)
        segment = self.open.setdefault(file, _Open(name))
        segment.entries.append(entry)
        segment.sources.append(source)
        segment.nbytes += entry.tokens * self.itemsize
        if not self.concat or segment.nbytes >= SEGMENT_BYTES:
            return [self._close(file)]
        return []

    def take_from(self, sources: dict) -> None:
        """Parts of the segments gathering take their tokens from elsewhere: `sources`, by (id of where they were, key)
        (a shard kept on the store while they gather, runner/copies.py SegmentUploads._unpin)."""
        for segment in self.open.values():
            segment.sources = [sources.get((id(s.buffered), s.key), s) for s in segment.sources]

    def end(self, stem: str) -> list[ClosedSegment]:
        """The split's files have no more parts: their last segments are closed, however short."""
        return [self._close(file) for file in [file for file in self.open if file[0] == stem]]

    def _close(self, file: tuple[str, str | None]) -> ClosedSegment:
        segment = self.open.pop(file)
        stem, group = file
        name = self.out.name(self.out.segment(stem, group, segment.first))
        tokens, documents = sum(e.tokens for e in segment.entries), sum(e.documents for e in segment.entries)
        return ClosedSegment(Segment(stem, group, name, segment.entries, tokens, documents), segment.sources)


@dataclass
class SegmentIndex:
    """The committed segments' records again, INDEX_EVERY to an index object (layout/stored.py SEGMENT_INDEX): what a
    rerun reads them from, and from a segment's own .json only where no index object holds it."""

    out: StoredOut
    listed: list[str] = field(default_factory=list)  # index objects a rerun's listing found
    unindexed: list[Segment] = field(default_factory=list)  # committed segments in no index object yet

    def note(self, key: str) -> bool:
        """A key of OUT's listing: whether it is an index object's."""
        index = key.startswith(self.out.segment_index)
        if index:
            self.listed.append(key)
        return index

    def read(self, bases: list[str], pool: ThreadPoolExecutor, say: Callable[[str], None]) -> list[Segment]:
        """The records of the committed segments at these keys (less their suffix), said first: an index object's where
        it has one (the segment's .bin listed: committed, and not removed since), else its .json's, a GET each."""
        raws = pool.map(lambda key: self.out.bucket.get(key)[0], self.listed)
        held = {self.out.key(s.name): s for raw in raws for s in indexed(raw)}
        unread = [base for base in bases if base not in held]
        if bases:
            how = f" ({len(bases) - len(unread):,} in index objects, {len(unread):,} a GET each)" if self.listed else ""
            said = f"reading which parts each of the {len(bases):,} segments committed under {self.out} holds"
            say(f"resuming: {said}{how}")
        self.unindexed = list(pool.map(lambda base: Segment.parse(self.out.bucket.get(f"{base}.json")[0]), unread))
        return [held[base] for base in bases if base in held] + self.unindexed

    def add(self, segments: list[Segment], lease_check: Callable[[], None]) -> None:
        """Segments committed: every INDEX_EVERY of them (and those `read` GET) into an index object."""
        self.unindexed += segments
        if len(self.unindexed) >= INDEX_EVERY:
            data = index_record(self.unindexed)
            lease_check()
            self.out.bucket.put(self.out.index_object(hashlib.sha256(data).hexdigest()[:16]), data)
            self.unindexed = []

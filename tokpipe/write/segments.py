"""The parts of an OUT on a store (layout/stored.py) uploaded in split order, gathered into segments: each token
uploaded once, into a segment of at least SEGMENT_BYTES (a split file's last segment may be shorter), so that
finalize can compose the split file from its segments on the server (store.compose: every source but the last at
least MIN_PART).

A segment is three objects: its .json (the parts it holds, and its place among its file's segments), its .idx (its
documents' ends, counted from its first token) and its .bin (its tokens), written in that order: the .bin, a
create-only PUT (or a multipart upload completed create-only), is the commit. A .json or .idx without its .bin was
never committed (a rerun removes it). A segment's key is its first part's (a function of split, shard and part), and
what a segment holds is decided by the order of the parts alone: a writer of another attempt that commits the same
key commits the same bytes, and of the two exactly one commit succeeds (`Exists`: the other's stands).

With --no-concat nothing is gathered: every part is a segment of its own, its file in meta.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import orjson

from tokpipe.layout.records import IDX_DTYPE
from tokpipe.layout.stored import StoredOut
from tokpipe.store import MIN_PART, Bucket, Exists, Upload

# A segment is committed once it holds this many bytes of tokens. S3's least part: the most segments a split file may
# be composed of in one go is 10,000 (50 GB of them at this size; past it store.compose goes in two steps), and what
# the writer holds of a file at once is one segment.
SEGMENT_BYTES = MIN_PART
# A .bin of up to this many bytes is one PUT; a larger one (a segment that ends with a large part) a multipart
# upload of UPLOAD_PART_BYTES a request, so that no copy of the whole is made in memory.
WHOLE_PUT_BYTES = 64 << 20
UPLOAD_PART_BYTES = 16 << 20


@dataclass(frozen=True)
class Entry:
    """A part as a segment's .json lists it: whose (its shard's relpath), which of the shard's (held out, group), and
    its counts."""

    shard: str
    held: bool
    group: str | None
    tokens: int
    documents: int

    @property
    def key(self) -> tuple[str, bool, str | None]:
        return self.shard, self.held, self.group


@dataclass
class Segment:
    """A segment as a rerun finds it (or the writer made it): its file (stem, group), its place among that file's
    segments, its name (key without suffix), its parts and counts."""

    stem: str
    group: str | None
    seq: int
    name: str
    entries: list[Entry]
    tokens: int
    documents: int

    def record(self) -> bytes:
        return orjson.dumps({**asdict(self), "entries": [asdict(e) for e in self.entries]})

    @classmethod
    def parse(cls, raw: bytes) -> Segment:
        found = orjson.loads(raw)
        return cls(**{**found, "entries": [Entry(**e) for e in found["entries"]]})


@dataclass
class _Open:
    """A file's segment being gathered: its parts, their tokens and ends (ends from each part's first token)."""

    entries: list[Entry] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    ends: list[np.ndarray] = field(default_factory=list)
    nbytes: int = 0


class Segments:
    """Gathers each split file's parts, given in split order, into segments, and commits each once it is large enough
    (`add`) or its file has no more parts (`end`). Each returns the segments just committed: the runner writes a
    shard's checkpoint once all of its parts are in one. `seqs`: the segments each file has already (a resumed run);
    with `open_segments`, another writer's state, which this one goes on from (the driver's, when Ray takes over from
    it: the parts in its open segments are in no committed one yet)."""

    def __init__(self, out: str, concat: bool, seqs: dict | None = None, open_segments: dict | None = None):
        self.out, self.concat = StoredOut.of(out), concat
        self.bucket: Bucket = self.out.bucket
        self.seqs: dict[tuple[str, str | None], int] = dict(seqs or {})
        self.open: dict[tuple[str, str | None], _Open] = dict(open_segments or {})
        self.uploaded = 0  # bytes of tokens and ends this writer uploaded

    def add(
        self, stem: str, name: str, entry: Entry, tokens: list[np.ndarray], ends: list[np.ndarray]
    ) -> list[Segment]:
        """A part, the next of its file (stem, entry.group): `name` its part name, `tokens` and `ends` its arrays."""
        file = (stem, entry.group)
        segment = self.open.setdefault(file, _Open())
        segment.entries.append(entry)
        segment.names.append(name)
        shift = sum(e.tokens for e in segment.entries[:-1])
        segment.tokens += tokens
        segment.ends += [a + shift for a in ends] if shift else ends
        segment.nbytes += sum(a.nbytes for a in tokens)
        if not self.concat or segment.nbytes >= SEGMENT_BYTES:
            return self._commit(file)
        return []

    def end(self, stem: str) -> list[Segment]:
        """The split's files have no more parts: their last segments are committed, however short."""
        committed = []
        for file in [file for file in self.open if file[0] == stem]:
            committed += self._commit(file)
        return committed

    def _commit(self, file: tuple[str, str | None]) -> list[Segment]:
        segment = self.open.pop(file)
        stem, group = file
        seq = self.seqs.get(file, 0)
        self.seqs[file] = seq + 1
        name = self.out.segment(stem, group, segment.names[0])
        made = Segment(stem, group, seq, self.out.name(name), segment.entries, *_counts(segment.entries))
        self.bucket.put(f"{name}.json", made.record())
        ends = np.concatenate(segment.ends).astype(IDX_DTYPE) if segment.ends else np.zeros(0, IDX_DTYPE)
        self.bucket.put(f"{name}.idx", ends.tobytes())
        try:
            _upload(self.bucket, f"{name}.bin", segment.tokens)
        except Exists:  # another attempt's writer committed this segment: the same parts, the same bytes
            pass
        self.uploaded += segment.nbytes + ends.nbytes
        return [made]


def _counts(entries: list[Entry]) -> tuple[int, int]:
    return sum(e.tokens for e in entries), sum(e.documents for e in entries)


def _upload(bucket: Bucket, key: str, arrays: list[np.ndarray]) -> None:
    """The arrays' bytes as one object, create-only: one PUT, or past WHOLE_PUT_BYTES a multipart upload."""
    views = [memoryview(a).cast("B") for a in arrays if a.nbytes]
    if sum(len(v) for v in views) <= WHOLE_PUT_BYTES:
        bucket.put(key, b"".join(views), create=True)
        return
    upload = Upload.begin(bucket, key)
    try:
        chunk, size = [], 0
        for view in views:
            while len(view):
                take = view[: UPLOAD_PART_BYTES - size]
                chunk.append(take)
                size += len(take)
                view = view[len(take) :]
                if size == UPLOAD_PART_BYTES:
                    upload.send(chunk)
                    chunk, size = [], 0
        if chunk:
            upload.send(chunk)
    except BaseException:
        upload.abort()
        raise
    upload.finish(create=True)

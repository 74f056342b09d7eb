"""An OUT on a store assembled (layout/stored.py): the shards' parts gathered into segments in split order
(write/segments.py), each segment uploaded where its tokens are (here, or by runner/copies.py on Ray), a shard's
checkpoint written once all its parts are in committed segments; at the end finalize.py composes each split file
on the server from its segments.

A rerun lists OUT's prefix once: the done checkpoints (those shards are not tokenized again), the committed segments
(read back, from index objects: the parts in them are not uploaded again), the segments never committed (removed)
and the multipart uploads a killed attempt left open (aborted). A shard done but not checkpointed (a part of it not yet
in a committed segment when the run stopped) is tokenized again; its parts already in a segment are passed over.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.layout.checkpoints import Checkpoint, PartCounts, placed_file
from tokpipe.layout.files import RECORD, ShardFiles, split_file_stem
from tokpipe.layout.records import IDX_DTYPE
from tokpipe.layout.run import WriteSpec, output_splits, sources
from tokpipe.layout.stored import Entry, Segment, StoredOut, part_name
from tokpipe.store import MIN_PART, REQUESTS_AT_ONCE, Exists, Lease, Upload, compose, put_buffers
from tokpipe.write.segments import ClosedSegment, Gatherer, HeldParts, Kept, SegmentIndex, Spilled, part_arrays

# A split's placed checkpoint objects are merged this many at a time: by a run, its own, as it writes them (on Ray a
# commit completes about a shard); at finalize, all of them (its reruns' too) in manifest order, into objects of
# PLACED_MOST: fewer cost its readers under a second of GETs (16 at once, ~2.5 ms of CPU each).
COMPACT_FROM = 64
PLACED_MOST = 4096
# A run without Ray commits the segments it uploads together, this often: their shards' checkpoints an object a split,
# not one a shard with --no-concat (2,000 shards on SeaweedFS: the run 25.0 -> 15.3 s, `status` 14.3 -> 2.2 s).
COMMIT_EVERY = 1.0


@dataclass(frozen=True)
class PartTokens:
    """Where a part's tokens are: the `key` of `buffered` (the arrays by key, or on Ray, the OnNode of its shard)."""

    buffered: object
    key: tuple

    def arrays(self) -> tuple[list, list]:
        """The part's tokens and ends, where they are in this process (or in files of this node's)."""
        return part_arrays(self.buffered[self.key])

    def release(self) -> None:
        """Once the part is uploaded (its segment committed): let go of its tokens, which its shard's parts waiting in a
        segment still gathering held (a rare --group-by group's held every shard's: 209 M tokens without Ray, the
        driver's peak RSS 484-485 MB plain, 666-697 grouped, 490-503 so), and remove its files of this node's."""
        value = self.buffered.pop(self.key)
        if isinstance(value, Spilled):
            value.remove()


@dataclass
class _Cursor:
    """Where a split's walk over its sources stands (layout/run.py `sources`, in manifest order)."""

    sources: Iterator[tuple[Shard, bool]]
    head: tuple[Shard, bool] | None = None
    ended: bool = False

    def advance(self) -> None:
        self.head = next(self.sources, None)


@dataclass
class StoredCheckpoints:
    """The done shards of an OUT on a store and their checkpoints: a shard's own object (one kept for a rerun:
    `keep`), else its entry in an object of those checkpointed together (layout/checkpoints.py's placed: one a
    commit of segments, not a PUT a shard from the driver, nor a GET a shard at finalize)."""

    out: StoredOut
    own: set[str] = field(default_factory=set)  # keys of the done checkpoints of their own
    placed: dict[str, str] = field(default_factory=dict)  # a done checkpoint's key -> the placed object holding it
    unread: list[str] = field(default_factory=list)  # placed objects listed, not yet read (read_placed)
    recent: dict[str, dict[str, dict]] = field(default_factory=dict)  # split -> this run's placed objects not merged
    loaded: dict[str, dict] = field(default_factory=dict)  # placed objects `of` read at finalize, for `compact`

    @classmethod
    def listed(cls, out: StoredOut) -> StoredCheckpoints:
        """The done shards, from a LIST of OUT's checkpoints alone: what a changed manifest may not change, known
        before the run's resume (runner/storage.py `_append`)."""
        found = cls(out)
        for obj in out.bucket.list(out.checkpoints):
            found.note(obj.key)
        with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
            found.read_placed(pool)
        return found

    def note(self, key: str) -> bool:
        """A key of OUT's listing: whether it is a checkpoint's or a placed object's."""
        if not (key.startswith(self.out.checkpoints) and key.endswith(".json")):
            return False
        (self.unread.append if key.split("/")[-2] == "placed" else self.own.add)(key)
        return True

    def read_placed(self, pool: ThreadPoolExecutor) -> None:
        """The placed objects the listing found, read: which shard's checkpoint each holds."""
        read = pool.map(self._load, self.unread)
        for key, keys in zip(self.unread, read):
            folder = self.out.layout.shards / self.out.name(key).split("/")[1]
            self.placed.update((self.out.of_local(ShardFiles(folder, k).checkpoint), key) for k in keys)
        self.unread = []

    def is_done(self, shard: Shard) -> bool:
        key = self.out.checkpoint(shard)
        return key in self.own or key in self.placed

    def read_own(self, shard: Shard) -> Checkpoint:
        """A done shard's checkpoint of its own (one kept for a rerun: `keep`)."""
        return Checkpoint.parse(json.loads(self.out.bucket.get(self.out.checkpoint(shard))[0]))

    def _load(self, key: str) -> dict:
        """A placed object: key -> checkpoint of the shards it holds."""
        return json.loads(self.out.bucket.get(key)[0])

    def write(self, ready: dict[str, dict[str, tuple[Shard, Checkpoint]]]) -> None:
        """Done shards' checkpoints (split -> key -> (shard, checkpoint)), an object a split; a split's last
        COMPACT_FROM objects of this run then merged into one, from memory, and removed (a kill between leaves both,
        holding the same checkpoints). On Ray a commit completes about a shard: a live run's readers GET ~1/64 of the
        objects (2,000 shards --no-concat on Ray: 505 -> 67-69, `status` 2.2-2.6 -> 1.1-1.2 s)."""
        for split, by_key in ready.items():
            recent = self.recent.setdefault(split, {})
            recent[self._put(split, by_key)] = by_key
            if len(recent) >= COMPACT_FROM:
                merged = self._put(split, {key: done for held in recent.values() for key, done in held.items()})
                self.out.bucket.delete_many(sorted(set(recent) - {merged}))
                recent.clear()

    def _put(self, split: str, by_key: dict[str, tuple[Shard, Checkpoint]]) -> str:
        digest, data = placed_file({key: ckpt for key, (_, ckpt) in by_key.items()})
        key = self.out.of_local(self.out.layout.placed(split, digest))
        self.out.bucket.put(key, data)
        self.placed.update((self.out.checkpoint(shard), key) for shard, _ in by_key.values())
        return key

    def of(self, shards: list[Shard]) -> list[Checkpoint]:
        """Done shards' checkpoints, in order (finalize's parts lists), each placed object read once, and kept for
        `compact` (a split's checkpoints, as it holds them); REQUESTS_AT_ONCE GETs at a time."""
        keys = [self.out.checkpoint(shard) for shard in shards]
        objects = {self.placed[key] for key in keys if key not in self.own and key in self.placed}
        unread = list(objects - set(self.loaded))
        own = [shard for shard, key in zip(shards, keys) if key in self.own or key not in self.placed]
        with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
            self.loaded.update(zip(unread, pool.map(self._load, unread)))
            owned = dict(zip((s.relpath for s in own), pool.map(self.read_own, own)))
        loaded = self.loaded
        return [
            owned[shard.relpath] if shard.relpath in owned else Checkpoint.parse(loaded[self.placed[key]][shard.key])
            for shard, key in zip(shards, keys)
        ]

    def compact(self, manifest: Manifest) -> None:
        """At finalize, a split's checkpoints in COMPACT_FROM or more placed objects (a run's last, its reruns') merged
        in manifest order into objects of PLACED_MOST, the others removed once those are up (a kill leaves both, holding
        the same checkpoints; the rerun's finalize merges them again): every later reader GETs a few. The objects `of`
        read are not read again (read twice, 505 objects took finalize from 21.3 to 25.5 s)."""
        for split in dict.fromkeys(shard.split for shard in manifest.shards()):
            held = [found.key for found in self.out.bucket.list(self.out.of_local(self.out.layout.placed(split)) + "/")]
            if len(held) < COMPACT_FROM:
                continue
            raw: dict[str, dict] = {}
            with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
                unread = [key for key in held if key not in self.loaded]
                self.loaded.update(zip(unread, pool.map(self._load, unread)))
                for key in held:
                    raw.update(self.loaded.pop(key))
                shards = [shard for shard in manifest.shards(split) if shard.key in raw]
                starts = range(0, len(shards), PLACED_MOST)
                chunks = [{s.key: (s, raw[s.key]) for s in shards[at : at + PLACED_MOST]} for at in starts]
                made = list(pool.map(self._put, [split] * len(chunks), chunks))
            self.out.bucket.delete_many(sorted(set(held) - set(made)))
            self.recent.pop(split, None)
        self.loaded.clear()


@dataclass
class StoreAssembly:
    """The driver's side of an OUT on a store: which shards are done, what each file's segments are, what comes next."""

    out: StoredOut
    spec: WriteSpec
    manifest: Manifest
    itemsize: int
    lease: Lease | None = None  # the run's hold on OUT (store/lease.py): checked before each checkpoint and meta
    committed: set[tuple] = field(default_factory=set)  # Entry.key of every part in a committed segment
    made: dict[tuple, list[Segment]] = field(default_factory=dict)  # (stem, group) -> its committed segments
    # relpath -> (shard, checkpoint, its parts in no committed segment yet, buffered): checkpointed once none are
    waiting: dict[str, tuple[Shard, Checkpoint, set, object]] = field(default_factory=dict)
    results: dict[str, list] = field(default_factory=dict)  # relpath -> [ckpt, buffered, sources not walked]
    placed_tokens: int = 0  # in segments committed by this run (the run's phases say them)

    def __post_init__(self):
        stems = sorted({split_file_stem(split) for split in output_splits(self.manifest, self.spec.val_fraction)})
        self.cursors = {stem: _Cursor(sources(self.manifest, stem, self.spec.val_fraction)) for stem in stems}
        for cursor in self.cursors.values():
            cursor.advance()
        self.segments = Gatherer(self.out, self.spec.concat, self.itemsize)
        self.checkpoints, self.index = StoredCheckpoints(self.out), SegmentIndex(self.out)
        self.held_parts = HeldParts(self.out, self.spec, f"<u{self.itemsize}", self.checkpoints.of)

    # -- a rerun ---------------------------------------------------------------------------------------

    def resume(self, say: Callable[[str], None]) -> None:
        """One LIST of OUT's prefix: done checkpoints, committed segments (read back: SegmentIndex), what killed
        attempts left uncommitted removed, their open uploads aborted, and the split files of a finalize killed before
        meta.json removed (made again from the segments, which stay until meta.json is written)."""
        bucket, out = self.out.bucket, self.out
        self.abort_uploads()
        for path in (out.layout.meta_json, out.layout.meta_pkl):  # a finished OUT's, appended to: unfinished now
            bucket.delete(out.of_local(path))
        by_segment: dict[str, set[str]] = {}
        removed = []  # in one DeleteObjects, not a DELETE each (~30 ms at a cloud store)
        for found in bucket.list(out.prefix):
            if self.held_parts.note(found.key) or self.checkpoints.note(found.key) or self.index.note(found.key):
                continue
            if found.key.startswith(out.segments):
                base, _, suffix = found.key.rpartition(".")
                by_segment.setdefault(base, set()).add(suffix)
            elif found.key.endswith((".bin", ".idx", ".parts")) and out.name(found.key).split("/")[0] not in RECORD:
                removed.append(found.key)
        uncommitted = [(base, suffixes) for base, suffixes in by_segment.items() if "bin" not in suffixes]
        bucket.delete_many(removed + [f"{base}.{suffix}" for base, suffixes in uncommitted for suffix in suffixes])
        bases = [base for base, suffixes in by_segment.items() if "bin" in suffixes]
        with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
            for segment in self.index.read(bases, pool, say):
                self._made(segment)
            self.checkpoints.read_placed(pool)

    def abort_uploads(self) -> None:
        """The multipart uploads open under OUT's prefix aborted: a killed attempt's, or a Placer's killed inside
        one (its segment was uploaded again by another)."""
        for key, upload in self.out.bucket.uploads(self.out.prefix):
            self.out.bucket.abort(key, upload)

    def _made(self, segment: Segment) -> None:
        self.made.setdefault((segment.stem, segment.group), []).append(segment)
        self.committed.update(e.key for e in segment.entries)

    def is_done(self, shard: Shard) -> bool:
        return self.checkpoints.is_done(shard)

    # -- while shards are tokenized ------------------------------------------------------------------

    def done(self, shard: Shard, ckpt: Checkpoint, buffered) -> None:
        """A shard done: its parts (`buffered`: their arrays by key, or where they wait on Ray) go to the writer as
        their turn comes; its checkpoint once they are all committed."""
        left = {(shard.relpath, *part.key) for part in ckpt.parts} - self.committed
        self.waiting[shard.relpath] = (shard, ckpt, left, buffered)
        held_too = self.spec.val_fraction > 0 and shard.split == "train"  # its held-out part is a source of val
        self.results[shard.relpath] = [ckpt, buffered, 1 + held_too]
        self.checkpoint([shard.relpath])

    def ready(self, excluded: frozenset[str] = frozenset()) -> list[ClosedSegment]:
        """The segments closed as their turn comes: each split's next sources, while their shards are done (or
        excluded, or done before), then the split's end."""
        planned = []
        for stem, cursor in self.cursors.items():
            while cursor.head is not None:
                shard, held = cursor.head
                if shard.relpath in self.results:
                    result = self.results[shard.relpath]
                    planned += self._add(stem, shard, held, result[0].source_parts(held), result[1])
                    result[2] -= 1
                    if not result[2]:  # every split has walked past it
                        del self.results[shard.relpath]
                elif self.is_done(shard):  # its parts in committed segments, or held on the store
                    planned += self._add(stem, shard, held, *self.held_parts.take(shard, held))
                elif shard.relpath not in excluded:
                    break
                cursor.advance()
            if cursor.head is None and not cursor.ended:
                cursor.ended = True
                planned += self.segments.end(stem)
        return planned

    def held(self) -> list:
        """Where the tokens of the parts not yet handed out wait (the buffered of their shards): done shards whose
        turn has not come, and parts in a segment still gathering, which closes later and would be sent to the node
        of a lost shard's tokens (a Placer made there waits ~14 s for Ray's GCS to find the node dead)."""
        gathering = [step.buffered for segment in self.segments.open.values() for step in segment.sources]
        return [buffered for _, buffered, _ in self.results.values()] + gathering

    def unplaced(self) -> list[tuple[Shard, Checkpoint, object]]:
        """Done shards with a part in no committed segment (a shard before them failed, or their segment still
        gathers): (shard, checkpoint, buffered), for the runner to keep."""
        return [(shard, ckpt, buffered) for shard, ckpt, _, buffered in self.waiting.values()]

    def _add(self, stem: str, shard: Shard, held: bool, parts: list[PartCounts], buffered) -> list[ClosedSegment]:
        planned = []
        for part in parts:
            entry = Entry(shard.relpath, held, part.group, part.tokens, part.documents)
            if entry.key not in self.committed:
                planned += self.segments.add(stem, part_name(shard, part.key), entry, PartTokens(buffered, part.key))
        return planned

    def commit(self, segments: list[Segment]) -> None:
        """Segments committed: their parts' shards checkpointed where they have no part left outside one."""
        touched = []
        for segment in segments:
            self._made(segment)
            self.placed_tokens += segment.tokens
            for entry in segment.entries:
                if entry.shard in self.waiting:
                    self.waiting[entry.shard][2].discard(entry.key)
                    touched.append(entry.shard)
        self.index.add(segments, self.lease_check)
        self.checkpoint(touched)

    def lease_check(self) -> None:
        """Raise (UserError) once another run took OUT's lease: this one writes nothing more."""
        if self.lease is not None:
            self.lease.check()

    def checkpoint(self, relpaths: list[str]) -> None:
        """Those of these shards with no part left outside a committed segment (or kept: runner/copies.py) checkpointed
        together: one object a split (layout/checkpoints.py's `placed`), not a PUT a shard from the driver."""
        ready: dict[str, dict[str, tuple[Shard, Checkpoint]]] = {}
        for relpath in dict.fromkeys(relpaths):
            if relpath in self.waiting and not self.waiting[relpath][2]:
                shard, ckpt, _, _ = self.waiting.pop(relpath)
                ready.setdefault(shard.split, {})[shard.key] = (shard, ckpt)
        if ready:
            self.lease_check()
            self.checkpoints.write(ready)

    def place_ready(self, excluded: frozenset[str] = frozenset()) -> None:
        """The segments whose turn has come uploaded from here (a run without Ray), REQUESTS_AT_ONCE at once (2,000
        groups' at 20 ms an answer: 291 s one after another, 28 s so), committed as they are up (COMMIT_EVERY)."""
        ready, done, since = self.ready(excluded), 0, time.monotonic()
        if ready:
            self.lease_check()
        with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
            for n, _ in enumerate(pool.map(lambda planned: upload_closed(self.out, planned), ready), 1):
                if n == len(ready) or time.monotonic() - since >= COMMIT_EVERY:
                    self.commit([planned.segment for planned in ready[done:n]])
                    done, since = n, time.monotonic()


def upload_segment(out: StoredOut, segment: Segment, arrays: list[tuple[list[np.ndarray], list[np.ndarray]]]) -> int:
    """A segment's objects (.json, .idx, then .bin: the commit), `arrays` its parts' tokens and ends in its order.
    Returns the bytes uploaded. A segment another attempt committed stands (the same parts, the same bytes)."""
    tokens, ends, shift = [], [], 0
    for entry, (part_tokens, part_ends) in zip(segment.entries, arrays, strict=True):
        if sum(a.size for a in part_tokens) != entry.tokens:
            raise ValueError(f"{segment.name}: the tokens of {entry.shard}'s part are not the {entry.tokens} counted")
        tokens += part_tokens
        ends += [a + shift for a in part_ends] if shift else part_ends
        shift += entry.tokens
    bucket, key = out.bucket, out.key(segment.name)
    bucket.put(f"{key}.json", segment.record())
    ends = np.concatenate(ends).astype(IDX_DTYPE) if ends else np.zeros(0, IDX_DTYPE)
    bucket.put(f"{key}.idx", ends.tobytes())
    try:
        put_buffers(bucket, f"{key}.bin", tokens)
    except Exists:  # another attempt committed this segment: the same parts, the same bytes
        pass
    return sum(a.nbytes for a in tokens) + ends.nbytes


def upload_closed(out: StoredOut, planned: ClosedSegment) -> int:
    """A segment uploaded by this process (upload_segment), its parts' tokens where its steps say (kept ones' GETs at
    once: a rare group's segment may hold thousands); Spilled files removed once it is up. Returns the bytes sent."""
    if any(isinstance(step.buffered[step.key], Kept) for step in planned.sources):  # (a pool: ~0.25 ms, +15 µs a part)
        with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
            arrays = list(pool.map(PartTokens.arrays, planned.sources))
    else:
        arrays = [step.arrays() for step in planned.sources]
    uploaded = upload_segment(out, planned.segment, arrays)
    for step in planned.sources:
        step.release()
    return uploaded


def keep(out: StoredOut, shard: Shard, ckpt: Checkpoint | None, buffered: dict) -> None:
    """shard.keep on a store: a done shard's buffered parts (in memory, or Spilled) uploaded whole to its own files'
    keys (segments.Kept), each .idx then .bin, then its checkpoint (None: the driver writes it, with others'): the rerun
    takes them into its segments instead of tokenizing the shard again."""
    files = ShardFiles.of(out.work, shard)
    for key, value in buffered.items():
        tokens, ends = part_arrays(value)
        bin_path, idx_path = files.part(key)
        ends = np.concatenate(ends).astype(IDX_DTYPE) if ends else np.zeros(0, IDX_DTYPE)
        out.bucket.put(out.of_local(idx_path), ends.tobytes())
        put_buffers(out.bucket, out.of_local(bin_path), tokens, create=False)
        if isinstance(value, Spilled):
            value.remove()
    if ckpt is not None:
        out.bucket.put(out.checkpoint(shard), ckpt.encoded())


def compose_split(assembly: StoreAssembly, stem: str) -> None:
    """A split's files (its groups', --group-by), each from its segments in the order of their first parts;
    REQUESTS_AT_ONCE files at once (a group's file is a few requests, each a round trip: finalize composed 2,000
    groups' in 59 s one after another on SeaweedFS here, 46 s at once)."""
    files = {group: segments for (of, group), segments in assembly.made.items() if of == stem}
    if assembly.spec.group_by is None:
        files.setdefault(None, [])  # a split of no part (every shard left out): an empty file, as on disk
    walk = sources(assembly.manifest, stem, assembly.spec.val_fraction)
    order = {(shard.relpath, held): n for n, (shard, held) in enumerate(walk)}
    for segments in files.values():
        segments.sort(key=lambda segment: order[segment.entries[0].shard, segment.entries[0].held])
    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:  # (a thread a file at most: made as they are asked)
        list(pool.map(lambda file: _compose(assembly, stem, *file), files.items()))


def _compose(assembly: StoreAssembly, stem: str, group: str | None, segments: list[Segment]) -> None:
    """A split file (or its group's) from its segments, on the server; its .idx from theirs, each shifted."""
    bucket, out, itemsize = assembly.out.bucket, assembly.out, assembly.itemsize
    base = out.of_local(out.layout.split(stem, group))
    compose(bucket, f"{base}.bin", [(out.key(p.name) + ".bin", 0, p.tokens * itemsize) for p in segments])
    upload, chunk, size, shift = None, [], 0, 0
    idx_keys = [out.key(segment.name) + ".idx" for segment in segments]
    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
        for segment, raw in zip(segments, _ahead(pool, lambda key: bucket.get(key)[0], idx_keys)):
            ends = np.frombuffer(raw, dtype=IDX_DTYPE) + shift
            shift += segment.tokens
            chunk.append(ends.tobytes())
            size += ends.nbytes
            if size >= MIN_PART:
                upload = upload or Upload.begin(bucket, f"{base}.idx")
                upload.send(chunk)
                chunk, size = [], 0
    if upload is None:
        bucket.put(f"{base}.idx", b"".join(chunk))
    else:
        if chunk:
            upload.send(chunk)
        upload.finish(create=False)


def _ahead(pool: ThreadPoolExecutor, fn, items: list) -> Iterator:
    """fn(item) for each item, in order, REQUESTS_AT_ONCE * 4 of them asked ahead: a request's latency hidden, never
    every answer held at once (a split's 60,000 segments' .idx: its whole index)."""
    asked: deque = deque()
    for item in items:
        asked.append(pool.submit(fn, item))
        if len(asked) > REQUESTS_AT_ONCE * 4:
            yield asked.popleft().result()
    while asked:
        yield asked.popleft().result()

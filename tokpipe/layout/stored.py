"""OUT on an object store (`--out s3://BUCKET/PREFIX`): the key of each of its objects, and the local folder where
the driver keeps the records it alone writes while the run lasts.

A store has no append, no rename and no write at an offset: an object is written whole, once. So OUT's split files
are not assembled in place as on disk. The shards' parts are uploaded in split order, gathered into segments
(`segments/<stem>/[groups/<group>/]<first part>.bin`, `.idx`, `.json`: at least MIN_PART each but a split file's last,
so that the store can compose them) under keys that are a function of the first part they hold; a shard's
checkpoint is written once every part of it is in a segment; finalize composes each split file from its segments on the
server, and writes <stem>.idx, <stem>.parts, meta.pkl and meta.json (last) as on disk. The names of the finished
files are Layout's, so that a copy of OUT (`aws s3 sync`) is an OUT as a run on disk leaves it.

The driver's records (run.json, manifest.json, logs/) are written into a local folder of its own (`work`) and
uploaded whole: at the start, and the logs as it runs and at the end (a kill -9 loses their last minute, never a token).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.util import Finalize
from pathlib import Path

import orjson

from tokpipe.errors import UserError
from tokpipe.inputs.manifest import Shard
from tokpipe.layout.files import FAILED, RECORD, REFUSED, Layout, PartKey, group_stem, is_out, out_folder, work_folder
from tokpipe.layout.locks import lock_holder
from tokpipe.layout.meta import Meta
from tokpipe.store import (
    MIN_PART,
    REQUESTS_AT_ONCE,
    Bucket,
    Exists,
    Holder,
    Lease,
    Object,
    StoreRefused,
    StoreUnavailable,
    Url,
    compose,
    is_url,
)

SEGMENTS = "segments"
SEGMENT_INDEX = f"{SEGMENTS}/index"  # objects that each hold many committed segments' records (write/segments.py)
SOURCES = "sources"  # a finished OUT's split files as they were, while shards appended to it are assembled
# A segment is closed once it holds this many bytes of tokens (write/segments.py). S3's least part: the most segments
# a split file may be composed of in one go is 10,000 (50 GB of them at this size; past it store.compose goes in two
# steps), and what an uploader holds of a segment of small parts is about this.
SEGMENT_BYTES = MIN_PART


@dataclass(frozen=True)
class StoredOut:
    """OUT at `url`: the keys of its objects (`key`), and its records' local folder (`work`)."""

    url: Url

    @classmethod
    def of(cls, text: str) -> StoredOut:
        url = Url.parse(text)
        return cls(Url(url.bucket, url.key.strip("/")))

    def __str__(self) -> str:
        return str(self.url).rstrip("/")  # a bucket's root: s3://b, as s3://b/p, whose files are s3://b/NAME

    @property
    def bucket(self) -> Bucket:
        return Bucket.of(self.url)

    def check(self) -> None:
        """Refuse, before any work, a store that cannot be used (store.Bucket.check: one line, exit 2)."""
        self.bucket.check(self.prefix)

    @property
    def prefix(self) -> str:
        """Of every key of OUT: `PREFIX/` (a folder: s3://b/out holds out/x, not outx)."""
        return f"{self.url.key}/" if self.url.key else ""

    def enclosing(self) -> str | None:
        """The OUT whose prefix holds this one's, if one does (files.is_out, of a HEAD of each of its marks a level)."""
        levels = self.url.key.split("/")[:-1] if self.url.key else []
        marks = (Layout("").run_json.name, Layout("").manifest.name)
        for n in range(len(levels), -1, -1):
            above = StoredOut(Url(self.url.bucket, "/".join(levels[:n])))
            if is_out(Path(""), {mark for mark in marks if self.bucket.head(above.key(mark)) is not None}):
                return str(above)
        return None

    def key(self, name: str | os.PathLike) -> str:
        """The key of OUT's file `name` (a path relative to OUT, as Layout names it)."""
        return self.prefix + Path(name).as_posix()

    def name(self, key: str) -> str:
        return key.removeprefix(self.prefix)

    def of_local(self, path: Path) -> str:
        """The key of a file of `work` (of `layout`)."""
        return self.key(path.relative_to(self.work))

    @property
    def work(self) -> Path:
        """The local folder that holds this run's records while it runs (files.work_folder)."""
        return work_folder(str(self.url))

    def spill_name(self) -> str:
        """A run's folder for its large parts past --shard-buffer (write/shard.py Spilled), named from each node's
        temporary folder: under `work`, so that the driver's node removes it with the run's records, and this
        run's alone (a node removes its earlier runs' as it first spills)."""
        return str((self.work / "spill" / secrets.token_hex(4)).relative_to(tempfile.gettempdir()))

    @property
    def layout(self) -> Layout:
        """`work` named as OUT: its records' names, and the finished files' names relative to it."""
        return Layout(self.work)

    @property
    def lock(self) -> str:
        return self.of_local(self.layout.lock_file)

    def lease(self) -> Lease:
        """OUT held by one run (store/lease.py): its lock, a lease that ends by itself after a kill -9."""
        return Lease(self.bucket, self.lock)

    def checkpoint(self, shard: Shard) -> str:
        return self.of_local(self.layout.shard(shard).checkpoint)

    @property
    def checkpoints(self) -> str:
        return self.of_local(self.layout.shards) + "/"

    def segment(self, stem: str, group: str | None, first: str) -> str:
        """A segment of a split file (of its group's, --group-by), without its suffix: named by its first part."""
        folder = f"{SEGMENTS}/{stem}" + (f"/groups/{group_stem(group)}" if group is not None else "")
        return self.key(f"{folder}/{first}")

    @property
    def segments(self) -> str:
        return self.key(SEGMENTS) + "/"

    @property
    def segment_index(self) -> str:
        return self.key(SEGMENT_INDEX) + "/"

    def index_object(self, digest: str) -> str:
        return self.key(f"{SEGMENT_INDEX}/{digest}.jsonl")

    @property
    def sources(self) -> str:
        return self.key(SOURCES) + "/"

    def records(self, segments: bool = True) -> Iterator[Object]:
        """Every object of OUT, in key order; without `segments`, those under segments/ passed over by the store."""
        listed = self.bucket.list(self.prefix)
        if segments:
            yield from listed
            return
        for found in listed:
            if found.key >= self.segments:
                break
            yield found
        yield from self.bucket.list(self.prefix, after=self.segments[:-1] + "0")  # "0": the character after "/"

    def copy_to_sources(self, meta: Meta) -> None:
        """A finished OUT's split files (.bin, .idx, each group's, and .parts) copied on the server under `sources`,
        whence an append takes their finished parts (write/segments.py HeldParts); no token through this process."""
        names = [name for entry in meta.splits.values() for f in entry.token_files() for name in (f.bin, f.idx)]
        for name in names + [entry.parts for entry in meta.splits.values()]:
            size = self.bucket.head(self.key(name)).size
            compose(self.bucket, f"{self.sources}{name}", [(self.key(name), 0, size)], create=False)

    def unseen(self, token: str, who: str) -> str | None:
        """What a node cannot see of OUT, with its own credentials (runner/nodes.py): the token the driver put there
        read back, then an object of its own (`who`'s) written (create-only) and removed beside it. None: it sees it."""
        key, mine = self.of_local(self.layout.node_check()), self.of_local(self.layout.node_check(who))
        try:
            found = self.bucket.get(key)
        except (StoreRefused, StoreUnavailable) as e:
            return f"cannot read OUT {self} ({e})"
        if found is None or found[0] != token.encode():
            return f"sees another OUT at {self} than the driver's (without this run's {Path(key).name})"
        try:
            self.bucket.put(mine, token.encode(), create=True)
            self.bucket.delete(mine)
        except (StoreRefused, StoreUnavailable, Exists) as e:
            return f"cannot write under OUT {self} ({e})"
        return None

    def holds_tokens(self) -> bool:
        """Whether OUT holds anything made under its recorded identity: a segment, a checkpoint, a split file."""
        return any(self.name(found.key).split("/")[0] not in RECORD for found in self.bucket.list(self.prefix))

    def upload_logs(self) -> bool:
        """The run's logs (`work`'s), each uploaded whole; whether they were (a store that does not answer: the
        run's error is said, and the logs stay in the local folder)."""
        logs = self.work / "logs"
        try:
            for path in sorted(logs.iterdir()) if logs.is_dir() else []:
                self.bucket.put(self.of_local(path), path.read_bytes())
            gone = [self.of_local(logs / name) for name in (FAILED, REFUSED) if not (logs / name).exists()]
            self.bucket.delete_many(gone)  # verdicts downloaded at the start, removed by this run (as on disk)
        except OSError:
            return False
        return True

    def leftovers(self, concat: bool) -> list[str]:
        """The objects a finished OUT no longer needs, a second copy of tokens its split files hold: the segments
        (but with --no-concat, where they are the split's files), the parts kept for a rerun (write/stored.py
        keep), the split files an append moved (`sources`) and the segments' index objects. Finalize removes them
        after meta.json; a finish killed before it is done leaves them."""
        found = [o.key for o in self.bucket.list(self.checkpoints) if o.key.endswith((".bin", ".idx"))]
        found += [o.key for o in self.bucket.list(self.sources)]
        return found + [o.key for o in self.bucket.list(self.segments if concat else self.segment_index)]


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
    """A segment: its file (stem, group), its name (key without suffix), its parts and counts."""

    stem: str
    group: str | None
    name: str
    entries: list[Entry]
    tokens: int
    documents: int

    def record(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes) -> Segment:
        found = orjson.loads(raw)
        found.pop("seq", None)  # a segment of 0.x's one writer, which numbered them; their order is their parts'
        return cls(**{**found, "entries": [Entry(**e) for e in found["entries"]]})


def part_name(shard: Shard, key: PartKey) -> str:
    """A part's name among its file's: its shard's key, and what it holds out (val.bin's part of a train shard)."""
    return shard.key + (".held-out" if key[0] else "")


class RecordsCopy(type(Path())):
    """A local copy of an OUT on a store's records, which a reader reads as OUT (its meta, parts lists, run.json,
    checkpoints, logs); its token files stay on the store (`stored`), read by ranged GETs (read/maps.py StoreFile).
    A path made from it (`copy / name`) holds no `stored`: a reader asks the copy itself (`stored_of`)."""

    stored: StoredOut
    listed: dict[str, Object] | None = None  # the token objects (.bin, .idx) the copy's LIST found; None: not listed
    folders: dict[str, dict[str, Object] | None]  # a folder's objects by a LIST of its own (None: too many; maps)


def on_store(out: str | os.PathLike) -> bool:
    """Whether OUT, as a command or a caller names it, is on a store (a URL), not in a folder."""
    return is_url(os.fspath(out))


def records_of(out: str) -> Path:
    """Where a run's records are on this machine (its logs: a stalled shard's stack dump): OUT itself, or for an OUT on
    a store its local folder (StoredOut.work)."""
    return work_folder(out) if on_store(out) else Path(out)


def reader_out(out: str | os.PathLike, names: list[str] | None = None, segments: bool = True) -> Path:
    """OUT as a reader (status, verify, inspect, report, export, tokpipe.data) names it: a folder (out_folder), or an
    OUT on a store, whose records are copied into a temporary folder (removed at exit) and whose token files are read
    where they are: every record (one LIST, then a GET each; the token files are looked up in the LIST: maps.seen; a
    finished OUT's segments' records, a GET a shard with --no-concat, are its parts lists' already), or
    the records `names` names (a GET each: the loader's meta and parts list, where a LIST and a GET per shard's
    checkpoint would cost each DataLoader worker seconds). Without `segments`, nothing under segments/ is listed or
    copied (status: a live run holds three objects a 5 MiB segment, 1.5 million for 2.5 TB of tokens)."""
    if getattr(out, "stored", None) is not None:  # a copy already: one reader handing OUT to another
        return out
    if not on_store(out):
        return out_folder(out)
    stored = StoredOut.of(os.fspath(out))
    stored.check()
    copy = RecordsCopy(tempfile.mkdtemp(prefix="tokpipe-read-"))
    copy.stored, copy.folders = stored, {}
    # Removed as the process ends: by multiprocessing's exit, which a DataLoader's workers run before their os._exit
    # (an atexit's never ran there: 8 workers re-made each epoch left 8 copies of OUT's meta in /tmp an epoch).
    Finalize(None, shutil.rmtree, (str(copy), True), exitpriority=0)
    if names is None:
        listed = {stored.name(o.key): o for o in stored.records(segments)}
        if not listed:
            raise no_object(stored)
        names = [name for name in listed if not name.endswith((".bin", ".idx"))]
        if Layout("").meta_json.name in listed:
            names = [name for name in names if not name.startswith(f"{SEGMENTS}/")]
        copy.listed = {name: o for name, o in listed.items() if name.endswith((".bin", ".idx"))}
        indexes = [name for name in names if name.startswith(f"{SEGMENT_INDEX}/")]
        copy_records(copy, indexes)  # then no segment's .json they hold (a GET each: 21 min for 500,000)
        held = {f"{name}.json" for name in indexed_segments(copy)}
        names = [name for name in names if name not in held and name not in indexes]
    copy_records(copy, names)
    return copy


def meta_copy(out: str) -> Path:
    """A reader's copy of an OUT on a store's meta (the loader's), made once per process while its meta.pkl is the
    same (a HEAD of it): a loader of a group of 2,000 made 2,000 copies (734 MB of temporary files) with 4,000 GETs."""
    stored, meta = StoredOut.of(out), [Layout("").meta_json.name, Layout("").meta_pkl.name]
    found = _shared_head(stored, stored.key(meta[1]))
    if found is None:  # not finished, or no OUT: reader_out and finished_meta say which
        return reader_out(out, meta)
    with _COPYING:  # (a Mixture opens its sources at once: one copy of each OUT)
        if (out, found.etag) not in _META_COPIES:
            _META_COPIES[out, found.etag] = reader_out(out, meta)
    return _META_COPIES[out, found.etag]


_META_COPIES: dict[tuple[str, str], Path] = {}  # (OUT's URL, its meta.pkl's ETag) -> the copy of its meta here
_COPYING = threading.Lock()


def _shared_head(stored: StoredOut, key: str) -> Object | None:
    """A HEAD of `key`, whose answer every thread that asks for it while it is in flight shares: a Mixture opens 16
    groups of one OUT at once, each asking for its meta.pkl's (400 groups at 20 ms a request: 805 -> 457 requests,
    opened in 4.3-4.7 -> 3.1-3.8 s, unpickled in 3.6-4.2 -> 2.9-3.3 s, botocore's CPU most of it)."""
    with _ASKING:
        asked = _HEADS.get((stored.url.bucket, key))
        mine = asked is None
        if mine:
            asked = _HEADS[stored.url.bucket, key] = Future()
    if mine:
        try:
            asked.set_result(stored.bucket.head(key))
        except BaseException as e:
            asked.set_exception(e)
        with _ASKING:
            del _HEADS[stored.url.bucket, key]
    return asked.result()


_HEADS: dict[tuple[str, str], Future] = {}  # (a bucket, a key) -> its HEAD in flight
_ASKING = threading.Lock()


def _forked() -> None:
    """In a forked child (a DataLoader worker), where a HEAD its parent had in flight is never answered."""
    global _ASKING
    _HEADS.clear()
    _ASKING = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def copy_records(copy: Path, names: list[str]) -> None:
    """OUT's records `names` copied from the store into a reader's copy (reader_out), REQUESTS_AT_ONCE at a time (a
    checkpoint a shard: 60,000 of them for SlimPajama); one that is not there (removed since a LIST: a live run's
    segment) is left out, and a checkpoint's (merged since into a placed object: write/stored.py) listed again."""
    stored = stored_of(copy)

    def fetch(name: str) -> bool:
        found = stored.bucket.get(stored.key(name))
        if found is not None:
            path = copy / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(found[0])
        return found is not None

    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
        gone = [name for name, found in zip(names, pool.map(fetch, names)) if not found]
        if any(stored.key(name).startswith(stored.checkpoints) for name in gone):
            again = {stored.name(o.key) for o in stored.bucket.list(stored.checkpoints) if o.key.endswith(".json")}
            list(pool.map(fetch, sorted(again - set(names))))


def no_object(stored: StoredOut) -> UserError:
    """A reader's one line for a prefix that holds no object: one within an OUT (a file of it, s3://b/out/meta.json,
    is an object, not a prefix) names that OUT."""
    above = stored.enclosing()
    return UserError(f"{stored} holds no object" + (f"; it is within the tokpipe OUT {above}: give that" if above else
                                                   ": give the --out of a tokpipe run"))  # fmt: skip


def stored_of(out: Path) -> StoredOut | None:
    """The store an OUT's token files are on, for a reader's copy of its records (reader_out); None for a folder."""
    return getattr(out, "stored", None)


def held_by(out: Path) -> str | None:
    """Who holds OUT, for a reader (reader_out): "pid N on HOST" of the run that holds it, or None. A folder's lock is
    flock-ed (layout/locks.py); an OUT on a store's is a lease (store/lease.py), read from the copy: held until it
    ends, or at once when its holder is a process of this machine that is gone."""
    lock = Layout(out).lock_file
    if stored_of(out) is None:
        return lock_holder(lock)
    found = Holder.read(lock.read_bytes()) if lock.is_file() else None
    return str(found) if found is not None and not found.gone(time.time()) else None


def index_record(segments: list[Segment]) -> bytes:
    """An index object's bytes (write/segments.py SegmentIndex): its segments' records, a line each."""
    return b"".join(segment.record() + b"\n" for segment in segments)


def indexed(raw: bytes) -> list[Segment]:
    """The segments' records an index object holds (index_record)."""
    return [Segment.parse(line) for line in raw.splitlines()]


def indexed_segments(copy: Path) -> dict[str, Segment]:
    """The segments' records a reader's copy holds in index objects, by name."""
    return {s.name: s for path in (copy / SEGMENT_INDEX).glob("*.jsonl") for s in indexed(path.read_bytes())}


def shown(out: Path, name: str) -> str:
    """How a reader names a file of OUT: its path, or for an OUT on a store (reader_out) its URL."""
    stored = stored_of(out)
    return str(out / name) if stored is None else str(stored.url / name)


def left_over(out: Path, concat: bool) -> tuple[str, int] | None:
    """For a reader's copy of a finished OUT on a store (reader_out): where the objects a finish killed after meta.json
    left are (StoredOut.leftovers), and how many; None where there are none, or on a disk."""
    stored = stored_of(out)
    if stored is None:
        return None
    n = len(stored.leftovers(concat))
    return (str(stored.url), n) if n else None

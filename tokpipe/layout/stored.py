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
uploaded whole: at the start, and the logs at the end (a kill -9 loses the logs of that attempt, never a token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tokpipe.inputs.manifest import Shard
from tokpipe.layout.files import Layout, PartKey, group_stem, work_folder
from tokpipe.store import Bucket, Url

SEGMENTS = "segments"


@dataclass(frozen=True)
class StoredOut:
    """OUT at `url`: the keys of its objects (`key`), and its records' local folder (`work`)."""

    url: Url

    @classmethod
    def of(cls, text: str) -> StoredOut:
        url = Url.parse(text)
        return cls(Url(url.bucket, url.key.strip("/")))

    def __str__(self) -> str:
        return str(self.url)

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

    @property
    def layout(self) -> Layout:
        """`work` named as OUT: its records' names, and the finished files' names relative to it."""
        return Layout(self.work)

    @property
    def lock(self) -> str:
        return self.key(".lock")

    def checkpoint(self, shard: Shard) -> str:
        return self.of_local(self.layout.shard(shard).checkpoint)

    @property
    def checkpoints(self) -> str:
        return self.key("shards") + "/"

    def segment(self, stem: str, group: str | None, first: str) -> str:
        """A segment of a split file (of its group's, --group-by), without its suffix: named by its first part."""
        folder = f"{SEGMENTS}/{stem}" + (f"/groups/{group_stem(group)}" if group is not None else "")
        return self.key(f"{folder}/{first}")

    @property
    def segments(self) -> str:
        return self.key(SEGMENTS) + "/"


def part_name(shard: Shard, key: PartKey) -> str:
    """A part's name among its file's: its shard's key, and what it holds out (val.bin's part of a train shard)."""
    return shard.key + (".held-out" if key[0] else "")

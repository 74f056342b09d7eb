"""Bytes that survive a crash and can be checked afterwards: fsync, atomic replace, range checksums.

Every stage that writes state others trust (a shard's checkpoint, run.json, the assembled split
files, meta) writes through here, so "durable" means one thing: the data is fsynced before the name
that points at it is swapped in, and the directory entry is fsynced after.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

HASH_CHUNK = 8 << 20  # bytes read per call when hashing a file range


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a reader sees the old file or the whole new one, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data).encode())


def hash_range(fd: int, start: int, end: int, hasher, buffer: bytearray) -> None:
    """Feed bytes [start, end) of an open file to hasher through `buffer`, reused by the caller: a fresh
    8 MiB object per read costs its page faults (hashing ran at 0.7 GB/s, 1.2 with one buffer)."""
    view = memoryview(buffer)
    while start < end:
        got = os.preadv(fd, [view[: min(len(view), end - start)]], start)
        if not got:
            raise RuntimeError(f"file ended at byte {start}, expected {end}")
        hasher.update(view[:got])  # hashlib drops the GIL on large updates
        start += got

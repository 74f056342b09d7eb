"""Who holds OUT and its shards: a run holds OUT/.lock (LayoutWriter.lock), flock-ed, writing who it is; the
worker on a shard holds a byte of its split's shards.lock (ShardFiles.lock). The kernel lets go of both when
their process dies, however it dies."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tokpipe.layout.files import ShardFiles

_lock_files: dict[Path, int] = {}  # each split's shards.lock, opened once by the process (shard_lock)


@contextmanager
def shard_lock(files: ShardFiles) -> Iterator[None]:
    """The shard's lock, held while a worker reads the shard and writes its files: a worker left over from a killed
    run may still be writing it, and is waited out. A byte of one file a split, locked with lockf, not a file a
    shard flock-ed: creating a file a shard was 14% of a worker's time on two-document shards (268 us a file, 1.3
    us a byte, here). Two keys that name one byte (of 2**56) only make one shard's worker wait for the other's.
    The file stays open: closing any descriptor of it drops every lock the process holds on it (POSIX), so it is
    opened once, and again only where another file took its path (OUT made anew)."""
    path, at = files.lock
    fd = _lock_files.get(path)
    try:
        kept = fd is not None and os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        kept = False
    if not kept:
        if fd is not None:
            os.close(fd)
        path.parent.mkdir(parents=True, exist_ok=True)  # a shard's files go beside it
        fd = _lock_files[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, at)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, at)


def shard_locked(files: ShardFiles) -> bool:
    """Whether another process holds the shard's lock (its worker, or one left over from a killed run), tested as
    lock_holder tests OUT/.lock."""
    path, at = files.lock
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, at)
        return False
    except OSError:  # EAGAIN or EACCES: held
        return True
    finally:
        os.close(fd)


def lock_holder(lock: Path) -> str | None:
    """What the process holding a flock wrote in the file ("pid N on HOST" for OUT/.lock), or None if none holds it.

    Tested by taking the lock shared without waiting and dropping it at once: only a run or worker
    starting in that same microsecond could find it taken (a run says so and can be rerun; a worker waits).
    """
    try:
        f = open(lock, "rb")
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().decode("utf-8", "replace").strip() or "a process"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None

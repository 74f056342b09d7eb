"""Bytes that survive a crash and can be checked afterwards: fsync, atomic replace, range checksums.

Every stage that writes state others trust (a shard's checkpoint, run.json, the assembled split
files, meta) writes through here, so "durable" means one thing: the data is fsynced before the name
that points at it is swapped in, and the directory entry is fsynced after.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

HASH_CHUNK = 8 << 20  # bytes read per call when hashing a file range
COPY_CHUNK = 1 << 30  # bytes per copy_file_range call
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), a copy-on-write clone of a whole file


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


def write_at(fd: int, buffers, offset: int) -> int:
    """Write byte-like `buffers` one after another from `offset` of an open file (pwrite may write less
    than asked: it is called until all is written); returns the bytes written."""
    written = 0
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while view:
            n = os.pwrite(fd, view, offset + written)
            view = view[n:]
            written += n
    return written


class ShortRead(RuntimeError):
    """A file ended before the range read from it: at byte `at`, of `end` expected."""

    def __init__(self, at: int, end: int):
        super().__init__(f"file ended at byte {at}, expected {end}")
        self.at, self.end = at, end


def read_range(fd: int, start: int, end: int, buffer: bytearray) -> Iterator[memoryview]:
    """Bytes [start, end) of an open file, a view of `buffer` at a time (each valid until the next), read
    with preadv into that one buffer, which the caller reuses: a fresh 8 MiB object per read costs its
    page faults (hashing ran at 0.7 GB/s, 1.2 with one buffer). ShortRead if the file ends first."""
    view = memoryview(buffer)
    while start < end:
        got = os.preadv(fd, [view[: min(len(view), end - start)]], start)
        if not got:
            raise ShortRead(start, end)
        yield view[:got]
        start += got


def hash_range(fd: int, start: int, end: int, hasher, buffer: bytearray) -> None:
    """Feed bytes [start, end) of an open file to hasher through `buffer` (read_range)."""
    for view in read_range(fd, start, end, buffer):
        hasher.update(view)  # hashlib drops the GIL on large updates


def copy_range(src_path: str | os.PathLike, dst_fd: int, length: int, dst_offset: int) -> str:
    """Write the first `length` bytes of src at `dst_offset` of dst, in the kernel, not through Python
    objects; returns how: "copy_file_range", or "buffer" where the file systems cannot (some refuse
    a copy from another file system)."""
    with open(src_path, "rb") as src:
        done = 0
        try:
            while done < length:
                copied = os.copy_file_range(
                    src.fileno(), dst_fd, min(length - done, COPY_CHUNK), done, dst_offset + done
                )
                if copied == 0:
                    raise RuntimeError(f"{src_path} ended {length - done} bytes before the {length} expected")
                done += copied
            return "copy_file_range"
        except OSError:  # through a buffer, in pieces
            try:
                for view in read_range(src.fileno(), done, length, bytearray(HASH_CHUNK)):
                    os.pwrite(dst_fd, view, dst_offset + done)
                    done += len(view)
            except ShortRead as short:
                raise RuntimeError(f"{src_path} ended {length - short.at} bytes before the {length} expected") from None
            return "buffer"


def reflink(src_fd: int, dst_fd: int) -> bool:
    """Make dst a copy-on-write clone of src (btrfs, XFS with reflink, bcachefs...): no byte copied, no
    block used until either file changes. False where the file system cannot (ext4, another file system)."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError:
        return False


def copy_file(src: Path, dst: Path) -> str:
    """dst as a new file with src's bytes, fsynced, as cheaply as the file systems allow; returns how:
    "reflink", "copy_file_range" or "buffer"."""
    dst.unlink(missing_ok=True)  # a new inode: never write through a name that may be another file's link
    with open(src, "rb") as s, open(dst, "xb") as d:
        how = (
            "reflink"
            if reflink(s.fileno(), d.fileno())
            else copy_range(src, d.fileno(), os.fstat(s.fileno()).st_size, 0)
        )
        os.fsync(d.fileno())
    return how


def own_inode(path: Path) -> None:
    """Give `path` an inode of its own before anything writes into it in place. A finished split file may
    have other names: `tokpipe export --format megatron` hard-links it as Megatron's .bin, and bytes written
    here would change (or a truncate would empty) that export too. Atomic: a crash leaves the old link."""
    if path.stat().st_nlink == 1:
        return
    own = path.with_name(path.name + ".own")
    copy_file(path, own)
    os.replace(own, path)
    fsync_dir(path.parent)

"""Bytes that survive a crash and can be checked afterwards: fsync, atomic replace, range checksums.

Every stage that writes state others trust (a shard's checkpoint, run.json, the assembled split
files, meta) writes through here, so "durable" means one thing: the data is fsynced before the name
that points at it is swapped in, and the directory entry is fsynced after.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HASH_CHUNK = 8 << 20  # bytes read per call when hashing a file range
COPY_CHUNK = 1 << 30  # bytes per copy_file_range call
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), a copy-on-write clone of a whole file
# O_DIRECT wants offsets, lengths and memory aligned to the disk's logical block: 512 or 4096 bytes on every disk
# in use, and 4096 is a multiple of both.
DIRECT_ALIGN = 4096
DIRECT_CHUNK = 8 << 20  # bytes per direct write, copied into an aligned buffer first
# A range shorter than this goes through the page cache: a direct write waits for the disk, and for tiny parts
# (thousands of one-document shards) that wait is all there is.
DIRECT_MIN = 1 << 20


def fsync_path(path: Path) -> None:
    """A folder, or a file, fsynced by its path: fsync is the inode's, whichever descriptor wrote."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a reader sees the old file or the whole new one, never a mix. Any number of
    writers may replace it at once, threads of a process (a Placer's two calls, each writing a shard's checkpoint)
    or processes of a node (its workers, each writing the node's copy of a shipped tokenizer): each writes a file of
    its own, unnamed until it is whole and fsynced (O_TMPFILE), links it under a name of its own, and renames that
    over `path`; the last rename wins, whole. A fixed temporary name, one writer's truncating another's, failed 3
    runs in ~30 into a store. A writer killed before its link leaves nothing; where the file system has no
    O_TMPFILE, the file is named from the start, and a kill leaves it (`<name>.<pid>-<thread>.tmp`)."""
    write_all_atomic({path: data})


def write_all_atomic(files: dict[Path, bytes]) -> None:
    """Each file replaced as write_atomic does, and each folder that holds them fsynced once, after the last rename:
    a Placer's call of N small shards writes their N checkpoints with N + 1 fsyncs, not 2N. A crash before that
    fsync can lose renames, never a file's bytes: each checkpoint stands alone, and one lost is a shard placed
    again, the same bytes, as after a kill between two of them. The files' fsyncs are made at once, on threads
    (FSYNCS_AT_ONCE): a file system's journal commit then covers several. One after another, they held a Placer
    behind the workers on 20,000 two-document shards, and on a loaded machine each was ~0.3-0.7 ms (64 files:
    265-709 us a file, against 180-352 at once)."""
    folders: dict[Path, int] = {}
    items = list(files.items())
    try:
        for start in range(0, len(items), FSYNCS_AT_ONCE):
            unnamed: list[tuple[Path, int, bool]] = []
            try:
                for path, data in items[start : start + FSYNCS_AT_ONCE]:
                    if path.parent not in folders:
                        folders[path.parent] = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
                    unnamed.append((path, *_written(path, data, folders[path.parent])))
                if len(unnamed) > 1:
                    list(_fsyncs().map(os.fsync, [fd for _, fd, _ in unnamed]))
                else:
                    os.fsync(unnamed[0][1])
                for path, fd, named in unnamed:
                    _swap_in(path, fd, named, folders[path.parent])
            finally:
                for _, fd, _ in unnamed:
                    os.close(fd)
        for folder in folders.values():
            os.fsync(folder)
    finally:
        for folder in folders.values():
            os.close(folder)


FSYNCS_AT_ONCE = 16
_pools: dict[int, ThreadPoolExecutor] = {}  # pid -> its threads (a fork has none of its parent's)


def _fsyncs() -> ThreadPoolExecutor:
    if os.getpid() not in _pools:
        _pools[os.getpid()] = ThreadPoolExecutor(FSYNCS_AT_ONCE, thread_name_prefix="tokpipe-fsync")
    return _pools[os.getpid()]


def _tmp(path: Path) -> Path:
    """A name of this writer's own (process and thread) beside `path`."""
    return path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def _written(path: Path, data: bytes, folder: int) -> tuple[int, bool]:
    """`data` in a new file of the open `folder`, not fsynced: its descriptor, and whether it is named (_tmp) yet."""
    try:
        fd, named = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o666, dir_fd=folder), False
    except OSError:  # EOPNOTSUPP (FUSE, NFS, tmpfs of old kernels), EISDIR (kernels before 3.11)
        fd, named = os.open(_tmp(path).name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666, dir_fd=folder), True
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        if named:
            os.unlink(_tmp(path).name, dir_fd=folder)
        raise
    return fd, named


def _swap_in(path: Path, fd: int, named: bool, folder: int) -> None:
    """The file written (and fsynced) on `fd` renamed over `path`: linked under its _tmp name first if unnamed."""
    tmp = _tmp(path)
    if not named:
        tmp.unlink(missing_ok=True)  # a name a killed writer of this pid and thread left
        # linkat(AT_SYMLINK_FOLLOW), which os.link uses only given a folder's descriptor
        os.link(f"/proc/self/fd/{fd}", tmp.name, dst_dir_fd=folder)
    try:
        os.replace(tmp, path)
    except BaseException:  # refused (`path` a folder, say): the writer's name goes; only a kill leaves it
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data).encode())


def open_direct(path: str | os.PathLike) -> int | None:
    """A second descriptor of `path` for writing past the page cache (O_DIRECT), or None where the file system
    refuses it (tmpfs, some FUSE and network file systems): write_at then writes everything through `fd`."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except (AttributeError, OSError):  # AttributeError: no O_DIRECT on this OS
        return None


_staging = threading.local()  # each thread's aligned buffer for direct writes (a Placer runs two calls at once)


def write_at(fd: int, buffers, offset: int, direct_fd: int | None = None) -> int:
    """Write byte-like `buffers` one after another from `offset` of an open file; returns the bytes written.

    With `direct_fd` (open_direct's, of the same file), the blocks wholly inside the range go to the disk
    directly, through an aligned buffer, and only the partial blocks at either end through `fd` and the page
    cache (a neighbouring part may share them, written at another time). Measured here (2 vCPUs under KVM,
    ext4 on virtio), 1 GiB and its fdatasync: 0.05-0.1 CPU-s direct, copy included, against 0.26-2.46 CPU-s
    through the page cache (2.3-2.5 whenever its pages were memory the VM had not touched yet, as a run's new
    pages are), which the Placer took from the shard workers' cores; and a file written once is never read
    back while the run lasts, so caching it buys nothing. The fdatasync after it is still what makes the
    bytes durable: it flushes the disk's cache for both kinds of write (Linux syncs the file, not the
    descriptor). pwrite may write less than asked: it is called until all is written.
    """
    views = [view for buffer in buffers if (view := memoryview(buffer).cast("B"))]
    end = offset + sum(len(view) for view in views)
    lo, hi = -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN, end // DIRECT_ALIGN * DIRECT_ALIGN
    if direct_fd is None or hi - lo < DIRECT_MIN:
        lo = hi = end  # all of it through the page cache
    staged, at = 0, offset  # bytes in the staging buffer, which hold the range just before `at`
    staging = _staging_buffer() if lo < hi else None
    for view in views:
        while view:
            if lo <= at < hi:
                n = min(len(view), hi - at, DIRECT_CHUNK - staged)
                staging[staged : staged + n] = view[:n]
                staged += n
                if staged == DIRECT_CHUNK or at + n == hi:
                    _pwrite_direct(direct_fd, fd, staging[:staged], at + n - staged)
                    staged = 0
            else:
                n = min(len(view), lo - at) if at < lo else len(view)
                _pwrite(fd, view[:n], at)
            view, at = view[n:], at + n
    return end - offset


def _staging_buffer() -> memoryview:
    if not hasattr(_staging, "buffer"):
        _staging.buffer = memoryview(mmap.mmap(-1, DIRECT_CHUNK))  # page-aligned, as O_DIRECT needs
    return _staging.buffer


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pwrite_direct(direct_fd: int, fd: int, view: memoryview, offset: int) -> None:
    """One aligned range written directly; all of it again through `fd` where the file system takes O_DIRECT's
    open but not its write (EINVAL: a disk whose logical block is larger than DIRECT_ALIGN)."""
    try:
        _pwrite(direct_fd, view, offset)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _pwrite(fd, view, offset)


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


def copy_range(src_path: str | os.PathLike, dst_fd: int, length: int, dst_offset: int, src_offset: int = 0) -> str:
    """Write `length` bytes of src, from `src_offset`, at `dst_offset` of dst, in the kernel, not through
    Python objects; returns how: "copy_file_range", or "buffer" where the file systems cannot (some refuse
    a copy from another file system). Where both offsets lie as far into a block, the first call ends at the
    block's end: copy_file_range clones the aligned rest where the file system shares blocks (btrfs, XFS),
    and clones nothing of a range that starts mid-block."""
    with open(src_path, "rb") as src:
        done = 0
        head = -dst_offset % DIRECT_ALIGN if (src_offset - dst_offset) % DIRECT_ALIGN == 0 else 0
        try:
            while done < length:
                step = min(length - done, head or COPY_CHUNK)
                copied = os.copy_file_range(src.fileno(), dst_fd, step, src_offset + done, dst_offset + done)
                if copied == 0:
                    raise RuntimeError(f"{src_path} ended {length - done} bytes before the {length} expected")
                done, head = done + copied, 0
            return "copy_file_range"
        except OSError:  # through a buffer, in pieces
            try:
                for view in read_range(src.fileno(), src_offset + done, src_offset + length, bytearray(HASH_CHUNK)):
                    _pwrite(dst_fd, view, dst_offset + done)
                    done += len(view)
            except ShortRead as short:
                missing = src_offset + length - short.at
                raise RuntimeError(f"{src_path} ended {missing} bytes before the {length} expected") from None
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
        cloned = reflink(s.fileno(), d.fileno())
        how = "reflink" if cloned else copy_range(src, d.fileno(), os.fstat(s.fileno()).st_size, 0)
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
    fsync_path(path.parent)

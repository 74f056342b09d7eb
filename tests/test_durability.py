"""durability: what "durable" means, once. A file is replaced atomically (a reader sees the old bytes or
all the new ones, and no .tmp is left), the data and then its directory entry fsynced; a file range is
hashed exactly, through one reused buffer, and a file shorter than the range is an error; bytes written at
an offset land exactly there, their whole blocks past the page cache where the file system allows it."""

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tokpipe import durability
from tokpipe.durability import (
    DIRECT_ALIGN,
    DIRECT_CHUNK,
    DIRECT_MIN,
    copy_file,
    hash_range,
    open_direct,
    own_inode,
    write_all_atomic,
    write_at,
    write_atomic,
    write_json_atomic,
)


def test_write_atomic_replaces_the_whole_file_and_fsyncs_data_then_directory(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_bytes(b"old")
    done = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        durability.os, "fsync", lambda fd: done.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd)
    )
    monkeypatch.setattr(durability.os, "replace", lambda a, b: done.append("replace") or real_replace(a, b))
    write_atomic(path, b"new bytes")
    assert path.read_bytes() == b"new bytes" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    # The data (a file of its own, unnamed while written), the rename, then the folder.
    assert done[1:] == ["replace", str(tmp_path)] and done[0].startswith(f"{tmp_path}/")


def test_write_all_atomic_fsyncs_each_file_then_each_folder_once_after_the_last_rename(tmp_path, monkeypatch):
    # A Placer's call of many small shards: their checkpoints in two folders, N + 2 fsyncs rather than 2N.
    files = {tmp_path / folder / f"{n}.json": f"{folder} {n}".encode() for folder in ("a", "b") for n in range(3)}
    for path in files:
        path.parent.mkdir(exist_ok=True)
    (tmp_path / "a" / "0.json").write_bytes(b"old")
    done = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        durability.os, "fsync", lambda fd: done.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd)
    )
    monkeypatch.setattr(durability.os, "replace", lambda a, b: done.append("replace") or real_replace(a, b))
    write_all_atomic(files)
    assert {path: path.read_bytes() for path in files} == files
    # Each file's data (a file of its own in its folder, unnamed while written) fsynced, all at once, before any
    # rename; then the renames; the folders once each, after every rename.
    assert len(done) == 14 and done[6:12] == ["replace"] * 6, done
    assert sorted(data.rsplit("/", 1)[0] for data in done[:6]) == [f"{tmp_path}/{folder}" for folder in "aaabbb"]
    assert done[-2:] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_write_all_atomic_holds_at_most_fsyncs_at_once_files_open(tmp_path, monkeypatch):
    monkeypatch.setattr(durability, "FSYNCS_AT_ONCE", 4)
    files = {tmp_path / f"{n}.json": b"%d" % n for n in range(10)}
    opened, real_open = [], os.open
    monkeypatch.setattr(
        durability.os, "open", lambda *a, **k: opened.append(len(os.listdir("/proc/self/fd"))) or real_open(*a, **k)
    )
    before = len(os.listdir("/proc/self/fd"))
    write_all_atomic(files)
    assert {path: path.read_bytes() for path in files} == files
    assert len(os.listdir("/proc/self/fd")) == before  # every descriptor closed
    assert max(opened) - before <= 4 + 1  # a batch's files and their folder's


@pytest.mark.parametrize("o_tmpfile", [True, False])
def test_a_write_or_rename_that_fails_leaves_the_old_file_and_no_other(tmp_path, monkeypatch, o_tmpfile):
    path = tmp_path / "meta.json"
    write_json_atomic(path, {"v": 1})
    if not o_tmpfile:  # a file system without it (FUSE, NFS): the file is named from its start
        opened = os.open

        def without_o_tmpfile(name, flags, *args, **kwargs):
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            return opened(name, flags, *args, **kwargs)

        monkeypatch.setattr(durability.os, "open", without_o_tmpfile)

    def interrupted(*_):
        raise KeyboardInterrupt

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    for call, error, failure in (("replace", KeyboardInterrupt, interrupted), ("write", OSError, full)):
        with monkeypatch.context() as patched:
            patched.setattr(durability.os, call, failure)
            with pytest.raises(error):
                write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    # `path` a folder (`tokpipe report -o /tmp` left a 374 KB /tmp.<pid>-<thread>.tmp in / once).
    with pytest.raises(IsADirectoryError):
        write_json_atomic(tmp_path, {"v": 2})
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(tmp_path.name)) == [tmp_path.name]
    write_json_atomic(path, {"v": 3})
    assert json.loads(path.read_text()) == {"v": 3} and [p.name for p in tmp_path.iterdir()] == ["meta.json"]


RACE = """
import sys
from pathlib import Path
from tokpipe.durability import write_atomic
path, me = Path(sys.argv[1]), sys.argv[2]
for n in range(40):
    write_atomic(path, f"{me}:{n}:".encode() * 20_000)
"""


def test_processes_and_threads_that_replace_one_file_at_once_each_replace_it_whole(tmp_path):
    # A node's workers each writing its copy of a shipped tokenizer, and a Placer's two calls each writing a
    # checkpoint: 6 processes and 2 threads replace one file 40 times each, while a reader reads it. Each rename
    # finds its own file (a shared .tmp name failed here: FileNotFoundError), every read is one writer's whole.
    path = tmp_path / "tokenizer.json"
    write_atomic(path, b"first")
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(path), f"p{k}"]) for k in range(6)]
    reads, stop = [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            reads.append(path.read_bytes())

    reader = threading.Thread(target=read)
    reader.start()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda t: [write_atomic(path, f"t{t}:{n}:".encode() * 20_000) for n in range(40)], (0, 1)))
    assert [proc.wait() for proc in procs] == [0] * 6
    stop.set()
    reader.join()
    for data in [*reads, path.read_bytes()]:
        assert data == b"first" or data == data[: data.index(b":", data.index(b":") + 1) + 1] * 20_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]


@pytest.mark.parametrize("start, end, buffer", [(0, 0, 8), (0, 100_000, 4096), (123, 99_999, 1000), (5, 6, 1)])
def test_hash_range_is_the_sha256_of_exactly_those_bytes(tmp_path, start, end, buffer):
    data = os.urandom(100_000)
    (tmp_path / "f").write_bytes(data)
    hasher = hashlib.sha256()
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        hash_range(fd, start, end, hasher, bytearray(buffer))
        assert hasher.hexdigest() == hashlib.sha256(data[start:end]).hexdigest()
        with pytest.raises(RuntimeError, match="file ended at byte 100000, expected 100001"):
            hash_range(fd, 99_000, 100_001, hashlib.sha256(), bytearray(buffer))
    finally:
        os.close(fd)


def test_own_inode_parts_a_file_from_its_other_names_before_it_is_written(tmp_path):
    path, other = tmp_path / "train.bin.tmp", tmp_path / "export.bin"
    path.write_bytes(b"tokens" * 1000)
    os.link(path, other)
    own_inode(path)
    assert os.stat(path).st_ino != os.stat(other).st_ino and os.stat(other).st_nlink == 1
    with open(path, "r+b") as f:
        f.truncate(3)
    assert other.read_bytes() == b"tokens" * 1000 and path.read_bytes() == b"tok"
    alone = os.stat(path).st_ino
    own_inode(path)  # one name already: nothing copied
    assert os.stat(path).st_ino == alone and not list(tmp_path.glob("*.own"))


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_file_copies_every_byte_in_the_kernel_or_through_a_buffer(tmp_path, monkeypatch, kernel):
    if not kernel:

        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(durability, "reflink", lambda src_fd, dst_fd: False)
    src = tmp_path / "src"
    src.write_bytes(os.urandom(3 * durability.HASH_CHUNK + 5))
    (tmp_path / "dst").write_bytes(b"stale")
    assert copy_file(src, tmp_path / "dst") == ("copy_file_range" if kernel else "buffer")
    assert (tmp_path / "dst").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("src_offset, dst_offset", [(12_345, 12_345 + 3 * DIRECT_ALIGN), (12_345, 1_000), (0, 0)])
def test_copy_range_writes_a_range_from_an_offset_in_the_kernel_or_through_a_buffer(
    tmp_path, monkeypatch, kernel, src_offset, dst_offset
):
    """Bytes [src_offset, +length) of src at dst_offset of dst, nothing else of dst changed: with both offsets as
    far into a block (the first pair), the first call ends at the block's end, where a cloning file system shares
    the rest."""
    if not kernel:

        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    src, dst = tmp_path / "src", tmp_path / "dst"
    data, before = os.urandom(src_offset + 2 * durability.HASH_CHUNK + 99), os.urandom(dst_offset + 50_000)
    src.write_bytes(data)
    dst.write_bytes(before)
    length = 2 * durability.HASH_CHUNK + 7
    with open(dst, "r+b") as f:
        how = durability.copy_range(src, f.fileno(), length, dst_offset, src_offset)
    assert how == ("copy_file_range" if kernel else "buffer")
    assert dst.read_bytes() == before[:dst_offset] + data[src_offset : src_offset + length]
    with open(dst, "r+b") as f, pytest.raises(RuntimeError, match=r"ended 8 bytes before the \d+ expected"):
        durability.copy_range(src, f.fileno(), len(data) - src_offset + 8, dst_offset, src_offset)


def _pieces(seed: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**32, n, dtype=np.uint32) for n in sizes]


# (where the range starts, its pieces' lengths in uint32): unaligned at both ends, aligned at both, one piece
# across many chunks, pieces ending inside a block, too short for a direct write, and nothing at all.
RANGES = [
    (4 * 1_234_567, [300_000, 1, 1_000_000, 77_777, 4_000_000]),
    (DIRECT_ALIGN * 1_000, [DIRECT_ALIGN * 300]),
    (DIRECT_ALIGN * 7 + 12, [5_000_000]),
    (8, [DIRECT_MIN // 4 - 1]),
    (4 * 99, []),
]


@pytest.mark.parametrize("offset, sizes", RANGES)
def test_write_at_sends_whole_blocks_to_the_direct_descriptor_and_the_ends_through_the_page_cache(
    tmp_path, monkeypatch, offset, sizes
):
    path = tmp_path / "train.bin.tmp"
    path.write_bytes(b"\xee" * (offset + 2 * DIRECT_ALIGN))  # bytes before and after the range stay
    pieces = _pieces(offset, sizes)
    data = b"".join(p.tobytes() for p in pieces)
    calls, real_pwrite = [], os.pwrite
    monkeypatch.setattr(
        durability.os, "pwrite", lambda fd, b, at: calls.append((fd, at, len(b))) or real_pwrite(fd, b, at)
    )
    # A plain descriptor stands in for the direct one, so that what goes where is checked on any file system.
    with open(path, "r+b") as f, open(path, "r+b") as direct:
        assert write_at(f.fileno(), pieces, offset, direct.fileno()) == len(data)
        cached_fd, direct_fd = f.fileno(), direct.fileno()
    expected = b"\xee" * offset + data + b"\xee" * max(0, 2 * DIRECT_ALIGN - len(data))
    assert path.read_bytes() == expected
    end = offset + len(data)
    lo, hi = -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN, end // DIRECT_ALIGN * DIRECT_ALIGN
    direct_writes = [(at, n) for fd, at, n in calls if fd == direct_fd]
    if hi - lo < DIRECT_MIN:
        assert direct_writes == []
        return
    assert all(at % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 and n <= DIRECT_CHUNK for at, n in direct_writes)
    assert [at for at, _ in direct_writes] == list(range(lo, hi, DIRECT_CHUNK))
    assert sum(n for _, n in direct_writes) == hi - lo
    through_cache = sorted((at, n) for fd, at, n in calls if fd == cached_fd)
    covered = sum(n for _, n in through_cache)
    assert covered == (lo - offset) + (end - hi) and all(at + n <= lo or at >= hi for at, n in through_cache)


def test_write_at_on_this_file_system_with_o_direct_lands_every_byte(tmp_path):
    path = tmp_path / "train.bin.tmp"
    path.write_bytes(b"")
    direct = open_direct(path)
    if direct is None:
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    expected = bytearray()
    try:
        with open(path, "r+b") as f:
            for k, (offset, sizes) in enumerate(RANGES * 2):  # the second round rewrites what is cached and on disk
                pieces = _pieces(k, sizes)
                data = b"".join(p.tobytes() for p in pieces)
                write_at(f.fileno(), pieces, offset, direct)
                expected.extend(bytes(max(0, offset + len(data) - len(expected))))  # a hole reads as zeros
                expected[offset : offset + len(data)] = data
                os.fdatasync(f.fileno())
    finally:
        os.close(direct)
    assert path.read_bytes() == bytes(expected)


def test_a_direct_write_the_file_system_refuses_goes_through_the_page_cache(tmp_path, monkeypatch):
    path = tmp_path / "train.bin.tmp"
    path.write_bytes(b"")
    pieces = _pieces(3, [3_000_000])
    real_pwrite = os.pwrite
    with open(path, "r+b") as f, open(path, "r+b") as direct:

        def refuse_direct(fd, b, at):
            if fd == direct.fileno():
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, b, at)

        monkeypatch.setattr(durability.os, "pwrite", refuse_direct)
        write_at(f.fileno(), pieces, 4 * 5, direct.fileno())
    assert path.read_bytes() == bytes(20) + pieces[0].tobytes()

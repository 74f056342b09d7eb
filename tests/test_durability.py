"""durability: what "durable" means, once. A file is replaced atomically (a reader sees the old bytes or
all the new ones, and no .tmp is left), the data and then its directory entry fsynced; a file range is
hashed exactly, through one reused buffer, and a file shorter than the range is an error."""

import hashlib
import json
import os

import pytest

from tokpipe import durability
from tokpipe.durability import copy_file, hash_range, own_inode, write_atomic, write_json_atomic


def test_write_atomic_replaces_the_whole_file_and_fsyncs_data_then_directory(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_bytes(b"old")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        durability.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd)
    )
    write_atomic(path, b"new bytes")
    assert path.read_bytes() == b"new bytes" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert synced == [str(tmp_path / "state.json.tmp"), str(tmp_path)]  # the data, then the rename


def test_a_crash_before_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "meta.json"
    write_json_atomic(path, {"v": 1})

    def crash(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(durability.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}  # the next write replaces the stray .tmp
    monkeypatch.undo()
    write_json_atomic(path, {"v": 3})
    assert json.loads(path.read_text()) == {"v": 3} and not (tmp_path / "meta.json.tmp").exists()


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

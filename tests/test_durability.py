"""durability: what "durable" means, once. A file is replaced atomically (a reader sees the old bytes or
all the new ones, and no .tmp is left), the data and then its directory entry fsynced; a file range is
hashed exactly, through one reused buffer, and a file shorter than the range is an error."""

import hashlib
import json
import os

import pytest

from tokpipe import durability
from tokpipe.durability import hash_range, write_atomic, write_json_atomic


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

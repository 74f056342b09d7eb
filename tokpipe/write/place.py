"""A split file's parts written at their offsets: from the memory a shard kept them in, or copied from its own
files; and, after a crash, whether a part found there unlisted is the part its worker made.

Plain Python: the runner calls `place` in a Placer actor on the node whose object store holds the tokens (on
a cluster every node writes: OUT is on storage they all see), in the driver for what it tokenized itself, and
finalize for what is left. assembly.py decides what goes where; this module only writes and checks.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from tokpipe.durability import HASH_CHUNK, copy_range, hash_range, open_direct, write_at
from tokpipe.layout.checkpoints import Checkpoint, write_placed
from tokpipe.layout.files import Layout
from tokpipe.layout.records import IDX_DTYPE, Part


def place(out: str | os.PathLike, parts: list[Part], itemsize: int) -> list[dict]:
    """Write parts of one split at their offsets, fsync, and return their records (checksums filled in).
    A part is copied from its shard's own files, or from where it was in the split file before shards were added
    before it (`moved_from`), or written from the memory it waited in (`buffered`);
    the checkpoints such parts carry are written after the fsync, when the disk covers them. Idempotent: a
    part written twice is the same bytes.
    """
    records = [dict(part.record) for part in parts]
    files: dict[tuple[str, str | None], list[tuple[Part, dict]]] = {}  # (stem, group) -> its parts, with their records
    for part, record in zip(parts, records):
        if part.bin or part.buffered is not None:  # else a shard's accounting line (--group-by): no tokens of its own
            files.setdefault((part.stem, part.group), []).append((part, record))
    # One file at a time, each fsynced once: --group-by's groups held open together (3 descriptors each) ran past a
    # login shell's limit of 1,024 descriptors at 990 groups (EMFILE).
    for (stem, group), its_parts in files.items():
        _write(Layout(out).assembly(stem, group)[:2], its_parts, itemsize)
    placed: dict[str, dict[str, Checkpoint]] = {}
    for split, key, ckpt in (part.checkpoint for part in parts if part.checkpoint):
        placed.setdefault(split, {})[key] = ckpt
    if placed:
        write_placed(Layout(out), placed)
    return records


def _write(paths: tuple[Path, Path], parts: list[tuple[Part, dict]], itemsize: int) -> None:
    """Parts of one split file (a group's) written at their offsets and fsynced, their records' checksums filled in."""
    bin_tmp, idx_tmp = paths
    with open(bin_tmp, "r+b") as bin_f, open(idx_tmp, "r+b") as idx_f:
        direct = open_direct(bin_tmp)
        try:
            for part, record in parts:
                _write_part(bin_f.fileno(), idx_f.fileno(), direct, part, record, itemsize)
            os.fdatasync(bin_f.fileno())  # the file's, whichever descriptor wrote: the direct writes too
            os.fdatasync(idx_f.fileno())
        finally:
            if direct is not None:
                os.close(direct)


def _write_part(bin_fd: int, idx_fd: int, direct: int | None, part: Part, record: dict, itemsize: int) -> None:
    # Where its bytes are in `part.bin`: a shard's own files from their start, a moved part where it was.
    token, document = part.moved_from or (0, 0)
    start, length = token * itemsize, record["tokens"] * itemsize
    if part.buffered is not None:
        parts_of_shard, key = part.buffered
        tokens, ends = parts_of_shard[key]
        write_at(bin_fd, tokens, part.token_offset * itemsize, direct)
        relative = np.concatenate(ends) if ends else np.empty(0, IDX_DTYPE)
    else:
        copy_range(part.bin, bin_fd, length, part.token_offset * itemsize, start)
        ends = np.fromfile(part.idx, IDX_DTYPE, record["documents"], offset=document * IDX_DTYPE.itemsize)
        relative = ends - token
    os.pwrite(idx_fd, memoryview(relative + part.token_offset), part.doc_offset * IDX_DTYPE.itemsize)
    if record["sha256"] is None:  # a shard finished by an earlier tokpipe, which hashed only whole files
        bin_hash = hashlib.sha256()
        with open(part.bin, "rb") as src:
            hash_range(src.fileno(), start, start + length, bin_hash, bytearray(HASH_CHUNK))
        record.update(sha256=bin_hash.hexdigest(), idx_sha256=hashlib.sha256(memoryview(relative)).hexdigest())


def is_in_place(bin_f, idx_f, record: dict, tokens: int, documents: int, itemsize: int, buffer: bytearray) -> bool:
    """Whether the split file's open .bin/.idx hold, from `tokens` and `documents` on, the part `record` lists:
    its ranges' sha256 as the worker that encoded it took them (document ends counted from the part's start)."""
    start, end = tokens * itemsize, (tokens + record["tokens"]) * itemsize
    if record["sha256"] is None or os.fstat(bin_f.fileno()).st_size < end:
        return False
    bin_hash = hashlib.sha256()
    hash_range(bin_f.fileno(), start, end, bin_hash, buffer)
    raw = os.pread(idx_f.fileno(), record["documents"] * IDX_DTYPE.itemsize, documents * IDX_DTYPE.itemsize)
    relative = np.frombuffer(raw, IDX_DTYPE) - tokens
    idx_sha256 = hashlib.sha256(memoryview(np.ascontiguousarray(relative))).hexdigest()
    listed = (record["sha256"], record["idx_sha256"])
    return len(relative) == record["documents"] and (bin_hash.hexdigest(), idx_sha256) == listed

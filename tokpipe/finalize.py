"""Finished shards -> OUT/<split>.bin + .idx per split, then meta.pkl, then meta.json (last: it marks a finished run).

Each split file is written under a temporary name, fsynced and renamed, so a killed finalize leaves
either the old file or the complete new one; rerunning it rebuilds the same bytes from the shards.
Token bytes are copied in the kernel (copy_file_range); their sha256, which meta records and
`verify` checks, is computed by a second thread reading each copied range back from the page cache,
so hashing overlaps copying; a third starts the disk writeback of each copied range, so the final
fsync does not wait for the whole file at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tokpipe import __version__
from tokpipe.manifest import Manifest, Shard
from tokpipe.shard import IDX_DTYPE, Checkpoint, ShardFiles, fsync_dir, write_json_atomic
from tokpipe.tokenizer import TokenizerInfo

COPY_CHUNK = 1 << 30
HASH_CHUNK = 8 << 20
SYNC_EVERY = 64 << 20  # bytes copied between two writebacks started early


def split_file_stem(split: str) -> str:
    return "val" if split == "validation" else split


def _copy_range(src_path: Path, dst_fd: int, length: int) -> None:
    """Append the first `length` bytes of src to dst in the kernel, not through Python objects."""
    with open(src_path, "rb") as src:
        remaining = length
        try:
            while remaining:
                copied = os.copy_file_range(src.fileno(), dst_fd, min(remaining, COPY_CHUNK))
                if copied == 0:
                    raise RuntimeError(f"{src_path} ended {remaining} bytes before its checkpoint says it does")
                remaining -= copied
        except OSError:  # file systems without copy_file_range: sendfile stays in the kernel too
            src.seek(length - remaining)
            while remaining:
                copied = os.sendfile(dst_fd, src.fileno(), None, min(remaining, COPY_CHUNK))
                if copied == 0:
                    raise RuntimeError(f"{src_path} ended {remaining} bytes before its checkpoint says it does") from None
                remaining -= copied


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


def _write_split(out: Path, stem: str, shards: Iterable[Shard], itemsize: int, log_skips) -> dict:
    """Write <stem>.bin and <stem>.idx from the split's finished shards, in order; returns the split's meta entry."""
    bin_tmp, idx_tmp = out / f"{stem}.bin.tmp", out / f"{stem}.idx.tmp"
    bin_hash, idx_hash = hashlib.sha256(), hashlib.sha256()
    entry = {"file": f"{stem}.bin", "idx": f"{stem}.idx", "tokens": 0, "documents": 0, "lines": 0}
    skipped, repaired, count = Counter(), Counter(), 0
    with open(bin_tmp, "w+b") as bin_f, open(idx_tmp, "wb") as idx_f, ThreadPoolExecutor(1) as hasher, ThreadPoolExecutor(1) as syncer:
        fd, buffer = bin_f.fileno(), bytearray(HASH_CHUNK)
        hashed: deque = deque()  # ranges being hashed, in order (sha256 is sequential)
        hashed_to = synced_to = 0  # bytes handed to the hasher, and to a writeback
        synced = None

        def follow(copied: int, last: bool = False) -> None:
            # Hash what is copied in ranges of HASH_CHUNK (read back from the page cache while the next
            # shards are copied), and start its writeback every SYNC_EVERY bytes: shards may be tiny.
            nonlocal hashed_to, synced_to, synced
            if copied - hashed_to >= HASH_CHUNK or (last and copied > hashed_to):
                hashed.append(hasher.submit(hash_range, fd, hashed_to, copied, bin_hash, buffer))
                hashed_to = copied
            while hashed and hashed[0].done():
                hashed.popleft().result()
            if copied - synced_to >= SYNC_EVERY and (synced is None or synced.done()):
                if synced is not None:
                    synced.result()  # a writeback error is reported once per open file: never drop one
                synced, synced_to = syncer.submit(os.fdatasync, fd), copied

        for shard in shards:
            files = ShardFiles.of(out, shard)
            ckpt = Checkpoint.load(files.checkpoint)
            if ckpt is None or not ckpt.done:
                raise RuntimeError(f"cannot finalize: shard {shard.relpath} is unfinished")
            base = entry["tokens"]
            _copy_range(files.bin, fd, ckpt.tokens * itemsize)
            ends = np.fromfile(files.idx, dtype=IDX_DTYPE, count=ckpt.documents) + base
            idx_hash.update(memoryview(ends))
            ends.tofile(idx_f)
            entry["tokens"] += ckpt.tokens
            entry["documents"] += ckpt.documents
            entry["lines"] += ckpt.lines
            skipped.update(ckpt.skipped)
            repaired.update(ckpt.repaired)
            count += 1
            log_skips(shard, ckpt)
            follow(entry["tokens"] * itemsize)
        follow(entry["tokens"] * itemsize, last=True)
        for future in [*hashed, *([synced] if synced else [])]:
            future.result()
        for f in (bin_f, idx_f):
            f.flush()
            os.fsync(f.fileno())
    os.replace(bin_tmp, out / f"{stem}.bin")
    os.replace(idx_tmp, out / f"{stem}.idx")
    entry.update(skipped=dict(sorted(skipped.items())), repaired=dict(sorted(repaired.items())), shards=count)
    entry.update(sha256=bin_hash.hexdigest(), idx_sha256=idx_hash.hexdigest())
    return entry


@contextmanager
def _skip_log(out: Path):
    """OUT/logs/skipped.json, written a shard at a time: per shard, the count of each skip reason and
    the first lines skipped. Yields log_skips(shard, checkpoint)."""
    path = out / "logs" / "skipped.json"
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write('{"shards": [')
        entries = 0

        def log_skips(shard: Shard, c: Checkpoint) -> None:
            nonlocal entries
            if c.skipped or c.repaired:
                entry = {"shard": shard.relpath, "lines": c.lines, "documents": c.documents, "skipped": c.skipped, "repaired": c.repaired, "first": c.skip_log}
                f.write(("," if entries else "") + "\n" + json.dumps(entry))
                entries += 1

        yield log_skips
        f.write("\n]}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def finalize(out: str | os.PathLike, manifest: Manifest, info: TokenizerInfo, text_field: str, excluded: dict[str, str] | None = None) -> dict:
    """Concatenate every split's shards in manifest order and write meta; returns the meta dict.

    `excluded` (relpath -> error) are failed shards left out on purpose (`run --skip-failed`); meta
    records them, so a partial output is never mistaken for a whole one.
    """
    out = Path(out)
    (out / "meta.json").unlink(missing_ok=True)  # OUT is unfinished while its split files change
    excluded = excluded or {}
    itemsize = np.dtype(info.dtype).itemsize
    splits = {}
    with _skip_log(out) as log_skips:
        for split in manifest.counts:
            shards = (s for s in manifest.shards(split) if s.relpath not in excluded)
            splits[split] = _write_split(out, split_file_stem(split), shards, itemsize, log_skips)
    fsync_dir(out)
    meta = {
        "dtype": info.dtype,
        "vocab_size": info.vocab_size,
        "eos_token_id": info.eos_id,
        "eos_token": info.eos_token,
        "bos_token_id": info.bos_id,
        "tokenizer": info.id,
        "tokenizer_sha256": info.sha256,
        "tokenizer_path": info.path,
        "text_field": text_field,
        "splits": splits,
        "excluded": dict(sorted(excluded.items())),
        "manifest_sha256": manifest.fingerprint,
        "tokpipe_version": __version__,
    }
    pkl_tmp = out / "meta.pkl.tmp"
    with open(pkl_tmp, "wb") as f:
        pickle.dump(meta, f, protocol=4)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pkl_tmp, out / "meta.pkl")
    write_json_atomic(out / "meta.json", meta)
    return meta


def load_meta_json(out: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(out) / "meta.json").read_text())
    except FileNotFoundError:
        return None

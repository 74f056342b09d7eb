"""Tokenize one shard into OUT/shards/<split>/<key>.{bin,idx}, checkpointing as it goes.

Plain Python, no Ray: the runner wraps `tokenize_shard` in a task. The invariant that makes crashes
harmless: a checkpoint is written (tmp + fsync + rename) only after the .bin/.idx bytes it covers are
fsynced, so on resume every byte the checkpoint covers is on disk, and whatever lies beyond it is
cut off and redone. A shard resumed any number of times ends byte-identical to one never interrupted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokpipe.durability import HASH_CHUNK, hash_range, write_json_atomic
from tokpipe.manifest import Shard
from tokpipe.source import SKIP_LOG_CAP, Batch, read_batches
from tokpipe.tokenizer import drop_encoder, encoder

WORKER_MEMORY = 768 << 20  # default RSS budget of a worker: 128 of them fit a 128 GiB node
BATCH_HEADROOM = 64 << 20  # least room the word cache gets before it is dropped

IDX_DTYPE = np.dtype("<i8")


@dataclass(frozen=True)
class EncodeSpec:
    """What a worker needs to turn text into the run's bytes (the same for every shard of a run)."""

    tokenizer_json: str
    backend: str
    eos_id: int
    vocab_size: int
    dtype: str
    text_field: str = "text"
    batch_bytes: int = 1 << 20  # of input text per encode call: bounds memory, paces progress reports
    checkpoint_interval: float = 30.0
    read_ahead: bool = False  # read the next batch on a second thread: for a task with a core to spare
    memory_limit: int = WORKER_MEMORY  # bytes of RSS; past it the encoder's word cache is dropped (0: never)


@dataclass
class Checkpoint:
    """How far a shard got. Everything here is covered by fsynced .bin/.idx bytes."""

    lines: int = 0  # input lines consumed = documents + sum(skipped)
    offset: int = 0  # decompressed input bytes consumed
    source_pos: int = 0  # bytes of the shard file read (compressed), for progress only
    documents: int = 0
    tokens: int = 0  # EOS included
    skipped: dict[str, int] = field(default_factory=dict)
    repaired: dict[str, int] = field(default_factory=dict)
    skip_log: list[list] = field(default_factory=list)  # first [line, reason] pairs, capped
    done: bool = False
    # Of the shard's .bin and .idx (ends counted from the shard's start), set when done: finalize
    # records them per range and verify checks them, so no pass over the whole output is sequential.
    sha256: str | None = None
    idx_sha256: str | None = None

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None


@dataclass
class ShardResult:
    split: str
    key: str
    checkpoint: Checkpoint
    resumed_tokens: int  # tokens already done by earlier attempts
    redone_tokens: int  # tokens written after the last checkpoint by an interrupted attempt, now redone
    seconds: float
    encoder_resets: int = 0  # times the encoder's cache was dropped to keep the worker under its memory limit


@dataclass(frozen=True)
class ShardFiles:
    bin: Path
    idx: Path
    checkpoint: Path
    lock: Path

    @classmethod
    def of(cls, out: str | os.PathLike, shard: Shard) -> ShardFiles:
        base = Path(out) / "shards" / shard.split / shard.key
        return cls(*(base.with_name(base.name + ext) for ext in (".bin", ".idx", ".json", ".lock")))


def to_dtype(ids: np.ndarray, dtype: str) -> np.ndarray:
    """Cast token ids to the output dtype; an id that does not fit is an error, never a wrap."""
    limit = np.iinfo(dtype).max
    if ids.size and int(ids.max()) > limit:
        raise OverflowError(f"token id {int(ids.max())} does not fit {dtype} (max {limit})")
    return ids.astype(dtype, copy=False)


def with_eos(flat: np.ndarray, lengths: np.ndarray, eos_id: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids with EOS after each, and each document's end (exclusive) counted from `base`."""
    tokens = np.insert(flat, np.cumsum(lengths), eos_id)
    ends = base + np.cumsum(lengths + 1)
    return tokens, ends


def read_ahead(batches: Iterator[Batch]) -> Iterator[Batch]:
    """The same batches, each read on a second thread while the caller encodes the one before.

    zstd and the encoder release the GIL: with a core to spare a shard goes 1.3-1.5x faster. With
    every core busy the thread only adds switching (~10% measured), so the runner asks for it only then.
    """
    with ThreadPoolExecutor(1) as reader:
        upcoming = reader.submit(next, batches, None)
        while (batch := upcoming.result()) is not None:
            upcoming = reader.submit(next, batches, None)
            yield batch


def resident_bytes() -> int:
    """This process's RSS now (Linux); 0 where /proc is missing, which turns the memory limit off."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class MemoryGuard:
    """Keeps a worker process under `limit` bytes of RSS by dropping the encoder's word cache in time.

    gigatoken caches every distinct pretoken it has encoded and never evicts (~85 bytes each): a worker
    that reads hashes, handles and session ids for hours grows until the node kills it. Dropping the
    encoder frees the cache; the next batch reloads it (~0.4 s) and re-misses the words it had cached.
    The ids are the same either way.

    The cache is let grow to a third of the room between the floor (the RSS just after the encoder
    was loaded) and the limit, not to the limit: its hash table doubles when full, and while it
    rehashes the old and the new table are both alive, a spike of up to ~0.85x the cache within one
    batch (measured: RSS 633 -> 905 MiB in one batch, a 1,188 MiB peak). One guard per process, since
    the cache outlives the shard that filled it.
    """

    def __init__(self, limit: int, backend: str, tokenizer_json: str):
        self.limit, self.backend, self.tokenizer_json = limit, backend, tokenizer_json
        self.resets = 0
        self.floor: int | None = None  # RSS with a freshly loaded encoder

    def encoder(self):
        if self.limit and self.floor is not None and resident_bytes() > self.floor + max((self.limit - self.floor) // 3, BATCH_HEADROOM):
            drop_encoder(self.backend, self.tokenizer_json)
            self.resets += 1
            self.floor = None
        enc = encoder(self.backend, self.tokenizer_json)
        if self.floor is None:
            self.floor = resident_bytes()
        return enc


_guards: dict[tuple[int, str, str], MemoryGuard] = {}


def memory_guard(spec: EncodeSpec) -> MemoryGuard:
    key = (spec.memory_limit, spec.backend, spec.tokenizer_json)
    if key not in _guards:
        _guards[key] = MemoryGuard(*key)
    return _guards[key]


def _open_at(path: Path, length: int, hasher) -> tuple[object, int]:
    """Open for appending after `length` bytes, cutting what lies beyond and hashing what is kept;
    returns (file, bytes cut)."""
    f = open(path, "r+b" if path.exists() else "w+b")
    size = os.fstat(f.fileno()).st_size
    if size < length:
        f.close()
        raise RuntimeError(f"{path} holds {size} bytes but its checkpoint covers {length}: the shard's files were altered")
    f.truncate(length)
    f.seek(length)
    hash_range(f.fileno(), 0, length, hasher, bytearray(min(HASH_CHUNK, max(length, 1))))
    return f, size - length


def tokenize_shard(
    shard: Shard,
    out: str | os.PathLike,
    spec: EncodeSpec,
    on_batch: Callable[[int, int, int], None] | None = None,
) -> ShardResult:
    """Tokenize (the rest of) one shard. `on_batch(file_bytes, documents, tokens)` follows progress."""
    started = time.monotonic()
    files = ShardFiles.of(out, shard)
    files.bin.parent.mkdir(parents=True, exist_ok=True)
    with open(files.lock, "a+") as lock:
        # A worker left over from a killed run may still be writing this shard: wait it out.
        fcntl.flock(lock, fcntl.LOCK_EX)
        ckpt = Checkpoint.load(files.checkpoint) or Checkpoint()
        if ckpt.done:
            return ShardResult(shard.split, shard.key, ckpt, ckpt.tokens, 0, time.monotonic() - started)
        itemsize = np.dtype(spec.dtype).itemsize
        resumed = ckpt.tokens
        bin_hash, idx_hash = hashlib.sha256(), hashlib.sha256()
        bin_f, bin_cut = _open_at(files.bin, ckpt.tokens * itemsize, bin_hash)
        idx_f, _ = _open_at(files.idx, ckpt.documents * IDX_DTYPE.itemsize, idx_hash)
        with bin_f, idx_f:
            memory = memory_guard(spec)
            resets_before = memory.resets
            skipped, repaired = Counter(ckpt.skipped), Counter(ckpt.repaired)

            def commit(done: bool = False) -> None:
                for f in (bin_f, idx_f):
                    f.flush()
                    os.fsync(f.fileno())
                ckpt.skipped, ckpt.repaired, ckpt.done = dict(skipped), dict(repaired), done
                if done:
                    ckpt.sha256, ckpt.idx_sha256 = bin_hash.hexdigest(), idx_hash.hexdigest()
                write_json_atomic(files.checkpoint, asdict(ckpt))

            last_commit = time.monotonic()
            batches = read_batches(shard.path, spec.text_field, ckpt.lines, ckpt.offset, spec.batch_bytes)
            for batch in read_ahead(batches) if spec.read_ahead else batches:
                flat, lengths = memory.encoder().encode(batch.texts)
                if flat.size and int(flat.max()) >= spec.vocab_size:
                    raise ValueError(f"{shard.relpath}: the encoder produced id {int(flat.max())} >= vocab_size {spec.vocab_size}")
                tokens, ends = with_eos(flat, lengths, spec.eos_id, ckpt.tokens)
                token_bytes, end_bytes = memoryview(to_dtype(tokens, spec.dtype)), memoryview(ends.astype(IDX_DTYPE))
                bin_f.write(token_bytes)
                idx_f.write(end_bytes)
                bin_hash.update(token_bytes)
                idx_hash.update(end_bytes)
                ckpt.lines += batch.lines
                ckpt.offset = batch.end_offset
                source_read, ckpt.source_pos = batch.source_pos - ckpt.source_pos, batch.source_pos
                ckpt.documents += len(batch.texts)
                ckpt.tokens += len(tokens)
                skipped.update(batch.skipped)
                repaired.update(batch.repaired)
                room = SKIP_LOG_CAP - len(ckpt.skip_log)
                ckpt.skip_log.extend([line, reason] for line, reason in batch.skip_log[:room])
                if on_batch is not None:
                    on_batch(source_read, len(batch.texts), len(tokens))
                if time.monotonic() - last_commit >= spec.checkpoint_interval:
                    commit()
                    last_commit = time.monotonic()
            commit(done=True)
    return ShardResult(shard.split, shard.key, ckpt, resumed, bin_cut // itemsize, time.monotonic() - started, memory.resets - resets_before)

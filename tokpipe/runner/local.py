"""Tokenizing in the driver's own process: while Ray starts, or instead of it when the run ends first
(the shipped example does). What became of each shard, here or on Ray, is kept in a Tally.

Nothing here imports Ray: a run that never needs it never pays for its import (0.7 CPU-s here).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import mmap
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np

from tokpipe.errors import TooManyGroups, Unavailable
from tokpipe.fmt import plural
from tokpipe.inputs.encoders import encoder
from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.runner.progress import Progress, RunLog
from tokpipe.write.assembly import Assembler
from tokpipe.write.shard import EncodeSpec, ShardResult, tokenize_shard

# The driver's done shards placed at most this often, each time all that is ready: a placing fsyncs the split's
# files, the parts list and the folder of the checkpoints, and per shard, on 20,000 two-document shards, that was
# 1.4 s of the driver's wall while Ray started (py-spy), its cores otherwise idle. A kill loses what waits.
PLACE_EVERY = 0.25
# Placings run in a thread of their own while the driver tokenizes on: in the driver's thread, writing and fsyncing
# 1.36 GB of tokens took 3.7 s of its 13.6 (800 MB of text, no Ray, py-spy), the disk's waits its cores' idle time.
# Past this many bytes of tokens waiting for the next placing, the driver waits for the one under way (the disk
# slower than the tokenizing).
PLACE_BACKLOG = 256 << 20
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# A helper's pack: its call's cost to the driver is per pack, and a pack small enough to end soon after the last
# shard is handed out (~0.1 s of a core) and to keep the progress moving.
HELPER_PACK_BYTES = 1 << 20
HELPER_PACK_SHARDS = 64
# Told to stop, a helper ends its shard's batch (1 MiB of text: ~0.8 s with the slowest backend here) or is killed.
STOP_WAIT = 10.0


@dataclass
class Tally:
    """What became of the shards this run worked on."""

    memory_limit: int  # of a worker, for the log
    shard_seconds: float = 0.0  # that shards took in this run, whether done or stopped (ShardResult.seconds)
    failed: dict[str, str] = field(default_factory=dict)  # shard relpath -> last error
    # Shards finished in the driver while Ray started: Ray's tasks pass them over. OUT's listing of checkpoints
    # (layout/checkpoints.py) was taken before they were done, and on 20,000 two-document shards 2,594 went to Ray's
    # workers again, each to find its checkpoint done and be said "resumed".
    here: set[str] = field(default_factory=set)
    resumed: list[ShardResult] = field(default_factory=list)  # shards that went on from a checkpoint
    lacking: list[tuple[str, int, int]] = field(default_factory=list)  # (shard, lines without the text, lines)

    def add(self, shard: Shard, result: ShardResult, log: RunLog) -> None:
        ckpt = result.checkpoint
        self.shard_seconds += result.seconds
        if result.resumed_tokens or result.redone_tokens:
            self.resumed.append(result)
            log(f"shard {shard.relpath}: resumed at {result.resumed_tokens:,} tokens, redid {result.redone_tokens:,}")
        if result.encoder_resets:
            log(
                f"shard {shard.relpath}: encoder cache dropped {plural(result.encoder_resets, 'time')} to stay under "
                f"{self.memory_limit >> 20} MiB"
            )
        if 2 * ckpt.skipped.get("no_text", 0) > ckpt.lines:
            self.lacking.append((shard.relpath, ckpt.skipped["no_text"], ckpt.lines))


def tokenize_while(
    manifest: Manifest,
    out: Path,
    spec: EncodeSpec,
    busy: Callable[[], bool],
    progress: Progress,
    tally: Tally,
    log,
    assembler: Assembler,
    is_done: Callable[[Shard], bool],
    helpers: Helpers | None = None,
) -> int:
    """Tokenize shards in this process, and in the `helpers` processes beside it, while `busy()` (Ray starting, or
    not needed): each shard stops at its next batch once Ray is up, checkpointed, and a worker goes on from there.
    Returns the shards finished; the helpers are closed by then, their cores Ray's workers'.

    Ray's start takes seconds that the driver would otherwise wait through, and with it the machine's cores: a
    corpus of small shards is done before it is up, and a large one has its first shards done on every core. Only
    regular files: a pipe could block the driver, which alone watches for stalls. `out`: where the tokens go, as
    the user names OUT (runner/storage.py), and `is_done` which shards it holds done."""
    here = _Here(busy, progress, tally, log, assembler, spec, helpers, ThreadPoolExecutor(1, "tokpipe-place"))
    shards = (s for s in manifest.shards() if not is_done(s) and not s.may_block())
    try:
        here.tend(shards)
        while busy() and (shard := next(shards, None)) is not None:
            try:
                result = tokenize_shard(shard, out, spec, lambda *read: here.on_batch(shards, read), stop=here.stopping)
            except Exception as e:  # what a task's failure would be: the shard is failed, the others go on (take)
                here.take(shard, e)
                continue
            here.take(shard, (result, [0, 0, 0]))
            here.tend(shards)
        while helpers is not None and helpers.running:
            here.tend(shards, wait=True)
        here.place()
        here.wait_placing()
    finally:
        here.writer.shutdown()  # the placing under way ends first: nothing writes OUT once this returns
        if helpers is not None:
            helpers.close()
    progress.base = here.totals
    return here.done


@dataclass
class _Here:
    """What tokenize_while keeps while the driver (and its helpers) tokenize."""

    busy: Callable[[], bool]
    progress: Progress
    tally: Tally
    log: Callable[[str], None]
    assembler: Assembler
    spec: EncodeSpec
    pool: Helpers | None
    writer: ThreadPoolExecutor  # where the placings run, one at a time, in order
    done: int = 0
    totals: list[int] = field(default_factory=lambda: [0, 0, 0])  # input bytes, documents, tokens read here
    placed_at: float = float("-inf")  # when the done shards' parts were last placed (PLACE_EVERY)
    placing: Future | None = None  # the placing under way
    waiting: list[tuple] = field(default_factory=list)  # (shard, checkpoint, buffered) of the next placing
    backlog: int = 0  # tokens waiting

    def stopping(self) -> bool:
        return not self.busy()

    def take(self, shard: Shard, outcome) -> None:
        """A shard's outcome, here or in a helper ((result, read), or its exception): placed if done, counted
        either way. TooManyGroups stops the run: no shard of it can do better; so does a store that did not
        answer through its retries (Unavailable): every shard would wait them out."""
        if isinstance(outcome, TooManyGroups | Unavailable):
            raise outcome
        if isinstance(outcome, BaseException):
            self.tally.failed[shard.relpath] = describe_failure(outcome)
            self.log(f"shard {shard.relpath} FAILED: {self.tally.failed[shard.relpath]}")
            return
        result, read = outcome
        self.totals[:] = [a + b for a, b in zip(self.totals, read)]
        if not result.checkpoint.done:  # stopped for Ray's workers, which go on from its checkpoint
            self.tally.shard_seconds += result.seconds
            return
        self.done += 1
        self.tally.here.add(shard.relpath)
        self.tally.add(shard, result, self.log)
        self.waiting.append((shard, result.checkpoint, result.buffered))
        self.backlog += result.checkpoint.tokens * self.assembler.itemsize
        if self.progress.projects(self.progress.done_before + self.done):  # before its parts may fill the disk
            self.report()
        due = time.monotonic() - self.placed_at >= PLACE_EVERY and (self.placing is None or self.placing.done())
        if due or self.backlog > PLACE_BACKLOG:
            self.place()

    def place(self) -> None:
        """The shards done since the last placing into the split files, in the writer's thread, as a Ray run's copies
        do: no tail at the end."""
        self.wait_placing()
        waiting, self.waiting, self.backlog = self.waiting, [], 0
        self.placing = self.writer.submit(_place, self.assembler, waiting)
        self.placed_at = time.monotonic()

    def wait_placing(self) -> None:
        """Until the placing under way is done (what it raised, raised here)."""
        if self.placing is not None:
            self.placing.result()

    def tend(self, shards, wait: bool = False) -> None:
        """The helpers' ended shards taken, new ones handed out while Ray is not up (else all told to stop)."""
        if self.pool is None:
            return
        if not self.busy():
            self.pool.halt()
        for shard, outcome in self.pool.ended(wait):
            self.take(shard, outcome)
        # A quarter of a process's share of what is left at most, as Ray's packs (schedule.packs): no helper still
        # on its pack long after the others ended.
        p = self.progress
        limit = min(HELPER_PACK_BYTES, (p.total - p.start_bytes - p.read_this_run) // (4 * (1 + self.pool.room())))
        while self.pool.halted is None and self.pool.has_room() and (pack := _pack(shards, limit)):
            self.pool.submit(pack, self.spec)

    def on_batch(self, shards, read: tuple[int, int, int]) -> None:
        """After each of the driver's batches: its progress, and the helpers tended."""
        self.totals[:] = [a + b for a, b in zip(self.totals, read)]
        self.tend(shards)
        self.report()

    def report(self) -> None:
        running = 1 + (len(self.pool.running) if self.pool else 0)
        self.progress.update(
            *self.totals, done=self.progress.done_before + self.done, running=running, failed=len(self.tally.failed)
        )


def _place(assembler: Assembler, done: list[tuple]) -> None:
    for shard, ckpt, buffered in done:
        assembler.done(shard, ckpt, buffered)
    assembler.place_ready()


def _pack(shards: Iterator[Shard], limit: int) -> list[Shard]:
    """A helper's next shards: consecutive ones until they come to `limit` bytes, at most HELPER_PACK_SHARDS."""
    pack, size = [], 0
    for shard in itertools.islice(shards, HELPER_PACK_SHARDS):
        pack.append(shard)
        size += shard.size
        if size >= limit:
            break
    return pack


class Helpers:
    """Processes beside the driver that tokenize with it (concurrent.futures' pool: Ray is not up to run them),
    started with the run, each loading the encoder the check will likely pick (`warm`) while the driver plans and
    checks: a helper's first shard came 1.6 s after the driver's when started once the check was done. A helper
    takes a pack of shards a call: a call a shard (multiprocessing's Pool, its three threads) cost the driver ~5 ms
    of its CPU a shard, 20,000 two-document shards 103 s. A helper that dies breaks the pool: what it held is left
    for Ray, never waited for (the Pool replaced the process and its call never returned: the run hung). Told to
    stop, each stops its shard at the next batch, checkpointed, and passes over the rest of its pack."""

    def __init__(self, room: Callable[[], int], out: str):
        # spawn: not a fork of the driver, whose threads (Ray's start) a fork would copy mid-step; and each helper a
        # child of the driver's, killed with it (_helper_start). A forkserver's outlived a kill -9 of the driver,
        # waiting on a call queue whose ends they held both of.
        context = multiprocessing.get_context("spawn")
        _quiet_tracker()
        self.stop = context.Event()
        self.pool = ProcessPoolExecutor(room(), context, initializer=_helper_start, initargs=(self.stop, os.getpid()))
        self.room, self.out = room, out
        self.running: dict[Future, int] = {}  # a pack's call -> the memory file its tokens come back in
        self.broken = False  # a helper died: the pool takes no more
        self.halted: float | None = None  # when the helpers were told to stop (closed: no pool, no stop)
        self.pool.submit(os.getpid)  # every process started now (spawn: all at the first call)

    def warm(self, backend: str, tokenizer_json: str) -> None:
        """Each helper loading the encoder of the backend the check will likely pick."""
        try:
            for _ in range(self.room()):
                self.pool.submit(encoder, backend, tokenizer_json)
        except BrokenProcessPool:  # a helper died starting: the driver goes on alone, Ray's workers if it is long
            self.broken = True

    def has_room(self) -> bool:
        """Two packs a helper: its next one queued, not waiting on the driver's placing (~50 ms every PLACE_EVERY
        on 20,000 two-document shards)."""
        return not self.broken and len(self.running) < 2 * self.room()

    def submit(self, pack: list[Shard], spec: EncodeSpec) -> None:
        tokens = os.memfd_create("tokpipe-pack", os.MFD_CLOEXEC)
        path = f"/proc/{os.getpid()}/fd/{tokens}"  # the helper opens the driver's file by its path
        try:
            self.running[self.pool.submit(_helper_pack, pack, self.out, spec, path)] = tokens
        except BrokenProcessPool:  # a helper died warming: the pack is left for Ray, as a running one would be
            self.broken = True
            os.close(tokens)

    def halt(self) -> None:
        """Each helper to stop its shard at its next batch, checkpointed, and pass over the rest of its pack."""
        if self.halted is None:
            self.stop.set()
            self.halted = time.monotonic()

    def ended(self, wait: bool) -> list[tuple[Shard, object]]:
        """(shard, (result, read) or the exception it raised) of each shard of the helpers' packs that ended;
        with `wait`, after waiting a moment for one. Helpers told to stop STOP_WAIT ago are killed: one stuck in a
        shard leaves it to Ray's workers, which are watched for stalls, not to hold the run."""
        if self.halted is not None and self.running and time.monotonic() - self.halted > STOP_WAIT:
            self._kill()
        if wait and self.running:
            futures.wait(self.running, timeout=0.05, return_when=futures.FIRST_COMPLETED)
        outcomes = []
        for done in [f for f in self.running if f.done()]:
            tokens = self.running.pop(done)
            try:
                outcomes += _parts_read(done.result(), tokens)
            except BrokenProcessPool:  # a helper killed (the OOM killer): its shards go to Ray, from checkpoints
                self.broken = True
            finally:
                os.close(tokens)  # what was mapped stays, until its arrays are placed and gone
        return outcomes

    def __enter__(self) -> Helpers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ended: every pack handed out has come back (or the run is stopping, and they are killed). Again: nothing.
        The pool and its semaphores go now, not at the process's exit, which a run's is not (os._exit, cli.py): a
        run stopped by SIGTERM, the helpers still referenced from the traceback, left multiprocessing's resource
        tracker to say on the terminal that 5 semaphores leaked (2 stops in 4)."""
        if self.pool is None:
            return
        self.halt()
        self._kill()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = self.stop = None
        for tokens in self.running.values():
            os.close(tokens)
        self.running.clear()

    def _kill(self) -> None:
        for process in list((self.pool._processes or {}).values()):  # the executor kills none of its own
            process.kill()
            process.join()


def _quiet_tracker() -> None:
    """multiprocessing's resource tracker (the pool's semaphores are its) started with its stderr on /dev/null: it
    outlives a driver killed by kill -9, and said on the user's terminal that 10 semaphores leaked, which it then
    removes. Its stderr is the process's fd 2 as it is at the tracker's start, so for that moment fd 2 is elsewhere."""
    quiet, terminal = os.open(os.devnull, os.O_WRONLY), os.dup(2)
    os.dup2(quiet, 2)
    try:
        resource_tracker.ensure_running()
    finally:
        os.dup2(terminal, 2)
        os.close(terminal)
        os.close(quiet)


_stop = None  # in a helper: the event that tells it to stop


def _helper_start(stop, driver: int) -> None:
    global _stop
    _stop = stop
    # Killed with the driver: a driver killed (kill -9) leaves no helper writing on into OUT beside its rerun. One
    # killed before this line ran is gone already: the helper was adopted.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != driver:
        os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core: no thread pool inside each


def _helper_pack(shards: list[Shard], out: str, spec: EncodeSpec, tokens: str) -> list[tuple[Shard, object]]:
    """A helper's pack, shard after shard until told to stop: each shard with its outcome, (the result, what it read:
    input bytes, documents, tokens) or the exception it raised. The tokens of its parts in memory go to `tokens`, the
    driver's memory file for the pack, the result saying where (_At): pickled into the pool's pipe they cost the
    helper ~1 s of CPU and the driver's reading thread ~0.9 s on 800 MB of text (py-spy)."""
    outcomes = []
    with open(tokens, "wb") as file:
        for shard in shards:
            if _stop.is_set():
                break  # the pack's rest goes to Ray
            try:
                outcomes.append((shard, _helper_shard(shard, out, spec, file)))
            except Exception as e:  # the shard's failure, told to the driver
                outcomes.append((shard, e))
    return outcomes


def _helper_shard(shard: Shard, out: str, spec: EncodeSpec, file) -> tuple[ShardResult, list[int]]:
    read = [0, 0, 0]

    def on_batch(*counts: int) -> None:
        for i, n in enumerate(counts):
            read[i] += n

    result = tokenize_shard(shard, out, spec, on_batch, stop=_stop.is_set)
    if result.buffered:
        at = {
            key: _written(value, file) if isinstance(value, tuple) else value for key, value in result.buffered.items()
        }
        result = dataclasses.replace(result, buffered=at)
    return result, read


@dataclass(frozen=True)
class _At:
    """Where an array of a helper's is in its pack's memory file."""

    offset: int
    dtype: str
    count: int


def _written(buffered: tuple[list, list], file) -> tuple[list[_At], list[_At]]:
    """A part's tokens and ends (write/segments.py Buffered) written to `file`, and where."""
    at = ([], [])
    for arrays, where in zip(buffered, at):
        for array in arrays:
            where.append(_At(file.tell(), array.dtype.str, len(array)))
            file.write(memoryview(np.ascontiguousarray(array)).cast("B"))
    return at


def _parts_read(outcomes: list[tuple[Shard, object]], tokens: int) -> list[tuple[Shard, object]]:
    """A pack's outcomes with their parts' arrays back, as views of its memory file mapped here (no copy)."""
    size = os.fstat(tokens).st_size
    memory = mmap.mmap(tokens, size, prot=mmap.PROT_READ) if size else b""
    for i, (shard, outcome) in enumerate(outcomes):
        if isinstance(outcome, tuple) and outcome[0].buffered:
            result, read = outcome
            arrays = {
                key: tuple([np.frombuffer(memory, a.dtype, a.count, a.offset) for a in where] for where in value)
                if isinstance(value, tuple)
                else value
                for key, value in result.buffered.items()
            }
            outcomes[i] = (shard, (dataclasses.replace(result, buffered=arrays), read))
    return outcomes


def describe_failure(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"

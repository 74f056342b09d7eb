"""Scheduling on Ray: one task per unfinished shard (or per pack of small ones), two at once per worker;
stalled tasks cancelled and submitted again; finished shards copied into their split files meanwhile.

Ray does the scheduling and the retrying of tasks whose worker or node died (`max_retries`); a retry
resumes the shard from its checkpoint. What Ray cannot see is a task that is alive but stuck: each
worker reports progress to the ProgressBoard actor, and the scheduler cancels a task that reported
nothing for `stall_timeout` seconds (the worker dumps its stacks to OUT/logs first) and submits it again.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokpipe.errors import NodeError, TooManyGroups
from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.options import RunOptions
from tokpipe.out.files import stall_dump
from tokpipe.out.records import Part
from tokpipe.runner.local import Finished, Tally, describe_failure
from tokpipe.runner.progress import Progress, RunLog
from tokpipe.runner.task import Placer, ProgressBoard, Stored, shard_task
from tokpipe.store import StoreUnavailable
from tokpipe.write.assembly import COPY_BATCH_BYTES, Assembler
from tokpipe.write.shard import EncodeSpec, ShardResult

POLL_EVERY = 0.5  # seconds between looks at progress and stalls
# Shard tasks in flight per worker: one running, one queued in Ray, so that a worker that finishes starts its
# next shard at once and the driver can take finished ones in batches.
QUEUED = 2
# Once a task is done, how long the driver lets others finish before it takes them all: its cost is per wake-up
# (a wait over the running tasks, one placing call, one fsync of the parts list), not per shard. Measured
# (2,500 one-document shards, 16 workers on 2 cores): 3.1 ms of the driver's CPU per shard when it woke for
# each one.
GATHER = 0.02
# A task takes consecutive shards while they come to at most this much input (or PACK_SHARDS of them), never
# more than a quarter of a worker's share of what is left (`packs`). Ray's submit is most of the driver's cost
# per task (0.66 of 1.29 ms, py-spy, 2,500 one-document shards, 16 workers on 2 cores), the rest is per shard;
# at ~60 MB/s a core 32 MiB is half a second of a worker's tail.
PACK_BYTES = 32 << 20
PACK_SHARDS = 64


def _get(ref):
    """ray.get; a node's NodeError, a shard's TooManyGroups (--group-by), or a store that did not answer through
    its retries (StoreUnavailable), raised as itself: its one line, not Ray's traceback around it. Each stops the
    run: no other shard or node can do better."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (NodeError, TooManyGroups, StoreUnavailable)):
            raise e.cause from None
        raise


class Copies:
    """The writes that assemble the split files while shards still tokenize; what goes where is the Assembler's.

    A Placer actor on each node that holds tokens (task.Placer) takes no CPU of the shards': a shard's
    buffered parts are written on the node whose object store holds them (never through the driver, whose
    own CPU stays per shard, not per byte), the parts copied from shards' own files by the placers in turn
    (OUT is on storage all of them see). Parts wait in a queue while every slot is busy, so the next call
    takes all of them: with thousands of tiny shards, one call and one fsync cover many.
    """

    def __init__(self, assembler: Assembler, out: Path, itemsize: int, nodes: int, check: ray.ObjectRef | None):
        self.assembler, self.out, self.itemsize, self.check = assembler, out, itemsize, check
        self.slots = 2 * nodes
        self.here = ray.get_runtime_context().get_node_id()
        self.placers: dict[str, ray.actor.ActorHandle] = {}  # node -> its Placer, made when first needed
        self.turn = 0  # which placer copies the next parts from files
        self.queue: deque[Part] = deque()
        self.running: dict = {}  # ObjectRef -> its parts
        self.bytes_by_node: Counter = Counter()

    def _placer(self, node: str | None) -> ray.actor.ActorHandle:
        if node is None:  # tokens in files: any node's placer, in turn
            placers = list(self.placers.values()) or [self._placer(self.here)]
            self.turn += 1
            return placers[self.turn % len(placers)]
        if node not in self.placers:
            where = NodeAffinitySchedulingStrategy(node, soft=True)
            self.placers[node] = Placer.options(scheduling_strategy=where).remote()
        return self.placers[node]

    def feed(self, excluded: frozenset[str] = frozenset()) -> None:
        if not self.assembler.concat:  # --no-concat: nothing to copy, a part is listed as it is
            parts = self.assembler.ready(excluded)
            self.assembler.placed(parts, [p.record for p in parts])
            return
        self.queue.extend(self.assembler.ready(excluded))
        while self.queue and len(self.running) < self.slots:
            batch, size, (stem, node) = [], 0, _where(self.queue[0])
            while self.queue and _where(self.queue[0]) == (stem, node) and size < COPY_BATCH_BYTES:
                batch.append(self.queue.popleft())
                size += batch[-1].record["tokens"] * self.itemsize
            self.running[self._placer(node).place.remote(str(self.out), batch, self.itemsize, self.check)] = batch

    def collect(self, block: bool = False) -> None:
        """List the copies that are done (with `block`, after waiting for one), then start the next."""
        if not self.running:
            return
        done, _ = ray.wait(
            list(self.running), num_returns=1 if block else len(self.running), timeout=None if block else 0
        )
        for handle in done:
            parts = self.running.pop(handle)
            node, records = _get(handle)
            self.assembler.placed(parts, records)
            self.bytes_by_node[node] += sum(r["tokens"] for r in records) * self.itemsize
        self.feed()

    def drain(self, excluded: frozenset[str] = frozenset()) -> None:
        """Copy everything whose place is known (with `excluded` left out) and wait for it."""
        self.feed(excluded)
        while self.running:
            self.collect(block=True)


def packs(shards: Iterator[Shard], left: int, workers: int) -> Iterator[list[Shard]]:
    """The shards in order, one task's at a time: consecutive ones while they come to at most PACK_BYTES,
    PACK_SHARDS, and a quarter of a worker's share of what is `left` (a larger shard alone). Lazy: each is taken
    when the task before it is made.

    What is left shrinks as packs are made, and so do they (guided self-scheduling): the last tasks are single
    shards, so no worker finishes a pack long after the others went idle. With a quarter of the whole run's
    share, 2 workers on 64 shards of 5.6 MB took packs of 5 to the end, and one waited up to a pack (~1.6 s) for
    the other."""
    pack, size, limit = [], 0, min(PACK_BYTES, left // (4 * workers))
    for shard in shards:
        if pack and (size + shard.size > limit or len(pack) == PACK_SHARDS):
            yield pack
            left -= size
            pack, size, limit = [], 0, min(PACK_BYTES, left // (4 * workers))
        pack.append(shard)
        size += shard.size
    if pack:
        yield pack


def _name(shards: list[Shard]) -> str:
    """How the log names a task's shards: `shard X`, or `a pack of N shards (X ... Y)`."""
    if len(shards) == 1:
        return f"shard {shards[0].relpath}"
    return f"a pack of {len(shards)} shards ({shards[0].relpath} ... {shards[-1].relpath})"


def _where(part: Part) -> tuple[str, str | None]:
    """A part's split file, and the node whose object store holds its tokens (None: they are in files)."""
    return part.stem, part.buffered[0].node if part.buffered else None


class Scheduler:
    """Runs every unfinished shard to completion or failure, copying finished ones into place as their
    offsets become known. Afterwards `failed` (relpath -> error) and `resumed` (results of shards
    that resumed from a checkpoint) say how it went.

    Shards are taken from the manifest as workers free up (the driver holds the running ones, never the
    list), checkpoints read again at that moment: a shard a leftover worker finished meanwhile is skipped.
    """

    def __init__(
        self,
        manifest: Manifest,
        out: Path,
        spec: EncodeSpec,
        opts: RunOptions,
        workers: int,
        log: RunLog,
        tally: Tally,
        check: ray.ObjectRef | None,
    ):
        self.out, self.spec, self.opts, self.workers, self.log, self.tally = out, spec, opts, workers, log, tally
        self.check = check  # on a cluster: the NodeCheck (an ObjectRef) a node the driver did not probe runs
        # One task name for all: the driver keeps state per distinct name (~1.8 MiB per 1k names, measured).
        self.task = ray.remote(
            num_cpus=2 if spec.read_ahead else 1,
            num_returns=2,  # the results, and the shards' buffered parts (task.shard_task)
            max_retries=opts.max_retries,
            retry_exceptions=False,
            name="tokpipe shard",
        )(shard_task)
        # A pack that fails is not retried as one: its shards go again one by one, and the one at fault fails alone.
        self.pack_task = self.task.options(max_retries=0)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.board = ProgressBoard.options(scheduling_strategy=here).remote()
        self.common = ray.put((str(out), spec, self.board, opts.stall_timeout))  # see task.shard_task
        # Not those that failed in this process already (tokenize_while).
        finished = Finished(out)

        def unfinished() -> Iterator[Shard]:  # read twice: the manifest streams, 60,000 shards are not held
            return (s for s in manifest.shards() if not finished(s) and s.relpath not in tally.failed)

        self.packs = packs(unfinished(), sum(s.size for s in unfinished()), workers)
        self.again: deque = deque()  # (shard, stall retries): cancelled for a stall, or of a pack that failed
        self.running: dict = {}  # results' ObjectRef -> (shards, stall retries, submitted at, buffered parts' ref)
        self.failed = tally.failed
        self.totals, self.beats = [0, 0, 0], {}  # the board's last snapshot

    def run(self, progress: Progress, copies: Copies, done: int) -> None:
        """`done`: shards finished before (this run's Ray tasks), for the progress counts."""
        last_look = 0.0  # when progress and stalls were last looked at
        copies.feed()  # what earlier runs finished and did not place
        while True:
            self._submit()
            if not self.running:
                break
            # Wake on the first finished task, then take all that are done GATHER later.
            ready, _ = ray.wait(list(self.running), num_returns=1, timeout=POLL_EVERY)
            if ready:
                ready, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=GATHER)
            copies.collect()
            for ref in ready:
                done += self._collect(ref, copies.assembler)
            copies.feed()
            now = time.time()
            if now - last_look < POLL_EVERY:
                continue
            last_look = now
            self._read_board()
            # Running: the shards whose workers have begun them (a beat), not those submitted and queued.
            progress.update(*self.totals, done=done, running=len(self.beats), failed=len(self.failed))
            self._cancel_stalled(now)
        self._read_board()
        progress.update(*self.totals, done=done, running=0, failed=len(self.failed), final=True)

    def _submit(self) -> None:
        while len(self.running) < QUEUED * self.workers:
            if self.again:
                shard, stalls = self.again.popleft()
                shards = [shard]
            elif shards := next(self.packs, None):
                stalls = 0
            else:
                return
            ref, buffered = (self.pack_task if len(shards) > 1 else self.task).remote(shards, self.common, self.check)
            self.running[ref] = (shards, stalls, time.time(), buffered)

    def _collect(self, ref, assembler: Assembler) -> int:
        """Take a finished task's results; returns how many shards it finished."""
        shards, _, _, buffered = self.running.pop(ref)
        try:
            results: list[ShardResult] = _get(ref)
        except NodeError as e:  # a node the driver did not probe: it stops the run
            self.log(f"node check: {e}")
            raise
        except StoreUnavailable as e:  # every shard would wait out the same retries: the run stops, resumable
            self.log(f"shard {shards[0].relpath}: {e}")
            raise
        except (ray.exceptions.RayError, OSError) as e:
            if len(shards) > 1:
                self.log(f"{_name(shards)} failed ({describe_failure(e)}); its shards go again one by one")
                self.again.extend((shard, 0) for shard in shards)
                return 0
            self.failed[shards[0].relpath] = describe_failure(e)
            self.log(f"shard {shards[0].relpath} FAILED: {self.failed[shards[0].relpath]}")
            return 0
        for index, (shard, result) in enumerate(zip(shards, results)):
            stored = Stored(buffered, result.buffered_on, index) if result.buffered_on else None
            assembler.done(shard, result.checkpoint, stored)
            self.tally.add(shard, result, self.log)
        return len(shards)

    def _cancel_stalled(self, now: float) -> None:
        for ref, (shards, stalls, submitted, _) in list(self.running.items()):
            beat = self.beats.get(f"{shards[0].split}/{shards[0].key}", 0.0)
            # A task's clock starts at its first beat: until then it waits for a worker process (1-3 s
            # here, over 5 s under load; whose failure to start Ray reports), which is no stall of the shard.
            if beat < submitted:
                continue
            quiet = now - beat
            if quiet < self.opts.stall_timeout:
                continue
            del self.running[ref]
            ray.cancel(ref, force=True)
            # The dump of the shard it was on: a pack's shards before it removed their empty ones.
            dump = next((d for s in shards if (d := stall_dump(self.out, s)).exists()), stall_dump(self.out, shards[0]))
            self.log(f"{_name(shards)}: no progress for {quiet:.0f}s, cancelled (stack dump: {dump})")
            if len(shards) > 1:  # which of them stalled is unknown: each goes again alone, with its own retries
                self.again.extend((s, 0) for s in shards)
                continue
            shard = shards[0]
            if stalls < self.opts.max_retries:
                self.again.append((shard, stalls + 1))
            else:
                self.failed[shard.relpath] = (
                    f"stalled {stalls + 1} times (no progress for {self.opts.stall_timeout:.0f}s); stacks in {dump}"
                )

    def _read_board(self) -> None:
        try:
            self.totals, self.beats = ray.get(self.board.snapshot.remote(), timeout=30)
        except ray.exceptions.RayError:  # board restarting: keep the last view; stall clocks wait for new beats
            pass

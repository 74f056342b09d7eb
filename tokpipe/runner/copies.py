"""The writes that assemble the split files on Ray while shards still tokenize: Placer actors (task.Placer)
write each part where its tokens are; what goes where is the Assembler's. A placing call that fails comes back
here: its parts go again, and those whose tokens were lost with a node wait for their shard to be tokenized
again (Losses, in runner/schedule.py)."""

from __future__ import annotations

from collections import Counter, deque
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokpipe.errors import NodeError, TooManyGroups
from tokpipe.layout.records import Checkpoint, Part
from tokpipe.runner.progress import RunLog
from tokpipe.runner.task import Placer, SegmentWriter, Stored
from tokpipe.store import StoreUnavailable
from tokpipe.write.assembly import COPY_BATCH_BYTES, Assembler
from tokpipe.write.shard import keep
from tokpipe.write.stored import Step, StoreAssembly


def get(ref):
    """ray.get; a node's NodeError, a shard's TooManyGroups (--group-by), or a store that did not answer through
    its retries (StoreUnavailable), raised as itself: its one line, not Ray's traceback around it. Each stops the
    run: no other shard or node can do better."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (NodeError, TooManyGroups, StoreUnavailable)):
            raise e.cause from None
        raise


def _where(part: Part) -> tuple[str, str | None]:
    """A part's split file, and the node whose object store holds its tokens (None: they are in files)."""
    return part.stem, part.buffered[0].node if part.buffered else None


def _lost(part: Part) -> bool:
    """Whether a part's tokens went with a lost node (its shard is being tokenized again)."""
    return part.buffered is not None and part.buffered[0].ref is None


class Copies:
    """A Placer actor on each node that holds tokens (task.Placer) takes no CPU of the shards': a shard's
    buffered parts are written on the node whose object store holds them (never through the driver, whose
    own CPU stays per shard, not per byte), the parts copied from shards' own files by the placers in turn
    (OUT is on storage all of them see). Parts wait in a queue while every slot is busy, so the next call
    takes all of them: with thousands of tiny shards, one call and one fsync cover many.
    """

    def __init__(
        self,
        assembler: Assembler,
        out: Path,
        itemsize: int,
        nodes: int,
        check: ray.ObjectRef | None,
        log: RunLog,
    ):
        self.assembler, self.out, self.itemsize, self.check, self.log = assembler, out, itemsize, check, log
        self.slots = 2 * nodes
        self.here = ray.get_runtime_context().get_node_id()
        self.placers: dict[str, ray.actor.ActorHandle] = {}  # node -> its Placer, made when first needed
        self.turn = 0  # which placer copies the next parts from files
        self.queue: deque[Part] = deque()
        self.parked: list[Part] = []  # parts whose tokens went with a lost node, until they are made again
        self.running: dict = {}  # ObjectRef -> (its Placer's node, its parts, the refs of their tokens as sent)
        self.bytes_by_node: Counter = Counter()

    @property
    def busy(self) -> bool:
        """Parts handed out and not yet placed (but those whose tokens are lost)."""
        return bool(self.running or self.queue)

    def _placer(self, node: str | None) -> tuple[str, ray.actor.ActorHandle]:
        if node is None:  # tokens in files: any node's placer, in turn
            if not self.placers:
                return self._placer(self.here)
            self.turn += 1
            node = list(self.placers)[self.turn % len(self.placers)]
        if node not in self.placers:
            # Pinned (not soft): a soft affinity let Ray's GCS place a Placer asked for on the driver's node on
            # another one (seen when the driver's node had no worker to spare), and a lost node's failures would be
            # taken for the node it was asked on.
            where = NodeAffinitySchedulingStrategy(node, soft=False)
            self.placers[node] = Placer.options(scheduling_strategy=where).remote()
        return node, self.placers[node]

    def feed(self, excluded: frozenset[str] = frozenset()) -> None:
        if not self.assembler.concat:  # --no-concat: nothing to copy, a part is listed as it is
            parts = self.assembler.ready(excluded)
            self.assembler.placed(parts, [p.record for p in parts])
            return
        self.queue.extend(self.assembler.ready(excluded))
        while self.queue and len(self.running) < self.slots:
            if _lost(self.queue[0]):
                self.parked.append(self.queue.popleft())
                continue
            stem, node = _where(self.queue[0])
            batch, size = [], 0
            while self.queue and _where(self.queue[0]) == (stem, node) and not _lost(self.queue[0]):
                batch.append(self.queue.popleft())
                size += batch[-1].record["tokens"] * self.itemsize
                if size >= COPY_BATCH_BYTES:
                    break
            node, placer = self._placer(node)
            sent = [part.buffered[0].ref if part.buffered else None for part in batch]
            self.running[placer.place.remote(str(self.out), batch, self.itemsize, self.check)] = (node, batch, sent)

    def collect(self) -> list[tuple[str, list[Stored], Exception]]:
        """List the copies that are done. A call that failed is taken back: its Placer is not called again, its
        parts go again, but those whose tokens Ray says are lost, which wait for their shard to be tokenized again.
        Returns, for each call that failed, its Placer's node, the Stored whose tokens it lost, and the error."""
        if not self.running:
            return []
        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
        failed = []
        for handle in done:
            node, parts, sent = self.running.pop(handle)
            try:
                wrote, records = get(handle)
            except ray.exceptions.RayError as e:
                object_lost = isinstance(e, ray.exceptions.RayTaskError)
                if object_lost and not isinstance(e.cause, ray.exceptions.ObjectLostError):
                    raise  # place() itself failed (a full disk, ...): no other node does better
                self.placers.pop(node, None)
                self.queue.extend(parts)
                lost = [p.buffered[0] for p, ref in zip(parts, sent) if p.buffered and p.buffered[0].ref is ref]
                failed.append((node, self._mark_lost(lost) if object_lost else [], e))
                continue
            self.assembler.placed(parts, records)
            self.bytes_by_node[wrote] += sum(r["tokens"] for r in records) * self.itemsize
        return failed

    def lose(self, node: str) -> list[Stored]:
        """A node is lost: its Placer goes, the calls to it go again (one still making it would wait for the GCS
        to find the node dead), and every shard whose tokens wait in its object store (to be scheduled, queued,
        being placed) is marked lost. Returns their Stored, each to tokenize again."""
        self.placers.pop(node, None)
        for handle, (placer_node, parts, _) in list(self.running.items()):
            if placer_node == node:
                del self.running[handle]
                self.queue.extend(parts)
        held = [p.buffered[0] for p in self.queue if p.buffered]
        held += [p.buffered[0] for _, parts, _ in self.running.values() for p in parts if p.buffered]
        held += [buffered for _, _, buffered in self.assembler.unplaced()]
        return self._mark_lost(s for s in held if isinstance(s, Stored) and s.node == node)

    def _mark_lost(self, stored) -> list[Stored]:
        """Mark each Stored lost once (its parts are parked as the queue reaches them); returns those newly lost."""
        lost = list({id(s): s for s in stored if s.ref is not None}.values())
        for s in lost:
            s.ref = None
        return lost

    def found(self, stored: Stored, ref: ray.ObjectRef, node: str) -> None:
        """A lost shard tokenized again: its parts take their tokens from the new copy (the first of `ref`)."""
        stored.ref, stored.node, stored.index = ref, node, 0
        self.queue.extend(p for p in self.parked if p.buffered[0] is stored)
        self.parked = [p for p in self.parked if p.buffered[0] is not stored]

    def keep(self, done: list[tuple]) -> int:
        """Done shards whose place this run will not know (a shard before them failed): their buffered parts
        written to their own files and checkpointed (shard.keep), on the node that holds them, so that the rerun
        places them without tokenizing them again. Returns how many were kept; one whose node is lost meanwhile
        is not (the rerun tokenizes it again)."""
        by_node: dict[str, list[tuple[Checkpoint, Stored]]] = {}
        kept = 0
        for shard, ckpt, buffered in done:
            if isinstance(buffered, Stored):
                by_node.setdefault(buffered.node, []).append((ckpt, buffered))
            else:  # tokenized in this process while Ray started
                keep(self.out, shard, ckpt, buffered)
                kept += 1
        calls = {self._placer(n)[1].keep.remote(str(self.out), held, self.check): n for n, held in by_node.items()}
        for call, node in calls.items():
            try:
                kept += get(call)
            except ray.exceptions.RayError as e:
                self.log(f"keeping the shards on node {node[:8]} failed ({type(e).__name__}): the rerun tokenizes them")
        return kept


class StoreCopies:
    """On a store (layout/stored.py): the parts handed in split order to a SegmentWriter actor on the driver's node,
    which gathers them into segments and uploads them (the driver never holds a token); the segments it committed
    come back, and the shards whose parts are all in one are checkpointed (write/stored.py). One call at a time: a
    call that fails (a part's tokens lost with a node) goes again first, once they are made again, so that the writer
    takes the parts in order. The interface is Copies', for the Scheduler."""

    def __init__(self, assembler: StoreAssembly):
        self.assembler = assembler
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # It goes on from the driver's writer, which wrote the segments of the shards done before Ray took over.
        driver, assembler.segments = assembler.segments, None
        made = (str(assembler.out), assembler.spec.concat, driver.seqs, driver.open)
        self.writer = SegmentWriter.options(scheduling_strategy=here).remote(*made)
        self.pending: list[Step] = []  # taken from the assembly, not yet sent
        self.running: dict = {}  # the call in flight -> its steps
        self.bytes_by_node: Counter = Counter()

    @property
    def busy(self) -> bool:
        return bool(self.running or self.pending)

    def feed(self, excluded: frozenset[str] = frozenset()) -> None:
        self.pending += self.assembler.ready(excluded)
        if self.running:
            return
        sent = next((i for i, step in enumerate(self.pending) if _tokens_lost(step)), len(self.pending))
        if sent:
            self.running[self.writer.write.remote(self.pending[:sent])] = self.pending[:sent]
            del self.pending[:sent]

    def collect(self) -> list[tuple[str, list[Stored], Exception]]:
        """Take back the call that is done: its segments committed, or (failed) its steps again, first, and the
        shards whose tokens it could not read marked lost (Copies.collect)."""
        if not self.running:
            return []
        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
        failed = []
        for handle in done:
            steps = self.running.pop(handle)
            try:
                self.assembler.commit(get(handle))
            except ray.exceptions.RayError as e:
                lost = isinstance(getattr(e, "cause", None), ray.exceptions.ObjectLostError)
                if isinstance(e, ray.exceptions.RayTaskError) and not lost:
                    raise  # the writer itself failed (the store, ...): no other node does better
                self.pending[:0] = steps
                held = [step.buffered for step in steps if isinstance(step.buffered, Stored)]
                failed.append((ray.get_runtime_context().get_node_id(), _mark_lost(held), e))
        return failed

    def lose(self, node: str) -> list[Stored]:
        """A node is lost: every shard whose tokens wait in its object store is marked lost (Copies.lose)."""
        held = [step.buffered for step in self.pending if isinstance(step.buffered, Stored)]
        held += [buffered for _, _, buffered in self.assembler.unplaced()]
        return _mark_lost(s for s in held if isinstance(s, Stored) and s.node == node)

    def found(self, stored: Stored, ref: ray.ObjectRef, node: str) -> None:
        """A lost shard tokenized again: its steps take their tokens from the new copy (the first of `ref`)."""
        stored.ref, stored.node, stored.index = ref, node, 0


def _tokens_lost(step: Step) -> bool:
    return isinstance(step.buffered, Stored) and step.buffered.ref is None


def _mark_lost(stored) -> list[Stored]:
    """Mark each Stored lost once; returns those newly lost."""
    lost = list({id(s): s for s in stored if s.ref is not None}.values())
    for s in lost:
        s.ref = None
    return lost

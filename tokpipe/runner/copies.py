"""The writes that assemble OUT on Ray while shards still tokenize: Placer actors (task.Placer) write each part
where its tokens are, into the split files (SplitFileWrites), or for an OUT on a store upload each segment
(SegmentUploads); what goes where is the assembler's. A placing call that fails comes back here: its parts go
again, and those whose tokens were lost with a node wait for their shard to be tokenized again (Losses, in
runner/schedule.py)."""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable
from typing import NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokpipe.errors import NodeError, TooManyGroups, Unavailable
from tokpipe.layout.checkpoints import Checkpoint
from tokpipe.layout.files import PartKey
from tokpipe.layout.records import Part
from tokpipe.runner.progress import RunLog
from tokpipe.runner.storage import Folder, Prefix
from tokpipe.runner.task import OnNode, Placer
from tokpipe.write.assembly import COPY_BATCH_BYTES
from tokpipe.write.segments import ClosedSegment, kept_parts
from tokpipe.write.stored import PartTokens, StoreAssembly

# A shard waiting for segments still gathering alone is kept (SegmentUploads._unpin) only where its waiting parts are at
# most this share of its tokens: a keep uploads them a second time, and frees its whole object.
KEEP_SHARE = 0.25


def get(ref, twin=None):
    """ray.get; a node's NodeError, a shard's TooManyGroups (--group-by), or a store that did not answer through
    its retries (Unavailable), raised as itself: its one line, not Ray's traceback around it. Each stops the
    run: no other shard or node can do better. `twin`: the task's other return, which holds the same error; read
    too, or Ray logs it as unhandled when it is dropped (a blind node's NodeError printed three tracebacks on the
    terminal in a CI run of the cluster-follow test; a failed shard's, one in OUT/logs/ray.log)."""
    try:
        return ray.get(ref)
    except Exception as e:
        if twin is not None:
            with contextlib.suppress(Exception):
                ray.get(twin, timeout=0)
        if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, (NodeError, TooManyGroups, Unavailable)):
            raise e.cause from None
        raise


def _where(part: Part) -> tuple[str, str | None]:
    """A part's split file, and the node whose object store holds its tokens (None: they are in files, or in the
    driver's memory and sent with the call)."""
    return part.stem, part.buffered[0].node if part.buffered and isinstance(part.buffered[0], OnNode) else None


class Placers:
    """What the writes that assemble OUT while shards still tokenize share, on disk (SplitFileWrites) and on a store
    (SegmentUploads): a Placer actor on each node (task.Placer), made when first needed, AT_ONCE calls to each; the
    items the assembler has ready (`_ready`) queued and each sent where its tokens are (`_send`), taken back done
    (`_took`) or failed and sent again; an item some of whose tokens (`_held`) went with a lost node parked until its
    shard is tokenized again."""

    AT_ONCE = 2

    def __init__(self, out: Folder | Prefix, assembler, itemsize: int, nodes: int, check, log: RunLog):
        self.out, self.assembler, self.itemsize, self.check, self.log = out, assembler, itemsize, check, log
        self.slots = self.AT_ONCE * nodes
        self.here = ray.get_runtime_context().get_node_id()
        self.placers: dict[str, ray.actor.ActorHandle] = {}  # node -> its Placer, made when first needed
        self.turn = 0  # which placer copies the next parts from files
        self.queue: deque = deque()
        self.parked: list = []  # items whose tokens went with a lost node, until they are made again
        self.running: dict = {}  # ObjectRef -> (its Placer's node, its items, the refs of their tokens as sent)
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
            self.placers[node] = Placer.options(scheduling_strategy=where, max_concurrency=self.AT_ONCE).remote()
        return node, self.placers[node]

    def feed(self, excluded: frozenset[str] = frozenset()) -> None:
        """Hand out what the assembler has ready, while slots are free; what lost its tokens with a node waits."""
        self.queue.extend(self._ready(excluded))
        while self.queue and len(self.running) < self.slots:
            if self._lost(self.queue[0]):
                self.parked.append(self.queue.popleft())
                continue
            node, items, call = self._send()
            self.running[call] = (node, items, [[s.ref for s in self._held(item)] for item in items])

    def _lost(self, item) -> bool:
        """Whether some of an item's tokens went with a lost node (their shard is being tokenized again)."""
        return any(stored.ref is None for stored in self._held(item))

    def collect(self) -> list[tuple[str, list[OnNode], Exception]]:
        """List the copies that are done. A call that failed is taken back: its Placer is not called again, its
        parts go again, but those whose tokens Ray says are lost, which wait for their shard to be tokenized again.
        Returns, for each call that failed, its Placer's node, the OnNode whose tokens it lost, and the error."""
        if not self.running:
            return []
        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
        failed, took = [], []
        try:
            for handle in done:
                node, items, sent = self.running.pop(handle)
                try:
                    took.append((items, get(handle)))
                except ray.exceptions.RayError as e:
                    object_lost = isinstance(e, ray.exceptions.RayTaskError)
                    if object_lost and not isinstance(e.cause, ray.exceptions.ObjectLostError):
                        # The call itself failed (a full disk, the store, ...): no other node does better. An OSError
                        # as itself, the CLI's one line: Ray's str of it is the Placer's traceback (a full disk: 14).
                        if isinstance(e.cause, OSError):
                            raise e.cause from None
                        raise
                    self.placers.pop(node, None)
                    self.queue.extend(items)
                    held = zip((s for item in items for s in self._held(item)), (r for refs in sent for r in refs))
                    lost = [stored for stored, ref in held if stored.ref is ref]
                    failed.append((node, self._mark_lost(lost) if object_lost else [], e))
        finally:  # those done before a failure too
            if took:
                self._took(took)
        return failed

    def lose(self, node: str) -> list[OnNode]:
        """A node is lost: its Placer goes, the calls to it go again (one still making it would wait for the GCS
        to find the node dead), and every shard whose tokens wait in its object store (to be scheduled, queued,
        parked for tokens another node lost, being placed) is marked lost. Returns their OnNode, each to tokenize
        again."""
        self.placers.pop(node, None)
        for handle, (placer_node, items, _) in list(self.running.items()):
            if placer_node == node:
                del self.running[handle]
                self.queue.extend(items)
        held = [s for item in [*self.queue, *self.parked] for s in self._held(item)]
        held += [s for _, items, _ in self.running.values() for item in items for s in self._held(item)]
        held += self.assembler.held()
        return self._mark_lost(s for s in held if isinstance(s, OnNode) and s.node == node)

    def _mark_lost(self, stored) -> list[OnNode]:
        """Mark each OnNode lost once (its parts are parked as the queue reaches them); returns those newly lost."""
        lost = list({id(s): s for s in stored if s.ref is not None}.values())
        for s in lost:
            s.ref = None
        return lost

    def keep(self, done: list[tuple]) -> int:
        """Done shards whose place this run will not know (a shard before them failed): their buffered parts kept
        where OUT lives and checkpointed (runner/storage.py keep_shard), by the node that holds them, so that the
        rerun places them without tokenizing them again. Returns how many were kept; one whose node is lost
        meanwhile is not (the rerun tokenizes it again)."""
        by_node: dict[str, list[tuple[Checkpoint, OnNode, None]]] = {}
        kept = 0
        for shard, ckpt, buffered in done:
            if isinstance(buffered, OnNode):
                by_node.setdefault(buffered.node, []).append((ckpt, buffered, None))
            else:  # tokenized in this process while Ray started
                self.out.keep_shard(shard, ckpt, buffered)
                kept += 1
        calls = {self._placer(n)[1].keep.remote(self.out.name, held, self.check): n for n, held in by_node.items()}
        for call, node in calls.items():
            try:
                kept += get(call)
            except ray.exceptions.RayError as e:
                self.log(f"keeping the shards on node {node[:8]} failed ({type(e).__name__}): the rerun tokenizes them")
        return kept

    def found(self, stored: OnNode, ref: ray.ObjectRef, node: str) -> None:
        """A lost shard tokenized again: its parts take their tokens from the new copy (the first of `ref`)."""
        stored.ref, stored.node, stored.index = ref, node, 0
        self.queue.extend(item for item in self.parked if not self._lost(item))
        self.parked = [item for item in self.parked if self._lost(item)]


class SplitFileWrites(Placers):
    """Parts written into split files on storage every node sees: a shard's buffered parts on the node whose object
    store holds them (never through the driver, whose own CPU stays per shard, not per byte), the parts copied from
    shards' own files by the placers in turn. Parts wait in a queue while every slot is busy, so the next call takes
    all of them: with thousands of tiny shards, one call and one fsync cover many. Two calls a node: one writes while
    the other waits on its fsync."""

    def _ready(self, excluded: frozenset[str]) -> list[Part]:
        if not self.assembler.concat:  # --no-concat: nothing to copy, a part is listed as it is
            parts = self.assembler.ready(excluded)
            self.assembler.placed(parts, [p.record for p in parts])
            return []
        return self.assembler.ready(excluded)

    def _send(self) -> tuple[str, list[Part], ray.ObjectRef]:
        """The next parts of one file whose tokens are on one node (or in files), up to COPY_BATCH_BYTES, to place."""
        stem, node = _where(self.queue[0])
        batch, size = [], 0
        while self.queue and _where(self.queue[0]) == (stem, node) and not self._lost(self.queue[0]):
            batch.append(self.queue.popleft())
            size += batch[-1].record["tokens"] * self.itemsize
            if size >= COPY_BATCH_BYTES:
                break
        node, placer = self._placer(node)
        return node, batch, placer.place.remote(self.out.name, batch, self.itemsize, self.check)

    def _took(self, took: list[tuple[list[Part], tuple]]) -> None:
        for parts, (wrote, records) in took:
            self.assembler.placed(parts, records)
            self.bytes_by_node[wrote] += sum(r["tokens"] for r in records) * self.itemsize

    @staticmethod
    def _held(part: Part) -> list[OnNode]:
        """Where an item's tokens wait on Ray (none: in files, or sent with the call: a shard the driver's helpers
        finished while Ray started, after one that stopped for Ray's workers)."""
        return [part.buffered[0]] if part.buffered and isinstance(part.buffered[0], OnNode) else []


def placing(out: Folder | Prefix, assembler, nodes: int, check, log: RunLog, room: Callable[[], int]) -> Placers:
    """The Placers' work where OUT lives (runner/storage.py): parts written into its split files, or segments
    uploaded to its prefix (`room()`: the bytes of shards that may wait for segments still gathering alone, now: one
    --shard-buffer a worker, as the workers are refitted to a cluster that grows or shrinks)."""
    if isinstance(out, Prefix):
        return SegmentUploads(out, assembler, nodes, check, log, room)
    return SplitFileWrites(out, assembler, assembler.itemsize, nodes, check, log)


class _Waits(NamedTuple):  # a shard whose parts wait for segments (SegmentUploads._unpin)
    alone: bool  # only for segments still gathering
    tokens: int  # all of its own
    waiting: int  # its waiting parts'
    on_node: OnNode
    keys: list[PartKey]  # its waiting parts'


class SegmentUploads(Placers):
    """On a store (layout/stored.py): the segments the driver closes (write/stored.py, from the parts' counts) each
    uploaded by the Placer of the node that holds most of its tokens: a large part from its own node, never moved;
    small parts gathered from the nodes that hold them. AT_ONCE calls a node: an upload waits on the network,
    not a core. A segment committed comes back, and the shards whose parts are all in one are checkpointed. Lost
    tokens, lost nodes: as SplitFileWrites."""

    AT_ONCE = 4

    def __init__(self, out: Prefix, assembler: StoreAssembly, nodes: int, check, log: RunLog, room: Callable[[], int]):
        super().__init__(out, assembler, assembler.itemsize, nodes, check, log)
        self.room = room
        self.keeping: dict[ray.ObjectRef, list[tuple[None, OnNode, list]]] = {}  # keep calls -> what they keep
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        for node in {self.here, *alive}:  # each node's Placer ready before its first segment
            self._placer(node)[1].warm.remote(str(assembler.out))

    @property
    def busy(self) -> bool:
        """Uploads, and keeps (`_unpin`): one still writing when the run finalized would leave its objects for good."""
        return super().busy or bool(self.keeping)

    def _ready(self, excluded: frozenset[str]) -> list[ClosedSegment]:
        ready = self.assembler.ready(excluded)
        self._kept()
        self._unpin()
        return ready

    def _unpin(self) -> None:
        """Shards that wait for segments still gathering alone, past `room()` bytes of them (their checkpoints' tokens),
        oldest first: their parts that wait kept on the store (write/stored.py keep), whence those segments take them,
        and they are checkpointed (`_kept`). A rare --group-by group's segment gathers until the split's end: until
        then each shard's whole object stayed in Ray's object store (spilled to the node's disk once that was full: a
        second copy of the tokens), and no checkpoint covered it (a kill lost every shard done). Only a shard whose
        waiting parts are at most KEEP_SHARE of it: a keep uploads them twice, to free the object of all of it."""
        assembler = self.assembler
        gathering = {entry.key for segment in assembler.segments.open.values() for entry in segment.entries}
        keeping = {id(on_node) for done in self.keeping.values() for _, on_node, _ in done}
        objects: dict[ray.ObjectRef, list[_Waits]] = {}  # an object's shards (a pack's)
        for relpath, (_, ckpt, left, on_node) in assembler.waiting.items():
            if isinstance(on_node, OnNode) and on_node.ref is not None and id(on_node) not in keeping:
                alone = left <= gathering and relpath not in assembler.results
                waiting = sum(part.tokens for part in ckpt.parts if (relpath, *part.key) in left)
                tokens = sum(part.tokens for part in ckpt.parts)  # (its held-out documents' too)
                keys = [key[1:] for key in left]
                objects.setdefault(on_node.ref, []).append(_Waits(alone, tokens, waiting, on_node, keys))
        waits = [shards for shards in objects.values() if all(shard.alone for shard in shards)]
        over = sum(shard.tokens for shards in waits for shard in shards) * self.itemsize - self.room()
        by_node: dict[str, list] = {}
        for shards in waits:
            if over <= 0:
                break
            if sum(shard.waiting for shard in shards) > KEEP_SHARE * sum(shard.tokens for shard in shards):
                continue
            for shard in shards:
                by_node.setdefault(shard.on_node.node, []).append((None, shard.on_node, shard.keys))
                over -= shard.tokens * self.itemsize
        for node, done in by_node.items():
            self.keeping[self._placer(node)[1].keep.remote(self.out.name, done, self.check)] = done

    def _kept(self) -> None:
        """Shards kept on the store (`_unpin`): the segments gathering take their parts from there, and they are
        checkpointed, as the rerun then takes them (segments.HeldParts), and Ray lets go of their objects. A keep that
        failed (a node lost: its shards are tokenized again) keeps none."""
        done = ray.wait(list(self.keeping), num_returns=len(self.keeping), timeout=0)[0] if self.keeping else []
        assembler, out = self.assembler, self.assembler.out
        for call in done:
            kept = self.keeping.pop(call)
            try:
                get(call)
            except ray.exceptions.RayError as e:
                self.log(f"keeping {len(kept)} shards whose parts wait for a segment failed ({type(e).__name__})")
                continue
            sources = {}
            for _, on_node, keys in kept:
                parts = kept_parts(out, assembler.held_parts.dtype, on_node.shard, keys)
                sources.update(((id(on_node), key), PartTokens(parts, key)) for key in keys)
                if (waiting := assembler.waiting.get(on_node.shard.relpath)) is not None:  # (else committed since)
                    waiting[2].clear()  # none left but kept
            assembler.segments.take_from(sources)
            assembler.checkpoint([on_node.shard.relpath for _, on_node, _ in kept])

    def _send(self) -> tuple[str, list[ClosedSegment], ray.ObjectRef]:
        """A segment to the node that holds most of its tokens: the node of its large part if it has one (which
        holds more than its small ones together, and may be in that node's files: Spilled)."""
        planned = self.queue.popleft()
        tokens: Counter = Counter()
        sources = []
        for step, entry in zip(planned.sources, planned.segment.entries):
            if isinstance(step.buffered, OnNode):
                tokens[step.buffered.node] += entry.tokens
                sources.append(step)
            else:  # tokenized by the driver before Ray took over: this part of its shard's, sent with the call
                tokens[self.here] += entry.tokens
                sources.append(PartTokens({step.key: step.buffered[step.key]}, step.key))
        node, placer = self._placer(tokens.most_common(1)[0][0])
        return node, [planned], placer.upload.remote(str(self.assembler.out), planned.segment, sources)

    def _took(self, took: list[tuple[list[ClosedSegment], tuple]]) -> None:
        """The segments that came back together committed together: their shards' checkpoints an object a split, not
        one a shard with --no-concat (2,000 shards, 2 workers: 2,000 -> 505 objects; `status` of it 4.8 -> 2.3 s)."""
        self.assembler.commit([segment for _, (_, segment, _) in took])
        for _, (node, _, uploaded) in took:
            self.bytes_by_node[node] += uploaded

    @staticmethod
    def _held(planned: ClosedSegment) -> list[OnNode]:
        return [step.buffered for step in planned.sources if isinstance(step.buffered, OnNode)]

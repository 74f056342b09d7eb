"""What runs on Ray's workers: the shard task around tokenize_shard, the Placer actor around place (and, for an
OUT on a store, a segment's upload), and the ProgressBoard actor where shard tasks leave their progress."""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray

from tokpipe.durability import write_atomic
from tokpipe.inputs.manifest import Shard
from tokpipe.layout.checkpoints import Checkpoint
from tokpipe.layout.files import stall_dump
from tokpipe.layout.records import Part
from tokpipe.layout.stored import Segment, StoredOut, records_of
from tokpipe.runner.nodes import NodeCheck, ensure_seen
from tokpipe.runner.storage import storage_of
from tokpipe.write.memory import MemoryGuard, memory_guard
from tokpipe.write.place import place
from tokpipe.write.segments import ClosedSegment, Spilled
from tokpipe.write.shard import EncodeSpec, ShardResult, tokenize_shard
from tokpipe.write.stored import PartTokens, upload_closed

REPORT_EVERY = 1.0  # seconds between a worker's progress reports
# Seconds between arms of a task's stall watchdog: each arm (faulthandler.dump_traceback_later) starts a thread.
# Reports and arms per shard and per batch were most of a worker's time on two-document shards: 2-3 ms a shard
# against ~0.25 ms of encoding (py-spy, 20,000 such shards, 2 workers).
REARM_EVERY = 0.25


@ray.remote(num_cpus=0, max_restarts=-1)
class ProgressBoard:
    """Where workers leave progress; the driver reads it twice a second. No per-batch round trips.

    It lives on the driver's node, so losing a worker node loses no progress; should it die anyway,
    Ray restarts it, and only the progress display and stall clocks start over.
    """

    def __init__(self):
        self.totals = [0, 0, 0]  # file bytes, documents, tokens
        self.beats: dict[str, float] = {}
        self.nodes: dict[str, str] = {}  # the node each running task is on, said with its first beat

    def report(
        self, key: str, file_bytes: int, documents: int, tokens: int, finished: bool = False, node: str | None = None
    ) -> None:
        self.totals = [a + b for a, b in zip(self.totals, (file_bytes, documents, tokens))]
        if finished:  # only running shards need a heartbeat: beats, and every snapshot, stay O(workers)
            self.beats.pop(key, None)
            self.nodes.pop(key, None)
        else:
            self.beats[key] = time.time()
        if node is not None:
            self.nodes[key] = node

    def snapshot(self) -> tuple[list[int], dict[str, float], dict[str, str]]:
        return self.totals, self.beats, self.nodes


def shard_task(
    shards: list[Shard], common: tuple, check: NodeCheck | None, again: bool = False
) -> tuple[list[ShardResult], list]:
    """The Ray task around tokenize_shard, for one shard or a pack of small ones in turn (schedule.packs):
    progress reports, and a stack dump if it stops moving. On a node the driver did not probe, first the paths
    the run needs (NodeError: not the stall dump's).
    `common`: what every shard task of the run takes (OUT, the EncodeSpec, the ProgressBoard, the stall
    timeout, and for an OUT on a store the tokenizer shipped: ship_tokenizer), put in the object store once:
    serialized for every task, it was a third of the driver's cost of submitting one; `check` comes apart (Ray
    resolves a reference only as an argument of its own).
    Two returns: the results, and apart from them each shard's parts kept in memory (None: in its files),
    which stay in this node's object store until a Placer here writes them into place (the driver never
    fetches them). The shards of a pack share one --shard-buffer: all of theirs wait here until the last.
    `again`: a shard whose tokens were lost with a node, tokenized anew (tokenize_shard)."""
    out, spec, board, stall_timeout, shipped = common
    ensure_seen(check)
    spec = local_tokenizer(spec, shipped)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker per core: no thread pool inside each
    node = ray.get_runtime_context().get_node_id()
    # The pack's progress and stack dump go under its first shard's name: the driver's stall clock is the task's.
    dump_path = stall_dump(records_of(out), shards[0])
    dump_path.parent.mkdir(parents=True, exist_ok=True)  # an OUT on a store: a local folder, on every node
    results, buffers = [], []
    with open(dump_path, "a") as dump:
        progress = _Progress(board, f"{shards[0].split}/{shards[0].key}", node, dump, stall_timeout, not again)
        guard = memory_guard(spec.memory_limit, spec.backend, spec.tokenizer_json)
        try:
            for shard in shards:
                room = max(0, spec.buffer_bytes - guard.held)  # the pack's shards before this one keep theirs here
                result = _one_shard(shard, out, replace(spec, buffer_bytes=room), guard, progress, again)
                if result.buffered is not None:  # in memory (not Spilled)
                    held = [v for v in result.buffered.values() if not isinstance(v, Spilled)]
                    guard.held += sum(a.nbytes for tokens, ends in held for a in tokens + ends)
                buffers.append(result.buffered)
                results.append(replace(result, buffered=None))
        finally:
            faulthandler.cancel_dump_traceback_later()
            guard.held = 0
            progress.report(finished=True)
            if os.fstat(dump.fileno()).st_size == 0:  # none stalled: no dump, whether the shards failed or not
                dump_path.unlink(missing_ok=True)
    if any(b is not None for b in buffers):
        results = [replace(r, buffered_on=node) if b is not None else r for r, b in zip(results, buffers)]
    return results, buffers


def ship_tokenizer(spec: EncodeSpec) -> tuple[str, ray.ObjectRef]:
    """The tokenizer.json, for nodes that share no file system with the driver (an OUT on a store): its sha256,
    and its bytes in Ray's object store. Shipped rather than required on each node: the corpus and OUT are on the
    store, and a tokenizer at the driver's path on every node would be the one thing a cluster still had to share
    (~10 MB, fetched once per node; workers read no other file of the tokenizer)."""
    data = Path(spec.tokenizer_json).read_bytes()
    return hashlib.sha256(data).hexdigest(), ray.put(data)


def local_tokenizer(spec: EncodeSpec, shipped: tuple[str, ray.ObjectRef] | None) -> EncodeSpec:
    """The spec with this node's copy of a shipped tokenizer.json, written once a node (atomically: the node's
    workers may write it at once) under its sha256."""
    if shipped is None:
        return spec
    sha256, data = shipped
    path = Path(tempfile.gettempdir()) / f"tokpipe-{os.getuid()}" / "tokenizers" / f"{sha256}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, ray.get(data))
    return replace(spec, tokenizer_json=str(path))


class _Progress:
    """A task's progress, over all of its shards: reported to the ProgressBoard as it starts (the stall clock runs
    from there, not from submission; and the driver knows the node, should it lose it), then at most every
    REPORT_EVERY as batches come, the rest with its end; and its stall watchdog, armed again as batches come (at
    most every REARM_EVERY), which writes the stacks to `dump` if none comes for most of the stall timeout. A shard
    tokenized again (its tokens lost with a node) was counted when it was done: it beats, and adds nothing again
    (`counted` False; its bytes read twice showed 122.7% read, ETA -7s)."""

    def __init__(self, board, tag: str, node: str, dump, stall_timeout: float, counted: bool = True):
        self.board, self.tag, self.dump, self.stall_timeout, self.counted = board, tag, dump, stall_timeout, counted
        self.pending, self.reported, self.armed = [0, 0, 0], time.monotonic(), 0.0
        board.report.remote(tag, 0, 0, 0, node=node)
        self.arm()

    def arm(self) -> None:
        now = time.monotonic()
        if now - self.armed >= REARM_EVERY:
            # Fires in a C watchdog thread, so it works even when Python is stuck holding the GIL.
            faulthandler.dump_traceback_later(max(self.stall_timeout * 0.8, 0.5), file=self.dump)
            self.armed = now

    def __call__(self, file_bytes: int, documents: int, tokens: int) -> None:
        """A batch read and encoded (tokenize_shard's on_batch)."""
        self.arm()
        if self.counted:
            self.pending = [self.pending[0] + file_bytes, self.pending[1] + documents, self.pending[2] + tokens]
        if time.monotonic() - self.reported >= REPORT_EVERY:
            self.report()

    def report(self, finished: bool = False) -> None:
        call = self.board.report.remote(self.tag, *self.pending, finished=finished)
        self.pending, self.reported = [0, 0, 0], time.monotonic()
        if finished:  # on the board before the results reach the driver, whose look at them projects the disk's use
            with contextlib.suppress(ray.exceptions.RayError):  # (a board lost: its progress only, which restarts)
                ray.get(call, timeout=10 * REPORT_EVERY)


def _one_shard(
    shard: Shard, out: str, spec: EncodeSpec, guard: MemoryGuard, progress: _Progress, again: bool
) -> ShardResult:
    # `ps` shows which shard each worker is on (Ray sets the title back to ray::IDLE after the task).
    # Ray's own setter, as it uses for task names; the task name itself is the same for every shard.
    getattr(ray._raylet, "setproctitle", lambda title: None)(f"ray::tokpipe {shard.split}/{shard.key}")
    # The encoder is loaded before the shard is opened, and its load counts as progress: 1-2 s per
    # worker here, more on a busy machine, which a short --stall-timeout took for a stall.
    guard.encoder()
    progress(0, 0, 0)
    return tokenize_shard(shard, out, spec, progress, again=again)


@dataclass(eq=False)
class OnNode:
    """Where a done shard's buffered parts are: the `index`th of the second return (`ref`) of a shard_task on
    `node`. One per shard, shared by its parts and by the plan's entry for it, and changed in place: when the node
    is lost the shard is tokenized again (`ref` None meanwhile), and this points at the new copy for all of them."""

    shard: Shard
    ref: ray.ObjectRef | None
    node: str
    index: int


def fetch(where: list[OnNode]):
    """The parts of the shards `where` names, from the object stores that hold them, in one ray.get: a function
    from an OnNode to its shard's parts by key (shard.ShardResult.buffered)."""
    refs = list({w.ref for w in where})
    values = dict(zip(refs, ray.get(refs)))
    return lambda w: values[w.ref][w.index]


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class Placer:
    """Writes parts into their split files on one node: buffered ones from that node's object store
    (zero-copy, never through the driver), others from their shards' own files (OUT is on storage every node
    sees). An actor, one per node, not a task: copy tasks took worker processes from Ray's pool beside the
    shard tasks, which Ray then ended as idle and started anew, each new one loading the encoder again
    (measured: 2,500 one-document shards took 72 s of tokenizing against 29 s). Calls at once: runner/copies.py's.

    Never restarted, a call never retried by Ray: a Placer whose node was lost would come back elsewhere and wait
    there on tokens that went with the node (Ray's "actor is temporarily unavailable", then the run's end). A call
    that fails goes back to the driver, which places its parts again (runner/copies.py)."""

    def __init__(self):
        self.node = ray.get_runtime_context().get_node_id()

    def place(self, out: str, parts: list[Part], itemsize: int, check: NodeCheck | None) -> tuple[str, list[dict]]:
        """place.place, after reading the buffered parts from this node's object store (those the driver held come
        with the call); says which node wrote them. `check`: a call's argument, not the actor's: Ray could not
        restart an actor whose constructor took a reference that went."""
        ensure_seen(check)
        on_ray = [
            part.buffered[0] if part.buffered and isinstance(part.buffered[0], OnNode) else None for part in parts
        ]
        held = fetch([where for where in on_ray if where is not None])
        parts = [
            part if where is None else replace(part, buffered=(held(where), part.buffered[1]))
            for part, where in zip(parts, on_ray)
        ]
        return self.node, place(out, parts, itemsize)

    def warm(self, out: str) -> None:
        """For an OUT on a store: its client made (boto3's import and a client: ~1.5 s of a new actor's first
        upload, which on a small corpus was the whole of the tokenizing) before the first segment comes."""
        self.client = StoredOut.of(out).bucket.client  # kept by the process for its uploads (store/bucket.py)

    def upload(self, out: str, segment: Segment, sources: list[PartTokens]) -> tuple[str, Segment, int]:
        """For an OUT on a store: a segment uploaded from this node (write/stored.py), its parts' tokens read
        from the object stores that hold them, this node's for all but small parts gathered from other nodes (or
        sent with the call: parts the driver tokenized before Ray took over); a large part moved into this node's
        files (Spilled) read from there, and they removed once it is up. Every part is read before anything is
        written: a part lost with its node fails the call first. Says which node uploaded it, and how much."""
        held = fetch([step.buffered for step in sources if isinstance(step.buffered, OnNode)])
        # Each step with its shard's parts as this process holds them (from Ray, or sent with the call).
        here = [
            replace(step, buffered=held(step.buffered)) if isinstance(step.buffered, OnNode) else step
            for step in sources
        ]
        return self.node, segment, upload_closed(StoredOut.of(out), ClosedSegment(segment, here))

    def keep(self, out: str, done: list[tuple[Checkpoint | None, OnNode, list | None]], check: NodeCheck | None) -> int:
        """Done shards whose buffered parts are in this node's object store kept where OUT lives (runner/storage.py
        keep_shard): all their parts and their checkpoint, or the parts of the keys given alone; returns how many."""
        ensure_seen(check)
        held, where = fetch([on_node for _, on_node, _ in done]), storage_of(out)
        for ckpt, on_node, keys in done:
            parts = held(on_node)
            where.keep_shard(on_node.shard, ckpt, parts if keys is None else {key: parts[key] for key in keys})
        return len(done)

"""Scheduling on Ray: one task per unfinished shard (or per pack of small ones), two at once per worker;
stalled tasks cancelled and submitted again; finished shards copied into their split files meanwhile
(copies.py); a node lost, what it held tokenized again.

Ray schedules; the retries are the driver's (Ray's `max_retries` is 0). A task whose worker or node died goes
again, up to --max-retries, and resumes its shard from its checkpoint. Ray's own retries would also re-run a
task behind the driver's back to rebuild a result whose node was lost (lineage reconstruction): a whole pack
for one shard's tokens, inside a Placer's wait, once a place's turn came, and only for tasks with retries left
(a pack has none). What Ray cannot see is a task that is alive but stuck: each worker reports progress to the
ProgressBoard actor, and the scheduler cancels a task that reported nothing for `stall_timeout` seconds (the
worker dumps its stacks to OUT/logs first) and submits it again.

A node lost (runner/nodes.py, NodeWatch) costs what it held, never the run: the shards done and waiting in its
object store to be placed are tokenized again on the nodes left (their place in the split is kept: the same
counts, the same bytes), those that ran there go again as a dead worker's do, and one line says which node and
how many shards. With no node left that can run a shard, the run stops with one line; the same command resumes.
The run follows the cluster: a node that joins is said, and the workers are refitted to the cluster as it is (up
to --workers); Ray gives it tasks as any node, and one that fails its check gets none (Scheduler._follow).
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokpipe.errors import NodeError, RayUnavailable, Unavailable
from tokpipe.fmt import plural
from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.layout.files import RUN_LOG, stall_dump
from tokpipe.options import RunOptions
from tokpipe.runner.cluster import fit_workers
from tokpipe.runner.copies import Placers, get
from tokpipe.runner.events import Listener, Said
from tokpipe.runner.local import Tally, describe_failure
from tokpipe.runner.nodes import NodeWatch
from tokpipe.runner.progress import Progress, RunLog
from tokpipe.runner.storage import Folder, Prefix
from tokpipe.runner.task import OnNode, ProgressBoard, shard_task, ship_tokenizer
from tokpipe.write.shard import EncodeSpec

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
PLACING_TRIES = 3  # failed calls of a node's Placer, live or never started, before the run stops, not spins
PACK_BYTES = 32 << 20
PACK_SHARDS = 64


def packs(shards: Iterator[Shard], left: int, workers: Callable[[], int]) -> Iterator[list[Shard]]:
    """The shards in order, one task's at a time: consecutive ones while they come to at most PACK_BYTES,
    PACK_SHARDS, and a quarter of a worker's share of what is `left` (a larger shard alone), `workers()` the workers
    the run has as the pack is made (they follow the cluster). Lazy: each is taken when the task before it is made.

    What is left shrinks as packs are made, and so do they (guided self-scheduling): the last tasks are single
    shards, so no worker finishes a pack long after the others went idle. With a quarter of the whole run's
    share, 2 workers on 64 shards of 5.6 MB took packs of 5 to the end, and one waited up to a pack (~1.6 s) for
    the other."""
    pack, size, limit = [], 0, min(PACK_BYTES, left // (4 * workers()))
    for shard in shards:
        if pack and (size + shard.size > limit or len(pack) == PACK_SHARDS):
            yield pack
            left -= size
            pack, size, limit = [], 0, min(PACK_BYTES, left // (4 * workers()))
        pack.append(shard)
        size += shard.size
    if pack:
        yield pack


def _name(shards: list[Shard]) -> str:
    """How the log names a task's shards: `shard X`, or `a pack of N shards (X ... Y)`."""
    if len(shards) == 1:
        return f"shard {shards[0].relpath}"
    return f"a pack of {len(shards)} shards ({shards[0].relpath} ... {shards[-1].relpath})"


def _tag(shards: list[Shard]) -> str:
    """Under which name a task reports to the ProgressBoard: its first shard's."""
    return f"{shards[0].split}/{shards[0].key}"


def _died_on(error: Exception) -> str | None:
    """The node a NodeDiedError names, for a task that failed before its first beat said where it ran: only in the
    message (the error has no field for it; _raylet.so: "... is dead or unavailable. Node IP: %s, node ID: %s.")."""
    found = re.search(r"node ID: ([0-9a-f]+)", str(error)) if isinstance(error, ray.exceptions.NodeDiedError) else None
    return found and found[1]


@dataclass(frozen=True)
class _Task:
    """A task as the driver keeps it: its shards and how often they stalled or their worker died; once
    submitted, when, and the reference to the parts it buffered. `redo`: the OnNode of a shard tokenized again
    because its node was lost (its parts have their place already, and wait for these tokens)."""

    shards: list[Shard]
    stalls: int = 0
    crashes: int = 0
    redo: OnNode | None = None
    submitted: float = 0.0
    buffered: ray.ObjectRef | None = None


class Tasks:
    """The shard tasks: those to go (the packs yet to be made, and `again`: those cancelled for a stall, their
    worker or node lost, of a failed pack) and those `running` on Ray, at most QUEUED per worker; the ProgressBoard's
    last snapshot of them; their retries, after a stall or a worker's death, and the shards that failed for good
    (the tally's `failed`).

    Shards are taken from the manifest as workers free up (the driver holds the running ones, never the
    list), checkpoints read again at that moment: a shard a leftover worker finished meanwhile is skipped.
    """

    def __init__(
        self,
        manifest: Manifest,
        out: Folder | Prefix,
        spec: EncodeSpec,
        opts: RunOptions,
        workers: int,
        log: RunLog,
        tally: Tally,
        check: ray.ObjectRef | None,
        watch: NodeWatch,
    ):
        self.out, self.opts, self.workers, self.log, self.tally = out, opts, workers, log, tally
        self.check, self.watch = check, watch  # check: on a cluster, the NodeCheck a node not probed runs
        # One task name for all: the driver keeps state per distinct name (~1.8 MiB per 1k names, measured).
        self.cpus = 2 if spec.read_ahead else 1
        self.task = ray.remote(
            num_cpus=self.cpus,
            num_returns=2,  # the results, and the shards' buffered parts (task.shard_task)
            max_retries=0,  # the driver's (see above)
            name="tokpipe shard",
        )(shard_task)
        # Pinned (not soft): with a soft affinity Ray's GCS put it on another node now and then (seen with Placers,
        # when the driver's node had no worker to spare), and losing that node stalled the driver's reads of it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.board = ProgressBoard.options(scheduling_strategy=here).remote()
        shipped = None if out.on_disk else ship_tokenizer(spec)  # a store: no file system shared with the nodes
        self.common = ray.put((out.name, spec, self.board, opts.stall_timeout, shipped))  # see task.shard_task
        # Not those done (in OUT: runner/storage.py), nor those that failed in this process already (tokenize_while).
        is_done = out.is_done

        def unfinished() -> Iterator[Shard]:  # read twice: the manifest streams, 60,000 shards are not held
            left = (s for s in manifest.shards() if s.relpath not in tally.here and s.relpath not in tally.failed)
            return (s for s in left if not is_done(s))

        self.packs = packs(unfinished(), sum(s.size for s in unfinished()), lambda: self.workers)
        self.packed = False  # every shard is in a task (or was)
        self.again: deque[_Task] = deque()
        self.running: dict[ray.ObjectRef, _Task] = {}  # by the reference to its results
        self.totals, self.beats, self.nodes = [0, 0, 0], {}, {}  # the board's last snapshot

    @property
    def left(self) -> bool:
        """Whether a shard is yet to be tokenized: running, to go again, or in no task yet."""
        return bool(self.running or self.again or not self.packed)

    def running_on(self, node: str) -> set[str]:
        """The shards of the tasks running on `node`, as the board's last snapshot says."""
        return {s.relpath for t in self.running.values() if self.nodes.get(_tag(t.shards)) == node for s in t.shards}

    def submit(self) -> None:
        while len(self.running) < QUEUED * self.workers:
            if self.again:
                task = self.again.popleft()
            elif shards := next(self.packs, None):
                task = _Task(shards)
            else:
                self.packed = True
                return
            remote = self.task
            if where := self.watch.steer(self.cpus):
                remote = self.task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(where, soft=True))
            # The clock read before the call: a worker free at once beats within milliseconds, maybe before the call
            # returns to a driver a loaded machine holds up; a beat older than `submitted` is taken for the last
            # attempt's, and a shard stuck from its start was never found stalled (the run hung, seen under load).
            submitted = time.time()
            ref, buffered = remote.remote(task.shards, self.common, self.check, task.redo is not None)
            self.running[ref] = replace(task, submitted=submitted, buffered=buffered)

    def retry(self, task: _Task, error: Exception, crashed: bool) -> None:
        """A task that failed: a pack's shards go again one by one; a shard whose worker or node died (`crashed`)
        goes again while it has retries; else it failed (a shard tokenized again after its node was lost too: its
        place in the split stays taken, and the run ends unfinished)."""
        if len(task.shards) > 1:
            self.log(f"{_name(task.shards)} failed ({describe_failure(error)}); its shards go again one by one")
            self.again.extend(_Task([shard]) for shard in task.shards)
            return
        relpath = task.shards[0].relpath
        if crashed and task.crashes < self.opts.max_retries:
            self.log(f"shard {relpath}: its worker died ({describe_failure(error)}); it goes again")
            self.again.append(replace(task, crashes=task.crashes + 1))
            return
        self.tally.failed[relpath] = describe_failure(error)
        self.log(f"shard {relpath} FAILED: {self.tally.failed[relpath]}")

    def cancel_stalled(self, now: float) -> None:
        for ref, task in list(self.running.items()):
            beat = self.beats.get(_tag(task.shards), 0.0)
            # A task's clock starts at its first beat: until then it waits for a worker process (1-3 s
            # here, over 5 s under load; whose failure to start Ray reports), which is no stall of the shard.
            if beat < task.submitted:
                continue
            quiet = now - beat
            if quiet < self.opts.stall_timeout:
                continue
            del self.running[ref]
            ray.cancel(ref, force=True)
            shards = task.shards
            dump = stall_dump(self.out.records, shards[0])  # the task's, a pack's under its first shard's name
            self.log(f"{_name(shards)}: no progress for {quiet:.0f}s, cancelled (stack dump: {dump})")
            if len(shards) > 1:  # which of them stalled is unknown: each goes again alone, with its own retries
                self.again.extend(_Task([s]) for s in shards)
            elif task.stalls < self.opts.max_retries:
                self.again.append(replace(task, stalls=task.stalls + 1))
            else:
                self.tally.failed[shards[0].relpath] = (
                    f"stalled {task.stalls + 1} times (no progress for {self.opts.stall_timeout:.0f}s);"
                    f" stacks in {dump}"
                )

    def read_board(self) -> None:
        try:
            self.totals, self.beats, self.nodes = ray.get(self.board.snapshot.remote(), timeout=30)
        except ray.exceptions.RayError:  # board restarting: keep the last view; stall clocks wait for new beats
            pass


class Losses:
    """The nodes the run lost (NodeWatch finds them): what each held goes again, and one line says what it cost."""

    def __init__(self, tasks: Tasks, tell: Listener):
        self.tasks, self.watch, self.log, self.tell = tasks, tasks.watch, tasks.log, tell
        self.unsaid: dict[str, tuple[float, set[str], set[str]]] = {}  # node -> found at, shards ran, waited there
        self.placing_failures: Counter[str] = Counter()  # node -> calls of its live Placers that failed

    def lose(self, node: str, copies: Placers, ran: list[Shard] = (), taken: list[OnNode] = ()) -> bool:
        """A node is lost: the shards done and waiting in its object store are tokenized again (with `taken`,
        those marked lost already), those running there go again as their tasks fail (`ran`: one that failed,
        which may come before the node is found lost or after). Said in one line (`say`). Stops the run if no
        node left can run a shard. Returns whether it held shards to tokenize again."""
        if node not in self.watch.lost:
            self.watch.lost.add(node)
            self.unsaid[node] = (time.monotonic(), set(), set())
        stored = [*taken, *copies.lose(node)]
        self.tasks.again.extendleft(_Task([s.shard], redo=s) for s in stored)
        running = {s.relpath for s in ran} | self.tasks.running_on(node)
        waiting = {s.shard.relpath for s in stored}
        if node in self.unsaid:
            self.unsaid[node][1].update(running)
            self.unsaid[node][2].update(waiting)
        elif waiting:
            self.log(f"node {self.watch.name(node)}, lost: done there, to tokenize again: {', '.join(sorted(waiting))}")
        if self.tasks.left and not self.watch.can_run(self.tasks.cpus):
            self.say(now=True)
            raise RayUnavailable(
                f"node {self.watch.name(node)} was lost, and no node left in the cluster can run a shard"
                f" ({plural(self.tasks.cpus, 'CPU')}): start one (`ray start --address ...`) and rerun the same"
                " command"
            )
        return bool(stored)

    def placing_failed(self, copies: Placers, node: str, lost: list[OnNode], error: Exception) -> None:
        """A placing call failed: its Placer, or the node its tokens were on, is gone. The shards whose tokens it
        lost are tokenized again; its other parts go again as they are (Placers.collect). A Placer that never starts
        (a driver in RAY_AUTH_MODE=token, a cluster not) was made again 6,278 times in 40 s, without a word."""
        failed = f"placing on node {self.watch.name(node)} failed ({describe_failure(error)})"
        self.log(f"{failed}: {plural(len(lost), 'shard')} to tokenize again")
        for where in {node} | {stored.node for stored in lost}:
            if where in self.watch.lost or self.watch.confirms(where):
                self.lose(where, copies, taken=[s for s in lost if s.node == where])
                lost = [s for s in lost if s.node != where]
        self.tasks.again.extendleft(_Task([stored.shard], redo=stored) for stored in lost)
        died = isinstance(error, ray.exceptions.RayActorError)  # a Placer killed: made again, and it goes on
        unborn = died and (error.actor_init_failed or "never ran" in str(error))
        if node not in self.watch.lost and (unborn or not died):
            self.placing_failures[node] += 1
            if self.placing_failures[node] >= PLACING_TRIES:
                raise RayUnavailable(
                    f"placing on node {self.watch.name(node)} failed {PLACING_TRIES} times, its Placer"
                    f" {'never started' if unborn else 'up'} ({describe_failure(error)}); details in OUT/logs/{RUN_LOG}"
                )

    def say(self, now: bool = False) -> None:
        """Say each node lost, in one line with what it cost, once POLL_EVERY has passed since it was found (or
        `now`): its tasks' failures come in meanwhile (a task there fails within 0.1 s of the loss, and may come
        before the node is found lost or after)."""
        for node, (found, running, waiting) in list(self.unsaid.items()):
            if not now and time.monotonic() - found < POLL_EVERY:
                continue
            del self.unsaid[node]
            line = f"ray: node {self.watch.name(node)} lost: " + (
                f"{plural(len(running | waiting), 'shard')} to tokenize again ({len(running)} running there,"
                f" {len(waiting)} done and waiting there to be placed)"
                if running | waiting
                else "it held no shard of the run"
            )
            self.tell(Said(line, stderr=True))
            self.log(f"{line}: {', '.join(sorted(running | waiting))}")


class Scheduler:
    """Runs every unfinished shard to completion or failure (Tasks), copying finished ones into place as their
    offsets become known (SplitFileWrites; on a store, SegmentUploads), and tokenizing again what a node lost held
    (Losses).
    Afterwards the tally's `failed` (relpath -> error) says which shards failed."""

    def __init__(self, tasks: Tasks, tell: Listener):
        self.tasks, self.log, self.tally, self.watch, self.tell = tasks, tasks.log, tasks.tally, tasks.watch, tell
        self.losses = Losses(tasks, tell)
        self.fitted = set(self.watch.up)  # the nodes the workers were last fitted to
        self.done = 0  # shards finished, for the progress counts

    def run(self, progress: Progress, copies: Placers, done: int) -> None:
        """Tokenize every unfinished shard, placing what can be meanwhile; returns once the last is tokenized.
        `done`: shards finished before (this run's, in the driver), for the progress counts."""
        self.done = done
        self._loop(progress, copies, None)

    def drain(self, progress: Progress, copies: Placers, excluded: frozenset[str]) -> None:
        """Place everything whose place is known (with `excluded` left out), tokenizing again what a node lost
        meanwhile held."""
        self._loop(progress, copies, excluded)

    def _loop(self, progress: Progress, copies: Placers, excluded: frozenset[str] | None) -> None:
        """`excluded` None: until every shard is tokenized; else until every part is placed (the tail, in which
        the driver also waits on the copies)."""
        tasks, failed = self.tasks, self.tally.failed
        last_look = 0.0  # when progress and stalls were last looked at
        copies.feed(excluded or frozenset())  # what earlier runs finished and did not place
        while True:
            tasks.submit()
            if not tasks.running and (excluded is None or not copies.busy):
                # The end; but a node lost since the last look, which the GCS may not have found yet, is said, and
                # what it held tokenized again.
                if excluded is None or not any([self.losses.lose(node, copies) for node in self.watch.gone(now=True)]):
                    break
                continue
            # Wake on the first finished task, then take all that are done GATHER later.
            waiting = [*tasks.running, *(copies.running if excluded is not None else ())]
            ready, _ = ray.wait(waiting, num_returns=1, timeout=POLL_EVERY)
            if ready:
                ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=GATHER)
            for placer_node, lost, error in copies.collect():
                self.losses.placing_failed(copies, placer_node, lost, error)
            for ref in ready:
                if ref in tasks.running:
                    self._collect(ref, copies)
            now = time.time()
            # At the first shard done, before its parts are written (which may fill the disk): the disk's projection.
            if now - last_look >= POLL_EVERY or progress.projects(self.done):
                last_look = now
                tasks.read_board()
                # Running: the shards whose workers have begun them (a beat), not those submitted and queued.
                progress.update(*tasks.totals, done=self.done, running=len(tasks.beats), failed=len(failed))
                tasks.cancel_stalled(now)
                for node in self.watch.gone():
                    self.losses.lose(node, copies)
                self._follow(progress, copies)
                self.losses.say()
            copies.feed(excluded or frozenset())
        self.losses.say(now=True)
        tasks.read_board()
        progress.update(*tasks.totals, done=self.done, running=0, failed=len(failed), final=True)

    def _follow(self, progress: Progress, copies: Placers) -> None:
        """The run follows the cluster: for nodes that joined since the last look, a line each, and, when a node
        joined, was lost or was refused, the workers of the cluster as it is now (up to --workers), for which Ray has
        the CPUs; Ray sends them tasks as any node. A node that joined checks itself at its first task
        (nodes.ensure_seen), and is refused if it fails: said once, whether or not its join was said before."""
        joined, self.watch.joined = [n for n in self.watch.joined if n not in self.watch.refused], []
        if not joined and self.watch.up == self.fitted:
            return
        self.fitted = set(self.watch.up)
        cpus, memory = self.watch.capacity()
        opts = self.tasks.opts
        workers = fit_workers(opts.workers, cpus, memory, opts.worker_memory, cluster=True)[0]
        self.tasks.workers = progress.workers = max(1, min(workers, cpus // self.tasks.cpus))
        copies.slots = copies.AT_ONCE * len(self.watch.up)
        self.log(f"cluster: {len(self.watch.up)} nodes up, {cpus} CPUs, {memory / 2**30:,.1f} GiB of memory for tasks:"
                 f" {plural(self.tasks.workers, 'worker')}")  # fmt: skip
        for node in joined:
            cpu = int(self.watch.known[node]["Resources"].get("CPU", 0))
            self.tell(Said(f"ray: node {self.watch.name(node)} joined ({plural(cpu, 'CPU')}): "
                           f"{plural(self.tasks.workers, 'worker')} now"))  # fmt: skip

    def _collect(self, ref, copies: Placers) -> None:
        """Take a finished task's results."""
        task = self.tasks.running.pop(ref)
        try:
            results = get(ref, task.buffered)
        except NodeError as e:  # a node the driver did not probe: one that joined since gets no shard, and the task
            # goes again elsewhere; a node of the start, or one no other node can stand in for, stops the run
            if e.node and e.node not in self.watch.initial:
                first = e.node not in self.watch.refused  # other tasks Ray sent there fail as this one did
                self.watch.refuse(e.node)
                if self.watch.can_run(self.tasks.cpus):  # a look at the nodes now: those up, less it
                    if first:
                        self.tell(Said(f"ray: {e.said}: it joined the cluster and gets no shard of this run"))
                    self.tasks.again.append(task)
                    return
            self.log(f"node check: {e}")
            raise
        except Unavailable as e:  # every shard would wait out the same retries: the run stops, resumable
            self.log(f"shard {task.shards[0].relpath}: {e}")
            raise
        except (ray.exceptions.RayError, OSError) as e:
            self._failed(task, e, copies)
            return
        if task.redo is not None:
            if results[0].buffered_on is None:  # alone, a shard has at least the room it had in its pack
                raise RuntimeError(f"shard {task.shards[0].relpath}, tokenized again, did not keep its tokens")
            copies.found(task.redo, task.buffered, results[0].buffered_on)
        else:
            for index, (shard, result) in enumerate(zip(task.shards, results)):
                stored = OnNode(shard, task.buffered, result.buffered_on, index) if result.buffered_on else None
                copies.assembler.done(shard, result.checkpoint, stored)
                self.tally.add(shard, result, self.log)
            self.done += len(task.shards)
        # Done there just before it was lost (a shard tokenized again too): its tokens are lost with it.
        for node in {r.buffered_on for r in results} & self.watch.lost:
            self.losses.lose(node, copies)

    def _failed(self, task: _Task, error: Exception, copies: Placers) -> None:
        """A task that failed: the node it ran on, if that is lost, said lost; the task retried (Tasks.retry)."""
        crashed = not isinstance(error, ray.exceptions.RayTaskError)  # the worker died, not the shard's code
        if crashed and _tag(task.shards) not in self.tasks.nodes:  # begun since the board's last snapshot, maybe
            self.tasks.read_board()
        node = self.tasks.nodes.get(_tag(task.shards)) or _died_on(error)
        if crashed and node is not None and (node in self.watch.lost or self.watch.confirms(node)):
            self.losses.lose(node, copies, task.shards)
        self.tasks.retry(task, error, crashed)

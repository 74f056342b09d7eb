"""The cluster's nodes: which ones the run has lost (NodeWatch), and, on a cluster (--address), that every
node sees the shards, the tokenizer and OUT at the driver's paths: storage that all of them mount alike.
That is checked before any shard is tokenized, by a zero-CPU probe task pinned to each alive node; a node
that joins later (or whose probe did not answer in time) checks itself in its first task, once per worker
process. A node of the start that cannot see a path stops the run with one line naming the node and the path
(exit 2); one that joined mid-run is named in one line and gets no shard (runner/schedule.py), unless no other
node can run one.
Unchecked, such a node failed every shard it took on whichever file of OUT it opened first (a stall
dump's), or worse, wrote shards to a disk of its own where the driver never sees them.

What a node checks (`unseen`), and why that is enough:
- its tokpipe, the driver's (code_digest): tasks and their results pass between them pickled, by module and class
  name, and another version's may not read back (a class moved: each placing call failed, made again for good).
  And the libraries that make the bytes, the driver's versions (LIBRARIES): the driver checked its encoder
  against `tokenizers` on a sample, not a node's other version.
- OUT, as where it lives says (runner/storage.py `unseen`): it reads back the token the driver wrote there for
  this run (a folder of the node's own at the same path lacks it), then writes and removes a file of its own
  beside it.
- the tokenizer.json, read whole: its sha256 must be the run's (a copy of another version would
  encode other ids). Workers read no other file of the tokenizer.
- the shards: one in each folder the manifest's shards lie in (at most MAX_FOLDERS, spread evenly)
  and SAMPLE more spread over the manifest, each opened, its size the one the driver sees. Not the
  manifest's: a shard fixed after it failed (a cut download fetched again) has another, and the
  documented fix, the same command, was refused on a cluster as if a node saw other storage. Every file of a
  folder lies on that folder's mount, so one per folder reaches every mount the shards are on; the
  sample catches a partial copy. Not every shard: 60,000 shards on hundreds of nodes would be
  millions of round trips to the shared storage, for what a few hundred prove.
With OUT on an object store (layout/stored.py) the nodes share no file system: a node reads back the token the
driver put under OUT on the store and writes and removes an object of its own there, with its own credentials;
the tokenizer comes to it through Ray's object store (task.ship_tokenizer), the shards are on
the store too (each read through the node's own client).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokpipe.errors import NodeError, UserError
from tokpipe.fmt import plural
from tokpipe.inputs.manifest import Manifest
from tokpipe.inputs.tokenizer import TokenizerInfo
from tokpipe.layout.files import RUN_LOG
from tokpipe.runner.head import WATCH_EVERY, takes_connection
from tokpipe.runner.storage import Folder, Prefix, storage_of

MAX_FOLDERS = 256  # of the shards' folders, one shard each
SAMPLE = 32  # shards more, spread over the manifest
PROBE_SECONDS = 30  # a node that has not answered by then checks itself in its first task


@dataclass(frozen=True)
class NodeCheck:
    """What every node must see, at these paths."""

    out: str
    token: str  # this run's, in OUT's node-check file
    tokenizer: str  # the tokenizer.json
    tokenizer_sha256: str
    shards: tuple[tuple[str, int], ...]  # (path, size as the driver sees it) of the shards each node opens
    code: str = ""  # the driver's code_digest()
    libraries: tuple[tuple[str, str | None], ...] = ()  # the driver's library_versions()
    checked: frozenset[str] = frozenset()  # ids of the nodes whose probe passed

    @classmethod
    def of(cls, manifest: Manifest, info: TokenizerInfo, out: Path | str) -> NodeCheck:
        """The shards to open (one pass over the manifest), each at the size the driver sees (the manifest's where it
        cannot: a driver with --ray-only need not mount the dataset), and a new token."""
        step = max(1, sum(manifest.counts.values()) // SAMPLE)
        firsts: dict[str, tuple[str, int]] = {}  # folder -> its first shard
        sample = []
        for i, shard in enumerate(manifest.shards()):
            if shard.on_store:  # not on a mount: each node reads it through its own client
                continue
            firsts.setdefault(os.path.dirname(shard.path), (shard.path, shard.size))
            if i % step == 0:
                sample.append((shard.path, shard.size))
        folders = list(firsts.values())
        folders = folders[:: max(1, -(-len(folders) // MAX_FOLDERS))]  # none: every shard on a store
        shards = tuple((path, _size_here(path, size)) for path, size in dict.fromkeys(folders + sample))
        return cls(str(out), secrets.token_hex(16), info.path, info.sha256, shards, code_digest(), library_versions())


def _size_here(path: str, listed: int) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return listed


OTHER_CODE = "runs another tokpipe than the driver"
PACKAGE = Path(__file__).resolve().parents[1]  # this process's tokpipe


@functools.cache
def code_digest() -> str:
    """This process's tokpipe: the sha256 of its modules' names and bytes (84 files: 4 ms, once a process)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# What the bytes of OUT depend on beside tokpipe: the encoders (inputs/encoders.py), and the readers of the shards'
# text (JSON, zstd, Parquet).
LIBRARIES = ("tokenizers", "fastokens", "gigatoken", "orjson", "zstandard", "pyarrow")


@functools.cache
def library_versions() -> tuple[tuple[str, str | None], ...]:
    """This process's version of each of LIBRARIES (None: not installed)."""
    found = []
    for name in LIBRARIES:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            found.append((name, None))
    return tuple(found)


def unseen(check: NodeCheck, who: str) -> str | None:
    """What this machine cannot see of what the run needs, in a few words; None when it sees it all.
    `who` names the file it writes under OUT (unique among the processes that check at once)."""
    if check.code and (code := code_digest()) != check.code:
        return f"{OTHER_CODE} ({PACKAGE}: sha256 {code[:16]}, not the driver's {check.code[:16]})"
    ours = dict(library_versions()) if check.libraries else {}
    for name, theirs in check.libraries:
        if ours[name] != theirs:
            return f"{OTHER_CODE} ({name} {ours[name] or 'not installed'}, not the driver's {theirs or 'none'})"
    out = storage_of(check.out)
    if (problem := out.unseen(check.token, who)) or not out.on_disk:
        return problem  # on a store: the tokenizer comes through Ray's object store (task.py), the shards are objects
    try:
        digest = hashlib.sha256(Path(check.tokenizer).read_bytes()).hexdigest()
    except OSError as e:
        return f"cannot read the tokenizer {check.tokenizer} ({e.strerror})"
    if digest != check.tokenizer_sha256:
        theirs = f"sha256 {digest[:16]}, not the run's {check.tokenizer_sha256[:16]}"
        return f"sees another tokenizer at {check.tokenizer} ({theirs})"
    for path, size in check.shards:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe: opening it would wait for a writer
                continue
            with open(path, "rb") as f:
                found = os.fstat(f.fileno()).st_size
        except OSError as e:
            return f"cannot read the shard {path} ({e.strerror})"
        if found != size:
            return f"sees the shard {path} with {found:,} bytes, not the driver's {size:,}"
    return None


def refusal(problems: list[str], out: Folder | Prefix) -> str:
    """The one line that stops the run: the first node's problem, how many more, what to do."""
    more = f" (and {len(problems) - 1} more nodes, in OUT/logs/{RUN_LOG})" if len(problems) > 1 else ""
    fix = "every node must run the driver's tokpipe (the same install)" if OTHER_CODE in problems[0] else out.every_node
    return f"{problems[0]}{more}: {fix}, and rerun the same command"


def _node() -> str:
    return f"node {ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()})"


def _probe(check: NodeCheck) -> str | None:
    problem = unseen(check, ray.get_runtime_context().get_node_id())
    return problem and f"{_node()} {problem}"


def check_nodes(manifest: Manifest, info: TokenizerInfo, out: Folder | Prefix, log, watch: NodeWatch) -> ray.ObjectRef:
    """Probe every alive node; refuse (UserError) if one cannot see what the run needs. Returns the
    NodeCheck, in Ray's object store, that the tasks take (and check on a node not probed here). A node whose
    raylet takes no connection is lost (the GCS yet to say so): a probe there would wait PROBE_SECONDS."""
    check = NodeCheck.of(manifest, info, out.name)
    out.post_token(check.token)
    probe = ray.remote(num_cpus=0, max_retries=0, name="tokpipe node check")(_probe)
    nodes = [node for node in watch.up if watch.answers(node)]
    for node in watch.up - set(nodes):
        log(f"node check: node {watch.name(node)} does not answer (lost, and Ray yet to find it): left out")
    refs = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(check): node
        for node in nodes
    }
    answered, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_SECONDS)
    problems, passed = [], set()
    for ref in answered:
        try:
            problem = ray.get(ref)
        except ray.exceptions.RayError:  # the node (or its worker) died meanwhile: it checks itself if back
            continue
        if problem:
            problems.append(problem)
        else:
            passed.add(refs[ref])
    for ref in late:
        ray.cancel(ref)
    for problem in problems:
        log(f"node check: {problem}")
    if problems:
        raise UserError(refusal(problems, out))
    unchecked = f"; {len(nodes) - len(passed)} did not answer in {PROBE_SECONDS}s, checked at their first task"
    log(
        f"node check: {plural(len(passed), 'node')} {'sees' if len(passed) == 1 else 'see'} OUT, the tokenizer and "
        f"{plural(len(check.shards), 'shard')}"
        f"{unchecked if len(passed) < len(nodes) else ''}"
    )
    return ray.put(replace(check, checked=frozenset(passed)))


_passed: set[str] = set()  # tokens of the checks this worker process passed


def ensure_seen(check: NodeCheck | None) -> None:
    """In a task, before it touches a path: a node the driver did not probe checks itself, once per
    worker process, and raises NodeError if it cannot see what the run needs."""
    if check is None or check.token in _passed:
        return
    node = ray.get_runtime_context().get_node_id()
    # A Placer runs two calls at once in one process: each thread writes a file of its own.
    if node not in check.checked and (problem := unseen(check, f"{node}-{os.getpid()}-{threading.get_ident()}")):
        said = f"{_node()} {problem}"
        raise NodeError(refusal([said], storage_of(check.out)), node=node, said=said)
    _passed.add(check.token)


class NodeWatch:
    """Which nodes of the cluster the run has lost. Ray's GCS finds a node dead once its health checks have
    missed for long enough (13.5-17 s after a kill -9 here, Ray's defaults), while a task there fails within
    0.1 s (NodeDiedError), or, in some runs, not before the GCS said so, and a Placer made there meanwhile
    waits for it: a run would wait on a lost node, or end before Ray said it was lost. So a node is lost when
    the GCS says so, or when its raylet takes no connection: looked at every WATCH_EVERY (`gone`), and at
    once where something failed (`confirms`)."""

    def __init__(self):
        self.known: dict[str, dict] = {}  # every node seen alive: its ray.nodes() entry
        self.alive: set[str] = set()  # as the GCS said at the last look
        self.up: set[str] = set()  # those, less the lost and the refused
        self.lost: set[str] = set()  # those the run has given up
        self.refused: set[str] = set()  # nodes that joined mid-run and cannot see what the run needs: no shard
        self.joined: list[str] = []  # nodes first seen alive since the start, until the scheduler takes them
        self.looked = 0.0
        self.turn = 0  # of the node `steer` names next
        self._look()
        self.joined.clear()  # the nodes at the start did not join
        self.initial = set(self.known)

    def _look(self) -> set[str]:
        """Look at the nodes now; returns those the GCS found dead that the run has not yet given up."""
        self.looked = time.monotonic()
        nodes = ray.nodes()
        self.joined += [n["NodeID"] for n in nodes if n["Alive"] and n["NodeID"] not in self.known]
        self.known.update((n["NodeID"], n) for n in nodes if n["Alive"])
        self.alive = {n["NodeID"] for n in nodes if n["Alive"]}
        self.up = self.alive - self.lost - self.refused
        return {n["NodeID"] for n in nodes if not n["Alive"] and n["NodeID"] in self.known} - self.lost

    def refuse(self, node: str) -> None:
        """A node that joined and failed its check: no shard goes there any more (`steer`)."""
        self.refused.add(node)
        self.up.discard(node)

    def capacity(self) -> tuple[int, int]:
        """The CPUs and the memory (bytes) of the nodes up, as Ray counts them."""
        resources = [self.known[node]["Resources"] for node in self.up]
        return int(sum(r.get("CPU", 0) for r in resources)), int(sum(r.get("memory", 0) for r in resources))

    def steer(self, cpus: int) -> str | None:
        """A node up to send the next task to, in turn, while a node lost is one the GCS has yet to find dead, or a
        node refused is alive: until it is found dead, Ray's scheduler leases new tasks there and waits (4 tasks,
        another node free: 14.4 s, against none sent with a soft affinity to that node). None otherwise: Ray's
        scheduling, as always."""
        if not (self.lost | self.refused) & self.alive:
            return None
        able = sorted(node for node in self.up if self.known[node]["Resources"].get("CPU", 0) >= cpus)
        self.turn += 1
        return able[self.turn % len(able)] if able else None

    def gone(self, now: bool = False) -> set[str]:
        """The nodes lost, and not yet given up, if a look is due (or `now`): one raylet connection each."""
        if not now and time.monotonic() - self.looked < WATCH_EVERY:
            return set()
        return self._look() | {node for node in self.up if not self.answers(node)}

    def confirms(self, node: str) -> bool:
        """Whether a node where a task or a Placer failed is lost (the failure of one process there, a worker or
        a Placer, leaves the node up)."""
        return node in self._look() or not self.answers(node)

    def answers(self, node: str) -> bool:
        """Whether a node's raylet takes a connection (one not known to be up: it would be, then)."""
        found = self.known.get(node)
        return found is None or takes_connection(f"{found['NodeManagerAddress']}:{found['NodeManagerPort']}")

    def name(self, node: str) -> str:
        """How a line names a node: its address and the start of its id."""
        found = self.known.get(node)
        return f"{found['NodeManagerAddress'] if found else '?'} ({node[:8]})"

    def can_run(self, cpus: int) -> bool:
        """Whether a node left has the CPUs a shard task takes."""
        self._look()
        return any(self.known[node]["Resources"].get("CPU", 0) >= cpus for node in self.up)

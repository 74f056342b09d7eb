"""Ray for one run: how many workers fit, started at once in a thread so that the driver plans (and
tokenizes) meanwhile, workers that load the encoder before their first shard, and a stop that does
not wait for what need not be waited for.

Measured here (2 vCPUs): `ray.init` of an embedded instance 2.5-5 s, `ray.shutdown` 1.4 s, a
worker's first task 0.4-0.6 s, loading the fast encoder in a worker 0.8-1.2 s.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokpipe.errors import RayUnavailable, ReaderMayLeave, keep_sigterm
from tokpipe.fmt import free_bytes, plural, size
from tokpipe.inputs.encoders import encoder
from tokpipe.layout.run import STOPPED
from tokpipe.options import RunOptions
from tokpipe.runner.head import answers_as_ray, watch_head
from tokpipe.runner.local import describe_failure

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# An embedded Ray keeps its session (logs, sockets, the port files its start waits for, objects spilled past its
# store) under its temp folder: with less room there than this, the line that says Ray did not start says so. A
# 20 MB tmpfs full: ray.init waited 30 s for a port file its GCS could not write, and said only that.
RAY_ROOM = 64 << 20


def available_cpus() -> int:
    """The CPUs this process may use: its affinity and its cgroup's quota (what Slurm and containers
    set), not os.cpu_count(), which counts the machine's."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup("cpu.max", "cpu.cfs_quota_us")
    if quota and quota[0] not in ("max", "-1"):
        period = quota[1] if len(quota) > 1 else (_cgroup("cpu.cfs_period_us", "cpu.cfs_period_us") or ["100000"])[0]
        cpus = min(cpus, max(1, math.ceil(int(quota[0]) / int(period))))
    return cpus


def available_memory() -> int:
    """Bytes the run's processes may use: the machine's memory, or less where the cgroup limits it;
    95% of it, where Ray's memory monitor starts killing workers."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:"))
    limit = _cgroup("memory.max", "memory.limit_in_bytes")
    if limit and limit[0].isdigit():
        total = min(total, int(limit[0]))
    return int(total * 0.95)


def _cgroup(v2: str, v1: str) -> list[str] | None:
    for path in (Path("/sys/fs/cgroup") / v2, Path("/sys/fs/cgroup/cpu") / v1, Path("/sys/fs/cgroup/memory") / v1):
        with contextlib.suppress(OSError):
            return path.read_text().split()
    return None


def fit_workers(asked: int | None, cpus: int, memory: int, worker_memory_mib: int, cluster: bool) -> tuple[int, str]:
    """(workers to run, what to tell the user): at most one per CPU, and as many as their memory
    budget lets fit."""
    workers = asked or cpus
    notes = []
    if workers > cpus:
        where = "of the cluster" if cluster else "this process may use (its CPU affinity and cgroup quota)"
        notes.append(f"--workers {workers} is more than the {plural(cpus, 'CPU')} {where}: running {cpus}")
        workers = cpus
    fit = max(1, memory // (worker_memory_mib << 20))
    if workers > fit:
        where = "in the cluster" if cluster else "here"
        notes.append(
            f"{workers} workers x --worker-memory {worker_memory_mib} MiB do not fit the"
            f" {memory / 2**30:,.1f} GiB Ray can use {where}: running {fit}"
        )
        workers = fit
    return workers, "; ".join(notes)


def _load_encoder(backend: str, tokenizer_json: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    encoder(backend, tokenizer_json)


@dataclass
class Shape:
    """What the started Ray gives this run."""

    workers: int  # shard tasks at once
    read_ahead: bool  # a task takes 2 CPUs and reads its next batch on the second while it encodes
    nodes: int
    where: str  # for the "ray:" line
    note: str  # why fewer workers than asked, if so


def _join(opts: RunOptions, address: str | None) -> Shape:
    """Ray started by joining the cluster at `address` (--address or RAY_ADDRESS), or None: the Ray this process
    is connected to already (a library caller's ray.init); its workers fitted to it."""
    import ray

    if address is not None:
        answers_as_ray(address)
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    alive = [n for n in ray.nodes() if n["Alive"]]
    cpus = int(ray.cluster_resources().get("CPU", 1))
    widest = max((n["Resources"].get("CPU", 0) for n in alive), default=0)
    memory = int(sum(n["Resources"].get("memory", 0) for n in alive))
    workers, note = fit_workers(opts.workers, cpus, memory, opts.worker_memory, cluster=True)
    where = f"cluster {ray.get_runtime_context().gcs_address}" + ("" if address else " (this process's ray.init)")
    return Shape(workers, 2 * workers <= cpus and widest >= 2, len(alive), where, note)


def _embed(opts: RunOptions, fit: tuple[int, str], cpus: int) -> Shape:
    """Ray started as an embedded instance of this process, for the `fit` workers on its `cpus`."""
    import ray

    workers, note = fit
    read_ahead = 2 * workers <= cpus  # one node: its widest is all of it
    # address="local": never attach to some other Ray instance that happens to run on this machine.
    # The object store holds the shards done before their place in the split is known, each up
    # to --shard-buffer (EncodeSpec.buffer_bytes): room for two per worker.
    room = 2 * workers * (opts.buffer_mib << 20)
    # Ray (2.59 on) turns token authentication on for a local instance and, where no token is, writes one to
    # ~/.ray/auth_token: a read-only home (a compute node's, a container's) stopped its start, and the file left
    # turned it on for the user's own `ray start --head` after. A token of this run's, in its environment, instead.
    tokens = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    if not any(map(os.environ.get, tokens)) and not (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    ray.init(
        address="local",
        num_cpus=workers * (2 if read_ahead else 1),
        include_dashboard=False,
        object_store_memory=max(128 << 20, min(room, available_memory() * 3 // 10)),
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    alive = [n for n in ray.nodes() if n["Alive"]]
    return Shape(workers, read_ahead, len(alive), "embedded local instance", note)


def _did_not_start(error: BaseException, address: str | None) -> str:
    """The line that says Ray did not start: what Ray said, and what to do (an embedded Ray's temp folder short of
    room, if it is)."""
    said = describe_failure(error)
    if address and "InvalidAuthToken" in str(error.__cause__):  # past Ray's 20 tries, "Failed to connect" alone
        sent = "sent a token the cluster does not take" if os.environ.get("RAY_AUTH_MODE") == "token" else "sent none"
        return (
            f"could not join the Ray cluster at {address}: it asks for its token (Ray's token authentication: a `ray"
            f" start` turns it on where a token is, as a ray.init() leaves one in ~/.ray/auth_token), and this run"
            f" {sent}: run with RAY_AUTH_MODE=token and the cluster's token (`ray get-auth-token` on its head) in"
            " ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, then rerun"
        )
    if address:
        return f"could not join the Ray cluster at {address} ({said}): is it up (`ray status`)? Then rerun"
    # Where Ray's start puts its session, as Ray picks it (ray._common.utils.get_default_system_temp_dir).
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    room = free_bytes(temp) if os.path.isdir(temp) else RAY_ROOM
    full = f"; its temp folder {temp} has {size(room)} free (RAY_TMPDIR moves it)" if room < RAY_ROOM else ""
    return f"Ray did not start ({said}){full}: fix the cause and rerun the same command"


class RayLines:
    """Where Ray's own lines go in a process that exits after the run (the CLI's): to OUT/logs/ray.log, not to the
    terminal, once the run knows OUT is its own (`path`) and Ray has started (not before: a run Ray never starts
    for writes none). Those are the lines its C++ side writes on this process's stderr (a node's loss, the tasks it
    failed, the kill at the end), and the errors its driver thread prints ("(raylet) Task ... failed ...", colour
    codes and all). tokpipe's own lines go on to the terminal: sys.stderr moves to a copy of it. A library caller's
    stderr is its own: its Cluster leaves `path` None."""

    def __init__(self):
        self.path: Path | None = None  # OUT/logs/ray.log
        self.file = None  # that file, open once Ray's lines go there
        self.up = False  # Ray is up: its driver thread's printing can be routed
        self.lock = threading.Lock()

    def open(self) -> None:
        """Ray's lines to `path`, once it is known (and now that Ray has started)."""
        if self.path is None or self.file is not None:
            return
        self.file = open(self.path, "a", buffering=1)
        _stderr_to(self.file.fileno())
        logging.raiseExceptions = False  # a line Ray cannot write there (a full disk) is lost, no traceback
        with self.lock:  # else Ray's start routes them, once up
            if self.up:
                self._route()

    def ray_up(self) -> None:
        """Ray is up (in the thread that started it)."""
        with self.lock:
            self.up = True
            self._route()

    def _route(self) -> None:
        """Ray's driver prints the errors the cluster publishes (tasks failed and retried, nodes marked dead)
        through ray._private.worker.print_to_stdstream, to sys.stdout: once they go to OUT/logs, so do these."""
        if self.file is None:
            return
        import ray._private.worker

        log = self.file

        def to_log(data: dict, ignore_prefix: bool) -> None:
            log.writelines(f"({data.get('pid')}) {line}\n" for line in data["lines"])

        ray._private.worker.print_to_stdstream = to_log

    def silence(self) -> None:
        """At the kill that stops Ray, Ray's C++ side logs on this process's stderr the tasks it loses (the encoder
        warm-ups, say): noise about a kill that is meant, to OUT/logs/ray.log or, before OUT was the run's,
        nowhere. tokpipe's own lines go on to the terminal."""
        if self.file is None:
            _stderr_to(os.open(os.devnull, os.O_WRONLY))


def _sigterm_is_the_drivers(exits_after: bool) -> None:
    """SIGTERM kept tokpipe's, in the thread that starts Ray, before it imports Ray."""
    # Ray's core worker, made in this process by ray.init, installs absl's failure-signal handler over tokpipe's for
    # SIGTERM (RayLog::InstallFailureSignalHandler, call_previous_handler): a SIGTERM once it was up printed 5-8 lines
    # (`*** SIGTERM received at time=...`, `PC: @ 0x7f...`; the frames "(unknown)": no symbols) and, measured here,
    # the run died of SIGABRT (-6), not 143. This is Ray's own switch for it (read by ray._private.ray_constants on
    # import, so set before). Ray's processes inherit it: a crashing worker still has Python's faulthandler.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    # systemd's stop, Slurm's scancel and a kill of the process group send SIGTERM to Ray's GCS and raylet too:
    # killed while ray.init waited for them, it spun a minute for the lost GCS, holding the GIL, and ended in Ray's
    # fatal, exit 1 after 62 s, no line (measured: a group SIGTERM 2 s into a run). Ray's processes inherit this
    # thread's signal mask, in which Ray blocks SIGINT for the same reason: with SIGTERM blocked too, the driver
    # alone takes it, and its stop kills them. Not for a library caller: ray.shutdown ends them with SIGTERM.
    if exits_after:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


class Cluster:
    """Ray for this run, started in a thread by `start` (and by `wait`, if need be): `ready` is set when
    it is up (or failed to start). Until it is started, nothing of Ray runs: a run the driver finishes
    alone never pays for it.

    With at least twice as many CPUs as tasks, a task takes 2 and reads its next batch on the second
    while it encodes (EncodeSpec.read_ahead); Ray keeps that core free for it.
    """

    def __init__(self, opts: RunOptions, exits_after: bool = False):
        """`exits_after`: the process exits once the run ends (the CLI's): Ray's lines go to OUT/logs (`log_to`),
        and `stop` kills Ray's processes instead of shutting Ray down."""
        self.opts, self.exits_after = opts, exits_after
        self.lines = RayLines()
        self.address = opts.address or os.environ.get("RAY_ADDRESS")
        self.ready = threading.Event()
        self._done = threading.Event()  # the run no longer needs Ray
        self._stopping = threading.Event()  # the run stops Ray: its head and raylet going are no news
        self.shape: Shape | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._warm: tuple[str, str] | None = None  # (backend, tokenizer) to load in every worker, once known
        self._loading: list = []  # those loads, as tasks
        if not self.address:  # known before Ray starts: said at once
            self.cpus = available_cpus()
            self.fit = fit_workers(opts.workers, self.cpus, available_memory(), opts.worker_memory, cluster=False)
            # Processes Ray starts and then orphans (its agents, when the raylet dies) come back to this
            # process, not to init: stop() finds them all.
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
        self._thread = threading.Thread(target=self._start, name="tokpipe ray start", daemon=True)
        self.borrowed = False  # the Ray of a caller who had called ray.init: not tokpipe's to shut down
        self.log, self.save_logs = (lambda line: None), (lambda: None)  # the run's log, its save: log_to sets them

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self.ready.is_set()

    def start(self) -> None:
        if not self.started:
            self.borrowed = not self.exits_after and "ray" in sys.modules and sys.modules["ray"].is_initialized()
            self.lines.open()
            self._thread.start()

    def _start(self) -> None:
        _sigterm_is_the_drivers(self.exits_after)
        import ray  # here, in the thread that starts it: a run the driver finishes alone never imports it (0.7 s)

        # ray.init sets SIGTERM handlers of its own: Node's calls signal.signal from this thread, which
        # Python refuses off the main thread (ValueError), and either would sys.exit halfway through the
        # start. tokpipe's own (tokpipe.errors) stays.
        ray._private.utils.set_sigterm_handler = keep_sigterm
        try:
            if self.borrowed or self.address:  # the caller's Ray (used as it is, and left up), or a cluster
                self.shape = _join(self.opts, None if self.borrowed else self.address)
            else:
                self.shape = _embed(self.opts, self.fit, self.cpus)
            with self._lock:
                if self._warm:
                    self._load_in_workers(*self._warm)
                self.lines.ray_up()
                self.ready.set()
        except BaseException as e:  # handed to the driver's thread by wait()
            self._error = e
            self.ready.set()
        # Ray starts its GCS and raylet with PR_SET_PDEATHSIG, which fires when the *thread* that
        # started them ends, not the process: this one lives as long as the run, and watches Ray's head.
        if self._error is None:
            try:
                watch_head(self._stopping, self._head_lost)
            except Exception as e:  # the thread must live on, or Ray's processes go with it
                self.log(f"ray: its head is not watched ({describe_failure(e)})")
        self._done.wait()

    def _head_lost(self, line: str) -> None:
        """Ray's head or the driver's raylet gone (head.watch_head): said; in the CLI's process the run ends here, as
        Ray's client would end it soon, wordless. Its work is durable, as at a kill -9: the same command resumes."""
        print(f"tokpipe run: error: {line}", file=sys.stderr, flush=True)
        self.log(STOPPED + line)
        if self.exits_after:
            self.save_logs()
            self.lines.silence()
            _kill_descendants()
            sys.stdout.flush()
            os._exit(1)  # a run that failed

    def warm(self, backend: str, tokenizer_json: str) -> None:
        """Have every worker load the encoder now, before its first shard (at once if Ray is up, else
        as soon as it is)."""
        with self._lock:
            self._warm = (backend, tokenizer_json)
            up = self.ready.is_set() and self.shape is not None
        if up:
            self._load_in_workers(backend, tokenizer_json)

    def _load_in_workers(self, backend: str, tokenizer_json: str) -> None:
        # The shard tasks queue behind these on the same workers.
        import ray

        load = ray.remote(num_cpus=1)(_load_encoder)
        self._loading = [load.remote(backend, tokenizer_json) for _ in range(self.shape.workers)]

    def working(self) -> bool:
        """Whether Ray's workers are up, their encoders loaded (starting them and loading took 1-2 s
        after Ray was up, measured: the driver tokenizes until then)."""
        if not self.ready.is_set():
            return False
        if self._error is not None or not self._loading:
            return True
        import ray

        return len(ray.wait(self._loading, num_returns=len(self._loading), timeout=0)[0]) == len(self._loading)

    def wait(self) -> Shape:
        """Ray's shape, once it is up; RayUnavailable, in one line with what Ray said, if it did not start."""
        self.start()
        self.ready.wait()
        if self._error is not None:
            raise RayUnavailable(_did_not_start(self._error, self.address)) from self._error
        return self.shape

    def log_to(self, path: Path, log: Callable[[str], None], save: Callable[[], None]) -> None:
        """From here on Ray's own lines go to `path` (OUT/logs/ray.log), not to the terminal (RayLines). Only in a
        process that exits after the run (the CLI's): a library caller's stderr is its own. `log`: the run's log;
        `save`: what puts it where OUT's readers look (Storage.save_logs)."""
        self.log, self.save_logs = log, save
        if self.exits_after:
            self.lines.path = path
            if self.started:
                self.lines.open()

    def stop(self) -> None:
        """Ray's own shutdown (~1.4 s here; what a Python caller of tokpipe.run gets, whose process goes on);
        in a process about to exit (`exits_after`) with its work durable, every process this one started
        (Ray's and its workers) is killed at once instead."""
        if not self.started:
            return
        import ray

        self._stopping.set()
        if not self.exits_after:
            self.ready.wait()
            if not self.borrowed:
                ray.shutdown()
            self._done.set()
            self._thread.join()
            return
        if threading.current_thread() is threading.main_thread():
            # A SIGTERM from here on would cut the kill short and leave Ray's processes behind; the
            # process exits next anyway, with the run's own exit code (143 if a SIGTERM stopped it).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # Not while an embedded Ray starts: its client would wait a minute for the GCS it lost, holding the GIL.
        # (Measured: 3-5 s; up to 43 s on this 2-core machine with a load average of 10-13.) A join starts no
        # process here, and may wait minutes on an address: a Ctrl-C or SIGTERM then must not wait with it.
        if not self.address:
            self.ready.wait()
        self.lines.silence()
        _kill_descendants()
        # Ray's exit handler would shut down what is gone; the process exits without it.
        atexit.unregister(ray.shutdown)
        self._done.set()


def _kill_descendants() -> None:
    """Kill every process this one started, until two looks find none: a process Ray started just before its
    parent was killed comes back to this one (the subreaper), not to init."""
    quiet = 0
    while quiet < 2:
        pids = _descendants(os.getpid())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        quiet = 0 if pids else quiet + 1
        time.sleep(0.02)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # collect the children that died
                pass


def _stderr_to(fd: int) -> None:
    """Point this process's fd 2 at `fd`; sys.stderr, where tokpipe's lines go, goes on to where fd 2 went (one
    that writes elsewhere, a caller's capture, stays as it is)."""
    sys.stderr.flush()
    try:
        on_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a StringIO's
        on_fd2 = False
    terminal = os.dup(2) if on_fd2 else None
    os.dup2(fd, 2)
    if terminal is not None:
        sys.stderr = ReaderMayLeave(open(terminal, "w", buffering=1, closefd=False))


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]  # the name in parentheses may hold spaces
            if state != "Z":  # dead already, its parent yet to collect it
                children.setdefault(int(ppid), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

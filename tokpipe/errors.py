"""Errors that reach the user as one readable line instead of a traceback; SIGTERM as one of them; a reader of
the output going away as none."""

import os
import signal
import threading


class UserError(Exception):
    """Bad input or usage: the message says what was wrong and what to do. Exit code 2. `fix`: the run
    options (RunOptions field -> value, None to drop it) that make the command work, where the message
    names them: `tokpipe status` puts them into the command it prints."""

    def __init__(self, message: str, fix: dict | None = None):
        super().__init__(message)
        self.fix = fix or {}


class TooManyGroups(UserError):
    """--group-by named a field with more distinct values than a split may have groups (each group gets files)."""


def too_many_groups(group_by: str, where: str, values, limit: int, within: str = "") -> TooManyGroups:
    """The one refusal of a field with too many values, wherever it is seen first (the driver's look at a first
    shard, a worker's shard, the assembly of a split); a few of the values shown."""
    shown = ", ".join(repr(v) for v in sorted(values)[:3])
    return TooManyGroups(
        f"--group-by {group_by}: {where} has more than {limit:,} distinct values{within} (e.g. {shown}), and a split"
        f" may have at most {limit:,} groups: group by a field with a few values (a source, a language), not one per"
        " document (an id, a url)",
        fix={"group_by": None},
    )


class Unavailable(OSError):
    """Storage that did not answer through every retry (an object store's: store.StoreUnavailable): the run stops,
    resumable, as on a full disk; no other shard or node would do better."""


class NodeError(UserError):
    """A cluster node cannot see, at the driver's path, what the run needs (runner/nodes.py): raised in a
    task, it stops the run with its one line (exit code 2), unless the node joined mid-run and others can stand in
    (runner/schedule.py). `node`: its id; `said`: the node and what it cannot see, without what to do."""

    def __init__(self, message: str, node: str = "", said: str = ""):
        super().__init__(message)
        self.node, self.said = node, said  # pickled with it (its __dict__), from the task to the driver


class RayUnavailable(Exception):
    """Ray cannot do the run's work: it did not start, or no node left in the cluster can run a shard. One line,
    exit 1; what is done is kept, and the same command resumes once the cause is gone."""


class SourceError(Exception):
    """A shard's bytes cannot be read to the end (truncated or corrupt download). Names file and place."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (how Slurm, Kubernetes and systemd stop a job before they kill it): stopped as Ctrl-C
    stops a run, through the same path (checkpoints kept, Ray shut down, one line). Exit code 143."""


_received = threading.Event()  # a SIGTERM came, at any time


def _terminate(signum, frame):
    _received.set()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: a second must not cut the cleanup short
    raise Terminated()


def terminate_on_sigterm() -> None:
    """Make SIGTERM raise Terminated in the main thread, as SIGINT raises KeyboardInterrupt."""
    if threading.current_thread() is threading.main_thread() and not _received.is_set():
        signal.signal(signal.SIGTERM, _terminate)


def keep_sigterm(_ray_handler) -> None:
    """Takes the place of Ray's `set_sigterm_handler` in the driver: tokpipe's handler stays. Ray's start
    is not cut in the middle by a SIGTERM either way (its agents would outlive the run): Terminated is
    raised in the main thread, whose cleanup waits for the start to end before it kills Ray's processes
    (runner/cluster.py, Cluster.stop)."""


def terminated(interrupt: KeyboardInterrupt) -> bool:
    """Whether an interrupt is a SIGTERM's: Ray's waits turn an exception that a signal handler raises
    into a plain KeyboardInterrupt, so what the handler noted says it."""
    return isinstance(interrupt, Terminated) or _received.is_set()


class ReaderMayLeave:
    """stdout or stderr for a reader that may go away (`| head -1`, `2>&1 | head`). Python ignores SIGPIPE, so a
    write to a pipe whose reader is gone raises, at whichever print or flush comes after it left: with `head` a
    race, which made the exit status 141 one time and 0 the next, and could stop a run halfway (on stderr it
    failed the shard the driver was on, then hung a minute in Ray's excepthook). Here the reader's leaving
    changes nothing: what is written from then on goes nowhere (devnull over the file descriptor) and the
    command ends as it would have, with its own exit status."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._gone()
            return self.stream.write(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._gone()
            self.stream.flush()  # what was buffered, to devnull: else Python tries again at exit and complains

    def _gone(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def __getattr__(self, name):  # fileno, encoding, isatty, buffer: the stream's
        return getattr(self.stream, name)

"""OUT's lock on an object store: a lease (on the key layout/stored.py names: StoredOut.lease). A store has no
flock, and a run killed with kill -9 (or a lost node, a preempted machine) never unlocks: the lock must end by itself.

OUT/.lock is made only where there is none (`If-None-Match: *`), holding who holds it and when it last said so;
the live run says so again every `seconds / 3` (a PUT `If-Match` its ETag: a run whose lease was taken learns it
there, and stops), and before it writes (`check`) where it has not for `seconds`: a run stopped (Ctrl-Z, a paused
VM) while another took OUT over learns it before its first write once it goes on. It is removed at the end (DELETE
`If-Match`). Another run that finds it is refused in one line while the lease is live; once it has expired (nothing
renewed it for `seconds`, by the finder's clock, less SKEW), or at once when its holder is a process of this
machine (its host name, boot and PID namespace) that is gone, it is taken over by a PUT `If-Match` its ETag: of two
runs taking it at once, one wins. So after a kill -9 the same command resumes: at once on the same machine, within
a lease on another.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokpipe.errors import UserError
from tokpipe.store.bucket import Bucket, Exists

LEASE_SECONDS = 60.0
# Clocks of two machines may disagree by this much: a lease is taken over only once it is this far past its end.
SKEW = 5.0


def this_machine() -> str | None:
    """This boot of this kernel and this PID namespace: where a PID names a process of this process table. Two
    containers (a pod on its node's network) may share a host name, not their PIDs. None where there is no /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


@dataclass(frozen=True)
class Holder:
    """What OUT/.lock holds."""

    host: str
    pid: int
    renewed: float  # unix time of the holder's last renewal, by its clock
    seconds: float  # the lease's length
    machine: str | None = None  # this_machine() of the holder (None: a lease of a tokpipe before it)

    @classmethod
    def read(cls, raw: bytes) -> Holder | None:
        """The holder OUT/.lock names; None where it is not a lease tokpipe wrote."""
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def gone(self, now: float) -> bool:
        """Whether the lease has ended: expired, or held by a process of this machine that no longer runs."""
        if now > self.renewed + self.seconds + SKEW:
            return True
        if self.host != socket.gethostname() or self.machine not in (None, this_machine()):
            return False  # another machine's, or another PID namespace's: its PID is not this process table's
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's live process
            return False
        return False


@dataclass
class Lease:
    """A run's hold on OUT at `bucket`/`key` (OUT/.lock), renewed on a thread of its own while it is held (`with`)."""

    bucket: Bucket
    key: str
    seconds: float = LEASE_SECONDS
    etag: str | None = None
    lost: str | None = None  # why the lease is no longer this run's (another run took it over), once it is not
    renewed: float = 0.0  # unix time of this run's last renewal (Holder.renewed)
    _renewing: threading.Lock = field(default_factory=threading.Lock)  # the thread's renewal and check's, one at a time
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _put(self, **condition) -> None:
        """OUT/.lock written as this run's, now, on `condition` (bucket.put's)."""
        now = time.time()
        holder = Holder(socket.gethostname(), os.getpid(), now, self.seconds, this_machine())
        self.etag, self.renewed = self.bucket.put(self.key, json.dumps(holder.__dict__).encode(), **condition), now

    def acquire(self) -> None:
        """Hold OUT, or refuse (UserError, one line) while another run's lease is live."""
        with contextlib.suppress(Exists):
            self._put(create=True)
            return
        found = self.bucket.get(self.key)
        if found is None:  # released between our create and this read: try once more
            self._put(create=True)
            return
        raw, etag = found
        holder = Holder.read(raw)
        if holder is not None and not holder.gone(time.time()):
            left = holder.renewed + holder.seconds + SKEW - time.time()
            raise UserError(
                f"{self.bucket.where(self.key).removesuffix('/.lock')} is in use by another tokpipe run ({holder});"
                f" wait for it to finish or stop it (a run killed without a word frees it within {max(left, 0):.0f} s,"
                " when its lease ends)"
            )
        try:  # expired, gone, or not a lease tokpipe wrote: take it, unless another run takes it first
            self._put(if_match=etag)
        except Exists:
            raise UserError(
                f"{self.bucket.where(self.key).removesuffix('/.lock')} was taken by another tokpipe run just now;"
                " wait for it to finish or stop it"
            ) from None

    def renew(self) -> None:
        """Say again that OUT is held; a lease another run took over (this one was silent past its end) is lost."""
        with self._renewing:
            if self.lost is None:
                try:
                    self._put(if_match=self.etag)
                except Exists:
                    self.lost = "another tokpipe run took over OUT's lease (this run did not renew it in time)"

    def release(self) -> None:
        if self.lost is None and self.etag is not None:
            with contextlib.suppress(Exists):  # taken over meanwhile: it is the other run's now
                self.bucket.delete(self.key, if_match=self.etag)
        self.etag = None

    def check(self) -> None:
        """Raise (UserError) once the lease is lost: the run must stop writing OUT. Unrenewed for its length (the
        process stopped, the store away), the lease may be another's: renewed first, which tells."""
        if self.lost is None and time.time() - self.renewed > self.seconds:
            self.renew()
        if self.lost is not None:
            raise UserError(f"{self.bucket.where(self.key)}: {self.lost}; nothing it wrote is lost: rerun the command")

    def _keep(self) -> None:
        while self.lost is None and not self._stop.wait(self.seconds / 3):
            # The store away for a moment: the next renewal tries again, well before the lease ends.
            with contextlib.suppress(OSError):
                self.renew()

    def __enter__(self) -> Lease:
        self.acquire()
        self._thread = threading.Thread(target=self._keep, name="tokpipe lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, failed, *_) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.release()
        except OSError:
            if failed is None:
                raise  # else what stopped the run is what to say; the lease ends by itself, unrenewed

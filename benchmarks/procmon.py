"""Watching processes while they run, from /proc alone (no psutil in tokpipe's environment).

`Poller` calls its `poll` on a thread every `interval` seconds while a with-block lasts (disk.py's watch
is one). `TreeMonitor`, peak memory and CPU of a process tree, is another: every descendant of the root
pid (Ray's gcs_server and raylet are children of the driver that started them, its workers children of
the raylet). Per process it keeps the kernel's own peak RSS (VmHWM, exact whenever the process is seen
at least once after its peak), its CPU seconds, and the names it went by: a Ray worker retitles itself
`ray::IDLE`, `ray::shard_task`, `ray::ProgressBoard.report`, ...
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")
RAY_NON_TASK = {"ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}


@dataclass
class ProcStats:
    pid: int
    names: list[str] = field(default_factory=list)
    hwm: int = 0  # VmHWM, bytes
    cpu: float = 0.0  # user + system seconds, last seen

    @property
    def kind(self) -> str:
        joined = " ".join(self.names)
        if not any(n.startswith("ray::") for n in self.names):
            return "driver" if not self.names or self.names[0] == "driver" else "system"
        if "ProgressBoard" in joined:
            return "actor"
        if any(n.startswith("ray::") and n not in RAY_NON_TASK for n in self.names):
            return "task"  # ray::shard_task, or whatever title a task gives its worker
        return "idle-worker" if "ray::IDLE" in self.names else "ray-agent"


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _read(pid: int) -> tuple[str, dict[str, int], float] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").strip().decode("utf-8", "replace")
        status = {}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    status[key] = int(value.split()[0]) * 1024
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return cmd, status, cpu


def short_name(cmd: str) -> str:
    if cmd.startswith("ray::"):
        return cmd.split()[0]
    parts = cmd.split()
    if not parts:
        return "?"
    exe = os.path.basename(parts[0])
    if exe.startswith("python") and len(parts) > 1:
        script = next((p for p in parts[1:] if not p.startswith("-")), "")
        if parts[1] == "-m" and len(parts) > 2:
            script = parts[2]
        return f"python {os.path.basename(script)}"
    return exe


class Poller:
    """with a Poller: its `poll()` runs on a thread every `interval` seconds until the block ends."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)


class TreeMonitor(Poller):
    """with TreeMonitor(pid) as mon: ...; mon.stats -> {pid: ProcStats}; mon.peak_sum: the most RSS the
    whole tree held at once, as sampled (the sum of the per-process peaks bounds it from above)."""

    def __init__(self, root: int, interval: float = 0.1):
        super().__init__(interval)
        self.root = root
        self.stats: dict[int, ProcStats] = {}
        self.peak_sum = 0  # bytes

    def poll(self) -> None:
        children = _children_map()
        todo, seen = [self.root], []
        while todo:
            pid = todo.pop()
            seen.append(pid)
            todo += children.get(pid, [])
        now = 0
        for pid in seen:
            got = _read(pid)
            if got is None:
                continue
            cmd, status, cpu = got
            now += status.get("VmRSS", 0)
            st = self.stats.get(pid)
            if st is None:
                st = self.stats[pid] = ProcStats(pid)
                if pid == self.root:
                    st.names.append("driver")
            name = short_name(cmd)
            if pid != self.root and (not st.names or st.names[-1] != name):
                st.names.append(name)
            st.hwm = max(st.hwm, status.get("VmHWM", 0))
            st.cpu = cpu
        self.peak_sum = max(self.peak_sum, now)

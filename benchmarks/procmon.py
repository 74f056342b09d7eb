"""Peak memory and CPU of a process tree, from /proc alone (no psutil in tokpipe's environment).

A thread polls every `interval` seconds: every descendant of the root pid (Ray's gcs_server and raylet
are children of the driver that started them, its workers children of the raylet). Per process it
keeps the kernel's own peak RSS (VmHWM, exact whenever the process is seen at least once after its
peak), the largest anonymous RSS seen (RssAnon: the process's own heap, not shared or file pages),
its CPU seconds, and the names it went by: a Ray worker retitles itself `ray::IDLE`,
`ray::shard_task`, `ray::ProgressBoard.report`, ...
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")
RAY_NON_TASK = {"ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}


@dataclass
class ProcStats:
    pid: int
    names: list[str] = field(default_factory=list)
    hwm: int = 0  # VmHWM, bytes
    anon: int = 0  # max RssAnon seen, bytes
    rss: int = 0  # last RSS seen, bytes
    cpu: float = 0.0  # user + system seconds, last seen
    first: float = 0.0
    last: float = 0.0

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
                if key in ("VmHWM", "VmRSS", "RssAnon"):
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


class TreeMonitor:
    """with TreeMonitor(pid) as mon: ...; mon.stats -> {pid: ProcStats}; mon.samples -> driver (t, rss)."""

    def __init__(self, root: int, interval: float = 0.1, on_sample=None):
        self.root, self.interval, self.on_sample = root, interval, on_sample
        self.stats: dict[int, ProcStats] = {}
        self.samples: list[tuple[float, int]] = []  # (seconds since start, driver RSS bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> TreeMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self) -> None:
        now = time.monotonic() - self.t0
        children = _children_map()
        todo, seen = [self.root], []
        while todo:
            pid = todo.pop()
            seen.append(pid)
            todo += children.get(pid, [])
        for pid in seen:
            got = _read(pid)
            if got is None:
                continue
            cmd, status, cpu = got
            st = self.stats.get(pid)
            if st is None:
                st = self.stats[pid] = ProcStats(pid, first=now)
                if pid == self.root:
                    st.names.append("driver")
            name = short_name(cmd)
            if pid != self.root and (not st.names or st.names[-1] != name):
                st.names.append(name)
            st.hwm = max(st.hwm, status.get("VmHWM", 0))
            st.anon = max(st.anon, status.get("RssAnon", 0))
            st.rss = status.get("VmRSS", 0)
            st.cpu, st.last = cpu, now
            if pid == self.root:
                self.samples.append((now, st.rss))
        if self.on_sample is not None:
            self.on_sample(self, now)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def summary(self) -> dict:
        """Driver, Ray workers by role, Ray system processes: peak RSS (MiB) and CPU seconds."""
        mib = 1 / 2**20
        out: dict = {"driver": None, "workers": [], "system": []}
        for st in sorted(self.stats.values(), key=lambda s: s.first):
            row = {
                "pid": st.pid,
                "kind": st.kind,
                "names": sorted(set(st.names)),
                "peak_rss_mib": round(st.hwm * mib, 1),
                "peak_anon_mib": round(st.anon * mib, 1),
                "cpu_s": round(st.cpu, 2),
            }
            if st.kind == "driver":
                out["driver"] = row
            elif st.kind == "system":
                out["system"].append(row)
            else:
                out["workers"].append(row)
        return out

"""Node soak: Ray clusters on 127.0.0.1 that lose nodes and gain nodes mid-run, again and again; every run must end
exit 0 with the same bytes.

    python benchmarks/soak_nodes.py --tries 20                 # a worker node lost once a shard is checkpointed
    python benchmarks/soak_nodes.py --mode elastic --tries 10  # three nodes; nodes lost and joined at random
    python benchmarks/soak_nodes.py --mode gain                # a node gained halfway, against 3 nodes throughout

Each try starts `ray start` nodes on 127.0.0.1 of one CPU each (a head, and worker nodes each in a session of its
own), runs `tokpipe run --address ... --workers N --checkpoint-interval 1` on a distinct-text corpus (default 248 MB
in 12 shards, fastokens, Qwen3). `lose`: two nodes, and once the first shard's checkpoint is on disk every process
of the worker node kill -9'd (its raylet, its workers, its Placer, its agents). `elastic`: three nodes, and from the
first checkpoint on, a worker node kill -9'd, a new one started 1-4 s later, and again 1-4 s after, until the
run ends (seeded by the try's number). A try must end exit 0 with OUT's token files byte-identical to an
uninterrupted run's (itself checked once against the `tokenizers` reference of tests/helpers.py, `--reference`),
say each loss and join in a line of its own, and print no line of Ray's. `gain`: the time of a run on two nodes that
gains a third once half the shards are checkpointed, against the same run on three nodes from the start
(alternated, `--tries` each). Prints each try as it ends and a summary; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, SHARED, TOKENIZER, build_distinct_corpus, cli, manifest_of, parse_size, spawn  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
TOKEN_FILES = ("train.bin", "train.idx", "train.parts")
NODE_SAID = "ray: node "  # the start of tokpipe's line for a node lost or joined


def session_processes(session: int) -> list[int]:
    """The live processes of a session: all that a `ray start` started there, whoever adopted them."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def kill_session(session: int) -> int:
    """kill -9 every process of a session; returns how many there were."""
    pids = session_processes(session)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


class Nodes:
    """A head of one CPU and worker nodes of one CPU each on 127.0.0.1, each `ray start` in a session of its own,
    added (`add`) and lost (`lose`) as a try needs."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="tpsoak-", dir="/tmp")  # short: Ray's socket paths fit 107 bytes
        self.address = f"127.0.0.1:{random.randint(20000, 29999)}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
        self.sessions: list[int] = []
        self.workers: list[int] = []  # the sessions of the worker nodes up
        self.added = 0  # worker nodes started: each at an address of its own, 127.0.0.2, .3, ...

    def __enter__(self) -> Nodes:
        port = self.address.split(":")[1]
        head = [RAY, "start", "--head", "--port", port, "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
        head += ["--include-dashboard", "false", "--temp-dir", self.temp, "--disable-usage-stats"]
        self._start(head, wait=True)
        return self

    def add(self) -> None:
        """A worker node, up once it says so (two started at once: one never registered)."""
        self.added += 1
        ip = f"127.0.0.{1 + self.added}"  # two raylets at one address: the second never registered
        worker = [RAY, "start", "--address", self.address, "--node-ip-address", ip, "--num-cpus", "1"]
        # Each node's object store in /dev/shm: Ray's default (30% of the memory) for three left a node none.
        worker += ["--object-store-memory", str(512 << 20), "--disable-usage-stats", "--block"]
        proc = subprocess.Popen(
            worker, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.sessions.append(proc.pid)
        self.workers.append(proc.pid)
        said = []
        for line in proc.stdout:
            said.append(line)
            if "Ray runtime started" in line:
                return
        raise SystemExit("a worker node did not start:\n" + "".join(said))

    def lose(self, session: int) -> None:
        kill_session(session)
        self.workers.remove(session)

    def wait_for(self, nodes: int) -> None:
        """Until that many nodes are alive (the head's included)."""
        deadline = time.monotonic() + 120
        while nodes_alive(self.address, self.env) < nodes:
            if time.monotonic() > deadline:
                raise SystemExit(f"{nodes} nodes did not come up")
            time.sleep(0.5)

    def _start(self, command: list[str], wait: bool) -> int:
        proc = subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.sessions.append(proc.pid)
        if wait and proc.wait(timeout=180) != 0:
            raise SystemExit(f"{' '.join(command[:3])} failed:\n{proc.stdout.read().decode()}")
        return proc.pid

    def __exit__(self, *exc) -> None:
        for session in self.sessions:
            kill_session(session)
        deadline = time.monotonic() + 30
        while any(session_processes(s) for s in self.sessions) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.temp, ignore_errors=True)


def nodes_alive(address: str, env: dict) -> int:
    code = "import ray; ray.init(address=%r, logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
    out = subprocess.run([sys.executable, "-c", code % address], env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else 0


def checkpointed(out: Path) -> int:
    return len(list((out / "shards").rglob("*.json"))) if (out / "shards").is_dir() else 0


def one_try(manifest: Path, out: Path, workers: int, mode: str, seed: int, shards: int, extra=()) -> dict:
    """One run on a fresh cluster of a head and `workers` worker nodes; `mode` what happens to them mid-run (none,
    lose, elastic, gain). Returns what it did: `seconds` the run's, `whole` the try's (the cluster's start and stop
    too), `events` the losses and joins made, with when."""
    whole, rnd = time.monotonic(), random.Random(seed)
    shutil.rmtree(out, ignore_errors=True)
    with Nodes() as cluster:
        for _ in range(workers):
            cluster.add()
        cluster.wait_for(1 + workers)
        command = cli("run", "--manifest", manifest, "--tokenizer", TOKENIZER, "--out", out)
        command += ["--address", cluster.address, "--workers", str(1 + workers + (mode == "gain"))]
        command += ["--checkpoint-interval", "1", *extra]
        started = time.monotonic()
        proc = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        events = []
        if mode != "none":
            first = 1 if mode != "gain" else max(1, shards // 2)
            while proc.poll() is None and checkpointed(out) < first:
                time.sleep(0.05)
        if mode == "lose" and proc.poll() is None:
            cluster.lose(cluster.workers[0])
            events.append(f"lost at {time.monotonic() - started:.1f}s")
        elif mode == "gain" and proc.poll() is None:
            cluster.add()
            events.append(f"gained at {time.monotonic() - started:.1f}s")
        while mode == "elastic" and proc.poll() is None:
            cluster.lose(rnd.choice(cluster.workers))
            events.append(f"lost at {time.monotonic() - started:.1f}s")
            time.sleep(rnd.uniform(1, 4))
            if proc.poll() is not None:
                break
            cluster.add()
            events.append(f"joined at {time.monotonic() - started:.1f}s")
            time.sleep(rnd.uniform(1, 4))
        output = proc.communicate(timeout=1200)[0]
        seconds = time.monotonic() - started
        log = out / "logs" / "run.log"
        said = log.read_text().splitlines() if log.exists() else []
        refits = [line.split(" ", 2)[-1] for line in said if " cluster: " in line]
    lines, whole = output.splitlines(), time.monotonic() - whole
    done = {"rc": proc.returncode, "seconds": seconds, "whole": whole, "events": events, "lines": lines}
    return done | {"refits": refits}


def check_reference(corpus, out: Path) -> bool:
    """OUT's train.bin against the independent reference (tests/helpers.py: `tokenizers`, file by file)."""
    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import QWEN3_EOS, reference_tokens

    files = [Path(corpus.path) / name for name in corpus.shards]
    expected = reference_tokens(files, TOKENIZER / "tokenizer.json", QWEN3_EOS)
    return np.array_equal(np.fromfile(out / "train.bin", dtype=np.uint32), expected)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("lose", "elastic", "gain"), default="lose")
    p.add_argument("--tries", type=int, default=20)
    p.add_argument("--size", default="248MB")
    p.add_argument("--shard-size", default="21MB", help="of JSONL (248MB / 21MB: 12 shards)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    p.add_argument("--reference", action="store_true", help="check the uninterrupted run against `tokenizers`")
    p.add_argument("--backend", help="the run's --backend (hf: ~3x slower than fastokens, runs that last here)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cluster's processes stopped on the way out too
    work = args.work_dir.resolve()
    corpus = build_distinct_corpus(str(SHARED), parse_size(args.size), 2, parse_size(args.shard_size), work)
    manifest = manifest_of(Path(corpus.path), work)
    shards, workers = len(corpus.shards), 2 if args.mode == "elastic" else 1
    extra = ("--backend", args.backend) if args.backend else ()
    if args.mode == "gain":
        return gain(manifest, work, shards, args.tries, extra)

    whole = work / "nodes-uninterrupted"
    first = one_try(manifest, whole, workers, "none", 0, shards, extra)
    print(f"uninterrupted: exit {first['rc']} in {first['seconds']:.1f}s", flush=True)
    if first["rc"] != 0:
        print("\n".join(first["lines"][-20:]))
        return 1
    if args.reference:
        print(f"uninterrupted against tokenizers' reference: {'same' if check_reference(corpus, whole) else 'DIFFERS'}")

    failures, seconds, wholes = 0, [], []
    out = work / "nodes-soaked"
    for n in range(1, args.tries + 1):
        t = one_try(manifest, out, workers, args.mode, n, shards, extra)
        same = t["rc"] == 0 and all(filecmp.cmp(whole / f, out / f, shallow=False) for f in TOKEN_FILES)
        said = [line for line in t["lines"] if line.startswith(NODE_SAID)]
        ray_lines = [line for line in t["lines"] if "(raylet)" in line or "\x1b[" in line or "Traceback" in line]
        # Every loss said; a join, where the run lasted past it long enough to look (every 2 s) and give it work.
        lost = sum(e.startswith("lost") for e in t["events"])
        ok = same and sum(" lost" in line for line in said) == lost and not ray_lines and t["events"]
        failures += not ok
        seconds.append(t["seconds"])
        wholes.append(t["whole"])
        print(
            f"try {n}: exit {t['rc']} in {t['seconds']:.1f}s ({', '.join(t['events']) or 'finished before any'}),"
            f" bytes {'same' if same else 'DIFFER'}, said: {'; '.join(said) or 'NOTHING'}"
            f"{f', Ray lines: {len(ray_lines)}' if ray_lines else ''}",
            flush=True,
        )
        if t["refits"]:
            print("  run.log: " + "; ".join(t["refits"]), flush=True)
        if not ok:
            shown = [line for line in t["lines"] if not line.startswith("[tokpipe]")]
            print("  its output, less progress lines:\n  " + "\n  ".join(shown), flush=True)
    print(
        f"{failures} of {args.tries} tries failed; a run took {min(seconds):.1f}-{max(seconds):.1f}s (median"
        f" {sorted(seconds)[len(seconds) // 2]:.1f}s), a try with its cluster's start and stop {min(wholes):.1f}-"
        f"{max(wholes):.1f}s (median {sorted(wholes)[len(wholes) // 2]:.1f}s)"
    )
    return 1 if failures else 0


def gain(manifest: Path, work: Path, shards: int, tries: int, extra=()) -> int:
    """A run that gains a node halfway against the same run on the bigger cluster from the start, alternated."""
    times: dict[str, list[float]] = {"gains a node halfway": [], "3 nodes from the start": []}
    for n in range(tries):
        for what, workers, mode in (("gains a node halfway", 1, "gain"), ("3 nodes from the start", 2, "none")):
            t = one_try(manifest, work / "nodes-gain", workers, mode, n, shards, extra)
            joined = [line for line in t["lines"] if " joined (" in line]
            if t["rc"] != 0 or (mode == "gain" and not joined):
                print(f"{what}: exit {t['rc']}, said {joined or 'no join'}\n" + "\n".join(t["lines"][-20:]))
                return 1
            times[what].append(t["seconds"])
            print(f"{what}: {t['seconds']:.1f}s {'; '.join(t['events'] + joined)}", flush=True)
    for what, seconds in times.items():
        print(f"{what}: median {sorted(seconds)[len(seconds) // 2]:.1f}s of {len(seconds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

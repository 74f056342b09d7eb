"""Node-loss soak: a two-node Ray cluster loses its worker node mid-run, again and again; every run must end
exit 0 with the same bytes.

    python benchmarks/soak_node_loss.py --tries 20

Each try starts two `ray start` nodes on 127.0.0.1 with one CPU each (a head, and a worker node in a session of
its own), runs `tokpipe run --address ... --workers 2 --checkpoint-interval 1` on a distinct-text corpus
(default 248 MB in 12 shards, fastokens, Qwen3), and once the first shard's checkpoint is on disk kill -9s every
process of the worker node (its raylet, its workers, its Placer, its agents). The run must end exit 0 with
OUT's token files byte-identical to an uninterrupted run's (itself checked once against the `tokenizers`
reference of tests/helpers.py, `--reference`), say the node's loss in one line of its own, and print no line
of Ray's. Prints each try as it ends and a summary (failures, seconds a try); exit 1 on any failure.
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
NODE_LOST = "ray: node "  # the start of tokpipe's line for a lost node


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


class TwoNodes:
    """A head and a worker node, one CPU each, on 127.0.0.1, each `ray start` in a session of its own."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="tpsoak-", dir="/tmp")  # short: Ray's socket paths fit 107 bytes
        self.address = f"127.0.0.1:{random.randint(20000, 29999)}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
        self.sessions: list[int] = []

    def __enter__(self) -> TwoNodes:
        port = self.address.split(":")[1]
        head = [RAY, "start", "--head", "--port", port, "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
        head += ["--include-dashboard", "false", "--temp-dir", self.temp, "--disable-usage-stats"]
        self._start(head, wait=True)
        worker = [RAY, "start", "--address", self.address, "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
        self.worker = self._start([*worker, "--block"], wait=False)
        return self

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


def one_try(manifest: Path, out: Path, kill: bool) -> dict:
    """One run on a fresh two-node cluster; with `kill`, the worker node killed once the first shard's
    checkpoint is on disk. Returns what it did: `seconds` the run's, `whole` the try's (the cluster's start and
    stop too)."""
    whole = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)
    with TwoNodes() as cluster:
        deadline = time.monotonic() + 120
        while nodes_alive(cluster.address, cluster.env) < 2:  # the worker node registered
            if time.monotonic() > deadline:
                raise SystemExit("the worker node did not join")
            time.sleep(0.5)
        command = cli("run", "--manifest", manifest, "--tokenizer", TOKENIZER, "--out", out)
        command += ["--address", cluster.address, "--workers", "2", "--checkpoint-interval", "1"]
        started = time.monotonic()
        proc = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        killed_at = None
        if kill:
            while proc.poll() is None and not list((out / "shards").rglob("*.json")):
                time.sleep(0.05)
            if proc.poll() is None:
                killed_at = time.monotonic() - started
                kill_session(cluster.worker)
        output = proc.communicate(timeout=1200)[0]
        seconds = time.monotonic() - started
    lines, whole = output.splitlines(), time.monotonic() - whole
    return {"rc": proc.returncode, "seconds": seconds, "whole": whole, "killed_at": killed_at, "lines": lines}


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
    p.add_argument("--tries", type=int, default=20)
    p.add_argument("--size", default="248MB")
    p.add_argument("--shard-size", default="21MB", help="of JSONL (248MB / 21MB: 12 shards)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    p.add_argument("--reference", action="store_true", help="check the uninterrupted run against `tokenizers`")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cluster's processes stopped on the way out too
    work = args.work_dir.resolve()
    corpus = build_distinct_corpus(str(SHARED), parse_size(args.size), 2, parse_size(args.shard_size), work)
    manifest = manifest_of(Path(corpus.path), work)

    whole = work / "nodeloss-uninterrupted"
    first = one_try(manifest, whole, kill=False)
    print(f"uninterrupted: exit {first['rc']} in {first['seconds']:.1f}s", flush=True)
    if first["rc"] != 0:
        print("\n".join(first["lines"][-20:]))
        return 1
    if args.reference:
        print(f"uninterrupted against tokenizers' reference: {'same' if check_reference(corpus, whole) else 'DIFFERS'}")

    failures, seconds, wholes = 0, [], []
    out = work / "nodeloss-killed"
    for n in range(1, args.tries + 1):
        t = one_try(manifest, out, kill=True)
        same = t["rc"] == 0 and all(filecmp.cmp(whole / f, out / f, shallow=False) for f in TOKEN_FILES)
        said = [line for line in t["lines"] if line.startswith(NODE_LOST)]
        ray_lines = [line for line in t["lines"] if "(raylet)" in line or "\x1b[" in line or "Traceback" in line]
        ok = same and len(said) == 1 and not ray_lines and t["killed_at"] is not None
        failures += not ok
        seconds.append(t["seconds"])
        wholes.append(t["whole"])
        killed = f"killed at {t['killed_at']:.1f}s" if t["killed_at"] is not None else "finished before the kill"
        print(
            f"try {n}: exit {t['rc']} in {t['seconds']:.1f}s ({killed}), bytes {'same' if same else 'DIFFER'},"
            f" said: {said[0] if said else 'NOTHING'}{f', Ray lines: {len(ray_lines)}' if ray_lines else ''}",
            flush=True,
        )
        if not ok:
            shown = [line for line in t["lines"] if not line.startswith("[tokpipe]")]
            print("  its output, less progress lines:\n  " + "\n  ".join(shown), flush=True)
    print(
        f"{failures} of {args.tries} tries failed; a run took {min(seconds):.1f}-{max(seconds):.1f}s (median"
        f" {sorted(seconds)[len(seconds) // 2]:.1f}s), a try with its cluster's start and stop {min(wholes):.1f}-"
        f"{max(wholes):.1f}s (median {sorted(wholes)[len(wholes) // 2]:.1f}s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

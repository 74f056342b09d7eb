"""Crash soak: kill -9 the whole `tokpipe run` process group at random moments, rerun, compare bytes.

    python benchmarks/soak_kill9.py --source ../shared/data/hf-cache --tokenizer examples/tokenizers/qwen3

Builds the source's shards repeated N times as a plain folder (train/chunk1..N/, validation/chunk1..N/),
runs it once uninterrupted, then again with a kill -9 of the process group at a random moment of each
of the --workers attempts, finishes with one more rerun, and checks that every output file is
byte-identical to the uninterrupted run and that `tokpipe verify` passes. Prints what each attempt
had done when it was killed and what the reruns reported.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import build_repeated_corpus, cli, manifest_of, spawn, timed  # noqa: E402


def shard_states(out: Path) -> str:
    states = (
        [json.loads(p.read_text())["done"] for p in (out / "shards").rglob("*.json")]
        if (out / "shards").exists()
        else []
    )
    return f"{sum(states)} shards done, {len(states) - sum(states)} partial"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--work", default="/tmp/tokpipe-soak")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--workers", default="2,1,3,2,1", help="--workers of each killed attempt")
    p.add_argument("--backend", default="hf")
    p.add_argument("--checkpoint-interval", default="2")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    work = Path(args.work).resolve()  # tokpipe names OUT as an absolute path
    data = work / "data"
    build_repeated_corpus(args.source, data, args.copies)
    manifest = manifest_of(data, work)
    common = (
        "--manifest",
        manifest,
        "--tokenizer",
        Path(args.tokenizer),
        "--backend",
        args.backend,
        "--checkpoint-interval",
        args.checkpoint_interval,
    )

    reference = work / "uninterrupted"
    shutil.rmtree(reference, ignore_errors=True)
    full_seconds = timed(cli("run", *common, "--out", reference, "--workers", "2"))["wall"]
    print(f"uninterrupted run: {full_seconds:.1f}s")

    out = work / "killed"
    shutil.rmtree(out, ignore_errors=True)
    rng = random.Random(args.seed)
    for attempt, workers in enumerate(args.workers.split(","), 1):
        # Early enough that five attempts do not finish the job between them (each spends ~8 s starting up).
        delay = rng.uniform(2, full_seconds / 2.5)
        proc = spawn(
            cli("run", *common, "--out", out, "--workers", workers),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
        resumed = [line for line in output.splitlines() if line.startswith(("resumed", "manifest", str(out)))]
        print(
            f"attempt {attempt}: --workers {workers}, kill -9 of the process group after {delay:.1f}s -> "
            f"{shard_states(out)}; it said: {' | '.join(resumed)}"
        )
        leftovers = subprocess.run(["pgrep", "-f", "ray::tokpipe"], capture_output=True, text=True).stdout.split()
        if leftovers:
            print(f"  leftover shard workers right after the kill: {leftovers}")

    final = timed(cli("run", *common, "--out", out, "--workers", "2"), check=False)
    final_lines = [line for _, line in final["lines"]]
    print(
        "final rerun:",
        " | ".join(
            line for line in final_lines if line.startswith(("manifest", "resumed", "train", "validation", "done"))
        ),
    )
    if final["returncode"] != 0:
        print("\n".join(final_lines))
        return 1
    names = sorted(
        p.name for p in reference.iterdir() if p.suffix in (".bin", ".idx", ".pkl", ".json") and p.name != "run.json"
    )
    same = {name: filecmp.cmp(reference / name, out / name, shallow=False) for name in names}
    print("byte-identical to the uninterrupted run:", ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    verify = timed(cli("verify", out), check=False)
    last = next((line for _, line in reversed(verify["lines"]) if line.strip()), "")
    print("tokpipe verify:", last.strip(), f"(exit {verify['returncode']})")
    return 0 if all(same.values()) and verify["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

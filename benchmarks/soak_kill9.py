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

from tokpipe.manifest import build_manifest


def build_corpus(source: str, dest: Path, copies: int) -> None:
    if dest.exists():
        return
    for shard in build_manifest(source).shards():
        top, *rest = shard.relpath.split("/")
        for i in range(1, copies + 1):
            target = dest / top / f"chunk{i}" / "/".join(rest[1:] if rest[0].startswith("chunk") else rest)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shard.path, target)


def tokpipe(*args) -> list[str]:
    return [sys.executable, "-m", "tokpipe.cli", *map(str, args)]


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

    work = Path(args.work)
    data, manifest = work / "data", work / "m.json"
    build_corpus(args.source, data, args.copies)
    subprocess.run(tokpipe("manifest", "--dataset-dir", data, "-o", manifest), check=True)
    common = (
        "--manifest",
        manifest,
        "--tokenizer",
        args.tokenizer,
        "--backend",
        args.backend,
        "--checkpoint-interval",
        args.checkpoint_interval,
    )

    reference = work / "uninterrupted"
    shutil.rmtree(reference, ignore_errors=True)
    started = time.monotonic()
    subprocess.run(tokpipe("run", *common, "--out", reference, "--workers", "2"), check=True, stdout=subprocess.DEVNULL)
    full_seconds = time.monotonic() - started
    print(f"uninterrupted run: {full_seconds:.1f}s")

    out = work / "killed"
    shutil.rmtree(out, ignore_errors=True)
    rng = random.Random(args.seed)
    for attempt, workers in enumerate(args.workers.split(","), 1):
        # Early enough that five attempts do not finish the job between them (each spends ~8 s starting up).
        delay = rng.uniform(2, full_seconds / 2.5)
        proc = subprocess.Popen(
            tokpipe("run", *common, "--out", out, "--workers", workers),
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

    final = subprocess.run(tokpipe("run", *common, "--out", out, "--workers", "2"), capture_output=True, text=True)
    print(
        "final rerun:",
        " | ".join(
            line
            for line in final.stdout.splitlines()
            if line.startswith(("manifest", "resumed", "train", "validation", "done"))
        ),
    )
    if final.returncode != 0:
        print(final.stderr)
        return 1
    names = sorted(
        p.name for p in reference.iterdir() if p.suffix in (".bin", ".idx", ".pkl", ".json") and p.name != "run.json"
    )
    same = {name: filecmp.cmp(reference / name, out / name, shallow=False) for name in names}
    print("byte-identical to the uninterrupted run:", ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    verify = subprocess.run(tokpipe("verify", out), capture_output=True, text=True)
    print("tokpipe verify:", verify.stdout.strip().splitlines()[-1], f"(exit {verify.returncode})")
    return 0 if all(same.values()) and verify.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

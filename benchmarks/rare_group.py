"""A rare --group-by group on Ray into a store: how much of the shards' tokens waits in Ray's object store. A rare
group's segment gathers until the split's end (write/segments.py), and on Ray each shard's tokens are one object;
runner/copies.py SegmentUploads keeps the parts of a shard that waits for gathering segments alone on the store once
such shards outgrow the run's room (--shard-buffer a worker), and Ray lets go of its object.

    .venv/bin/python benchmarks/rare_group.py [--shards 100] [--shard-size 4MB] [--runs 2]

SHARDS shards of JSONL, each the shared corpus's texts (from a different one each shard) up to SHARD_SIZE, group
"common", and one short document of group "rare". A local Ray head (2 CPUs, a 768 MiB object store) and a local
SeaweedFS; `tokpipe run --address` with the 600-id tokenizer of the tests (uint16, its cost is the pipeline's not
the encoder's), 2 workers, --ray-only. A sampler joined to the head reads the head's object store every 0.2 s: the
peak of its bytes in use is what this reports, with the run's wall time and the objects the keep left on the store.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import REPO, SHARED, TOKENIZER, load_texts, parse_size, timed
from store import BUCKET, start_weed

# The head's raylet writes its state every RAY_debug_dump_period_milliseconds (set to 200 here): the bytes of the
# objects pinned in its store, and of those spilled to its disk.
STATE = re.compile(r"- pinned objects size: (\d+)\n(?:.*\n)*?- num bytes currently spilled: (\d+)")


def sample(state: Path, stop: threading.Event, seen: list) -> None:
    """(seconds, pinned bytes, spilled bytes) each time the raylet's state changes, until `stop`."""
    began, last = time.monotonic(), None
    while not stop.wait(0.05):
        found = STATE.search(state.read_text()) if state.exists() else None
        if found and found.groups() != last:
            last = found.groups()
            seen.append((time.monotonic() - began, *map(int, last)))


def corpus(folder: Path, shards: int, size: int) -> Path:
    texts = load_texts(SHARED)
    rng = random.Random(0)
    for n in range(shards):
        rng.shuffle(texts)
        lines, held = [json.dumps({"text": f"rare document {n}", "g": "rare"})], 0
        for text in texts:
            lines.append(json.dumps({"text": text, "g": "common"}))
            held += len(lines[-1])
            if held >= size:
                break
        (folder / "train").mkdir(parents=True, exist_ok=True)
        (folder / "train" / f"s{n:04d}.jsonl").write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("4MB"))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-buffer", type=int, default=32, help="MiB (the run's room: one a worker)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rare-group-"))
    data = corpus(work / "data", args.shards, args.shard_size)
    manifest = work / "m.json"
    timed([sys.executable, "-m", "tokpipe.cli", "manifest", "--dataset-dir", data, "-o", manifest])
    weed, env = start_weed(work / "weed")
    env = {**os.environ, **env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}  # the run's own
    env["RAY_debug_dump_period_milliseconds"] = "200"
    temp = tempfile.mkdtemp(prefix="rg-", dir="/tmp")
    head = ["ray", "start", "--head", "--num-cpus", "2", "--object-store-memory", str(768 << 20), "--temp-dir", temp]
    started = subprocess.run(
        [str(REPO / ".venv" / "bin" / h) if h == "ray" else h for h in head], capture_output=True, text=True, env=env
    )
    address = re.search(r"--address='([^']+)'", started.stdout)[1]
    try:
        for run in range(args.runs):
            stop, seen = threading.Event(), []
            state = Path(temp) / "session_latest" / "logs" / "debug_state.txt"
            sampler = threading.Thread(target=sample, args=(state, stop, seen))
            sampler.start()
            url = f"s3://{BUCKET}/rare-{run}"
            command = [
                sys.executable,
                "-m",
                "tokpipe.cli",
                "run",
                "--manifest",
                manifest,
                "--tokenizer",
                TOKENIZER,
                "--out",
                url,
                "--workers",
                args.workers,
                "--ray-only",
                "--group-by",
                "g",
                "--address",
                address,
                "--shard-buffer",
                args.shard_buffer,
            ]
            began = time.monotonic()
            done = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=env)
            wall = time.monotonic() - began
            stop.set()
            sampler.join()
            assert done.returncode == 0, done.stdout + done.stderr
            said = next(line for line in done.stdout.splitlines() if line.startswith("done in"))
            every_2s = seen[:: max(1, len(seen) * 2 // int(wall + 1))]
            found = {
                "run": run,
                "wall_s": round(wall, 1),
                "pinned_peak_mib": max(p for _, p, _ in seen) >> 20,
                "spilled_peak_mib": max(s for _, _, s in seen) >> 20,
                "pinned_mib_each_2s": [p >> 20 for _, p, _ in every_2s],
                "said": said.split(";")[0],
            }
            print(json.dumps(found), flush=True)
    finally:
        subprocess.run([str(REPO / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True, env=env)
        weed.kill()


if __name__ == "__main__":
    main()

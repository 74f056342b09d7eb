"""OUT on an object store (issue 46, item 7): the same run into a local SeaweedFS (`weed mini` on 127.0.0.1, as
store.py starts it) and into a local folder, 2 workers on Ray (--ray-only: the shared corpus is small enough for the
driver to tokenize alone), alternating: wall and CPU seconds of each (the CPU of the
run's whole process tree: driver, Ray, workers; not the store's own), the driver's and a worker's peak RSS, and every
request the run made of the store (each process of the run counts its own, through botocore's events: a
sitecustomize on PYTHONPATH), by operation and bytes sent, per shard; bytes uploaded over the output's bytes.

    .venv/bin/python benchmarks/outstore.py --runs 2
    .venv/bin/python benchmarks/outstore.py --runs 2 --size 250MB --shards 16   # a distinct corpus, larger parts
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

from harness import SHARED, build_distinct_corpus, manifest_of, parse_size, tokpipe_run
from procmon import TreeMonitor
from store import BUCKET, start_weed

import tokpipe.store
from tokpipe.inputs.manifest import build_manifest

# Loaded by every Python process of a run (PYTHONPATH), so Ray's workers and the Placer actors count theirs
# too: a line per request sent, "OPERATION BYTES", appended to a file of the process's own.
COUNTER = """
import os
if os.environ.get("BENCH_REQUESTS"):
    import tokpipe.store.bucket as bucket

    made, counted = bucket._client, set()

    def _client(endpoint, tries=None):
        client = made(endpoint, tries)
        if id(client) not in counted:
            counted.add(id(client))
            client.meta.events.register("before-send.s3", _sent)
        return client

    def _sent(request, event_name, **_):
        # A body sent aws-chunked (boto3's checksums) says its own length apart from the chunks' framing.
        headers = request.headers
        size = int(headers.get("X-Amz-Decoded-Content-Length") or headers.get("Content-Length") or 0)
        path = os.path.join(os.environ["BENCH_REQUESTS"], str(os.getpid()))
        with open(path, "a") as f:
            f.write(f"{event_name.rpartition('.')[2]} {size}\\n")

    bucket._client = _client
"""


def requests(folder: Path) -> tuple[Counter, int]:
    """The requests every process counted: by operation, and the bytes sent (bodies)."""
    ops, sent = Counter(), 0
    for path in folder.iterdir():
        for line in path.read_text().splitlines():
            op, size = line.split()
            ops[op] += 1
            sent += int(size)
    return ops, sent


def peaks(monitor: TreeMonitor) -> dict:
    """MiB: the driver's peak RSS, the largest of a shard worker's, and the Placers' (which write the parts on disk,
    or upload the segments to a store): the processes that hold tokens on their way to storage."""
    stats = monitor.stats.values()

    def peak(chosen) -> int:
        return round(max((s.hwm for s in stats if chosen(s)), default=0) / 2**20)

    def writes(s) -> bool:
        return any("Placer" in n for n in s.names)

    return {
        "driver_mib": peak(lambda s: s.kind == "driver"),
        "worker_mib": peak(lambda s: s.kind == "task" and not writes(s)),
        "writer_mib": peak(writes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench/outstore"))
    parser.add_argument("--size", help="JSONL bytes of a distinct corpus (harness.py) instead of the shared one")
    parser.add_argument("--shards", type=int, default=16, help="the distinct corpus's shards")
    args = parser.parse_args()
    for made in ("hook", "weed", "out", "corpus"):
        shutil.rmtree(args.work_dir / made, ignore_errors=True)
    for old in args.work_dir.glob("requests-*"):
        shutil.rmtree(old)
    hook = args.work_dir / "hook"
    hook.mkdir(parents=True)
    (hook / "sitecustomize.py").write_text(COUNTER)
    if args.size:  # built once, kept in the work dir
        size = parse_size(args.size)
        local = Path(build_distinct_corpus(str(SHARED), size, 2, -(-size // args.shards), args.work_dir).path)
    proc, _ = start_weed(args.work_dir / "weed")
    try:
        if not args.size:
            local = args.work_dir / "corpus"
            for shard in build_manifest(SHARED).shards():  # the shared corpus as a folder: one manifest for both
                (local / shard.relpath).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(shard.path, local / shard.relpath)
        manifest = manifest_of(local, args.work_dir)
        shards = sum(build_manifest(local).counts.values())
        bucket = tokpipe.store.Bucket(BUCKET, os.environ["AWS_ENDPOINT_URL"])
        results = {"disk": [], "store": []}
        for n in range(args.runs):
            for where in ("disk", "store"):
                counts = args.work_dir / f"requests-{where}-{n}"
                counts.mkdir()
                out = args.work_dir / "out" if where == "disk" else f"s3://{BUCKET}/out-{n}"
                env = {"PYTHONPATH": str(hook), "BENCH_REQUESTS": str(counts)}
                run = tokpipe_run(manifest, out, 2, "--ray-only", watch=TreeMonitor, env=env)
                row = {"wall": round(run["wall"], 2), "cpu": round(run["cpu"], 2), **peaks(run["watch"])}
                row["phases"] = next(line for _, line in run["lines"] if line.startswith("phases: "))
                if where == "store":
                    ops, sent = requests(counts)
                    output = sum(o.size for o in bucket.list(f"out-{n}/") if o.key.endswith((".bin", ".idx")))
                    row |= {
                        "requests": dict(ops.most_common()),
                        "requests_per_shard": round(sum(ops.values()) / shards, 1),
                    }
                    row |= {"sent_bytes": sent, "output_bytes": output, "sent_over_output": round(sent / output, 4)}
                results[where].append(row)
                print(where, json.dumps(row), flush=True)
        disk, store = results["disk"], results["store"]
        wall = sum(r["wall"] for r in store) / sum(r["wall"] for r in disk)
        cpu = sum(r["cpu"] for r in store) / sum(r["cpu"] for r in disk)
        print(f"{shards} shards, 2 workers: store / disk wall {wall:.2f}x, CPU {cpu:.2f}x")
        (args.work_dir / "outstore.json").write_text(json.dumps(results, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    main()

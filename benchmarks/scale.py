"""Measurements behind the scale model in benchmarks/README.md (issue 10), on distinct text.

    python benchmarks/scale.py tail    --trees before=../OLD,after=. --size 250MB --workers 2
    python benchmarks/scale.py memory  --trees before=../OLD,after=. --size 550MB --workers 1
    python benchmarks/scale.py rates   --size 250MB
    python benchmarks/scale.py driver  --trees before=../OLD,after=. --shards 5000 --pack-shards 1,64
    python benchmarks/scale.py cluster --size 100MB
    python benchmarks/scale.py cores   --size 250MB --shard-size 12.5MB

Each tree is a tokpipe checkout run with PYTHONPATH set to it (its Ray workers too), so an older
commit is measured from a worktree of it. Phases are read from OUT's files alone, the same way for
every version: tokenizing runs from the first shard lock created to the last checkpoint written, the
finalize tail from then to meta.json. Results print as JSON lines and go to WORK_DIR/scale-*.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import (  # noqa: E402
    REPO,
    SHARED,
    TOKENIZER,
    batches,
    build_distinct_corpus,
    load_texts,
    manifest_of,
    parse_size,
    phases_from_files,
    timed,
    tiny_shards,
    tokpipe_run,
)
from procmon import TreeMonitor  # noqa: E402


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def run_once(tree: Path, corpus_dir: str | Path, out: Path, workers: int, *extra, monitor: bool = False) -> dict:
    manifest = manifest_of(Path(corpus_dir), out.parent, tree)
    run = tokpipe_run(manifest, out, workers, *extra, tree=tree, watch=TreeMonitor if monitor else None)
    result = {"wall_s": round(run["wall"], 2), **phases_from_files(out), "train_sha256": sha256(out / "train.bin")[:16]}
    if monitor:
        stats = run["watch"].stats
        tasks = [s for s in stats.values() if s.kind == "task"]
        result["task_worker_peak_rss_mib"] = sorted(round(s.hwm / 2**20) for s in tasks)
        result["stats"] = stats
    return result


def cmd_tail(args) -> list[dict]:
    corpus = build_distinct_corpus(
        str(SHARED), parse_size(args.size), args.workers, parse_size(args.shard_size), args.work_dir
    )
    results = []
    for repeat in range(args.repeats):
        for name, tree in args.trees:
            r = run_once(tree, corpus.path, args.work_dir / f"tail-{name}", args.workers)
            results.append(
                {
                    "measure": "tail",
                    "tree": name,
                    "repeat": repeat,
                    "text_mb": round(corpus.text_bytes / 1e6, 1),
                    "shards": len(corpus.shards),
                    **r,
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


def cmd_memory(args) -> list[dict]:
    corpus = build_distinct_corpus(
        str(SHARED), parse_size(args.size), args.workers, parse_size(args.shard_size), args.work_dir, long_tail=True
    )
    results = []
    for name, tree in args.trees:
        r = run_once(tree, corpus.path, args.work_dir / f"memory-{name}", args.workers, monitor=True)
        del r["stats"]
        results.append(
            {
                "measure": "memory",
                "tree": name,
                "text_mb": round(corpus.text_bytes / 1e6, 1),
                "documents": corpus.documents,
                **r,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def cmd_rates(args) -> list[dict]:
    """Per-core rates the model multiplies out: encode (cold and warm), copy into place, sha256, verify."""
    import numpy as np

    from tokpipe.durability import HASH_CHUNK, hash_range
    from tokpipe.inputs.encoders import GigatokenEncoder
    from tokpipe.layout.records import Part
    from tokpipe.read.verify import verify
    from tokpipe.write.place import place

    corpus = build_distinct_corpus(str(SHARED), parse_size(args.size), 2, parse_size(args.shard_size), args.work_dir)
    results = []
    # the first quarter of the shards: the loader stops at the text that ends them
    texts = load_texts(corpus.path, sum(corpus.shard_text_bytes[: max(1, len(corpus.shards) // 4)]))
    size = sum(len(t.encode()) for t in texts)
    calls = batches(texts)
    enc = GigatokenEncoder(str(TOKENIZER / "tokenizer.json"))
    for label in ("encode_cold", "encode_warm"):
        started = time.process_time()
        tokens = sum(len(enc.encode(b)[0]) for b in calls)
        results.append(
            {
                "measure": label,
                "mb_per_core_s": round(size / 1e6 / (time.process_time() - started), 1),
                "text_mb": round(size / 1e6, 1),
                "tokens": tokens,
            }
        )

    out = args.work_dir / "tail-after"  # a finished OUT of the tail measurement
    meta = json.loads((out / "meta.json").read_text())
    train = out / meta["splits"]["train"]["file"]
    nbytes = train.stat().st_size
    scratch = args.work_dir / "rates"
    scratch.mkdir(exist_ok=True)
    (scratch / "train.bin.tmp").write_bytes(b"")
    np.zeros(0, "<i8").tofile(scratch / "train.idx.tmp")
    (scratch / "empty.idx").write_bytes(b"")
    record = {"tokens": nbytes // 4, "documents": 0, "sha256": "-", "idx_sha256": "-"}
    part = Part("train", 0, 0, 0, record, str(train), str(scratch / "empty.idx"))
    started = time.monotonic()
    place(scratch, [part], 4)
    results.append(
        {
            "measure": "copy_into_place",
            "gb_per_s": round(nbytes / 1e9 / (time.monotonic() - started), 2),
            "gb": round(nbytes / 1e9, 2),
        }
    )
    hasher, started = hashlib.sha256(), time.process_time()
    with open(train, "rb") as f:
        hash_range(f.fileno(), 0, nbytes, hasher, bytearray(HASH_CHUNK))
    results.append({"measure": "sha256_one_core", "gb_per_s": round(nbytes / 1e9 / (time.process_time() - started), 2)})
    for jobs in (1, os.cpu_count()):
        started = time.monotonic()
        assert all(c.ok for c in verify(out, jobs=jobs))
        results.append(
            {"measure": f"verify_jobs_{jobs}", "gb_per_s": round(nbytes / 1e9 / (time.monotonic() - started), 2)}
        )
    for r in results:
        print(json.dumps(r), flush=True)
    return results


# The CLI with schedule.PACK_SHARDS set from its first argument: 1 gives one task per shard, so that a run of
# one-document shards measures the driver's cost per task, and the default its cost per shard in packs.
PACKED_CLI = (
    "import sys, tokpipe.runner.schedule as s; s.PACK_SHARDS = int(sys.argv.pop(1));"
    " from tokpipe.cli import main; sys.exit(main())"
)


def cmd_driver(args) -> list[dict]:
    """The driver's own CPU per shard (scheduling, progress, placement; --ray-only: it tokenizes nothing itself)
    on one-document shards, and the run's shards/s: at a fifth of --shards and at --shards, so that the
    difference is the marginal cost per shard, without the fixed start (Ray's client, the backend check).
    Once per --pack-shards (at most that many shards to a task): with 1 the cost per task, with many per shard.
    --address: a Ray cluster to join (e.g. 16 CPUs on these 2 cores: `ray start --head --num-cpus 16`)."""
    results = []
    for name, tree in args.trees:
        for pack in args.pack_shards:
            cpu = {}
            for count in (args.shards // 5, args.shards):
                folder = tiny_shards(count, args.work_dir)
                out = args.work_dir / f"driver-{name}"
                manifest = manifest_of(folder, args.work_dir, tree)
                shutil.rmtree(out, ignore_errors=True)
                extra = ("--address", args.address) if args.address else ("--ray-only",)
                command = [sys.executable, "-c", PACKED_CLI, str(pack), "run", "--manifest", manifest]
                command += ["--tokenizer", TOKENIZER, "--out", out, "--workers", args.workers, *extra]
                run = timed(command, tree=tree, watch=TreeMonitor)
                driver = next(s for s in run["watch"].stats.values() if s.kind == "driver")
                cpu[count] = driver.cpu
                results.append(
                    {
                        "measure": "driver",
                        "tree": name,
                        "pack_shards": pack,
                        "shards": count,
                        "wall_s": round(run["wall"], 2),
                        "driver_cpu_s": round(driver.cpu, 2),
                        "driver_ms_per_shard": round(1000 * driver.cpu / count, 2),
                        "driver_peak_rss_mib": round(driver.hwm / 2**20),
                        **phases_from_files(out),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
            small, large = args.shards // 5, args.shards
            marginal = 1000 * (cpu[large] - cpu[small]) / (large - small)
            results.append(
                {"measure": "driver marginal", "tree": name, "pack_shards": pack, "ms_per_shard": round(marginal, 3)}
            )
            print(json.dumps(results[-1]), flush=True)
    return results


def cmd_cores(args) -> list[dict]:
    """The worker curve against benchmarks/handwritten.py: 1, 2, 4, ... workers up to the CPUs this process may
    use, the two alternated on one corpus of distinct text. Per row: wall and CPU seconds of each (the CPU of
    the command and its children), their ratios, tokpipe's phases line (workers busy), and, from a run with
    --ray-only (the driver tokenizes nothing itself), the driver's own CPU seconds per GB of input."""
    from price import handwritten_run

    cpus = len(os.sched_getaffinity(0))
    corpus = build_distinct_corpus(str(SHARED), parse_size(args.size), 1, parse_size(args.shard_size), args.work_dir)
    manifest = manifest_of(Path(corpus.path), args.work_dir)
    input_gb = sum(os.path.getsize(Path(corpus.path) / name) for name in corpus.shards) / 1e9
    results = []
    for workers in [w for w in (1, 2, 4, 8, 16, 32, 64, 128) if w <= cpus]:
        for repeat in range(args.repeats):
            out = args.work_dir / "cores-out"
            tp = tokpipe_run(manifest, out / "tokpipe", workers)
            backend = next(line for _, line in tp["lines"] if line.startswith("backend ")).split()[1].rstrip(":")
            hw = handwritten_run(manifest, out / "handwritten", workers, backend)
            alone = tokpipe_run(manifest, out / "ray-only", workers, "--ray-only", watch=TreeMonitor)
            driver = next(s for s in alone["watch"].stats.values() if s.kind == "driver")
            results.append(
                {
                    "measure": "cores",
                    "workers": workers,
                    "repeat": repeat,
                    "text_mb": round(corpus.text_bytes / 1e6, 1),
                    "input_mb": round(input_gb * 1e3, 1),
                    "shards": len(corpus.shards),
                    "handwritten_s": round(hw["wall"], 2),
                    "tokpipe_s": round(tp["wall"], 2),
                    "wall_ratio": round(tp["wall"] / hw["wall"], 3),
                    "handwritten_cpu_s": round(hw["cpu"], 1),
                    "tokpipe_cpu_s": round(tp["cpu"], 1),
                    "cpu_ratio": round(tp["cpu"] / hw["cpu"], 3),
                    "phases": next(line for _, line in tp["lines"] if line.startswith("phases: ")),
                    "driver_cpu_s_per_input_gb": round(driver.cpu / input_gb, 3),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


def cmd_cluster(args) -> list[dict]:
    """Two Ray nodes on 127.0.0.1: shards and copy tasks land on both (run.log names the nodes that copied)."""
    from ray.cluster_utils import Cluster

    corpus = build_distinct_corpus(str(SHARED), parse_size(args.size), 2, parse_size(args.shard_size), args.work_dir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        out = args.work_dir / "cluster"
        r = run_once(REPO, corpus.path, out, 2, "--address", cluster.address)
    finally:
        cluster.shutdown()
    log = (out / "logs" / "run.log").read_text().splitlines()
    local = run_once(REPO, corpus.path, args.work_dir / "cluster-local", 2)
    r = {
        "measure": "cluster",
        "nodes": 2,
        **r,
        "assembled_by_node": next(
            (line.split("assembled by node: ")[1] for line in log if "assembled by node" in line), None
        ),
    }
    r["same_bytes_as_local_run"] = r["train_sha256"] == local["train_sha256"]
    print(json.dumps(r), flush=True)
    return [r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("tail", "memory", "rates", "driver", "cluster", "cores"))
    p.add_argument("--shards", type=int, default=5000, help="driver: one-document shards")
    p.add_argument("--pack-shards", default="1,64", help="driver: at most this many shards to a task, each in turn")
    p.add_argument("--address", help="driver: a Ray cluster to join instead of an embedded one (--ray-only)")
    p.add_argument("--trees", default=f"after={REPO}", help="name=path,... of tokpipe checkouts")
    p.add_argument("--size", default="250MB")
    p.add_argument("--shard-size", default="20MB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    args = p.parse_args()
    args.pack_shards = [int(n) for n in args.pack_shards.split(",")]
    args.trees = [(name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.trees.split(","))]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "tail": cmd_tail,
        "memory": cmd_memory,
        "rates": cmd_rates,
        "driver": cmd_driver,
        "cluster": cmd_cluster,
        "cores": cmd_cores,
    }[args.command](args)
    (args.work_dir / f"scale-{args.command}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

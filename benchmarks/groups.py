"""What --group-by costs (issue 29): throughput with and without it, and the cost of a group's files.

  python benchmarks/groups.py [--runs 3] [--workers 2] [--work-dir WORK_DIR]

1. Throughput: `tokpipe run` of the shared SlimPajama-style cache (29 MB, 8 shards, 4 groups in
   meta.redpajama_set_name) with and without `--group-by meta.redpajama_set_name`, the same workers,
   alternated run by run so that the machine's load falls on both alike; the tokenize phase's seconds.
   On a shared 2-core machine a run's tokenize phase also holds Ray's start (whether and when it starts
   varies), so the worker's own cost is measured too: every shard through tokenize_shard in this process
   (one worker), grouped and plain alternated, the fastest pass of each.
2. Files: what each extra part costs the worker and the file system, as a grouped shard does it: create
   a part's .bin and .idx, write them, fsync both (its checkpoint), copy it into its group's file
   (copy_file_range), fsync that, and unlink the part's files once listed; per part, on OUT's file system.
3. The driver: what the assembly's bookkeeping costs per shard (parts scheduled, listed and fsynced in
   <stem>.parts.tmp, one shard finishing at a time) with 7 groups a shard and without, no tokens copied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from harness import SHARED, TOKENIZER, manifest_of, phases, tokpipe_run

GROUP_BY = "meta.redpajama_set_name"


def throughput(source: Path, work_dir: Path, runs: int, workers: int) -> dict:
    manifest = manifest_of(next(source.glob("datasets--*")), work_dir)
    seconds = {"plain": [], "grouped": []}
    for _ in range(runs):
        for name, extra in (("plain", ()), ("grouped", ("--group-by", GROUP_BY))):
            run = tokpipe_run(manifest, work_dir / f"out-{name}", workers, *extra)
            seconds[name].append((phases(run)["tokenize_s"], run["wall"]))
    return seconds


def worker_cost(source: Path, work_dir: Path, runs: int) -> dict:
    """Seconds of one worker for every shard of `source`, plain and grouped: the fastest of `runs` passes."""
    from dataclasses import replace

    from tokpipe.inputs.manifest import build_manifest
    from tokpipe.inputs.tokenizer import load_tokenizer_info
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import encode_spec
    from tokpipe.write.shard import tokenize_shard

    shards = list(build_manifest(next(source.glob("datasets--*"))).shards())
    info = load_tokenizer_info(TOKENIZER)
    best = {}
    for warm in range(runs + 1):  # pass 0 warms the encoder and the page cache
        for name, group_by in (("plain", None), ("grouped", GROUP_BY)):
            spec = replace(encode_spec(RunOptions(group_by=group_by), info, "fastokens"), memory_limit=0)
            out = work_dir / f"worker-{name}"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            for shard in shards:
                tokenize_shard(shard, out, spec)
            seconds = time.perf_counter() - started
            if warm:
                best[name] = min(best.get(name, seconds), seconds)
    return best


def part_cost(folder: Path, parts: int, part_bytes: int) -> float:
    """Seconds per part: create, write, fsync, copy into a group file, fsync, unlink (what a grouped shard
    does per group more than a plain one)."""
    payload = os.urandom(part_bytes)
    group = os.open(folder / "group.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    started = time.perf_counter()
    for i in range(parts):
        paths = [folder / f"part{i}.bin", folder / f"part{i}.idx"]
        for path, data in zip(paths, (payload, payload[:64])):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            os.write(fd, data)
            os.fsync(fd)
            os.close(fd)
        src = os.open(paths[0], os.O_RDONLY)
        os.copy_file_range(src, group, part_bytes, 0, i * part_bytes)
        os.close(src)
        os.fdatasync(group)
        for path in paths:
            path.unlink()
    seconds = time.perf_counter() - started
    os.close(group)
    return seconds / parts


def assembly_cost(folder: Path, shards: int, groups: int) -> float:
    """Seconds of the driver per shard: Assembler.ready and .placed (--no-concat: no copy) as each shard is done."""
    from tokpipe.durability import write_atomic
    from tokpipe.inputs.manifest import Manifest, Shard
    from tokpipe.layout.checkpoints import Checkpoint, PartCounts
    from tokpipe.layout.files import ShardFiles
    from tokpipe.options import RunOptions
    from tokpipe.write.assembly import Assembler

    source = tuple(Shard("train", f"s{i:06d}.jsonl", "/dev/null", 1, f"s{i:06d}") for i in range(shards))
    manifest = Manifest(str(folder), str(folder), False, None, None, "x", {"train": shards}, shards, source)
    opts = RunOptions(no_concat=True, group_by="meta.set" if groups else None)
    counts = {"tokens": 1000, "documents": 3, "text_bytes": 4000, "sha256": "0" * 64, "idx_sha256": "0" * 64}
    parts = [PartCounts(False, f"Set{g}", **counts) for g in range(groups)] or [PartCounts(False, None, **counts)]
    ckpt = Checkpoint(lines=21, documents=3 * len(parts), tokens=1000 * len(parts), done=True, parts=parts)
    for shard in source:
        path = ShardFiles.of(folder, shard).checkpoint
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, ckpt.encoded())
    assembler = Assembler(folder, 4, opts.output)
    assembler.resume(manifest)
    started = time.perf_counter()
    for shard in source:
        assembler.done(shard, ckpt)
        parts = assembler.ready()
        assembler.placed(parts, [p.record for p in parts])
    return (time.perf_counter() - started) / shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--parts", type=int, default=2000)
    parser.add_argument("--source", type=Path, default=SHARED, help="an HF cache (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tokpipe-bench")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result = {"runs": throughput(args.source, args.work_dir, args.runs, args.workers)}
    for name, runs in result["runs"].items():
        tokenize = [t for t, _ in runs]
        print(
            f"{name:8} tokenize {statistics.median(tokenize):.2f} s median of {', '.join(f'{t:.2f}' for t in tokenize)}"
            f"; wall {statistics.median(w for _, w in runs):.1f} s"
        )
    result["worker_s"] = worker_cost(args.source, args.work_dir, args.runs)
    for name, seconds in result["worker_s"].items():
        print(f"{name:8} one worker, every shard in process: {seconds:.2f} s (fastest of {args.runs})")
    result["part_ms"], result["assembly_ms"] = {}, {}
    with tempfile.TemporaryDirectory(dir=args.work_dir) as folder:
        for size in (4 << 10, 1 << 20):
            result["part_ms"][size] = 1e3 * part_cost(Path(folder), args.parts, size)
            what = "create, write, 2 fsyncs, copy, unlink"
            print(f"per extra part of {size >> 10} KiB: {result['part_ms'][size]:.2f} ms ({what})")
    for groups in (0, 7):
        with tempfile.TemporaryDirectory(dir=args.work_dir) as folder:
            result["assembly_ms"][groups] = 1e3 * assembly_cost(Path(folder), args.parts, groups)
            print(f"driver's assembly per shard, {groups or 'no'} groups: {result['assembly_ms'][groups]:.2f} ms")
    (args.work_dir / "groups.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""tokpipe.data from an OUT on a store against the same split on a local disk: batches a second, bytes fetched an
epoch, the cache's size over time, the windows covered, and how shuffled the store's order is.

The shared data's OUT (benchmarks/loader.py shared_outs: its train split, 8.5 M Qwen3 tokens in uint32) is put on a
SeaweedFS `weed mini` on 127.0.0.1 (benchmarks/store.py start_weed). Each round runs two ranks (world_size 2), each
its own process and all at once, as a node's two ranks under DDP: first reading the store through one cache_dir of
`--cache-size`, then the local OUT; rounds alternate. The ranks step in lockstep, at a barrier before each batch
(free-running, the rank that started later lagged buffers behind, and fetched again what the other had removed).
Each rank takes `--epochs` epochs of batches of `--batch` windows of `--seq-len`; its rate is batches over the time
spent in next_batch (what a trainer waits for), its CPU its process's; SeaweedFS's CPU beside. Meanwhile this
process samples the cache folder's bytes every 5 ms (every file in it, those being written too). Every GET's bytes
are counted (tokpipe.store.Bucket.read wrapped, in each rank), the next epoch's first buffer included, and divided
by the split's bytes times the epochs. The first epoch's windows of both ranks, as a multiset, must be those
of the ranks on the local copy.

Shuffle (no store needed): an epoch's order at the same cache size, as world size 1 reads it, for the store's order,
a local OUT's (a permutation of every window), and MosaicML streaming's py1e at the same cache (shards of a block,
shuffle block_size the windows of a buffer; with `pip install mosaicml-streaming --no-deps`, its shuffle modules
are loaded alone). Measured: the correlation of draw position and window index; the mean distance between
consecutive windows over the split's windows (1/3 for a uniform permutation); and how many of 64 equal regions of
the split a batch of 64 consecutive draws touches (40.6 expected of a uniform permutation).

With `--litdata PYTHON` (a Python with litdata and torch), litdata_store.py then reads the same tokens from the same
SeaweedFS through litdata's StreamingDataset at the same cache size, one rank, and ours is read the same way.

    .venv/bin/python benchmarks/loader_store.py --rounds 3 --cache-size 8MiB --seq-len 256 --batch 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parse_size  # noqa: E402
from loader import shared_outs  # noqa: E402
from store import BUCKET, start_weed  # noqa: E402


def rank(args, barrier) -> dict:
    """One rank's run (a child process): its rate, the bytes it fetched, its first epoch's windows; rank 0 also the
    cache's size over time."""
    import tokpipe.store.bucket as bucket
    from tokpipe.data import Sequences

    fetched, read = [0], bucket.Bucket.read

    def counted(self, key, start, end, etag=None):
        data, size = read(self, key, start, end, etag)
        fetched[0] += len(data)
        return data, size

    bucket.Bucket.read = counted
    opened = began = time.perf_counter()
    s = Sequences(
        args.source, "train", args.seq_len, seed=args.seed, rank=args.rank, world_size=2,
        cache_dir=args.cache_dir, cache_size=args.cache_size,
    )  # fmt: skip
    opened = time.perf_counter() - opened
    per_epoch, batches, spent, taken = len(s) // 2, 0, 0.0, []
    while batches * args.batch < args.epochs * per_epoch:
        barrier.wait()
        started = time.perf_counter()
        batch = s.next_batch(args.batch)
        spent += time.perf_counter() - started
        batches += 1
        taken.append(batch.windows)
    cpu = time.process_time()
    first = np.concatenate(taken)[:per_epoch]
    return {
        "rate": batches / spent, "open_s": opened, "cpu_s": cpu, "wall_s": time.perf_counter() - began,
        "fetched": fetched[0], "windows": first.tolist(),
    }  # fmt: skip


def both_ranks(source: str, on: str, cache: Path, args, seed: int) -> list[dict]:
    """The two ranks run at once, each a process, in lockstep: both wait at a barrier before each batch (as DDP's
    all-reduce makes a step wait for every rank)."""
    shutil.rmtree(cache, ignore_errors=True)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    options = dict(vars(args), on=on, source=source, cache_dir=str(cache), seed=seed)
    runs = [
        context.Process(target=_rank, args=(argparse.Namespace(**options, rank=r), barrier, results)) for r in (0, 1)
    ]
    for run in runs:
        run.start()
    sizes, started = [], time.perf_counter()
    while any(run.is_alive() for run in runs) and results.empty():
        sizes.append((round(time.perf_counter() - started, 2), cache_bytes(cache)))
        time.sleep(0.005)
    found = dict(results.get() for _ in runs)
    for run in runs:
        run.join()
    found[0] |= {"cache_max": max(b for _, b in sizes), "cache_over_time": sizes[:: max(1, len(sizes) // 40)]}
    return [found[0], found[1]]


def one_rank(url: str, cache: Path, args) -> dict:
    """Our loader as litdata_store.py reads: one rank, an epoch of warm-up, then an epoch timed."""
    from tokpipe.data import Sequences

    shutil.rmtree(cache, ignore_errors=True)
    s = Sequences(url, "train", args.seq_len, seed=args.seed, cache_dir=cache, cache_size=args.cache_size)
    for _ in range(len(s) // args.batch):
        s.next_batch(args.batch)
    spent = 0.0
    for _ in range(len(s) // args.batch):
        started = time.perf_counter()
        s.next_batch(args.batch)
        spent += time.perf_counter() - started
    return {"batches_s": round(len(s) // args.batch / spent)}


def cpu_of(pid: int) -> float:
    """A process's CPU seconds so far (/proc/PID/stat: user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cache_bytes(folder: Path) -> int:
    held = 0
    for path in folder.rglob("*"):
        try:
            held += path.stat().st_size
        except FileNotFoundError:  # removed meanwhile
            pass
    return held


def _rank(args, barrier, results) -> None:
    results.put((args.rank, rank(args, barrier)))


def shuffle_measures(order: np.ndarray, n: int) -> dict:
    """How shuffled one epoch's order of n windows is."""
    position = np.arange(len(order))
    regions = order * 64 // n
    batches = regions[: len(regions) // 64 * 64].reshape(-1, 64)
    return {
        "corr_position_window": round(float(np.corrcoef(position, order)[0, 1]), 4),
        "consecutive_distance": round(float(np.abs(np.diff(order)).mean() / n), 4),
        "regions_per_batch_of_64": round(float(np.mean([len(np.unique(b)) for b in batches])), 1),
    }


def py1e_order(shard_sizes: np.ndarray, seed: int, block_size: int) -> np.ndarray | None:
    """MosaicML streaming's py1e order of one epoch, where the package is installed (its modules loaded alone: the
    package's own __init__ imports torch)."""
    if "streaming.base.shuffle.py1e" in sys.modules:  # loaded by an earlier call
        return sys.modules["streaming.base.shuffle.py1e"].get_shuffle_py1e(shard_sizes, 1, seed, 0, block_size)
    spec = importlib.util.find_spec("streaming")
    if spec is None:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "base" / "shuffle"
    for name in ("streaming", "streaming.base", "streaming.base.shuffle"):
        sys.modules.setdefault(name, types.ModuleType(name))
    for name in ("py1s", "py1e"):
        module_spec = importlib.util.spec_from_file_location(f"streaming.base.shuffle.{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    return sys.modules["streaming.base.shuffle.py1e"].get_shuffle_py1e(shard_sizes, 1, seed, 0, block_size)


def shuffles(out: Path, args) -> dict:
    from tokpipe.data import Sequences
    from tokpipe.data.blocks import BlockOrder, Geometry

    local = Sequences(out, "train", args.seq_len, seed=1)
    n = len(local)
    geometry = Geometry.fitted(n, args.seq_len, local.files.dtype.itemsize, args.cache_size)
    orders = {
        "a local OUT: a permutation of every window": local.take(n),
        f"a store's: blocks of {geometry.per_block} windows, {geometry.buffer} a buffer": BlockOrder(
            geometry, 1
        ).windows(0, np.arange(n)),
    }
    py1e = py1e_order(geometry.counts(), 1, geometry.per_block * geometry.buffer)
    if py1e is not None:
        orders[f"MosaicML py1e: shards of {geometry.per_block} windows, block_size a buffer's windows"] = py1e
    return {name: shuffle_measures(np.asarray(order), n) for name, order in orders.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cache-size", type=parse_size, default=8 << 20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--litdata", metavar="PYTHON", help="a Python with litdata and torch: litdata_store.py too")
    args = parser.parse_args()
    out = shared_outs(args.work_dir)["concat"]
    weed, env = start_weed(args.work_dir / "loader-store-weed")
    try:
        import tokpipe.store

        bucket = tokpipe.store.Bucket(BUCKET, env["AWS_ENDPOINT_URL"])
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            bucket.put(f"loader/{path.relative_to(out).as_posix()}", path.read_bytes())
        url, split = f"s3://{BUCKET}/loader", (out / "train.bin").stat().st_size
        cache = args.work_dir / "loader-store-cache"
        rows = []
        for r in range(args.rounds):
            served = cpu_of(weed.pid)
            store = both_ranks(url, "store", cache, args, args.seed + r)
            served = cpu_of(weed.pid) - served
            local = both_ranks(str(out), "local", cache, args, args.seed + r)
            same = sorted(store[0]["windows"] + store[1]["windows"]) == sorted(
                local[0]["windows"] + local[1]["windows"]
            )
            rows.append({
                "cpu_s": [round(s["cpu_s"], 2) for s in store + local], "weed_cpu_s": round(served, 2),
                "wall_s": [round(s["wall_s"], 2) for s in store + local],
                "store_batches_s": round(store[0]["rate"]), "local_batches_s": round(local[0]["rate"]),
                "ratio": round(store[0]["rate"] / local[0]["rate"], 2),
                "fetched_over_split": round(sum(s["fetched"] for s in store) / (split * args.epochs), 3),
                "cache_max_over_size": round(store[0]["cache_max"] / args.cache_size, 2),
                "open_s": round(store[0]["open_s"], 2), "epoch_windows_as_local": same,
                "cache_over_time": store[0]["cache_over_time"],
            })  # fmt: skip
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "cache_over_time"}), flush=True)
        print("ratio median", statistics.median(r["ratio"] for r in rows))
        print(json.dumps(shuffles(out, args), indent=1))
        print("cache over time (s, bytes), round 1:", rows[0]["cache_over_time"])
        if args.litdata:
            script = [args.litdata, str(Path(__file__).with_name("litdata_store.py")), "--out", str(out)]
            script += ["--bucket", BUCKET, "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
            script += ["--cache-size", f"{args.cache_size // 1_000_000}MB"]
            print("litdata:", subprocess.run(script, capture_output=True, text=True, env={**os.environ, **env}).stdout)
            print("ours, one rank the same way:", one_rank(url, cache, args))
    finally:
        weed.kill()


if __name__ == "__main__":
    main()

"""tokpipe.data's Sequences.next_batch against nanoGPT's get_batch on the same OUT: batches per second and
the process's memory, then the same as the split grows to 10^11 tokens.

nanoGPT's get_batch (train.py), with numpy where it has torch: a fresh np.memmap of the split file each
call (nanoGPT does so against a memory leak), 64 random offsets with replacement, x and y stacked as
int64. `get_batch (memmap kept)` is the same with the memmap opened once: the faster baseline.
Each method runs in a fresh process (alternating, `--rounds` times): its batches per second over
`--batches` batches after 50 of warm-up (on a synthetic split, one round of `--synthetic-batches`), and
from /proc/self/status its RssAnon (what the process holds) and RssFile (the split's pages it touched:
page cache, reclaimable).

The real OUT is `tokpipe run` of the shared data (cached under --work-dir). The growing ones are
synthetic: a sparse train.bin (reads as zeros) of 10^8..10^11 tokens, a document every 4,096 tokens in
train.idx, and a meta.json/meta.pkl as finalize writes them; what they measure is that nothing held
grows with the split.

    python benchmarks/loader.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SHARED, manifest_of, tokpipe_run  # noqa: E402

METHODS = ("get_batch", "get_batch (memmap kept)", "next_batch")
SYNTHETIC_DOCUMENT = 4096


def memory() -> dict:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) // 1024 for k in ("RssAnon", "RssFile", "VmHWM")}  # MiB


def measure(method: str, out: Path, seq_len: int, batch: int, batches: int) -> dict:
    """In this process: `batches` batches of `method` after 50 of warm-up."""
    meta = json.loads((out / "meta.json").read_text())
    path = out / meta["splits"]["train"]["file"]
    dtype = np.dtype(meta["dtype"])
    kept = np.memmap(path, dtype=dtype, mode="r")

    def get_batch():
        data = kept if method == "get_batch (memmap kept)" else np.memmap(path, dtype=dtype, mode="r")
        ix = np.random.randint(len(data) - seq_len, size=batch)
        x = np.stack([data[i : i + seq_len].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1 : i + 1 + seq_len].astype(np.int64) for i in ix])
        return x, y

    if method == "next_batch":
        from tokpipe.data import Sequences

        sequences = Sequences(out, seq_len=seq_len, seed=1)
        step = lambda: sequences.next_batch(batch)  # noqa: E731
    else:
        step = get_batch
    for _ in range(50):
        step()
    started = time.perf_counter()
    for _ in range(batches):
        step()
    seconds = time.perf_counter() - started
    return {"method": method, "batches_per_s": batches / seconds, **memory()}


def in_child(method: str, out: Path, args, batches: int) -> dict:
    command = [sys.executable, __file__, "--child", method, "--out", str(out), "--seq-len", str(args.seq_len)]
    command += ["--batch", str(args.batch), "--batches", str(batches)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def synthetic_out(folder: Path, tokens: int) -> Path:
    """An OUT's files for a train split of `tokens` zero tokens (a sparse file), a document every 4,096."""
    from tokpipe.layout import write_meta

    out = folder / f"synthetic-{tokens:.0e}"
    if (out / "meta.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.bin", "wb") as f:
        f.truncate(tokens * 4)
    documents = -(-tokens // SYNTHETIC_DOCUMENT)
    ends = np.minimum(np.arange(1, documents + 1, dtype="<i8") * SYNTHETIC_DOCUMENT, tokens)
    ends.tofile(out / "train.idx")
    split = {"file": "train.bin", "idx": "train.idx", "parts": "train.parts", "parts_sha256": "synthetic"}
    split |= {"tokens": tokens, "documents": documents}
    write_meta(out, {"dtype": "uint32", "vocab_size": 151669, "eos_token_id": 0, "splits": {"train": split}})
    return out


def real_out(work_dir: Path) -> Path:
    out = work_dir / "loader-shared-out"
    if not (out / "meta.json").exists():
        tokpipe_run(manifest_of(SHARED, work_dir), out, 2)
    return out


def compare(out: Path, args, methods=METHODS, rounds: int = 1, batches: int = 2000) -> dict:
    runs = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            runs[m].append(in_child(m, out, args, batches))
    return {
        m: {
            "batches_per_s": [round(r["batches_per_s"]) for r in rs],
            "median": round(statistics.median(r["batches_per_s"] for r in rs)),
            "RssAnon_MiB": max(r["RssAnon"] for r in rs),
            "RssFile_MiB": max(r["RssFile"] for r in rs),
        }
        for m, rs in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    parser.add_argument("--out", type=Path, help="an OUT to compare on (default: tokpipe run of the shared data)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1e8,1e10,1e11", help="synthetic split sizes in tokens")
    parser.add_argument(
        "--synthetic-batches", type=int, default=300, help="per run on a synthetic split (each row faults in pages)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.out, args.seq_len, args.batch, args.batches)))
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    out = args.out or real_out(args.work_dir)
    tokens = json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"]
    results = {"out": str(out), "tokens": tokens, "real": compare(out, args, rounds=args.rounds, batches=args.batches)}
    real = results["real"]
    for baseline in METHODS[:2]:
        ratio = real["next_batch"]["median"] / real[baseline]["median"]
        print(f"next_batch: {ratio:.2f}x the batches per second of {baseline}", flush=True)
    print(json.dumps(real, indent=1), flush=True)
    results["synthetic"] = {}
    for size in args.sizes.split(","):
        synthetic = synthetic_out(args.work_dir, int(float(size)))
        methods = ("get_batch (memmap kept)", "next_batch")
        results["synthetic"][size] = compare(synthetic, args, methods, batches=args.synthetic_batches)
        print(size, json.dumps(results["synthetic"][size]), flush=True)
    (args.work_dir / "loader.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

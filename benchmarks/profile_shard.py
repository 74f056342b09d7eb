"""Where a worker's time goes, without Ray: the stages of tokpipe.shard.tokenize_shard added one at a time.

    python benchmarks/profile_shard.py SHARD [SHARD ...] --tokenizer examples/tokenizers/qwen3 [--cprofile N]

Times are CPU seconds of this (single-threaded) process, steady on a shared machine; wall is shown too
(tokenize_shard's wall includes waiting for fsync). Each stage runs over the same shards in one process, after the encoder has seen their text once (so
its pretoken cache is warm, as it is for most of a long run; the cold first pass is reported too):

  decompress     the shard's bytes through tokpipe.source.decompressed_blocks (zstd)
  read_batches   + line splitting, orjson, the document checks: what tokpipe.source yields
  + encode       + GigatokenEncoder.encode (gigatoken encode_batch + awkward -> numpy)
  + eos/dtype    + the id check, delimit (EOS placed), to_dtype
  tokenize_shard the real thing: + writes, fsync, checkpoints, the lock file (into a temp OUT)

The difference between two lines is that stage's cost. --cprofile N prints the N costliest functions
of tokenize_shard under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokpipe.manifest import Shard
from tokpipe.shard import EncodeSpec, delimit, to_dtype, tokenize_shard
from tokpipe.source import decompressed_blocks, read_batches
from tokpipe.tokenizer import encoder, load_tokenizer_info


def stage_decompress(paths):
    for path in paths:
        for _ in decompressed_blocks(path):
            pass


def stage_read(paths):
    for path in paths:
        for _ in read_batches(path):
            pass


def stage_encode(paths, enc):
    for path in paths:
        for batch in read_batches(path):
            enc.encode(batch.texts)


def stage_eos(paths, enc, spec):
    for path in paths:
        for batch in read_batches(path):
            flat, lengths = enc.encode(batch.texts)
            if flat.size and int(flat.max()) >= spec.vocab_size:
                raise ValueError("id out of range")
            tokens, _ = delimit(flat, lengths, spec.bos_id, spec.eos_id, 0)
            to_dtype(tokens, spec.dtype)


def stage_shard(paths, spec, out: Path):
    shutil.rmtree(out, ignore_errors=True)
    for k, path in enumerate(paths):
        shard = Shard("train", f"p{k}", path, Path(path).stat().st_size, f"p{k}")
        tokenize_shard(shard, out, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shards", nargs="+")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, metavar="N")
    p.add_argument("--json")
    args = p.parse_args(argv)

    info = load_tokenizer_info(args.tokenizer)
    t0 = time.perf_counter()
    enc = encoder("gigatoken", info.path)
    load_s = time.perf_counter() - t0
    spec = EncodeSpec(info.path, "gigatoken", info.eos_id, info.vocab_size, info.dtype)
    text_bytes = sum(len(t.encode("utf-8", "replace")) for path in args.shards for b in read_batches(path) for t in b.texts)

    t0 = time.perf_counter()
    stage_encode(args.shards, enc)  # the cold pass also warms the pretoken cache for what follows
    cold_s = time.perf_counter() - t0

    out = Path(tempfile.mkdtemp(prefix="tokpipe-profile-"))
    stages = {
        "decompress": lambda: stage_decompress(args.shards),
        "read_batches": lambda: stage_read(args.shards),
        "+ encode": lambda: stage_encode(args.shards, enc),
        "+ eos/dtype": lambda: stage_eos(args.shards, enc, spec),
        "tokenize_shard": lambda: stage_shard(args.shards, spec, out / "o"),
    }
    results = {"text_bytes": text_bytes, "encoder_load_s": load_s, "cold_encode_pass_s": cold_s, "stages": {}}
    for name, fn in stages.items():
        walls, cpus = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        results["stages"][name] = {"s": statistics.median(cpus), "wall_s": statistics.median(walls), "cpu_all": [round(t, 3) for t in cpus]}

    print(f"{len(args.shards)} shards, {text_bytes / 1e6:.1f} MB of text; gigatoken load {load_s:.2f}s; cold encode+read pass {cold_s:.2f}s ({text_bytes / cold_s / 1e6:.1f} MB/s)")
    print(f"| stage (warm encoder, median of {args.repeats}) | CPU s | wall s | MB/s of text per core (CPU) | this stage's own CPU ms per MB | share of tokenize_shard |")
    print("|---|---:|---:|---:|---:|---:|")
    total = results["stages"]["tokenize_shard"]["s"]
    prev = 0.0
    for name, r in results["stages"].items():
        own = r["s"] - prev
        print(f"| {name} | {r['s']:.3f} | {r['wall_s']:.3f} | {text_bytes / r['s'] / 1e6:.1f} | {own / (text_bytes / 1e6) * 1e3:.2f} | {100 * own / total:.0f}% |")
        prev = r["s"]

    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        stage_shard(args.shards, spec, out / "o")
        prof.disable()
        stats = pstats.Stats(prof, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(args.cprofile)
    shutil.rmtree(out, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The segment writer of an OUT on a store (write/segments.py) alone: 64 parts of 4 MiB of tokens added in order to a
split file on a `weed mini` of this machine, twice: tokens per second through the one writer of a run, and its own CPU
per GB (the upload is the server's and the network's). What benchmarks/README.md's projection of a run at 128 workers
rests on."""

import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
from store import BUCKET, start_weed

from tokpipe.write.segments import Entry, Segments

proc, env = start_weed(Path(tempfile.mkdtemp(prefix="segments-")) / "weed")
try:
    rng = np.random.default_rng(0)
    part = rng.integers(0, 151669, size=(1 << 20), dtype=np.uint32)  # 4 MiB of tokens a part
    ends = np.arange(1, part.size // 1024 + 1, dtype=np.int64) * 1024
    for rnd in range(2):
        seg = Segments(f"s3://{BUCKET}/seg{rnd}", concat=True)
        c0, t0 = time.process_time(), time.perf_counter()
        n = 64
        for i in range(n):
            seg.add("train", f"s{i:03d}", Entry(f"s{i:03d}.jsonl", False, None, part.size, ends.size), [part], [ends])
        seg.end("train")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        mb = n * part.nbytes / 1e6
        rate, per_gb = mb / wall, cpu / mb * 1000
        print(f"round {rnd}: {mb:.0f} MB of tokens in {wall:.2f} s ({rate:.0f} MB/s),", end=" ")
        print(f"writer CPU {cpu:.2f} s ({per_gb:.1f} CPU-s/GB)")
finally:
    os.killpg(proc.pid, signal.SIGKILL)

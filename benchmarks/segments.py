"""Segment uploads of an OUT on a store (write/segments.py) alone, to a `weed mini` of this machine: what one node's
Placer sends (runner/copies.py, SegmentUploads: AT_ONCE uploads at a time, each a thread of the actor), for the two
shapes of segment a run makes: large parts, each a segment of its own (16 MiB of tokens: a shard of ~16 MB of text),
and small parts gathered into 5 MiB segments (1 MiB of tokens a part). MB/s of tokens, and the uploading process's
CPU per GB (the rest of the wall is the server's, on the same cores). What benchmarks/README.md's projection of a
run at 128 workers rests on.

    .venv/bin/python benchmarks/segments.py --rounds 2
"""

import argparse
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from store import BUCKET, start_weed

from tokpipe.layout.stored import StoredOut
from tokpipe.write.segments import Entry, Gatherer
from tokpipe.write.stored import upload_segment

TOKENS_MB = 256  # MB of tokens a measure uploads


def planned(out: StoredOut, part_mib: int) -> tuple[list, dict]:
    """The segments of a file of TOKENS_MB of parts of `part_mib` MiB (random tokens), and each part's arrays."""
    rng = np.random.default_rng(part_mib)
    tokens = rng.integers(0, 151669, size=part_mib << 18, dtype=np.uint32)
    ends = np.arange(1, tokens.size // 1024 + 1, dtype=np.int64) * 1024
    segments, closed = Gatherer(out, concat=True, itemsize=4), []
    for n in range(TOKENS_MB * 10**6 // tokens.nbytes):
        closed += segments.add("train", f"p{n:04d}", Entry(f"p{n:04d}", False, None, tokens.size, ends.size), n)
    return closed + segments.end("train"), ([tokens], [ends])


def measure(out: StoredOut, part_mib: int, at_once: int) -> str:
    closed, arrays = planned(out, part_mib)
    c0, t0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(at_once) as pool:
        sent = sum(pool.map(lambda p: upload_segment(out, p.segment, [arrays] * len(p.sources)), closed))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return f"{sent / 1e6 / wall:4.0f} MB/s, {cpu / sent * 1e9:.1f} CPU-s/GB ({len(closed)} segments)"


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()
proc, env = start_weed(Path(tempfile.mkdtemp(prefix="segments-")) / "weed")
try:
    for rnd in range(args.rounds):
        for part_mib, shape in ((16, "large parts, 16 MiB"), (1, "small parts gathered, 1 MiB")):
            for at_once in (1, 4):
                out = StoredOut.of(f"s3://{BUCKET}/r{rnd}-{part_mib}-{at_once}")
                print(f"round {rnd}, {shape}, {at_once} at once: {measure(out, part_mib, at_once)}", flush=True)
finally:
    os.killpg(proc.pid, signal.SIGKILL)

"""What a rerun of an OUT on a store pays to learn which parts its committed segments hold (write/segments.py
SegmentIndex.read), on a `weed mini` of this machine: N segments' records (.json, a part each, as a corpus of large
shards makes them), the index objects a run writes of them (INDEX_EVERY to one), then the records read back from
the index objects, and a GET of each .json (all a rerun could do before them). Seconds and the reader's CPU-s per
1,000 segments: what 500,000 segments (2.5 TB of tokens) cost a rerun's start, before any worker has a shard.

    .venv/bin/python benchmarks/resume.py --segments 3200
"""

import argparse
import os
import resource
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from store import BUCKET, start_weed

from tokpipe.layout.stored import Entry, Segment, StoredOut
from tokpipe.store import REQUESTS_AT_ONCE
from tokpipe.write.segments import INDEX_EVERY, SegmentIndex

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--segments", type=int, default=3200)
args = parser.parse_args()
proc, env = start_weed(Path(tempfile.mkdtemp(prefix="resume-")) / "weed")
os.environ.update(env)


def cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


try:
    out, n = StoredOut.of(f"s3://{BUCKET}/out"), args.segments
    segments = [
        Segment("train", None, f"segments/train/train__s{i:06d}", [Entry(f"s{i:06d}", False, None, 1 << 20, 700)],
                1 << 20, 700)
        for i in range(n)
    ]  # fmt: skip
    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
        list(pool.map(lambda s: out.bucket.put(out.key(s.name) + ".json", s.record()), segments))
    written = SegmentIndex(out)
    for at in range(0, n, INDEX_EVERY):
        written.add(segments[at : at + INDEX_EVERY], lambda: None)
    bases = [out.key(s.name) for s in segments]
    for how in ("from the index objects", "a GET of each .json"):
        index = SegmentIndex(out)
        if how.startswith("from"):
            for found in out.bucket.list(out.segment_index):
                index.note(found.key)
        start, used = time.perf_counter(), cpu()
        with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
            read = index.read(bases, pool, lambda said: None)
        seconds, used = time.perf_counter() - start, cpu() - used
        assert [s.name for s in read] == [s.name for s in segments]
        print(f"{how} ({len(index.listed)} objects): {seconds:.2f} s, {used:.2f} CPU-s;"
              f" per 1,000 segments {seconds / n * 1000:.2f} s, {used / n * 1000:.2f} CPU-s", flush=True)  # fmt: skip
finally:
    os.killpg(proc.pid, signal.SIGKILL)

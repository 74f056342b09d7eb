"""What finalize of an OUT on a store costs per segment (write/stored.py), on a `weed mini` of this machine: N
segments of S3's least part (5 MiB), then, one at a time and as a run does now, the split file composed from them
(UploadPartCopy: COPIES_AT_ONCE at a time against 1), their .idx fetched (REQUESTS_AT_ONCE ahead against one by one)
and the segments' objects removed (DeleteObjects of 1,000 keys against a DELETE each). Seconds per 1,000 segments:
what 60,000 shards' segments cost after the workers finish, here, where a request takes ~1-3 ms (a cloud store's
~20-50 ms makes the one-at-a-time figures ~10-20x worse, the batched ones barely).

    .venv/bin/python benchmarks/finalize.py --segments 200
"""

import argparse
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from store import BUCKET, start_weed

import tokpipe.store.upload as upload
from tokpipe.store import MIN_PART, Bucket
from tokpipe.write.stored import REQUESTS_AT_ONCE, _ahead

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--segments", type=int, default=200)
args = parser.parse_args()
proc, env = start_weed(Path(tempfile.mkdtemp(prefix="finalize-")) / "weed")
try:
    bucket, n = Bucket(BUCKET, os.environ["AWS_ENDPOINT_URL"]), args.segments
    body, ends = os.urandom(MIN_PART), os.urandom(8 * 1000)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: bucket.put(f"seg/{i:05d}.bin", body), range(n)))
        list(pool.map(lambda i: bucket.put(f"seg/{i:05d}.idx", ends), range(n)))
    sources = [(f"seg/{i:05d}.bin", 0, MIN_PART) for i in range(n)]

    def timed(what: str, fn) -> None:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        print(f"{what}: {seconds:.2f} s, {seconds / n * 1000:.1f} s per 1,000 segments", flush=True)

    for at_once in (1, upload.COPIES_AT_ONCE):
        upload.COPIES_AT_ONCE = at_once
        key = f"c{at_once}.bin"
        timed(f"compose, {at_once} copies at once", lambda: upload.compose(bucket, key, sources))  # noqa: B023
    keys = [f"seg/{i:05d}.idx" for i in range(n)]
    timed("the .idx fetched one by one", lambda: [bucket.get(k) for k in keys])
    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
        timed(f"the .idx fetched {REQUESTS_AT_ONCE} at a time, ahead", lambda: list(_ahead(pool, bucket.get, keys)))
    timed("the .idx objects removed one by one", lambda: [bucket.delete(k) for k in keys])
    timed("the .bin objects removed by DeleteObjects", lambda: bucket.delete_many([s for s, _, _ in sources]))
finally:
    os.killpg(proc.pid, signal.SIGKILL)

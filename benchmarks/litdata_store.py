"""litdata's StreamingDataset on the tokens loader_store.py reads: the same split, from the same kind of store, with
the same cache size, for comparison.

Run with a Python that has litdata and torch (not tokpipe's dependencies), e.g. a venv of its own:

    python3 -m venv /tmp/litvenv && /tmp/litvenv/bin/pip install "torch==2.13.0+cpu" litdata numpy boto3
    /tmp/litvenv/bin/python benchmarks/litdata_store.py --out /tmp/tokpipe-bench/loader-shared-concat \\
        --endpoint http://127.0.0.1:PORT --bucket bench --cache-size 8MB

The split's documents (train.bin cut at train.idx's ends) are written by litdata.optimize with its TokensLoader
into chunks of `--chunk-bytes`, uploaded under s3://BUCKET/litdata/, and read by one StreamingDataset (shuffle=True,
TokensLoader(block_size=seq_len + 1): items of seq_len + 1 tokens that share none) through a StreamingDataLoader of
`--batch`, one epoch after one of warm-up: batches a second, and the cache folder's most (sampled every 5 ms).
The endpoint and key come from the environment (AWS_*), as loader_store.py's `start_weed` sets them; loader_store.py
with `--litdata PYTHON` runs this script against its own SeaweedFS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import boto3
import litdata.streaming.downloader
import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.streaming.item_loader import TokensLoader

# litdata builds obstore's S3Store without allow_http, which an http:// endpoint (SeaweedFS here) needs: "HTTP error:
# builder error" on every GET. Its boto3 path instead.
litdata.streaming.downloader._OBSTORE_AVAILABLE = False


def document(item: tuple[str, int, int]) -> torch.Tensor:
    """A document's tokens (optimize's workers are processes of their own: each item names its file and range)."""
    path, start, stop = item
    return torch.from_numpy(np.fromfile(path, dtype=np.uint32, count=stop - start, offset=4 * start).astype(np.int32))


def folder_bytes(folder: Path) -> int:
    held = 0
    for path in folder.rglob("*"):
        try:
            held += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:
            pass
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"))
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cache-size", default="8MB")
    parser.add_argument("--chunk-bytes", default="2MB")
    args = parser.parse_args()
    ends = np.fromfile(args.out / "train.idx", dtype="<i8").tolist()
    documents = [(str(args.out / "train.bin"), a, b) for a, b in zip([0] + ends[:-1], ends)]
    work = Path(tempfile.mkdtemp(prefix="litdata-"))
    try:
        optimize(
            fn=document, inputs=documents, output_dir=str(work / "optimized"),
            chunk_bytes=args.chunk_bytes, item_loader=TokensLoader(), num_workers=1, verbose=False,
        )  # fmt: skip
        client = boto3.client("s3", endpoint_url=args.endpoint)
        for path in (work / "optimized").iterdir():
            client.upload_file(str(path), args.bucket, f"litdata/{path.name}")
        cache, most, done = work / "cache", [0], threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                most[0] = max(most[0], folder_bytes(cache))

        dataset = StreamingDataset(
            f"s3://{args.bucket}/litdata", cache_dir=str(cache), item_loader=TokensLoader(block_size=args.seq_len + 1),
            shuffle=True, max_cache_size=args.cache_size, storage_options={"endpoint_url": args.endpoint},
        )  # fmt: skip
        loader = StreamingDataLoader(dataset, batch_size=args.batch, num_workers=0)
        for _ in loader:  # an epoch of warm-up: the index fetched, the first chunks
            pass
        threading.Thread(target=sample, daemon=True).start()
        batches, spent, started = 0, 0.0, time.perf_counter()
        iterator = iter(loader)
        while True:
            at = time.perf_counter()
            try:
                next(iterator)
            except StopIteration:
                break
            spent += time.perf_counter() - at
            batches += 1
        done.set()
        wall = round(time.perf_counter() - started, 2)
        print(json.dumps({
            "litdata_batches_s": round(batches / spent), "batches": batches, "wall_s": wall,
            "cache_most": most[0], "chunks": len(list((work / "optimized").glob("*.bin"))),
        }))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

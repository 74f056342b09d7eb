"""Write a JSONL dataset's documents as Parquet shards in a Hugging Face cache layout, as the hub's
own conversion names them (data/train-00000-of-00002.parquet, data/validation-...).

    python examples/make_parquet_example.py examples/hf-cache examples/hf-cache-parquet \
        --repo tokpipe-realdata/slimpajama-mini-parquet --row-group 64

Each JSONL shard becomes one Parquet file with a single `text` column (null where a line had no
string text), rows in line order, so the same documents come out in the same order: tokpipe gives
both byte-identical bins. Row groups are small on purpose: a resume lands mid-file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.source import format_of
from tokpipe.inputs.source.jsonl import decompressed_blocks


def rows_of(path: str) -> list[str | None]:
    rows = []
    with open(path, "rb") as raw:
        text = b"".join(block for block, *_ in decompressed_blocks(raw, path, format_of(path)[0]))
    for line in text.splitlines():
        if line.strip():
            value = json.loads(line).get("text")
            rows.append(value if isinstance(value, str) else None)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a dataset `tokpipe manifest` accepts (JSONL shards)")
    p.add_argument("dest", help="the Hugging Face cache root to write (replaced)")
    p.add_argument("--repo", required=True, help="ORG/NAME of the dataset in the cache")
    p.add_argument("--row-group", type=int, default=64, help="rows per row group (default: 64)")
    args = p.parse_args()

    shards = list(build_manifest(args.source).shards())
    per_split = Counter(s.split for s in shards)
    repo = Path(args.dest) / f"datasets--{args.repo.replace('/', '--')}"
    if repo.exists():
        shutil.rmtree(repo)
    (repo / "blobs").mkdir(parents=True)
    files, seen = {}, Counter()
    for shard in shards:
        name = f"data/{shard.split}-{seen[shard.split]:05d}-of-{per_split[shard.split]:05d}.parquet"
        seen[shard.split] += 1
        tmp = repo / "blobs" / "tmp.parquet"
        table = pa.table({"text": pa.array(rows_of(shard.path), pa.string())})
        pq.write_table(table, tmp, row_group_size=args.row_group, compression="zstd")
        blob = hashlib.sha256(tmp.read_bytes()).hexdigest()
        tmp.rename(repo / "blobs" / blob)
        files[name] = blob
    # A revision named by the content, as a commit hash would be: the same input gives the same layout.
    revision = hashlib.sha1(json.dumps(files, sort_keys=True).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    for name, blob in files.items():
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(repo / "blobs" / blob, link.parent), link)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    print(f"{repo}: {len(files)} Parquet shards, revision {revision[:12]}")


if __name__ == "__main__":
    main()

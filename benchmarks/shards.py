"""Many small shards: `tokpipe run` against the pipeline a user writes by hand (handwritten.py) on the same
manifest of N zstd shards of D distinct documents each (documents cut to --chars characters), same encoder, same
workers, runs alternating (issue 55). Prints, per shard size, best of --repeats: each side's wall and CPU seconds
(CPU: the command and every process it started, Ray's included), their ratio, and tokpipe's wall per shard.

    python benchmarks/shards.py --shards 20000 --docs 2            # the many-small-files case of issue 55
    python benchmarks/shards.py --shards 20000,200,20 --docs 2,200,2000
"""

import argparse
import itertools
import shutil
import sys
from pathlib import Path

import orjson
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SHARED, distinct_texts, manifest_of, tokpipe_run  # noqa: E402
from price import handwritten_run  # noqa: E402


def small_shards(count: int, docs: int, chars: int, work_dir: Path) -> Path:
    """`count` zstd JSONL shards of `docs` distinct documents each, each cut to `chars` characters (1,000 shards a
    folder), built once."""
    folder = work_dir / "corpora" / f"shards-{count}x{docs}-{chars}"
    if (folder / "done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    texts, cctx = distinct_texts(str(SHARED)), zstandard.ZstdCompressor(level=3)
    for k in range(count):
        sub = folder / "train" / f"d{k // 1000:04d}"
        sub.mkdir(parents=True, exist_ok=True)
        lines = b"".join(orjson.dumps({"text": text[:chars]}) + b"\n" for text in itertools.islice(texts, docs))
        if lines.count(b"\n") < docs:
            raise SystemExit(f"distinct text ran out at shard {k}: ask for fewer or shorter documents")
        (sub / f"s{k:06d}.jsonl.zst").write_bytes(cctx.compress(lines))
    (folder / "done").write_text("ok\n")
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default="20000", help="shards of each corpus, comma-separated (default: 20000)")
    p.add_argument("--docs", default="2", help="documents a shard, one per --shards (default: 2)")
    p.add_argument("--chars", type=int, default=1000, help="characters a document, at most (default: 1000)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="fastokens", help="the encoder of both sides (default: fastokens)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    args = p.parse_args()
    for count, docs in zip(map(int, args.shards.split(",")), map(int, args.docs.split(","))):
        manifest = manifest_of(small_shards(count, docs, args.chars, args.work_dir), args.work_dir)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for side in ("handwritten", "tokpipe"):
                if side == "tokpipe":
                    run = tokpipe_run(manifest, args.work_dir / "shards-out", args.workers, "--backend", args.backend)
                else:
                    run = handwritten_run(manifest, args.work_dir / "shards-hw", args.workers, args.backend)
                if side not in best or run["wall"] < best[side]["wall"]:
                    best[side] = run
        hw, tp = best["handwritten"], best["tokpipe"]
        print(
            f"{count:,} shards x {docs:,} documents: tokpipe {tp['wall']:.1f} s wall, {tp['cpu']:.1f} CPU-s;"
            f" handwritten {hw['wall']:.1f} s, {hw['cpu']:.1f} CPU-s: {tp['wall'] / hw['wall']:.2f}x the wall,"
            f" {tp['cpu'] / hw['cpu']:.2f}x the CPU; {tp['wall'] / count * 1e3:.2f} ms of tokpipe's wall a shard",
            flush=True,
        )
        print("  " + next(line for _, line in tp["lines"] if line.startswith("phases: ")), flush=True)


if __name__ == "__main__":
    main()

"""What reading each format costs a worker: tokpipe's reader (tokpipe.inputs.source.read_batches) alone, no encoder,
over the same documents as JSON Lines, as one JSON array (json.dump's, and indented as alpaca_data.json is), and as
Parquet (pyarrow's defaults); then a million documents of ~30 characters as JSON Lines and as an array, where the cost
per document shows.

Run `.venv/bin/python benchmarks/formats.py --size 100MB`. Each file is read --rounds times in this process; the best
round counts (MB/s of the file, documents/s). An encoder's core reads ~100-150 MB/s of real text
(benchmarks/README.md, encoders.py): a reader well above that is not what a worker waits on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harness import SHARED, build_distinct_corpus, load_texts, parse_size


def write_formats(texts: list[str], folder: Path) -> dict[str, Path]:
    """The documents in each format, with a field beside the text as records carry one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    records = [{"text": text, "meta": {"n": n}, "id": n} for n, text in enumerate(texts)]
    names = ("records.jsonl", "records.json", "records-indent.json", "records.parquet", "tiny.jsonl", "tiny.json")
    files = {name: folder / name for name in names}
    files["records.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    files["records.json"].write_text(json.dumps(records))
    files["records-indent.json"].write_text(json.dumps(records, indent=4))
    pq.write_table(pa.Table.from_pylist(records), files["records.parquet"])
    tiny = [{"text": f"short document number {n}", "id": n} for n in range(1_000_000)]
    files["tiny.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in tiny))
    files["tiny.json"].write_text(json.dumps(tiny))
    return files


def read(path: Path, rounds: int) -> dict:
    from tokpipe.inputs.source import read_batches

    best, documents = float("inf"), 0
    for _ in range(rounds):
        started = time.perf_counter()
        documents = sum(len(batch.texts) for batch in read_batches(str(path)))
        best = min(best, time.perf_counter() - started)
    size = path.stat().st_size
    return {"MB": round(size / 1e6, 1), "MB_s": round(size / 1e6 / best), "documents_s": round(documents / best)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="100MB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    args = p.parse_args()
    corpus = build_distinct_corpus(str(SHARED), parse_size(args.size), 1, parse_size(args.size), args.work_dir)
    files = write_formats(load_texts(corpus.path), args.work_dir / "formats")
    result = {name: read(path, args.rounds) for name, path in files.items()}
    (args.work_dir / "formats.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

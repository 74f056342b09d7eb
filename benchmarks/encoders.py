"""The encoders on distinct text: each backend alone (a fresh process, one thread, texts in memory,
~1 MiB batches; cold = first pass, warm = second), with its ids checked against tokenizers on a sample;
then tokpipe's tokenize phase with each backend on the same corpus.

    python benchmarks/encoders.py --size 250MB --workers 2
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    SHARED,
    TOKENIZER,
    batches,
    build_distinct_corpus,
    load_texts,
    manifest_of,
    parse_size,
    phases,
    timed,
    tokpipe_run,
)

BACKENDS = ("fastokens", "gigatoken", "hf")
HF_MB = 6  # tokenizers runs ~2 MB/s a core: it gets a sample
CHECK_MB = 4  # of text whose ids each fast backend must match tokenizers' on


def one(backend: str, corpus_path: str) -> dict:
    """Run in a fresh process: load, encode everything twice, check a sample against tokenizers."""
    from tokpipe.inputs.encoders import encoder

    texts = load_texts(corpus_path, HF_MB * 10**6 if backend == "hf" else None)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    started = time.monotonic()
    enc = encoder(backend, str(TOKENIZER / "tokenizer.json"))
    load_s = time.monotonic() - started
    passes = []
    for _ in range(2):
        cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        tokens = sum(len(enc.encode(batch)[0]) for batch in batches(texts))
        now = resource.getrusage(resource.RUSAGE_SELF)
        seconds = time.monotonic() - wall
        passes.append(
            {
                "MB_s": round(mb / seconds, 1),
                "cpu_per_wall": round((now.ru_utime - cpu.ru_utime + now.ru_stime - cpu.ru_stime) / seconds, 2),
            }
        )
    differ = 0
    if backend != "hf":
        sample = load_texts(corpus_path, CHECK_MB * 10**6)
        ref = encoder("hf", str(TOKENIZER / "tokenizer.json"))
        for text in sample:
            differ += not np.array_equal(enc.encode([text])[0], ref.encode([text])[0])
    return {
        "backend": backend,
        "text_MB": round(mb, 1),
        "tokens": tokens,
        "load_s": round(load_s, 2),
        "cold": passes[0],
        "warm": passes[1],
        "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
        "checked_documents": 0 if backend == "hf" else len(sample),
        "differing_documents": differ,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="250MB")
    p.add_argument("--shards", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one backend in this process
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.corpus)))
        return
    size = parse_size(args.size)
    corpus = build_distinct_corpus(str(SHARED), size, args.workers, -(-size // args.shards), args.work_dir)
    raw = []
    for backend in BACKENDS:
        run = timed([sys.executable, Path(__file__), "--one", backend, "--corpus", Path(corpus.path)])
        raw.append(json.loads(next(line for _, line in reversed(run["lines"]) if line.startswith("{"))))
    manifest = manifest_of(Path(corpus.path), args.work_dir)
    phase = {}
    for backend in BACKENDS[:2]:  # hf would take most of an hour
        run = tokpipe_run(manifest, args.work_dir / "encoders-out", args.workers, "--backend", backend)
        phase[backend] = {
            "tokenize_s": phases(run)["tokenize_s"],
            "wall_s": round(run["wall"], 2),
        }
    phase["ratio_fastokens_to_gigatoken"] = round(
        phase["fastokens"]["tokenize_s"] / phase["gigatoken"]["tokenize_s"], 3
    )
    result = {"corpus_text_MB": round(corpus.text_bytes / 1e6, 1), "raw": raw, "tokpipe": phase}
    (args.work_dir / "encoders.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

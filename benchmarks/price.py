"""The machinery's price: `tokpipe run` against the pipeline a user would write by hand (handwritten.py),
same distinct corpus, same encoder (the one tokpipe's `auto` picks), same workers, runs alternating.

Prints, best of --repeats: the fixed cost of each (a 20-document corpus, from the command's start to
its exit), the marginal cost (full corpus minus tiny), their ratio, the whole-run ratio, and where
tokpipe's time goes (from the timestamps of its own output lines), with both sides' CPU seconds.

    python benchmarks/price.py --size 250MB --workers 2
    python benchmarks/price.py --size 800MB --base 424MB --shards 64 --long-tail             # the whole run
    python benchmarks/price.py --size 800MB --base 424MB --shards 64 --long-tail --ray-only  # past Ray's start
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    SHARED,
    TOKENIZER,
    build_distinct_corpus,
    manifest_of,
    parse_size,
    phases,
    timed,
    tiny_corpus,
    tokpipe_run,
)


def handwritten_run(manifest: Path, out: Path, workers: int, backend: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    script = [sys.executable, Path(__file__).with_name("handwritten.py"), manifest, TOKENIZER / "tokenizer.json"]
    run = timed([*script, out, "--workers", workers, "--backend", backend])
    run["tokens"] = int(run["lines"][-1][1].split()[1])
    return run


def _meta_tokens(out: Path) -> int:
    return sum(s["tokens"] for s in json.loads((out / "meta.json").read_text())["splits"].values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="250MB", help="JSONL bytes of distinct text (default: 250MB)")
    p.add_argument("--shards", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default=None, help="the encoder (default: what tokpipe's auto picks)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    p.add_argument(
        "--base",
        default=None,
        help="the smaller run of the marginal: a distinct corpus of this size in shards of the same size"
        " (default: 20 documents, which makes the marginal the whole run's less the fixed cost)",
    )
    p.add_argument(
        "--long-tail",
        action="store_true",
        help="a never-seen identifier after every 4th word (harness.build_distinct_corpus): distinct documents past"
        " the distinct text at hand (453 MB here), for a marginal measured where both sides run at full speed",
    )
    p.add_argument(
        "--ray-only",
        action="store_true",
        help="tokpipe's runs on Ray's workers from their start (its hidden --ray-only): a marginal past Ray's start"
        " where the base alone would end before Ray is up, and so run without it",
    )
    args = p.parse_args()
    size = parse_size(args.size)
    shard_bytes = -(-size // args.shards)
    corpus = build_distinct_corpus(str(SHARED), size, args.workers, shard_bytes, args.work_dir, args.long_tail)
    base = (
        Path(
            build_distinct_corpus(
                str(SHARED), parse_size(args.base), args.workers, shard_bytes, args.work_dir, args.long_tail
            ).path
        )
        if args.base
        else tiny_corpus(args.work_dir)
    )
    manifests = {"tiny": manifest_of(base, args.work_dir), "full": manifest_of(Path(corpus.path), args.work_dir)}
    out = args.work_dir / "price-out"
    runs: dict[str, list[dict]] = {}
    backend = args.backend
    for _ in range(args.repeats):
        for corpus_name in ("tiny", "full"):
            tp = tokpipe_run(manifests[corpus_name], out / "tokpipe", args.workers, *["--ray-only"] * args.ray_only)
            tp |= phases(tp) | {"tokens": _meta_tokens(out / "tokpipe")}
            backend = backend or next(line for _, line in tp["lines"] if line.startswith("backend ")).split()[1].rstrip(
                ":"
            )
            hw = handwritten_run(manifests[corpus_name], out / "handwritten", args.workers, backend)
            if tp["tokens"] != hw["tokens"]:
                raise SystemExit(
                    f"{corpus_name}: tokpipe wrote {tp['tokens']:,} tokens, the hand-written script {hw['tokens']:,}"
                )
            runs.setdefault(f"tokpipe {corpus_name}", []).append(tp)
            runs.setdefault(f"handwritten {corpus_name}", []).append(hw)
    best = {name: min(rs, key=lambda r: r["wall"]) for name, rs in runs.items()}
    w = {name: r["wall"] for name, r in best.items()}
    marginal = {who: w[f"{who} full"] - w[f"{who} tiny"] for who in ("tokpipe", "handwritten")}
    full_tp = best["tokpipe full"]
    result = {
        "corpus": {"text_MB": corpus.text_bytes / 1e6, "documents": corpus.documents, "shards": len(corpus.shards)},
        "backend": backend,
        "workers": args.workers,
        "repeats": args.repeats,
        "wall_s": {name: [round(r["wall"], 2) for r in rs] for name, rs in runs.items()},
        "cpu_s": {name: round(r["cpu"], 2) for name, r in best.items()},
        "fixed_s": {"tokpipe": round(w["tokpipe tiny"], 2), "handwritten": round(w["handwritten tiny"], 2)},
        "marginal_s": {k: round(v, 2) for k, v in marginal.items()},
        "marginal_ratio": round(marginal["tokpipe"] / marginal["handwritten"], 3),
        "whole_run_ratio": round(w["tokpipe full"] / w["handwritten full"], 3),
        "tokpipe_full_marks_s": {k: round(v, 2) for k, v in full_tp["marks"].items()}
        | {"exit": round(full_tp["wall"], 2)},
        "tokpipe_tiny_marks_s": {k: round(v, 2) for k, v in best["tokpipe tiny"]["marks"].items()}
        | {"exit": round(w["tokpipe tiny"], 2)},
        "tokpipe_full_phases": full_tp["phases"],
        "tokens_full": full_tp["tokens"],
    }
    (args.work_dir / "price.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""A/B of tokpipe trees on the same corpora: runs interleaved (A, B, A, B, ...), medians per variant.

    python benchmarks/ab.py --trees base=/work/wt-bench,patched=/tmp/scratch --sizes 100MB,300MB --rounds 4

Each variant runs `python -m tokpipe.cli run` in its tree with PYTHONPATH set to it (its Ray workers
inherit both), so a patched copy of tokpipe can be measured against the original without installing it. Interleaving spreads a noisy
neighbour's load over all variants alike. Reports wall, phases, CPU seconds and the marginal rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from corpus import build_corpus, parse_size  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="NAME=PATH,NAME=PATH: tokpipe checkouts to compare")
    p.add_argument("--source", default=str(HERE.parent.parent / "shared" / "data" / "hf-cache"))
    p.add_argument("--sizes", default="100MB,300MB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tokenizer", default=str(HERE.parent / "examples" / "tokenizers" / "qwen3"))
    p.add_argument("--work-dir", default="/tmp/tokpipe-bench")
    p.add_argument("--shard-size", default="16MB")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)

    work = Path(args.work_dir)
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    corpora = [(f"{parse_size(s) / 1e6:g}MB", build_corpus(args.source, parse_size(s), args.workers, parse_size(args.shard_size), work)) for s in args.sizes.split(",")]
    for name, tree in trees.items():  # make sure each variant really imports its own tree
        got = subprocess.run([sys.executable, "-c", "import tokpipe; print(tokpipe.__file__)"], cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True).stdout.strip()
        if not got.startswith(str(Path(tree).resolve())):
            raise SystemExit(f"variant {name}: tokpipe imports from {got}, not {tree}")
    runs: dict = {name: {label: [] for label, _ in corpora} for name in trees}
    for k in range(args.rounds):
        for name, tree in trees.items():
            bench.RAY_ENV["PYTHONPATH"] = tree
            bench.TOKPIPE_CWD = tree  # `python -m` would put the cwd's tokpipe first
            for label, c in corpora:
                manifest = work / "manifests" / f"{label}.json"
                if not manifest.is_file():
                    bench.run_monitored(bench.tokpipe_cmd("manifest", "--dataset-dir", c.path, "-o", str(manifest)))
                r = bench.e2e_run(c, manifest, args.tokenizer, args.workers, work / "out" / f"ab-{label}")
                runs[name][label].append({k2: v for k2, v in r.items() if k2 not in ("workers", "ray_system")})
                print(f"[ab] round {k + 1} {name} {label}: {r['wall_s']:.1f}s, tokenize {r['phases'].get('tokenize_s', 0):.1f}s, CPU {r['cpu_s']['total']:.1f}s", file=sys.stderr, flush=True)

    (la, a), (lb, b) = corpora[0], corpora[-1]
    dmb = (b.text_bytes - a.text_bytes) / 1e6
    med = statistics.median
    print(f"| variant (medians of {args.rounds}, interleaved) | wall {la} s | wall {lb} s | marginal MB/s (wall) | " + " | ".join(f"{p} {lb} s" for p in ("startup", "backend_check", "ray_init", "tokenize", "shutdown_finalize")) + f" | CPU {la} s | CPU {lb} s | marginal CPU ms/MB | driver peak RSS MiB | task worker peak RSS MiB |")
    print("|---|" + "---:|" * 13)
    summary = {}
    for name in trees:
        ra, rb = runs[name][la], runs[name][lb]
        wa, wb = med(r["wall_s"] for r in ra), med(r["wall_s"] for r in rb)
        ca, cb = med(r["cpu_s"]["total"] for r in ra), med(r["cpu_s"]["total"] for r in rb)
        ph = {k: med(r["phases"].get(k, 0) for r in rb) for k in ("startup_s", "backend_check_s", "ray_init_s", "tokenize_s", "shutdown_finalize_s")}
        row = {
            "wall": (wa, wb),
            "marginal_mb_s": dmb / (wb - wa) if wb > wa else None,
            "phases": ph,
            "cpu": (ca, cb),
            "marginal_cpu_ms_per_mb": (cb - ca) / dmb * 1e3,
            "driver_rss": max(r["driver"]["peak_rss_mib"] for r in ra + rb),
            "worker_rss": max(r["task_worker_peak_rss_mib"] or 0 for r in ra + rb),
        }
        summary[name] = row
        print(f"| {name} | {wa:.1f} | {wb:.1f} | {bench.fmt(row['marginal_mb_s'])} | " + " | ".join(f"{v:.2f}" for v in ph.values()) + f" | {ca:.1f} | {cb:.1f} | {row['marginal_cpu_ms_per_mb']:.1f} | {row['driver_rss']:.0f} | {row['worker_rss']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Mixture of many groups of one OUT (FineWeb-2 has ~1,900 language-script pairs): what opening it, its first
batches, a batch, an unpickling (each DataLoader worker's) and its state cost, against the groups' count.

    python benchmarks/mixture_groups.py --groups 400,2000
    python benchmarks/mixture_groups.py --groups 400 --out s3://BUCKET/PREFIX   # AWS_* set, as for tokpipe run

Data: GROUPS x 12 documents of 60 words drawn from 50,000 made-up ones, in 4 JSON Lines shards (every shard holds
every group), `tokpipe run --group-by g` with the repo's Qwen3 into a folder under --work-dir, or into --out (a
store: put benchmarks/lagproxy.py in front of it to see a region's latency). Each measurement in a fresh process:
Mixture.of_groups(OUT, every group at weight 1, seq_len 64), its first 20 batches of 64 rows, then 3 x 50 batches
(ms a batch, the best), a pickle round trip, state_dict and load_state_dict; the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from harness import manifest_of, tokpipe_run

MEASURE = """
import json, pickle, resource, sys, time
from tokpipe.data import Mixture
out, groups = sys.argv[1], int(sys.argv[2])
clock = time.perf_counter()
mixture = Mixture.of_groups(out, {f"g{i:05d}": 1 for i in range(groups)}, seq_len=64, cache_dir=sys.argv[3])
said = {"open_s": time.perf_counter() - clock}
clock = time.perf_counter()
for _ in range(20):
    mixture.next_batch(64)
said["first_20_batches_s"] = time.perf_counter() - clock
rounds = []
for _ in range(3):
    clock = time.perf_counter()
    for _ in range(50):
        mixture.next_batch(64)
    rounds.append((time.perf_counter() - clock) / 50 * 1000)
said["batch_ms"] = min(rounds)
raw = pickle.dumps(mixture)
clock = time.perf_counter()
pickle.loads(raw)
said["unpickle_s"] = time.perf_counter() - clock
clock = time.perf_counter()
state = mixture.state_dict()
mixture.load_state_dict(state)
said |= {"state_and_load_ms": (time.perf_counter() - clock) * 1000, "state_json_bytes": len(json.dumps(state))}
said["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
print(json.dumps(said))
"""


def grouped_data(folder: Path, groups: int, seed: int = 0) -> Path:
    rng, words = random.Random(seed), [f"w{i}" for i in range(50_000)]
    (folder / "train").mkdir(parents=True, exist_ok=True)
    for shard in range(4):
        with open(folder / "train" / f"shard{shard}.jsonl", "w") as f:
            for d in range(groups * 3):
                text = " ".join(rng.choice(words) for _ in range(60))
                f.write(json.dumps({"text": text, "g": f"g{d % groups:05d}"}) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="400,2000", help="counts of groups, comma-separated")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench/mixture-groups"))
    parser.add_argument("--out", help="an s3:// prefix to write each OUT under instead of --work-dir")
    args = parser.parse_args()
    for groups in map(int, args.groups.split(",")):
        work = args.work_dir / str(groups)
        manifest = manifest_of(grouped_data(work / "data", groups), work)
        out = f"{args.out.rstrip('/')}/{groups}" if args.out else work / "out"
        tokpipe_run(manifest, out, 2, "--group-by", "g", "--val-fraction", "0")
        measured = subprocess.run(
            [sys.executable, "-c", MEASURE, str(out), str(groups), str(work / "cache")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        print(json.dumps({"groups": groups, "out": str(out), **json.loads(measured.stdout)}), flush=True)


if __name__ == "__main__":
    main()

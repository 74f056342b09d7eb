"""tokpipe.data's next_batch against a careful random-offset reader in the same process: batches per
second on the shared data (a concatenated split, --no-concat, a Mixture of 3 groups), then milliseconds a
batch on synthetic splits up to 10^11 tokens with their pages cold.

The random-offset reader is the fastest plain way to read a split: its memmap kept open, 64 random
offsets, one fancy-index gather of 64 x (seq_len + 1) tokens per batch, cast to int64 (nanoGPT's
get_batch slices and stacks per row instead: 3-4x slower, measured at issue 28). It has no epochs, no
ranks and no document starts; next_batch has all three.

Warm (`--rounds`): one process per kind of OUT; in it, the reader and next_batch alternate, `--batches`
batches each after 50 of warm-up, on distinct data (the permutation's windows, random offsets); the
ratio is of their medians. Each batch's rows are read whole (their sum taken), so nothing is measured
that a trainer would not wait for; next_batch's doc_starts are built (`batch.doc_starts`) for the same
reason. `--clock cpu` times this thread's CPU time instead of the wall: on a machine shared with other
work the wall counts the time other processes hold the core, round by round unevenly.

Cold (`--sizes`): a sparse train.bin (reads as zeros) of 10^8..10^11 tokens, a document every 4,096
tokens in a real train.idx (195 MB at 10^11), meta as finalize writes it. In a fresh process per
method and round: open the loader (next_batch's first batch builds its sparse ends: timed apart), drop
the files' pages from the page cache (posix_fadvise DONTNEED), then time `--cold-batches` batches.

First (`--scalar`: only), the microseconds of a scalar `Permutation(n)[i]` lookup, the issue's bound 5 us.

Files (`--files 300,60000`, issue 47): a split's speed against its file count. `--files N` one-document
shards (the shared data's documents in turn) run through `tokpipe run` twice, concatenated and
--no-concat: the same tokens in one file or in N. In a fresh process under `ulimit -n` `--nofile` (64),
next_batch on each (and, as the option not taken, the same windows read with pread: an open, a preadv
and a close a file a window crosses, no document starts) alternate as above: first `--batches` batches
from a fresh loader (its files mapped as they are first read: the cold rate), then, once every file is
mapped (an epoch's windows read 4,096 at a time, timed: "mapped_s"; the concatenated split's too, so
that both have every page faulted in), `--rounds` rounds, each method's `--batches` taken 20 at a time in
turn (`interleaved`). Beside the rates: the maps of the --no-concat split's files (the lines of
/proc/self/maps that name one) and the descriptors the process holds beyond those it had before.
Another checkout's loader: this file and harness.py copied into its benchmarks/ (b43ee5c's needs
`--nofile` raised: two descriptors a map).

    python benchmarks/loader.py --rounds 5
    python benchmarks/loader.py --files 300,60000 --rounds 5 --clock cpu
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import SHARED, load_texts, manifest_of, tokpipe_run  # noqa: E402

SYNTHETIC_DOCUMENT = 4096
GROUPS = ("RedPajamaC4", "RedPajamaCommonCrawl", "RedPajamaGithub")
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def random_reader(out: Path, seq_len: int, batch: int):
    """One batch of the random-offset reader: a kept memmap, one gather, int64."""
    meta = json.loads((out / "meta.json").read_text())
    data = np.memmap(out / meta["splits"]["train"]["file"], dtype=meta["dtype"], mode="r")
    offsets = np.arange(seq_len + 1)
    rng = np.random.default_rng()
    return lambda: data[rng.integers(0, len(data) - seq_len - 1, batch)[:, None] + offsets].astype(np.int64)


def tokpipe_reader(out: Path, kind: str, seq_len: int, batch: int):
    from tokpipe.data import Mixture, Sequences

    if kind == "mixture":
        sources = {g: Sequences(out, seq_len=seq_len, seed=1, group=g) for g in GROUPS}
        loader = Mixture(sources, {"RedPajamaC4": 0.5, "RedPajamaCommonCrawl": 0.3, "RedPajamaGithub": 0.2})
    else:
        loader = Sequences(out, seq_len=seq_len, seed=1)

    def step():
        b = loader.next_batch(batch)
        b.doc_starts  # noqa: B018 (built, as a trainer that uses them pays for)
        return b.tokens

    return step


def rate(step, batches: int, clock=time.perf_counter) -> float:
    started = clock()
    for _ in range(batches):
        step().sum()
    return batches / (clock() - started)


def warm(kind: str, out: Path, reader_out: Path, args) -> dict:
    """In this process: the random-offset reader and next_batch, alternating, `args.rounds` times."""
    methods = {"random offsets": random_reader(reader_out, args.seq_len, args.batch)}
    methods["next_batch"] = tokpipe_reader(out, kind, args.seq_len, args.batch)
    runs, clock = {m: [] for m in methods}, CLOCKS[args.clock]
    for step in methods.values():
        rate(step, 50)
    for _ in range(args.rounds):
        for m, step in methods.items():
            runs[m].append(rate(step, args.batches, clock))
    medians = {m: statistics.median(r) for m, r in runs.items()}
    return {
        "kind": kind,
        "clock": args.clock,
        **{m: [round(r) for r in rs] for m, rs in runs.items()},
        "medians": {m: round(v) for m, v in medians.items()},
        "ratio": round(medians["next_batch"] / medians["random offsets"], 2),
    }


def scalar_permutation(rounds: int) -> dict:
    """Microseconds a scalar `Permutation(n)[i]` takes (the issue's bound: 5 us), at n = 10^12 + 39 (2^40 > n:
    ~1.1 cycle-walk passes a lookup) and n = 16,615 (just above 2^14: ~2 passes), median of `rounds` rounds of
    20,000 distinct indices each."""
    from tokpipe.data import Permutation

    results = {}
    for n in (10**12 + 39, 16_615):
        p, runs = Permutation(n, 5), []
        for r in range(rounds):
            indices = [(r * 20_000 + k) * 7_919 % n for k in range(20_000)]
            started = time.perf_counter()
            for i in indices:
                p[i]
            runs.append(1e6 * (time.perf_counter() - started) / len(indices))
        results[f"{n:,}"] = {"us": [round(u, 2) for u in runs], "median": round(statistics.median(runs), 2)}
    return results


def drop_pages(*paths: Path) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def cold(method: str, out: Path, args) -> dict:
    """In this (fresh) process: ms a batch of `method` on `out` with its pages dropped first."""
    started = time.perf_counter()
    if method == "random offsets":
        step = random_reader(out, args.seq_len, args.batch)
    else:
        step = tokpipe_reader(out, "concat", args.seq_len, args.batch)
        step()  # builds the sparse ends of train.idx
    opened = time.perf_counter() - started
    drop_pages(out / "train.bin", out / "train.idx")
    started = time.perf_counter()
    for _ in range(args.cold_batches):
        step().sum()
    return {"ms_per_batch": 1000 * (time.perf_counter() - started) / args.cold_batches, "open_s": opened}


def child(*extra: str) -> dict:
    command = [sys.executable, __file__, *extra]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def files(args) -> None:
    """--files: per file count, its two OUTs made (cached), then one process of files_warm."""
    common = ["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--batches", str(args.batches)]
    common += ["--rounds", str(args.rounds), "--clock", args.clock, "--nofile", str(args.nofile)]
    results = {}
    for count in map(int, args.files.split(",")):
        outs = files_outs(count, args.work_dir)
        results[count] = child("--files-warm", str(outs["concat"]), str(outs["no-concat"]), *common)
        print(json.dumps(results[count]), flush=True)
    (args.work_dir / "loader-files.json").write_text(json.dumps(results, indent=1))


def synthetic_out(folder: Path, tokens: int) -> Path:
    """An OUT's files for a train split of `tokens` zero tokens (a sparse file), a document every 4,096."""
    from tokpipe.layout.files import LayoutWriter

    out = folder / f"synthetic-{tokens:.0e}"
    if (out / "meta.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.bin", "wb") as f:
        f.truncate(tokens * 4)
    documents = -(-tokens // SYNTHETIC_DOCUMENT)
    ends = np.minimum(np.arange(1, documents + 1, dtype="<i8") * SYNTHETIC_DOCUMENT, tokens)
    ends.tofile(out / "train.idx")
    part = {"shard": "synthetic", "tokens": tokens, "documents": documents, "sha256": "synthetic (zeros)"}
    raw = (json.dumps(part) + "\n").encode()
    (out / "train.parts").write_bytes(raw)
    split = {"file": "train.bin", "idx": "train.idx", "parts": "train.parts"}
    split |= {"parts_sha256": hashlib.sha256(raw).hexdigest(), "tokens": tokens, "documents": documents}
    meta = {"dtype": "uint32", "vocab_size": 151669, "eos_token_id": 0, "splits": {"train": split}}
    LayoutWriter(out).write_meta(meta)
    return out


def small_shards(count: int, work_dir: Path) -> Path:
    """`count` plain JSONL shards of one document each, the shared data's documents in turn (1,000 a
    sub-folder): a --no-concat split of `count` files, each as small as a document (~2,600 tokens)."""
    import orjson

    folder = work_dir / "small-shards" / f"{count}"
    if (folder / "done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    texts = load_texts(SHARED)
    for k in range(count):
        sub = folder / "train" / f"d{k // 1000:04d}"
        if k % 1000 == 0:
            sub.mkdir(parents=True)
        (sub / f"s{k:07d}.jsonl").write_bytes(orjson.dumps({"text": texts[k % len(texts)]}) + b"\n")
    (folder / "done").write_text("ok\n")
    return folder


def files_outs(count: int, work_dir: Path) -> dict[str, Path]:
    """`tokpipe run` of `count` small shards, concatenated and --no-concat (cached under work_dir)."""
    shards = small_shards(count, work_dir)
    outs = {}
    for kind, extra in {"concat": [], "no-concat": ["--no-concat"]}.items():
        out = outs[kind] = work_dir / f"loader-{count}-files-{kind}"
        if not (out / "meta.json").exists():
            tokpipe_run(manifest_of(shards, work_dir), out, 2, *extra)
    return outs


def pread_reader(out: Path, seq_len: int, batch: int):
    """A batch of the --no-concat split's windows (the loader's seeded order) read with pread: for each window,
    each file it crosses opened, its piece read into the batch's row with preadv, and closed."""
    from tokpipe.data import Sequences

    loader = Sequences(out, seq_len=seq_len, seed=1)
    files, starts, dtype = loader.files, loader.files.starts, loader.files.dtype
    paths = [str(bin_path) for bin_path, _ in files.paths]

    def step():
        rows = np.empty((batch, seq_len + 1), dtype)
        for row, start in enumerate((loader.take(batch) * seq_len).tolist()):
            f, filled = int(np.searchsorted(starts, start, side="right")) - 1, 0
            while filled < seq_len + 1:
                piece = rows[row, filled : filled + int(starts[f + 1]) - (start + filled)]
                fd = os.open(paths[f], os.O_RDONLY)
                os.preadv(fd, [piece], (start + filled - int(starts[f])) * dtype.itemsize)
                os.close(fd)
                filled, f = filled + len(piece), f + 1
        return rows.astype(np.int64)

    return step


def interleaved(methods: dict, batches: int, clock, chunk: int = 20) -> dict[str, float]:
    """Batches per second of each method over `batches` batches, taken `chunk` at a time in turn: the load of
    a shared machine changes within a round of 1,000 batches (3-7 us a numpy call when loaded, ~1 quiet),
    and a round of each in turn compared different loads (one pass: 0.46 on 300 files, 0.65 on 60,000)."""
    seconds = dict.fromkeys(methods, 0.0)
    for _ in range(batches // chunk):
        for m, step in methods.items():
            started = clock()
            for _ in range(chunk):
                step().sum()
            seconds[m] += clock() - started
    return {m: batches // chunk * chunk / s for m, s in seconds.items()}


def maps_of(out: Path) -> int:
    """This process's maps of OUT's files: the lines of /proc/self/maps that name one."""
    return sum(f" {out}/" in line for line in Path("/proc/self/maps").read_text().splitlines())


def files_warm(concat_out: Path, files_out: Path, args) -> dict:
    """In this (fresh) process, under `ulimit -n` args.nofile: next_batch on the concatenated split and on
    the --no-concat one (and pread), alternating: cold, then with every file mapped."""
    import resource

    from tokpipe.data import Sequences

    resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    descriptors, clock = len(os.listdir("/proc/self/fd")), CLOCKS[args.clock]
    started = time.perf_counter()
    loader = Sequences(files_out, seq_len=args.seq_len, seed=1)
    opened = time.perf_counter() - started
    concatenated = Sequences(concat_out, seq_len=args.seq_len, seed=1)

    def step(sequences):
        batch = sequences.next_batch(args.batch)
        batch.doc_starts  # noqa: B018 (built, as a trainer that uses them pays for)
        return batch.tokens

    methods = {"concatenated": lambda: step(concatenated), "--no-concat": lambda: step(loader)}
    methods["pread"] = pread_reader(files_out, args.seq_len, args.batch)
    cold = {m: round(rate(read, args.batches, clock)) for m, read in methods.items()}
    mapped = []
    for sequences in (loader, concatenated):  # every window read once: every file mapped, every page faulted in
        started = time.perf_counter()
        for first in range(0, len(sequences), 4096):
            sequences.batch_of(np.arange(first, min(first + 4096, len(sequences))))
        mapped.append(time.perf_counter() - started)
    runs = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m, measured in interleaved(methods, args.batches, clock).items():
            runs[m].append(measured)
    medians = {m: statistics.median(r) for m, r in runs.items()}
    return {
        "files": len(loader.files),
        "clock": args.clock,
        "nofile": args.nofile,
        "open_s": round(opened, 2),
        "mapped_s": round(mapped[0], 2),
        "concatenated_read_s": round(mapped[1], 2),
        "cold": cold,
        **{m: [round(r) for r in rs] for m, rs in runs.items()},
        "medians": {m: round(v) for m, v in medians.items()},
        "ratio": round(medians["--no-concat"] / medians["concatenated"], 2),
        "pread_ratio": round(medians["pread"] / medians["concatenated"], 2),
        "maps": maps_of(files_out),
        "descriptors_held": len(os.listdir("/proc/self/fd")) - descriptors,
    }


def shared_outs(work_dir: Path) -> dict[str, Path]:
    """`tokpipe run` of the shared data: concatenated, --no-concat, --group-by (cached under work_dir)."""
    flags = {"concat": [], "no-concat": ["--no-concat"], "mixture": ["--group-by", "meta.redpajama_set_name"]}
    outs = {}
    for kind, extra in flags.items():
        out = outs[kind] = work_dir / f"loader-shared-{kind}"
        if not (out / "meta.json").exists():
            tokpipe_run(manifest_of(SHARED, work_dir), out, 2, *extra)
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="warm rates by the wall or this thread's CPU")
    parser.add_argument("--sizes", default="1e8,1e10,1e11", help="synthetic split sizes in tokens")
    parser.add_argument("--cold-rounds", type=int, default=3)
    parser.add_argument("--cold-batches", type=int, default=30, help="per process on a cold synthetic split")
    parser.add_argument("--warm", nargs=3, help=argparse.SUPPRESS)  # KIND OUT READER_OUT: one warm process
    parser.add_argument("--cold", nargs=2, help=argparse.SUPPRESS)  # METHOD OUT: one cold process
    parser.add_argument("--scalar", action="store_true", help="only the scalar Permutation lookup")
    parser.add_argument("--files", help="file counts of a --no-concat split to compare with its tokens in one file")
    parser.add_argument("--nofile", type=int, default=64, help="`ulimit -n` of the --files processes")
    parser.add_argument("--files-warm", nargs=2, help=argparse.SUPPRESS)  # CONCAT_OUT FILES_OUT: one process
    args = parser.parse_args()
    if args.files_warm:
        print(json.dumps(files_warm(Path(args.files_warm[0]), Path(args.files_warm[1]), args)))
        return
    if args.files:
        files(args)
        return
    if args.warm:
        kind, out, reader_out = args.warm
        print(json.dumps(warm(kind, Path(out), Path(reader_out), args)))
        return
    if args.cold:
        print(json.dumps(cold(args.cold[0], Path(args.cold[1]), args)))
        return
    results = {"scalar_permutation": scalar_permutation(args.rounds)}
    print("scalar Permutation(n)[i]", json.dumps(results["scalar_permutation"]), flush=True)
    if args.scalar:
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    outs = shared_outs(args.work_dir)
    common = ["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--batches", str(args.batches)]
    common += ["--rounds", str(args.rounds), "--cold-batches", str(args.cold_batches), "--clock", args.clock]
    results |= {"warm": {}, "cold": {}}
    for kind, out in outs.items():
        results["warm"][kind] = child("--warm", kind, str(out), str(outs["concat"]), *common)
        print(json.dumps(results["warm"][kind]), flush=True)
    for size in filter(None, args.sizes.split(",")):  # --sizes "": no cold runs
        out = synthetic_out(args.work_dir, int(float(size)))
        runs = {m: [] for m in ("random offsets", "next_batch")}
        for _ in range(args.cold_rounds):
            for m in runs:
                runs[m].append(child("--cold", m, str(out), *common))
        results["cold"][size] = {
            m: {
                "ms_per_batch": [round(r["ms_per_batch"], 1) for r in rs],
                "median": round(statistics.median(r["ms_per_batch"] for r in rs), 1),
                "open_s": round(max(r["open_s"] for r in rs), 2),
            }
            for m, rs in runs.items()
        }
        print(size, json.dumps(results["cold"][size]), flush=True)
    (args.work_dir / "loader.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

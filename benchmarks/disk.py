"""Tokens written once: OUT's peak disk use during a run against its final output, and the bytes the
run sent to storage per output byte, with and without --no-concat, on distinct text.

OUT is walked every 50 ms (allocated blocks of every file); write_bytes comes from /proc/PID/io of
the run's processes (its session), each process's last reading kept when it exits. `device_MB` is what
the block device under OUT took, from its counters in /sys/block (sync before the run and after it:
what the page cache still held counts, what was deleted before it reached the disk does not); the
machine should run nothing else meanwhile.

    python benchmarks/disk.py --size 110MB --shards 11 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, SHARED, build_distinct_corpus, manifest_of, parse_size, tokpipe_run  # noqa: E402
from procmon import Poller  # noqa: E402


def allocated(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:  # removed while we looked
                pass
    return total


def session_writes(sid: int, seen: dict[int, int]) -> None:
    """Update pid -> write_bytes for every live process of session `sid`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[3]) != sid:
                continue
            io = Path(entry.path, "io").read_text()
        except (OSError, ValueError):
            continue
        seen[int(entry.name)] = int(next(line.split()[1] for line in io.splitlines() if line.startswith("write_bytes")))


def output_bytes(out: Path) -> int:
    meta = json.loads((out / "meta.json").read_text())
    total = 0
    for split in meta["splits"].values():
        files = split.get("files") or [{"bin": split["file"], "idx": split["idx"]}]
        total += sum((out / f["bin"]).stat().st_size + (out / f["idx"]).stat().st_size for f in files)
    return total


class DiskWatch(Poller):
    """While a run lasts, every 50 ms: OUT's allocated bytes (`peak`) and the write_bytes of the processes
    of its session (`writes`, pid -> its last reading)."""

    def __init__(self, out: Path, sid: int):
        super().__init__(0.05)
        self.out, self.sid, self.peak, self.writes = out, sid, 0, {}

    def poll(self) -> None:
        self.peak = max(self.peak, allocated(self.out))
        session_writes(self.sid, self.writes)


def device_of(path: Path) -> Path:
    """/sys/block/DEV of the whole disk under `path` (a partition's counters live in its disk's folder)."""
    dev = os.stat(path).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    return block if (block / "stat").exists() and not (block / "partition").exists() else block.parent


def sectors_written(block: Path) -> int:
    return int((block / "stat").read_text().split()[6])  # field 7: sectors written, 512 bytes each


def measure(manifest: Path, out: Path, workers: int, *extra: str, tree: Path = REPO) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    block = device_of(out.parent)
    os.sync()
    before = sectors_written(block)
    run = tokpipe_run(manifest, out, workers, *extra, tree=tree, watch=lambda pid: DiskWatch(out, pid))
    os.sync()
    device = (sectors_written(block) - before) * 512
    peak, writes = run["watch"].peak, run["watch"].writes
    final = output_bytes(out)
    at_end = allocated(out)
    return {
        "mode": " ".join(extra) or "concat",
        "seconds": round(run["wall"], 2),
        "output_MB": round(final / 1e6, 1),
        "peak_OUT_MB": round(max(peak, at_end) / 1e6, 1),
        "peak_ratio": round(max(peak, at_end) / final, 3),
        "finished_OUT_MB": round(at_end / 1e6, 1),
        "written_MB": round(sum(writes.values()) / 1e6, 1),
        "written_per_output_byte": round(sum(writes.values()) / final, 3),
        "device_MB": round(device / 1e6, 1),
        "device_per_output_byte": round(device / final, 3),
        "phases": next(line for _, line in run["lines"] if line.startswith("phases: ")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="110MB")
    p.add_argument("--shards", type=int, default=11)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    p.add_argument("--tree", type=Path, default=None, help="the tokpipe checkout to run (default: this one)")
    args = p.parse_args()
    size = parse_size(args.size)
    # workers=1 for the builder: it rounds the shard count up to a multiple of it.
    corpus = build_distinct_corpus(str(SHARED), size, 1, -(-size // args.shards), args.work_dir)
    manifest = manifest_of(Path(corpus.path), args.work_dir)
    tree = args.tree or REPO
    out = args.work_dir / "disk-out"
    rows = [measure(manifest, out, args.workers, *extra, tree=tree) for extra in ((), ("--no-concat",))]
    result = {"corpus": {"text_MB": round(corpus.text_bytes / 1e6, 1), "shards": len(corpus.shards)}, "runs": rows}
    (args.work_dir / "disk.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

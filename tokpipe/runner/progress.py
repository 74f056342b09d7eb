"""What a run tells while it runs: the progress bar or lines, OUT/logs/progress.json, OUT/logs/run.log,
and where its time went (the phases)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokpipe.durability import write_json_atomic
from tokpipe.fmt import disk_line, disk_now, duration
from tokpipe.layout.files import PROGRESS, RUN_LOG, Layout
from tokpipe.layout.meta import Meta
from tokpipe.layout.run import log_line
from tokpipe.layout.series import Series
from tokpipe.runner.events import Listener, Said, silent

LINE_EVERY = 30.0  # seconds between the plain progress lines of a run with no terminal


class RunLog:
    """OUT/logs/run.log: the effective configuration, shard failures, stalls, the outcome."""

    def __init__(self, out: Path):
        path = Layout(out).log(RUN_LOG)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a")

    def __call__(self, message: str) -> None:
        self._f.write(log_line(message))
        self._f.flush()


class Progress:
    """A tqdm bar on a terminal; a plain line every LINE_EVERY seconds otherwise (CI, nohup, Slurm logs).

    Also keeps OUT/logs/progress.json current, so `tokpipe status` can tell rate and ETA from files alone.
    """

    def __init__(
        self,
        out: Path,
        total_bytes: int,
        plan,
        itemsize: int,
        series: Series,
        tell: Listener = silent,
        on_disk: bool = True,
    ):
        self.out, self.total, self.shards, self.itemsize, self.series = out, total_bytes, plan.shards, itemsize, series
        self.tell, self.done_before = tell, plan.done
        self.done = plan.done  # shards, as last updated
        self.start_bytes, self.t0, self.started_at = plan.done_bytes, time.monotonic(), time.time()
        self.disk: dict | None = None  # the output's projected size, once a shard of this run is done
        self.on_disk = on_disk  # False: OUT on a store, whose space is no file system's to compare it with
        self.base = [0, 0, 0]  # file bytes, documents, tokens of this run before its Ray tasks (the driver's)
        # The workers the run has (the driver sets them, once known; the scheduler as nodes join and are lost), and
        # their seconds so far: the busy share's denominator.
        self._workers, self._since, self._worker_seconds, self.worker_range = 0, self.t0, 0.0, (0, 0)
        self.last_line = self.last_file = 0.0
        self.read_this_run = 0
        self.bar = None
        if tell is not silent and sys.stderr.isatty():  # a bar only for who listens, on a terminal
            # Shard counts (and failures) before the rates, and no label: in 80 columns tqdm cuts the
            # line's end, and that must be the least important part.
            self.bar = tqdm(
                total=total_bytes,
                initial=self.start_bytes,
                unit="iB",
                unit_scale=True,
                unit_divisor=1024,
                dynamic_ncols=True,
                bar_format="{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}iB, ETA {remaining}{postfix}",
            )

    @property
    def workers(self) -> int:
        return self._workers

    @workers.setter
    def workers(self, workers: int) -> None:
        # The first count is the run's from its start: the cores that wait for Ray's workers (their start, a
        # cluster's node check) show in the busy share.
        if self._workers:
            now = time.monotonic()
            self._worker_seconds, self._since = self.worker_seconds(now), now
        fewest, most = self.worker_range
        self._workers, self.worker_range = workers, (min(fewest, workers) if fewest else workers, max(most, workers))

    def worker_seconds(self, until: float) -> float:
        return self._worker_seconds + self._workers * (until - self._since)

    def update(
        self, file_bytes: int, documents: int, tokens: int, done: int, running: int, failed: int, final: bool = False
    ) -> None:
        file_bytes, documents, tokens = (a + b for a, b in zip(self.base, (file_bytes, documents, tokens)))
        now = time.monotonic()
        elapsed = max(now - self.t0, 1e-9)
        # Workers report the compressed bytes they have read, and a shard's last report may miss the
        # file's tail (zstd's frame end, the reports still in flight): a finished run has read it all.
        read = self.total if final and done == self.shards else self.start_bytes + file_bytes
        self.read_this_run, self.done = read - self.start_bytes, done
        rate = file_bytes / elapsed
        eta = (self.total - read) / rate if rate > 0 else None
        projected = self.projects(done) and file_bytes and tokens
        if projected:
            self.disk = self._project_disk(file_bytes, tokens)
        failures = f" ({failed} FAILED)" if failed else ""
        self.series.point(read, tokens, documents, running, done, self.workers, final)
        rates = f"{documents:,} docs, {tokens / elapsed / 1e6:.2f}M tok/s"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{done}/{self.shards} shards{failures}, {rates}", refresh=False)
            self.bar.update(read - self.bar.n)
        elif final or now - self.last_line >= LINE_EVERY:
            self.last_line = now
            pct = 100 * read / self.total if self.total else 100.0
            eta_said = f", ETA {duration(eta)}" if eta is not None else ", ETA unknown"
            when = f" in {duration(elapsed)}" if final else eta_said
            self.tell(
                Said(
                    f"[tokpipe] {pct:5.1f}% of {self.total / 2**20:,.1f} MiB read{when} | {done}/{self.shards} "
                    f"shards done{failures}, {running} running, {rates}",
                    stderr=True,
                )
            )
        if final or projected or now - self.last_file >= 2.0:  # the projection kept at once, for status
            self.last_file = now
            write_json_atomic(
                Layout(self.out).log(PROGRESS),
                {
                    "pid": os.getpid(),
                    "started_at": self.started_at,
                    "updated_at": time.time(),
                    "bytes_read": read,
                    "bytes_total": self.total,
                    "documents": documents,
                    "tokens": tokens,
                    "tokens_per_s": tokens / elapsed,
                    "eta_s": eta,
                    "shards": {"total": self.shards, "done": done, "running": running, "failed": failed},
                    "disk": self.disk,
                },
            )

    def projects(self, done: int) -> bool:
        """Whether an update with `done` shards would project the output's size (once, at this run's first)."""
        return self.disk is None and self.on_disk and done > self.done_before

    def _project_disk(self, file_bytes: int, tokens: int) -> dict:
        """The output's size from the tokens per input byte so far, beside the free space of OUT's file
        system; said once, when the first shard of this run is done, so that a disk too small is known
        hours before it fills (a full disk stops the run; it resumes once space is freed)."""
        disk = disk_now(int(tokens / file_bytes * self.total * self.itemsize), self.out)
        self.tell(Said(disk_line(disk, tokens / file_bytes, self.total, self.itemsize)))
        return disk

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Timeline:
    """Where a run's time went, for run.log and the summary: plan (inputs, checkpoints, Ray, backend
    check), tokenize (until the last shard is done), finalize (from then until meta.json is written)."""

    start: float
    planned: float | None = None
    tokenized: float | None = None
    read_bytes: int = 0  # of input, by this run's workers
    assembled_bytes: int = 0  # of tokens, copied into place while shards tokenized
    workers: tuple[int, int] = (1, 1)  # the fewest and most it had (nodes join, are lost), at work or waiting for Ray
    worker_seconds: float = 0.0  # theirs in the tokenize phase
    shard_seconds: float = 0.0  # that this run's shards took, summed over them (ShardResult.seconds)
    series: Series | None = None  # OUT/logs/series.jsonl, for `tokpipe report`: gets a mark at each phase

    def tokenized_now(self, assembled_bytes: int) -> None:
        """The last shard is done: the tokenize phase ends, finalize's begins."""
        self.tokenized, self.assembled_bytes = time.monotonic(), assembled_bytes
        self.series.mark("finalize")

    def finalizing(self) -> None:
        """Finalize begins; where no shard was left to tokenize, the plan ends here (else finalize took "0.00s" of
        all its work, at 37,101,856 GB/s)."""
        self.planned = self.planned or time.monotonic()
        self.tokenized = self.tokenized or self.planned
        self.series.mark("finalize")

    def report(self, finished: float, meta: Meta) -> str:
        planned = self.planned or finished
        tokenized = self.tokenized or planned
        token_bytes = meta.tokens * np.dtype(meta.dtype).itemsize
        tokenize_s, finalize_s = tokenized - planned, finished - tokenized
        busy = self.shard_seconds / max(self.worker_seconds, 1e-9)
        fewest, most = self.workers
        had = f"{most} x {tokenize_s:.1f}s"
        if fewest != most:
            had = f"{fewest}-{most} workers, {self.worker_seconds:.1f}s of worker time"
        return (
            f"phases: plan {planned - self.start:.1f}s | tokenize {tokenize_s:.1f}s, "
            f"{self.read_bytes / 1e6:,.1f} MB of input read"
            f" ({self.read_bytes / 1e6 / max(tokenize_s, 1e-9):.1f} MB/s), workers busy {100 * min(busy, 1):.0f}%"
            f" ({had}, {self.shard_seconds:.1f}s on shards) | finalize {finalize_s:.2f}s"
            f"{f' ({100 * finalize_s / tokenize_s:.0f}% of tokenize)' if tokenize_s else ''}:"
            f" {token_bytes / 1e6:,.1f} MB of tokens, {self.assembled_bytes / 1e6:,.1f} MB of them assembled "
            "while tokenizing,"
            f" {(token_bytes - self.assembled_bytes) / 1e6:,.1f} MB after "
            f"({(token_bytes - self.assembled_bytes) / 1e9 / max(finalize_s, 1e-9):.2f} GB/s)"
        )

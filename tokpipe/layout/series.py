"""OUT/logs/series.jsonl: a compact time series of a run, for `tokpipe report`'s throughput chart.

One JSON object a line, appended by the driver:
  {"attempt": 2, "t": 1764000000.0, "every": 4.0}                  an attempt (a `tokpipe run`) starts
  {"a": 2, "t": ..., "phase": "tokenize"}                           a phase starts: plan (with the attempt),
                                                                    tokenize, finalize, finished, failed
  {"a": 2, "t": ..., "b": bytes, "k": tokens, "d": docs, "r": running, "s": done, "w": workers}   a point

`t` is wall-clock (Unix seconds), so attempts share one time axis. `b` (input bytes read) and `s`
(shards done) count the whole run, earlier attempts included; `k` and `d` count this attempt only.

Bounded for a multi-day run: a point is written at most every `every` seconds (1 s at first). When
the file holds more than MAX_POINTS points, it is rewritten (atomically) keeping every other point
of each attempt (its first and last kept, marks all kept) and `every` doubles: the whole run stays
at one even resolution, MAX_POINTS / 2 to MAX_POINTS points (~70 bytes each), whatever its length.
A later attempt starts at the interval the file had reached.

Durability: lines are appended and flushed, not fsynced (a lost tail costs a few points). A line
cut by a kill -9 is skipped by `read_series`, and cut off by the next attempt before it appends.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tokpipe.durability import write_atomic
from tokpipe.layout.files import SERIES, Layout

MAX_POINTS = 2000
FIRST_EVERY = 1.0  # seconds between points, until the first thinning


def series_path(out: str | os.PathLike) -> Path:
    return Layout(out).log(SERIES)


def read_series(out: str | os.PathLike) -> list[dict]:
    """Every whole line of OUT's series (none if there is no file); a torn or garbled line is skipped."""
    try:
        raw = series_path(out).read_bytes()
    except FileNotFoundError:
        return []
    records = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("t"), (int, float)):
            records.append(record)
    return records


class Series:
    """The writer, one per attempt: `point` as often as you like (it keeps one per `every` s), `mark` at phase
    starts."""

    def __init__(self, out: str | os.PathLike):
        self.out, self.path = out, series_path(out)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = read_series(out)
        if self.path.exists():
            with open(self.path, "r+b") as f:  # a line torn by a kill -9: cut it, so the next one starts clean
                raw = f.read()
                f.truncate(raw.rfind(b"\n") + 1)
        self.attempt = 1 + max((r.get("attempt", r.get("a", 0)) for r in records), default=0)
        self.every = max((r["every"] for r in records if "every" in r), default=FIRST_EVERY)
        self.points = sum(1 for r in records if "b" in r)
        self.last = 0.0
        self.phase = "plan"
        self._f = open(self.path, "ab")  # noqa: SIM115 (held for the attempt: one append per point)
        self._write({"attempt": self.attempt, "t": round(time.time(), 2), "every": self.every})

    def _write(self, record: dict) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._f.flush()

    def mark(self, phase: str) -> None:
        """A phase starts now (the same phase twice in a row is marked once)."""
        if phase != self.phase:
            self.phase = phase
            self._write({"a": self.attempt, "t": round(time.time(), 2), "phase": phase})

    def point(
        self, bytes_read: int, tokens: int, documents: int, running: int, done: int, workers: int, final: bool = False
    ) -> None:
        """`running`: shards under way now, of the run's `workers`."""
        now = time.time()
        if not final and now - self.last < self.every:
            return
        self.last = now
        self._write(
            {
                "a": self.attempt,
                "t": round(now, 2),
                "b": bytes_read,
                "k": tokens,
                "d": documents,
                "r": running,
                "s": done,
                "w": workers,
            }
        )
        self.points += 1
        if self.points > MAX_POINTS:
            self._thin()

    def _thin(self) -> None:
        records = read_series(self.out)
        last = {r["a"]: i for i, r in enumerate(records) if "b" in r}  # each attempt's last point
        kept, seen = [], {}
        for i, r in enumerate(records):
            if "b" in r:
                seen[r["a"]] = n = seen.get(r["a"], -1) + 1
                if n % 2 and i != last[r["a"]]:
                    continue
            kept.append(r)
        self.every *= 2
        for r in kept:
            if r.get("attempt") == self.attempt:
                r["every"] = self.every
        self._f.close()
        write_atomic(self.path, b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in kept))
        self.points = sum(1 for r in kept if "b" in r)
        self._f = open(self.path, "ab")  # noqa: SIM115 (held for the attempt: one append per point)

    def close(self) -> None:
        self._f.close()

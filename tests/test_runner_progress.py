"""runner/progress.py: where a run's time went, as its summary and run.log say it."""

import time
from types import SimpleNamespace

import pytest

from tokpipe.layout.series import Series
from tokpipe.runner import progress as progress_module
from tokpipe.runner.driver import Standing
from tokpipe.runner.progress import Progress, Timeline

TOKENS = SimpleNamespace(tokens=1_000_000, dtype="uint32")  # what the phases line reads of meta: 4.0 MB


@pytest.fixture
def clock(monkeypatch):
    """The monotonic clock progress.py reads, set by the test: [seconds]."""
    now = [100.0]
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    return now


def _phases(tmp_path, now, workers: list[tuple[float, int]], shard_seconds: float) -> str:
    """The phases line of a run that planned from 90 s to 100 s, had these workers from these moments, tokenized
    until 125 s and finished at 126 s, its shards taking `shard_seconds` in all; Progress's workers as the driver
    and the scheduler set them, the Timeline filled from it as the driver fills it."""
    plan = Standing(shards=4, done=0, partial=0, done_bytes=0)
    progress = Progress(tmp_path, 10 << 20, plan, 4, Series(tmp_path))
    for moment, count in workers:
        now[0] = moment
        progress.workers = count
    timeline = Timeline(90.0, planned=100.0, tokenized=125.0, shard_seconds=shard_seconds)
    timeline.workers, timeline.worker_seconds = progress.worker_range, progress.worker_seconds(125.0)
    return timeline.report(126.0, TOKENS)


def test_the_busy_share_is_of_the_workers_the_run_had_from_its_start(tmp_path, clock):
    # Known at 104 s (a cluster joined, its nodes checked), they count from the start: the wait shows.
    line = _phases(tmp_path, clock, [(104.0, 2)], shard_seconds=45.0)
    assert line.split(" | ")[1] == (
        "tokenize 25.0s, 0.0 MB of input read (0.0 MB/s), workers busy 90% (2 x 25.0s, 45.0s on shards)"
    )


def test_the_busy_share_follows_nodes_that_join_and_are_lost(tmp_path, clock):
    # 2 workers for 10 s, 3 for 10 s (a node joined), 1 for 5 s (two lost): 20 + 30 + 5 = 55 s of worker time.
    line = _phases(tmp_path, clock, [(100.0, 2), (110.0, 3), (120.0, 1)], shard_seconds=44.0)
    assert line.split(" | ")[1] == (
        "tokenize 25.0s, 0.0 MB of input read (0.0 MB/s), workers busy 80% (1-3 workers, 55.0s of worker time,"
        " 44.0s on shards)"
    )


def test_a_run_with_no_shard_left_to_tokenize_finalizes_from_the_end_of_its_plan(tmp_path, clock):
    # A rerun after a finish was killed: every shard done, its split files made again from 100 s to 104 s.
    timeline = Timeline(90.0, series=Series(tmp_path))
    clock[0] = 100.0
    timeline.finalizing()
    assert timeline.report(104.0, TOKENS).split(" | ")[0::2] == [
        "phases: plan 10.0s",
        "finalize 4.00s: 4.0 MB of tokens, 0.0 MB of them assembled while tokenizing,"
        " 4.0 MB after (0.00 GB/s)",
    ]

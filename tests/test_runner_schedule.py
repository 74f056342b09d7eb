"""runner/schedule.py: one Ray task per unfinished shard. A worker killed mid-shard is retried from the
shard's checkpoint, and a shard whose workers keep dying is reported by name after --max-retries; a task
that stops making progress for --stall-timeout is cancelled with a stack dump, retried, then reported,
while the other shards finish. Workers are really SIGKILLed; the stuck shard is a FIFO nobody writes.
Runs join the session's Ray (the `ray_address` fixture); those that kill workers run every shard on Ray's
workers (--ray-only), none in the driver."""

import json
import os
import threading

from helpers import assert_out_is, keep_killing, run_args, tokpipe

from tokpipe.inputs.manifest import build_manifest, write_manifest

HF = ("--backend", "hf")  # the slow reference encoder: runs last long enough to be hit mid-way


def test_killed_workers_are_retried_and_a_shard_that_keeps_dying_is_reported(
    manifest, tmp_path, example_reference, ray_address
):
    out = tmp_path / "out"
    stop = threading.Event()
    killed = keep_killing("example_train_0", stop, session_ray=ray_address)
    failing = tokpipe(
        *run_args(
            manifest, out, "--workers", "2", "--max-retries", "1", "--checkpoint-interval", "0.2", "--ray-only", *HF
        ),
        ray=ray_address,
    )
    stop.set()
    assert failing.returncode == 1 and len(killed) == 2  # the first attempt and its one retry
    assert "FAILED train/chunk1/example_train_0.jsonl.zst" in failing.stderr and "Traceback" not in failing.stderr
    assert not (out / "meta.json").exists()
    assert json.loads((out / "shards" / "validation" / "validation__chunk1__example_holdout_0.json").read_text())[
        "done"
    ]
    assert "example_train_0" in json.loads((out / "logs" / "failed.json").read_text()).popitem()[0]

    # The rerun tries again; one of its workers is killed once mid-shard and Ray retries it from the checkpoint.
    stop = threading.Event()
    killed = keep_killing("example_train_0", stop, once=True, session_ray=ray_address)
    rerun = tokpipe(
        *run_args(manifest, out, "--workers", "2", "--checkpoint-interval", "0.2", "--ray-only", *HF), ray=ray_address
    )
    stop.set()
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert len(killed) == 1
    assert_out_is(out, example_reference)
    assert not (out / "logs" / "failed.json").exists()


def test_a_stuck_shard_is_cancelled_with_a_stack_dump_and_reported(dataset, tmp_path, ray_address):
    os.mkfifo(dataset / "train" / "zz_stuck.jsonl")  # opening it for reading blocks forever
    write_manifest(build_manifest(dataset), tmp_path / "m.json")
    out = tmp_path / "out"
    # 5 s without progress is a stall. A shard's clock starts when a worker takes it (its first report), so the
    # seconds its worker takes to start on a busy machine are not counted (from submission, under pytest -n 2 on
    # 2 cores, real shards were reported stalled at 5 s).
    result = tokpipe(*run_args(tmp_path / "m.json", out, "--stall-timeout", "5", "--max-retries", "1"), ray=ray_address)
    assert result.returncode == 1
    dump = out / "logs" / "stall-train-train__zz_stuck.txt"
    assert [line for line in result.stderr.splitlines() if not line.startswith("[tokpipe]")][:1] == [
        f"FAILED train/zz_stuck.jsonl: stalled 2 times (no progress for 5s); stacks in {dump}"
    ]
    assert "format_of" in dump.read_text()  # the stack shows where it hangs
    log = (out / "logs" / "run.log").read_text()
    assert log.count("shard train/zz_stuck.jsonl: no progress for") == 2
    done = [json.loads(p.read_text())["done"] for p in (out / "shards").rglob("*.json")]
    assert done == [True, True, True]  # the other shards finished

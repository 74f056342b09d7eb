"""runner: crashes, kills, stalls, concurrent runs, changed inputs and lost nodes never change the bytes.

Every test here really does the thing: kill -9 of process groups, SIGKILL of Ray workers, a shard
that blocks forever, a full file system, a Ray node removed mid-run.
"""

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    EXAMPLE_CACHE,
    QWEN3,
    QWEN3_EOS,
    assert_out_is,
    held_out_texts,
    plain_copy_of_example,
    reference_tokens,
    snapshot_files,
    tokpipe,
)

from tokpipe.manifest import build_manifest, write_manifest

HF = ("--backend", "hf")  # the slow reference encoder: runs last long enough to be hit mid-way


@pytest.fixture
def dataset(tmp_path):
    return plain_copy_of_example(tmp_path / "data")


@pytest.fixture
def manifest(dataset, tmp_path):
    path = tmp_path / "m.json"
    write_manifest(build_manifest(dataset), path)
    return path


def run_args(manifest, out, *extra):
    return ("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, *extra)


def start(manifest, out, *extra) -> subprocess.Popen:
    """`tokpipe run` in its own process group, as a shell would start it."""
    log = open(Path(out).parent / f"run-{time.monotonic_ns()}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "tokpipe.cli", *map(str, run_args(manifest, out, *extra))],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def shard_workers(name_part: str) -> list[int]:
    """PIDs of Ray workers running a tokpipe shard task (their process title names the shard)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::tokpipe") and name_part in title:
                pids.append(int(entry.name))
    return pids


def keep_killing(name_part: str, stop: threading.Event, once: bool = False) -> list[int]:
    """SIGKILL every worker on a matching shard until `stop` (or the first, with once); returns the PIDs killed."""
    killed = []

    seen: dict[int, float] = {}

    def loop():
        while not stop.is_set():
            # A killed worker stays in /proc until Ray reaps it; count each process once. A worker is
            # killed once it has run its shard for a moment: one killed as its task starts may not
            # count as an attempt yet (the driver has not heard it began), and Ray tries it again.
            for pid in set(shard_workers(name_part)) - set(killed):
                if time.monotonic() - seen.setdefault(pid, time.monotonic()) < 0.5:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
                if once:
                    return
            time.sleep(0.05)

    threading.Thread(target=loop, daemon=True).start()
    return killed


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the run to get there"
        time.sleep(0.05)


def checkpoints(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (out / "shards").rglob("*.json")] if (out / "shards").exists() else []


def test_kill_9_of_the_whole_run_at_random_moments_with_changing_workers(dataset, tmp_path, example_reference):
    # Three copies of the example (chunk1..3): enough work that no attempt finishes before its kill,
    # however quiet the machine. Each split's reference is then its example reference three times.
    for split in ("train", "validation"):
        for copy in ("chunk2", "chunk3"):
            shutil.copytree(dataset / split / "chunk1", dataset / split / copy)
    manifest = tmp_path / "m3.json"
    write_manifest(build_manifest(dataset), manifest)
    expected = {stem: np.concatenate([tokens] * 3) for stem, tokens in example_reference.items()}
    out = tmp_path / "out"
    rng = random.Random(7)
    # The moments: during start-up (before Ray is up), just after a checkpoint, and with a shard
    # finished and others partial; each plus a random delay. --workers changes on every resume.
    moments = [
        lambda: True,
        lambda: len(checkpoints(out)) >= 1,
        lambda: any(c["done"] for c in checkpoints(out)) and len(checkpoints(out)) >= 2,
    ]
    for workers, ready in zip((8, 2, 5), moments):
        proc = start(manifest, out, "--workers", workers, "--checkpoint-interval", "0.2", *HF)
        wait_for(lambda: ready() or proc.poll() is not None)  # noqa: B023 (called at once)
        time.sleep(rng.uniform(0.1, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "meta.json").exists()
    final = tokpipe(*run_args(manifest, out, "--workers", "2", "--checkpoint-interval", "0.2", *HF))
    assert final.returncode == 0, final.stdout + final.stderr
    assert "0 done, 0 partial" not in final.stdout  # it resumed from what the killed runs left
    assert_out_is(out, expected)
    assert tokpipe("verify", out).returncode == 0


def test_kill_9_while_split_files_are_assembled_then_rerun_gives_the_same_bytes(manifest, tmp_path, example_reference):
    out = tmp_path / "out"
    listed = out / "train.parts.tmp"
    proc = start(manifest, out, "--workers", "1", "--checkpoint-interval", "0.2", *HF)
    # One shard at a time: the first train shard is copied into train.bin.tmp while the next one tokenizes.
    wait_for(lambda: (listed.exists() and listed.stat().st_size > 0) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "meta.json").exists() and (out / "train.bin.tmp").stat().st_size > 0
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, example_reference)
    assert tokpipe("verify", out).returncode == 0


def test_val_fraction_gives_the_same_val_bin_at_any_workers_with_a_kill_9_between(manifest, tmp_path):
    out = tmp_path / "out"
    proc = start(manifest, out, "--workers", "1", "--val-fraction", "0.05", "--checkpoint-interval", "0.2", *HF)
    wait_for(lambda: any(c["documents"] for c in checkpoints(out)) or proc.poll() is not None)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "meta.json").exists()
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2", "--val-fraction", "0.05"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    snapshot = next(EXAMPLE_CACHE.glob("datasets--*/snapshots/*"))
    train, holdout, tokenizer = (
        snapshot_files(snapshot, "train"),
        snapshot_files(snapshot, "validation"),
        QWEN3 / "tokenizer.json",
    )
    val = np.concatenate(
        [
            reference_tokens(train, tokenizer, QWEN3_EOS, texts=held_out_texts(0.05, True)),
            reference_tokens(holdout, tokenizer, QWEN3_EOS),
        ]
    )
    assert np.array_equal(np.fromfile(out / "val.bin", dtype=np.uint32), val)
    assert np.array_equal(
        np.fromfile(out / "train.bin", dtype=np.uint32),
        reference_tokens(train, tokenizer, QWEN3_EOS, texts=held_out_texts(0.05, False)),
    )
    splits = json.loads((out / "meta.json").read_text())["splits"]
    assert splits["train"]["documents"] + splits["validation"]["documents"] == 293 + 136  # every document read, once
    assert tokpipe("verify", out).returncode == 0


def test_killed_workers_are_retried_and_a_shard_that_keeps_dying_is_reported(manifest, tmp_path, example_reference):
    out = tmp_path / "out"
    stop = threading.Event()
    killed = keep_killing("example_train_0", stop)
    failing = tokpipe(
        *run_args(
            manifest, out, "--workers", "2", "--max-retries", "1", "--checkpoint-interval", "0.2", "--ray-only", *HF
        )
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
    killed = keep_killing("example_train_0", stop, once=True)
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2", "--checkpoint-interval", "0.2", "--ray-only", *HF))
    stop.set()
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert len(killed) == 1
    assert_out_is(out, example_reference)
    assert not (out / "logs" / "failed.json").exists()


def test_a_stuck_shard_is_cancelled_with_a_stack_dump_and_reported(dataset, tmp_path):
    os.mkfifo(dataset / "train" / "zz_stuck.jsonl")  # opening it for reading blocks forever
    write_manifest(build_manifest(dataset), tmp_path / "m.json")
    out = tmp_path / "out"
    result = tokpipe(*run_args(tmp_path / "m.json", out, "--stall-timeout", "5", "--max-retries", "1"))
    assert result.returncode == 1
    assert "FAILED train/zz_stuck.jsonl: stalled 2 times" in result.stderr
    dump = (out / "logs" / "stall-train-train__zz_stuck.txt").read_text()
    assert "format_of" in dump  # the stack shows where it hangs
    log = (out / "logs" / "run.log").read_text()
    assert log.count("shard train/zz_stuck.jsonl: no progress for") == 2
    done = [json.loads(p.read_text())["done"] for p in (out / "shards").rglob("*.json")]
    assert done == [True, True, True]  # the other shards finished


def test_a_second_run_on_the_same_out_is_refused_while_the_first_holds_it(manifest, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on elsewhere")
        held.flush()
        result = tokpipe(*run_args(manifest, out))
    assert result.returncode == 2
    assert "in use by another tokpipe run (pid 4242 on elsewhere)" in result.stderr


@pytest.fixture
def finished_copy(finished_example, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_example, out)
    return out


def test_a_rerun_with_other_inputs_is_refused_saying_what_differs(finished_copy, tmp_path, small_tokenizer, dataset):
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import run_identity
    from tokpipe.tokenizer import load_tokenizer_info

    manifest = build_manifest(dataset)
    write_manifest(manifest, tmp_path / "m.json")
    (finished_copy / "run.json").write_text(
        json.dumps(run_identity(manifest, load_tokenizer_info(QWEN3), RunOptions()))
    )
    other_field = tokpipe(*run_args(tmp_path / "m.json", finished_copy, "--text-field", "body"))
    assert other_field.returncode == 2 and "text_field: was 'text', now 'body'" in other_field.stderr
    other_tok = tokpipe(
        "run", "--manifest", tmp_path / "m.json", "--tokenizer", small_tokenizer, "--out", finished_copy
    )
    assert other_tok.returncode == 2
    assert "tokenizer_sha256" in other_tok.stderr and "dtype: was 'uint32', now 'uint16'" in other_tok.stderr
    other_eos = tokpipe(*run_args(tmp_path / "m.json", finished_copy, "--eos", "<|im_end|>"))
    assert other_eos.returncode == 2 and "eos_token_id: was 151643, now 151645" in other_eos.stderr


def test_a_manifest_that_only_gained_shards_resumes_as_an_append(dataset, tmp_path, example_reference):
    held_back = dataset / "validation" / "chunk1" / "example_holdout_0.jsonl.zst"
    data = held_back.read_bytes()
    held_back.unlink()
    out = tmp_path / "out"
    write_manifest(build_manifest(dataset), tmp_path / "small.json")
    assert tokpipe(*run_args(tmp_path / "small.json", out)).returncode == 0
    train_done_at = (out / "shards" / "train" / "train__chunk1__example_train_0.json").stat().st_mtime_ns

    held_back.write_bytes(data)
    write_manifest(build_manifest(dataset), tmp_path / "full.json")
    result = tokpipe(*run_args(tmp_path / "full.json", out))
    assert result.returncode == 0, result.stderr
    assert "gained 1 shards" in result.stdout and "2 done" in result.stdout
    assert (out / "shards" / "train" / "train__chunk1__example_train_0.json").stat().st_mtime_ns == train_done_at
    assert_out_is(out, example_reference)

    # A shard that changed is not an append: refused.
    write_jsonl_path = dataset / "train" / "chunk1" / "example_train_1.jsonl.zst"
    write_jsonl_path.write_bytes(write_jsonl_path.read_bytes()[:-10])
    write_manifest(build_manifest(dataset), tmp_path / "changed.json")
    refused = tokpipe(*run_args(tmp_path / "changed.json", out))
    assert refused.returncode == 2 and "changed or gone" in refused.stderr and "example_train_1" in refused.stderr


def test_killed_finalize_is_redone_from_the_shards(finished_copy, example_reference):
    # What a kill -9 during finalize can leave: no meta, and a split's files halfway through their
    # renames (train.parts renamed, train.bin and train.idx not yet).
    (finished_copy / "meta.json").unlink()
    (finished_copy / "meta.pkl").unlink()
    for name in ("train.bin", "train.idx"):
        os.replace(finished_copy / name, finished_copy / f"{name}.tmp")
    result = tokpipe(*run_args(finished_copy / "manifest.json", finished_copy))
    assert result.returncode == 0, result.stderr
    assert "ray:" not in result.stdout  # every shard was done: finalize only, nothing tokenized again
    assert_out_is(finished_copy, example_reference)


def test_a_split_file_damaged_after_its_shards_were_removed_is_tokenized_again(finished_copy, example_reference):
    (finished_copy / "meta.json").unlink()
    (finished_copy / "meta.pkl").unlink()
    with open(finished_copy / "train.bin", "r+b") as f:
        f.truncate(4000)  # cut by something outside tokpipe: the shards' own files are gone since placed
    result = tokpipe(*run_args(finished_copy / "manifest.json", finished_copy))
    assert result.returncode == 0, result.stderr
    assert (
        "the split files changed before 2 shards (e.g. train/chunk1/example_train_0.jsonl.zst) whose own files"
        " were already removed: tokenizing them again" in result.stdout.splitlines()
    )
    assert_out_is(finished_copy, example_reference)
    assert not (finished_copy / "train.bin.tmp").exists()
    assert tokpipe("verify", finished_copy).returncode == 0


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_disk_full_stops_the_shard_clearly_and_the_rerun_completes(manifest, tmp_path, example_reference):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "3m"):
        pytest.skip("cannot mount a tmpfs here (needs root); the write-error path is also covered in test_shard")
    try:
        out = disk / "out"
        full = tokpipe(*run_args(manifest, out, "--checkpoint-interval", "0.2"))
        assert full.returncode == 1
        assert "No space left on device" in full.stderr and "Traceback" not in full.stderr
        assert not (out / "meta.json").exists()
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # space freed
        rerun = tokpipe(*run_args(manifest, out))
        assert rerun.returncode == 0, rerun.stderr
        assert_out_is(out, example_reference)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_multi_node_cluster_with_a_node_removed_mid_run(manifest, tmp_path, example_reference):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    try:
        out = tmp_path / "out"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokpipe.cli",
                *map(
                    str,
                    run_args(
                        manifest,
                        out,
                        "--address",
                        cluster.address,
                        "--workers",
                        "2",
                        "--checkpoint-interval",
                        "0.2",
                        *HF,
                    ),
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_for(lambda: any(not c["done"] for c in checkpoints(out)))  # mid-shard
        # Remove the node whose raylet runs a shard worker right now: a machine lost mid-shard.
        status = {pid: Path(f"/proc/{pid}/status").read_text().splitlines() for pid in shard_workers("")}
        parents = {int(next(s for s in lines if s.startswith("PPid:")).split()[1]) for lines in status.values()}
        busy = next(n for n in nodes if n.all_processes["raylet"][0].process.pid in parents)
        assert proc.poll() is None and not (out / "meta.json").exists()
        cluster.remove_node(busy)
        cluster.add_node(num_cpus=1)
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output
        assert "cluster" in output
        assert_out_is(out, example_reference)
    finally:
        cluster.shutdown()

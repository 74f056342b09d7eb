"""SIGTERM (what Slurm, Kubernetes and systemd send before they kill) stops a run as Ctrl-C does: the
running shards keep their checkpoints, one line says how to resume, exit 143, no Ray stack on stderr,
no process of the run left behind; the rerun gives the bytes of an uninterrupted run. The stopped run starts
its own embedded Ray (whose processes must all end); the rerun joins the session's Ray."""

import os
import signal
import subprocess
import sys
import time

from helpers import QWEN3, alive, assert_out_is, descendants, plain_copy_of_example, tokpipe

from tokpipe.manifest import build_manifest, write_manifest

MESSAGE = "tokpipe run: terminated (SIGTERM); rerun the same command to resume"


def test_sigterm_keeps_checkpoints_says_one_line_exits_143_and_the_rerun_is_exact(
    tmp_path, example_reference, ray_address
):
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), manifest)
    args = ["run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, "--workers", "1", "--ray-only"]
    slow = ["--backend", "hf", "--checkpoint-interval", "0.2"]  # the reference encoder: seconds of tokenizing
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokpipe.cli", *map(str, args + slow)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while not ((out / "shards").is_dir() and any((out / "shards").rglob("*.json"))):  # a shard has checkpointed
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.05)
    processes = descendants(proc.pid)
    assert processes  # Ray's processes and workers, children of the run
    proc.send_signal(signal.SIGTERM)  # to the tokpipe process alone, as `kill PID` does
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 143, stdout + stderr
    assert stderr.splitlines()[-1] == MESSAGE and stderr.count("rerun") == 1
    for noise in ("SIGTERM received", "PC:", "Traceback", "Error"):
        assert noise not in stderr, stderr
    deadline = time.monotonic() + 5  # workers exit as they see their raylet go: allow them a moment
    while left := [pid for pid, started in processes if alive(pid, started)]:
        assert time.monotonic() < deadline, f"processes of the run left behind: {left}"
        time.sleep(0.1)
    assert not (out / "meta.json").exists()

    rerun = tokpipe(*args, ray=ray_address)  # the stopped run started its own Ray; the rerun joins the session's
    assert rerun.returncode == 0, rerun.stderr
    assert "0 done, 0 partial" not in rerun.stdout  # it resumed from what the stopped run kept
    assert_out_is(out, example_reference)

"""SIGTERM (what Slurm, Kubernetes and systemd send before they kill) stops a run as Ctrl-C does, at any
moment: before Ray starts, while it starts and the driver tokenizes, while Ray's workers run, and during
finalize. Each time: exit 143, one line on stderr (beside the progress lines) and nothing from Ray's handlers,
no process of the run left behind, and the rerun gives the bytes of the independent reference.

The signals are real ones, sent to the tokpipe process alone as `kill PID` does; while Ray starts, to its
whole process group, as systemd's stop and Slurm's scancel send one to every process of the job. The stopped
runs use the reference encoder (`--backend hf`, seconds of tokenizing); a stopped run that starts Ray starts its own
embedded one (whose processes must all end); the reruns use the default backend (the backend never changes
bytes), joining the session's Ray where their work is more than the driver alone finishes before a Ray is up.
Every run uses the session's 600-id tokenizer: Qwen3 is not the subject, and its load costs a run ~1.8 CPU-s
and each Ray worker of it ~1.3."""

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
from helpers import (
    EXAMPLE_HOLDOUT_FILES,
    EXAMPLE_TRAIN_FILES,
    alive,
    assert_out_is,
    descendants,
    launch,
    plain_copy_of_example,
    tokpipe,
    wait_for,
)

from tokpipe.inputs.manifest import build_manifest, write_manifest

MESSAGE = "tokpipe run: terminated (SIGTERM); rerun the same command to resume"
SLOW = ["--backend", "hf", "--checkpoint-interval", "0.2"]  # the reference encoder: seconds of tokenizing


def run_args(manifest: Path, out: Path, tokenizer: Path, *extra) -> list:
    return ["run", "--manifest", manifest, "--tokenizer", tokenizer, "--out", out, "--workers", "1", *extra]


def start(args: list, prefix: tuple = ("-m", "tokpipe.cli")) -> subprocess.Popen:
    """The run launched (helpers.launch), its stderr apart, its logs beside OUT (`args` end with OUT's options)."""
    return launch([*prefix, *args], Path(args[args.index("--out") + 1]).parent, apart=True)


def assert_stopped_cleanly(proc: subprocess.Popen, processes=frozenset()) -> str:
    """Exit 143, stderr's one line beside progress, no Ray handler's stack; nothing of the run left. Returns
    the run's stdout."""
    proc.wait(timeout=180)
    stdout, stderr = proc.log.read_text(), proc.err.read_text()
    assert proc.returncode == 143, stdout + stderr
    assert [line for line in stderr.splitlines() if not line.startswith("[tokpipe] ")] == [MESSAGE], stderr
    deadline = time.monotonic() + 5  # workers exit as they see their raylet go: allow them a moment
    while left := [pid for pid, started in processes if alive(pid, started)]:
        assert time.monotonic() < deadline, f"processes of the run left behind: {left}"
        time.sleep(0.1)
    return stdout


def assert_rerun_is_exact(args: list, out: Path, reference: dict, ray_address: str | None = None) -> None:
    """The rerun, on the session's Ray with `ray_address`; else on its own, as a user's (the example alone is
    tokenized by the driver before an embedded Ray would start: 2.8 s, where joining a Ray costs 8.2 s)."""
    rerun = tokpipe(*args, ray=ray_address)
    assert rerun.returncode == 0, rerun.stderr
    assert_out_is(out, reference)


def example(tmp_path) -> Path:
    manifest = tmp_path / "m.json"
    write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), manifest)
    return manifest


def test_before_ray_starts(tmp_path, small_tokenizer, small_reference):
    """The driver has recorded the run and checks the backend; Ray starts only once it has tokenized 1.5 s."""
    manifest, out = example(tmp_path), tmp_path / "out"
    proc = start(run_args(manifest, out, small_tokenizer, *SLOW))
    wait_for(lambda: (out / "run.json").exists(), 180, run=proc)
    processes = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert not processes  # no Ray yet
    assert_stopped_cleanly(proc)
    assert_rerun_is_exact(run_args(manifest, out, small_tokenizer), out, small_reference)


def _threads(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass
    return names


# The CLI, made to start its embedded Ray at once (a run of under 25 s of one core's work ends before Ray would pay:
# runner/driver.py _ray_pays), as a longer run does.
RAY_AT_ONCE = """
import sys
import tokpipe.runner.driver as driver
from tokpipe import cli

driver.MEASURED = driver.RAY_PAYS = driver.RAY_START_CPU = 0
sys.exit(cli.main(sys.argv[1:]))
"""


def test_while_ray_starts_and_the_driver_tokenizes(tmp_path, small_tokenizer, small_reference, ray_address):
    """The moment Ray's C++ side printed its failure-signal handler's stack at (`*** SIGTERM received at ...`,
    `PC: @ ...`, twice): Ray's core worker is up in the driver (its `worker.io` thread runs), Ray has not
    taken over from the driver yet. The driver starts Ray at once (RAY_AT_ONCE: otherwise only sixty copies of the
    example on the reference encoder were work enough, ~23 CPU-s with the rerun), and sixteen copies (symlinks to
    its files) keep it tokenizing with the reference encoder well past Ray's start (~13 s on a quiet core, where
    Ray's start took 9 s under load from other tests). The signal goes to the process group, Ray's GCS and raylet
    included: killed as they started, the run spun a minute waiting for its GCS and exited 1, wordless."""
    data = tmp_path / "data"
    copies = 16
    train = [data / f"train/copy{i}/part{k}.jsonl.zst" for i in range(copies) for k in range(len(EXAMPLE_TRAIN_FILES))]
    val = [
        data / f"validation/copy{i}/part{k}.jsonl.zst" for i in range(copies) for k in range(len(EXAMPLE_HOLDOUT_FILES))
    ]
    for link, target in zip(train + val, copies * EXAMPLE_TRAIN_FILES + copies * EXAMPLE_HOLDOUT_FILES):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    write_manifest(build_manifest(data, allow_outside=True), manifest)
    proc = start(run_args(manifest, out, small_tokenizer, *SLOW), prefix=("-c", RAY_AT_ONCE))
    wait_for(lambda: "worker.io" in _threads(proc.pid), 180, run=proc)
    processes = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    assert processes  # Ray's own, children of the run
    assert "ray: " not in assert_stopped_cleanly(proc, processes)  # the driver was still tokenizing
    assert not (out / "meta.json").exists()
    reference = {stem: np.concatenate([tokens] * copies) for stem, tokens in small_reference.items()}
    assert_rerun_is_exact(run_args(manifest, out, small_tokenizer), out, reference, ray_address)


def test_while_workers_run_checkpoints_are_kept(tmp_path, small_tokenizer, small_reference, ray_address):
    manifest, out = example(tmp_path), tmp_path / "out"
    proc = start(run_args(manifest, out, small_tokenizer, "--ray-only", *SLOW))
    wait_for(lambda: (out / "shards").is_dir() and any((out / "shards").rglob("*.json")), 180, run=proc)  # checkpoint
    processes = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert processes  # Ray's processes and workers, children of the run
    assert_stopped_cleanly(proc, processes)
    assert not (out / "meta.json").exists()
    rerun = tokpipe(*run_args(manifest, out, small_tokenizer, "--ray-only"), ray=ray_address)
    assert rerun.returncode == 0, rerun.stderr
    assert "0 done, 0 partial" not in rerun.stdout  # it resumed from what the stopped run kept
    assert_out_is(out, small_reference)


# The CLI, made to SIGTERM itself in the middle of finalize: the split files assembled, the skip log
# written, meta not yet (the one moment that no outside watcher can hit: finalize lasts 0.05 s).
SIGTERM_IN_FINALIZE = """
import os, signal, sys
import tokpipe.write.finalize
from tokpipe import cli

write_skip_log = tokpipe.write.finalize.write_skip_log

def then_sigterm(*args):
    write_skip_log(*args)
    os.kill(os.getpid(), signal.SIGTERM)

tokpipe.write.finalize.write_skip_log = then_sigterm
sys.exit(cli.main(sys.argv[1:]))
"""


def test_during_finalize(tmp_path, small_tokenizer, small_reference):
    manifest, out = example(tmp_path), tmp_path / "out"
    proc = start(run_args(manifest, out, small_tokenizer), prefix=("-c", SIGTERM_IN_FINALIZE))
    assert_stopped_cleanly(proc)
    assert not (out / "meta.json").exists()
    assert_rerun_is_exact(run_args(manifest, out, small_tokenizer), out, small_reference)

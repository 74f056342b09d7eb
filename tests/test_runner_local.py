"""runner/local: while Ray starts (or instead of it), the driver and helper processes beside it tokenize; a helper's
shards come back to the driver, which places them; told to stop, every shard stops at its next batch, checkpointed;
a helper killed leaves its shards to Ray, never a wait for them. With the
600-id tokenizer: each helper process loads it, and Qwen3's load (~1.1 CPU-s each) is not the subject."""

import mmap
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from helpers import EXAMPLE_CACHE, assert_out_is, cli, killed_run, run_args, session_processes, tokpipe, wait_for

from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
from tokpipe.layout.series import Series
from tokpipe.options import RunOptions
from tokpipe.runner import local
from tokpipe.runner.driver import Standing
from tokpipe.runner.identity import encode_spec, record_run
from tokpipe.runner.local import Tally, tokenize_while
from tokpipe.runner.progress import Progress, RunLog
from tokpipe.write.assembly import Assembler
from tokpipe.write.finalize import finalize

MANIFEST = build_manifest(EXAMPLE_CACHE)
OPTIONS = RunOptions()


@pytest.fixture(scope="module")
def info(small_tokenizer):
    return load_tokenizer_info(small_tokenizer)


def _tokenize_here(out, info, busy, helpers: int, warm: str | None = None) -> tuple[int, Tally, Assembler]:
    out.mkdir()
    record_run(out, MANIFEST, info, OPTIONS)  # as a run does before its first token: a rerun resumes this run
    itemsize = np.dtype(info.dtype).itemsize  # 2: the 600-id tokenizer's ids are uint16
    assembler = Assembler(out, itemsize, OPTIONS.output)
    assembler.resume(MANIFEST)
    plan = Standing(shards=3, done=0, partial=0, done_bytes=0)
    progress = Progress(out, MANIFEST.size, plan, itemsize, Series(out))
    tally = Tally(0)
    spec = encode_spec(OPTIONS, info, "fastokens")
    done_before = Checkpoints(out).done
    pool = local.Helpers(lambda: helpers, str(out)) if helpers else None
    if pool is not None:
        pool.warm("fastokens", warm or info.path)
    done = tokenize_while(MANIFEST, out, spec, busy, progress, tally, RunLog(out), assembler, done_before, pool)
    progress.close()
    return done, tally, assembler


def test_helpers_tokenize_beside_the_driver_and_the_driver_places_their_shards(
    tmp_path, info, small_reference, monkeypatch
):
    """A helper's tokens come back in its pack's memory file, mapped in the driver, not through the pool's pipe."""
    came, parts_read = [], local._parts_read

    def mapped(outcomes, tokens):
        read = parts_read(outcomes, tokens)
        came.extend(result.buffered for _, (result, _) in read)
        return read

    monkeypatch.setattr(local, "_parts_read", mapped)
    out = tmp_path / "out"
    done, tally, assembler = _tokenize_here(out, info, lambda: True, helpers=2)
    assert done == 3 and tally.failed == {} and tally.shard_seconds > 0
    arrays = [a for buffered in came for tokens, ends in buffered.values() for a in tokens + ends]
    assert arrays and all(isinstance(a.base.obj, mmap.mmap) for a in arrays)  # a helper's shard at least, mapped
    assert assembler.complete  # every shard placed as it came back, in split order
    finalize(out, MANIFEST, info, OPTIONS.output, assembler=assembler)
    assert_out_is(out, small_reference)
    assert not [p for p in (out / "shards").rglob("*") if p.suffix in (".bin", ".idx")]  # written once, in place


@pytest.mark.parametrize("every, placings", [(0, 3 + 1), (3600, 1 + 1)])
def test_the_driver_places_its_done_shards_at_most_every_place_every_and_all_at_its_end(
    tmp_path, info, small_reference, monkeypatch, every, placings
):
    """The driver's 3 shards placed as each is done (and looked for once more at its end), or, PLACE_EVERY longer
    than the run, the first at once and the other two at its end: each placing fsyncs the split's files. Here the
    writer places as it is handed a placing: a thread's placing still under way defers the next (a race, not the
    rule)."""

    class Inline(ThreadPoolExecutor):
        def submit(self, fn, *args):
            done = Future()
            done.set_result(fn(*args))
            return done

    monkeypatch.setattr(local, "PLACE_EVERY", every)
    monkeypatch.setattr(local, "ThreadPoolExecutor", Inline)
    calls, place_ready = [], Assembler.place_ready

    def counted(assembler, *args):
        calls.append(1)
        return place_ready(assembler, *args)

    monkeypatch.setattr(Assembler, "place_ready", counted)
    out = tmp_path / "out"
    done, _, assembler = _tokenize_here(out, info, lambda: True, helpers=0)
    assert done == 3 and len(calls) == placings and assembler.complete
    finalize(out, MANIFEST, info, OPTIONS.output, assembler=assembler)
    assert_out_is(out, small_reference)


def test_helpers_told_to_stop_leave_checkpoints_a_rerun_goes_on_from(tmp_path, info, small_tokenizer, small_reference):
    """Ray up at the driver's first batch: every shard begun stops there, its buffered tokens in its own files,
    checkpointed; the run that goes on from them ends with the reference bytes."""
    looks = []
    done, _, _ = _tokenize_here(tmp_path / "out", info, lambda: len(looks.append(1) or looks) < 3, helpers=1)
    stopped = [c for s in MANIFEST.shards() if (c := Checkpoint.of(tmp_path / "out", s)) and not c.done]
    assert stopped and all(c.lines > 0 for c in stopped)  # the driver's shard at least, stopped after a batch
    manifest = tmp_path / "m.json"
    write_manifest(MANIFEST, manifest)
    rerun = tokpipe(*run_args(manifest, tmp_path / "out", tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(tmp_path / "out", small_reference)


def test_a_helper_killed_leaves_its_shards_unfinished_and_the_driver_goes_on(
    tmp_path, info, small_tokenizer, small_reference, monkeypatch
):
    """The OOM killer's SIGKILL, as a helper takes its first pack: no wait for what it held (multiprocessing's Pool
    started another process and its call never came back: the run hung), no shard failed for it; its shards are
    left, neither done nor failed, for Ray's workers (here, the run that goes on) to tokenize."""
    submit, killed = local.Helpers.submit, []

    def killing(helpers, pack, spec):
        submit(helpers, pack, spec)
        if not killed:  # once: at a second pack the pool may have reaped it already (ProcessLookupError)
            for process in helpers.pool._processes.values():
                os.kill(process.pid, signal.SIGKILL)
        killed.extend(s.relpath for s in pack)  # this pack too: the pool's one process is gone

    monkeypatch.setattr(local.Helpers, "submit", killing)
    out = tmp_path / "out"
    done, tally, _ = _tokenize_here(out, info, lambda: True, helpers=1)
    assert killed and done == 3 - len(killed) and tally.failed == {}
    assert not [s for s in MANIFEST.shards() if s.relpath in killed and Checkpoint.of(out, s)]
    manifest = tmp_path / "m.json"
    write_manifest(MANIFEST, manifest)
    rerun = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)


def test_helpers_die_with_a_driver_killed(tmp_path, info):
    """A driver killed (kill -9) leaves no helper writing on into OUT beside its rerun: each is killed with it. Nor
    a line on the terminal: multiprocessing's resource tracker, which outlives it, said 10 semaphores had leaked."""
    code = (
        "import os\n"
        "from tokpipe.runner.local import Helpers\n"
        f"helpers = Helpers(lambda: 2, {str(tmp_path)!r})\n"
        "helpers.pool.submit(os.getpid).result()\n"
        "print(*helpers.pool._processes, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    pids = [int(pid) for pid in driver.stdout.readline().split()]
    assert driver.wait(60) == -signal.SIGKILL and len(pids) == 2
    wait_for(lambda: not session_processes(driver.pid), 30)
    assert driver.stderr.read() == ""


def test_a_helper_dead_before_the_tokenizer_is_loaded_leaves_the_driver_alone(tmp_path, info):
    """A helper killed as it starts (the OOM killer) breaks the pool before the driver knows which encoder to warm:
    the warming is passed over, no pack is handed out, and the run goes on without helpers (a traceback, at 2a718ec)."""
    helpers = local.Helpers(lambda: 1, str(tmp_path))
    helpers._kill()
    wait_for(lambda: helpers.pool._broken, 30)
    helpers.warm("fastokens", info.path)
    assert helpers.broken and not helpers.has_room()
    helpers.close()


def test_a_helper_stuck_past_stop_wait_is_killed_and_its_shards_left(
    tmp_path, info, small_tokenizer, small_reference, monkeypatch
):
    """Told to stop, a helper has STOP_WAIT to end its batch: one stuck (here in its encoder's load, from a FIFO no one
    writes) would hold the run for good, and is killed instead; its packs are left, neither done nor failed, for
    Ray's workers, which are watched for stalls."""
    monkeypatch.setattr(local, "STOP_WAIT", 0.5)
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    looks, out = [], tmp_path / "out"
    done, tally, _ = _tokenize_here(out, info, lambda: len(looks.append(1) or looks) < 20, helpers=1, warm=str(fifo))
    assert done == 1 and tally.failed == {}  # the driver's one; the helper's two are left
    manifest = tmp_path / "m.json"
    write_manifest(MANIFEST, manifest)
    rerun = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)


@pytest.mark.parametrize("call", [1, 2])
def test_a_run_with_helpers_killed_at_a_placing_then_the_same_command_is_the_reference(
    dataset, tmp_path, small_tokenizer, small_reference, call
):
    """Three copies of the example, a helper beside the driver, the driver killed (kill -9) at its first or second
    placing of done shards: what the helpers' packs had done and not yet placed is lost with it, and the same
    command tokenizes that again to the reference bytes."""
    for split in ("train", "validation"):
        for copy in ("chunk2", "chunk3"):
            shutil.copytree(dataset / split / "chunk1", dataset / split / copy)
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    write_manifest(build_manifest(dataset), manifest)
    killed_run(
        "tokpipe.write.assembly.Assembler.place_ready",
        call,
        manifest,
        out,
        "--workers",
        "2",
        tokenizer=small_tokenizer,
        helpers=True,
    )
    rerun = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, {stem: np.concatenate([tokens] * 3) for stem, tokens in small_reference.items()})
    assert cli("verify", out).returncode == 0

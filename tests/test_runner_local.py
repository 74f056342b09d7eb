"""runner/local: while Ray starts, the driver and helper processes beside it tokenize; a helper's shard comes
back to the driver, which places it; told to stop, every shard stops at its next batch, checkpointed."""

from helpers import EXAMPLE_CACHE, QWEN3, assert_out_is, run_args, tokpipe

from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.out.records import Checkpoint
from tokpipe.out.series import Series
from tokpipe.runner.driver import Plan
from tokpipe.runner.identity import encode_spec
from tokpipe.runner.local import Tally, tokenize_while
from tokpipe.runner.progress import Progress, RunLog
from tokpipe.write.assembly import Assembler
from tokpipe.write.finalize import finalize

MANIFEST = build_manifest(EXAMPLE_CACHE)
INFO = load_tokenizer_info(QWEN3)
OPTIONS = RunOptions()


def _tokenize_here(out, busy, helpers: int) -> tuple[int, Tally, Assembler]:
    out.mkdir()
    assembler = Assembler(out, 4, OPTIONS.output)
    assembler.resume(MANIFEST)
    plan = Plan(shards=3, done=0, partial=0, done_bytes=0)
    progress = Progress(out, MANIFEST.size, plan, 4, Series(out))
    tally = Tally(0)
    spec = encode_spec(OPTIONS, INFO, "fastokens")
    done = tokenize_while(MANIFEST, out, spec, busy, progress, tally, RunLog(out), assembler, helpers)
    progress.close()
    return done, tally, assembler


def test_helpers_tokenize_beside_the_driver_and_the_driver_places_their_shards(tmp_path, example_reference):
    out = tmp_path / "out"
    done, tally, assembler = _tokenize_here(out, lambda: True, helpers=2)
    assert done == 3 and tally.failed == {} and tally.shard_seconds > 0
    assert assembler.complete  # every shard placed as it came back, in split order
    finalize(out, MANIFEST, INFO, OPTIONS.output, assembler=assembler)
    assert_out_is(out, example_reference)
    assert not [p for p in (out / "shards").rglob("*") if p.suffix in (".bin", ".idx")]  # written once, in place


def test_helpers_told_to_stop_leave_checkpoints_a_rerun_goes_on_from(tmp_path, example_reference):
    """Ray up at the driver's first batch: every shard begun stops there, its buffered tokens in its own files,
    checkpointed; the run that goes on from them ends with the reference bytes."""
    looks = []
    done, _, _ = _tokenize_here(tmp_path / "out", lambda: len(looks.append(1) or looks) < 3, helpers=2)
    stopped = [c for s in MANIFEST.shards() if (c := Checkpoint.of(tmp_path / "out", s)) and not c.done]
    assert stopped and all(c.lines > 0 for c in stopped)  # the driver's shard at least, stopped after a batch
    manifest = tmp_path / "m.json"
    write_manifest(MANIFEST, manifest)
    rerun = tokpipe(*run_args(manifest, tmp_path / "out"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(tmp_path / "out", example_reference)

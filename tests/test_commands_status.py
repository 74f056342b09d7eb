"""status: from files alone, the state of a finished, killed, running or failed run, and the command to run next."""

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import socket
import time
from pathlib import Path

import pytest
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_TRAIN_FILES,
    HOLDOUT,
    QWEN3,
    QWEN3_EOS,
    TRAIN_0,
    TRAIN_1,
    cli,
    held_elsewhere,
    held_out,
    reference_tokens,
)

from tokpipe.cli import parser
from tokpipe.commands.status import report, status
from tokpipe.errors import UserError
from tokpipe.fmt import duration
from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.stored import StoredOut, on_store, records_of
from tokpipe.options import RunOptions
from tokpipe.runner.identity import record_run, refusals_noted


@pytest.fixture
def killed(killed_example, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(killed_example, copy)
    return copy


def states(st) -> dict[str, str]:
    return {s.relpath: s.state for s in st.shards}


def test_finished_run_says_verify_next(finished_example):
    st = status(finished_example)
    assert st.state == "finished" and set(states(st).values()) == {"done"}
    assert st.next == f"tokpipe verify {finished_example}"
    result = cli("status", finished_example)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{finished_example}: finished",
        "shards: 3 done, 0 partial, 0 pending, 0 failed (of 3)",
        "  train       2/2 done          859,703 tokens           293 documents",
        "  validation  1/1 done          303,964 tokens           136 documents",
        "committed: 1,163,667 tokens, 429 documents; 100.0% of 1.1 MiB read",
        f"next: tokpipe verify {finished_example}",
    ]


def test_a_finished_run_on_a_store_is_read_where_it_is(finished_stored):
    result = cli("status", finished_stored)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{finished_stored}: finished",
        "shards: 3 done, 0 partial, 0 pending, 0 failed (of 3)",
        "  train       2/2 done          859,703 tokens           293 documents",
        "  validation  1/1 done          303,964 tokens           136 documents",
        "committed: 1,163,667 tokens, 429 documents; 100.0% of 1.1 MiB read",
        f"next: tokpipe verify {finished_stored}",
    ]


def test_killed_run_shows_what_is_committed_and_the_resume_command(killed):
    st = status(killed)
    assert st.state == "stopped" and st.holder is None and st.progress is None
    assert states(st) == {TRAIN_0: "done", TRAIN_1: "partial", HOLDOUT: "pending"}
    partial = next(s for s in st.shards if s.state == "partial")
    assert 0 < partial.tokens and 0 < partial.read < partial.size
    text = report(st)
    assert "stopped before finishing: no run holds it" in text
    assert f"partial {TRAIN_1}:" in text and "1 done, 1 partial, 1 pending, 0 failed (of 3)" in text
    # The resume command is exact: this CLI parses it into the options the run had.
    argv = shlex.split(st.next)
    assert argv[:2] == ["tokpipe", "run"]
    args = parser().parse_args(argv[1:])
    assert args.manifest == str(killed / "manifest.json") and args.out == str(killed)
    assert args.tokenizer == str(QWEN3 / "tokenizer.json") and args.workers == 2 and args.checkpoint_interval == 1.0


@pytest.fixture(params=["in a folder", "on a store"])
def killed_either(request, killed) -> str:
    """The killed run's OUT in a folder (the test's copy), or uploaded under a prefix of the session's S3 server."""
    if request.param == "in a folder":
        return str(killed)
    server, prefix = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_prefix")
    request.addfinalizer(lambda: shutil.rmtree(records_of(server.url(prefix)), ignore_errors=True))
    return server.upload(killed, prefix)


@contextlib.contextmanager
def held(out: str):
    """OUT held as a live `tokpipe run` holds it: a folder's lock flock-ed, naming the run; a store's lease."""
    if on_store(out):
        with StoredOut.of(out).lease():
            yield
        return
    with open(Path(out) / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(f"pid {os.getpid()} on {os.uname().nodename}")
        lock.flush()
        yield


def test_a_live_run_shows_rate_and_eta(killed_either):
    """A live run's progress is in its records, which for an OUT on a store are its driver's folder (records_of)."""
    out = killed_either
    with held(out):
        assert status(out).state == "running" and status(out).progress is None
        log = f"{records_of(out)}/logs/run.log"
        assert f"not tokenizing now: starting up, or stuck (see {log})" in report(status(out))
        now = time.time()
        progress = {
            "pid": os.getpid(), "started_at": now - 125, "updated_at": now, "bytes_read": 100, "bytes_total": 300,
            "documents": 20, "tokens": 5000, "tokens_per_s": 1.5e6, "eta_s": 3725.0,
            "shards": {"total": 3, "done": 1, "running": 2, "failed": 0},
        }  # fmt: skip
        (records_of(out) / "logs").mkdir(parents=True, exist_ok=True)
        (records_of(out) / "logs" / "progress.json").write_text(json.dumps(progress))
        st = status(out)
        assert st.state == "running" and st.progress == progress
        text = report(st)
        assert f"running (pid {os.getpid()} on {socket.gethostname()}), started 2m05s ago" in text
        assert "rate: 1.50M tokens/s; ETA 1h02m; 2 shards running" in text
        assert st.next == f"nothing yet; check again with: tokpipe status {out}"
    # The run died: the kernel dropped its lock (or it ended its lease), its last progress report is history.
    st = status(out)
    assert st.state == "stopped" and st.progress is None and st.next.startswith("tokpipe run ")


def test_a_run_on_another_machine_holds_an_out_on_a_store_until_its_lease_ends(killed, s3_server, s3_prefix):
    """Its lease says who holds OUT, and that it was renewed; its progress is on that machine, not on the store."""
    out = s3_server.upload(killed, s3_prefix)
    running = f"{out}: running (pid 4242 on node-7): its progress is kept on that machine, where status shows it"
    stopped = f"{out}: stopped before finishing: no run holds it (killed or crashed)"
    for renewed, said in ((time.time(), running), (time.time() - 66, stopped)):  # a lease of 60 s, 5 s of skew
        lease = {"host": "node-7", "pid": 4242, "renewed": renewed, "seconds": 60.0}
        s3_server.put(f"{s3_prefix}/.lock", json.dumps(lease).encode())
        assert report(status(out)).splitlines()[0] == said
    # Once the run has uploaded its logs (every minute: runner/storage.py), its progress is read from them while fresh.
    lease["renewed"] = now = time.time()
    s3_server.put(f"{s3_prefix}/.lock", json.dumps(lease).encode())
    progress = {
        "pid": 4242, "started_at": now - 125, "updated_at": now - 42, "bytes_read": 100, "bytes_total": 300,
        "documents": 20, "tokens": 5000, "tokens_per_s": 1.5e6, "eta_s": 3725.0,
        "shards": {"total": 3, "done": 1, "running": 2, "failed": 0},
    }  # fmt: skip
    s3_server.put(f"{s3_prefix}/logs/progress.json", json.dumps(progress).encode())
    text = report(status(out)).splitlines()
    assert text[0] == f"{out}: running (pid 4242 on node-7), started 2m05s ago"
    assert "rate: 1.50M tokens/s; ETA 1h02m; 2 shards running (as of 42s ago)" in text
    progress["updated_at"] = now - 75  # none since: the run is past its uploads' minute, or stuck
    s3_server.put(f"{s3_prefix}/logs/progress.json", json.dumps(progress).encode())
    assert report(status(out)).splitlines()[0] == running


def test_what_stopped_the_last_run_is_said_where_it_said_and_a_kill_is_not(killed):
    # runner/driver.py notes the error that stops a run as run.log's last line (tests/test_runner_driver.py,
    # test_runner_schedule.py, test_cli.py run such runs); an unexpected error's traceback follows it (cli.py).
    headline = f"{killed}: stopped before finishing: no run holds it"
    assert report(status(killed)).splitlines()[0] == f"{headline} (killed or crashed)"
    (killed / "logs").mkdir(exist_ok=True)
    with open(killed / "logs" / "run.log", "a") as log:
        log.write("2026-12-06 12:00:01 stopped: KeyError: 'text'\nTraceback (most recent call last):\n")
        log.write("  File \"tokpipe/write/shard.py\", line 7, in _encode\nKeyError: 'text'\n")
    assert status(killed).stopped == "KeyError: 'text'"
    assert report(status(killed)).splitlines()[0] == f"{headline}; the last one stopped: KeyError: 'text'"
    with open(killed / "logs" / "run.log", "a") as log:  # a run after it, killed -9: it said nothing
        log.write("2026-12-06 12:05:00 run: manifest m.json (5d8ada2c35f236a9), tokenizer qwen3, 3 shards: 1 done\n")
    assert report(status(killed)).splitlines()[0] == f"{headline} (killed or crashed)"


def test_workers_left_over_from_a_killed_run_are_seen(killed):
    with held_elsewhere(killed / "shards" / "train", "train__chunk1__example_train_1"):
        st = status(killed)
        assert [s.writing for s in st.shards] == [False, True, False]
        assert "1 shard is still being written by workers of the stopped run" in report(st)
    assert not any(s.writing for s in status(killed).shards)


def test_failed_shards_are_named_with_their_error(killed):
    (killed / "logs").mkdir(exist_ok=True)
    (killed / "logs" / "failed.json").write_text(
        json.dumps({HOLDOUT: "SourceError: truncated download", TRAIN_0: "stale: done since"})
    )
    st = status(killed)
    assert states(st) == {TRAIN_0: "done", TRAIN_1: "partial", HOLDOUT: "failed"}
    text = report(st)
    assert "stopped before finishing: 1 shard failed in the last run" in text
    assert f"FAILED  {HOLDOUT}: SourceError: truncated download" in text
    assert st.next.startswith("fix the cause of the failures above") and "tokpipe run --manifest" in st.next


def test_not_a_run_is_one_line_exit_2(tmp_path):
    with pytest.raises(UserError, match="holds no tokpipe run"):
        status(tmp_path)
    result = cli("status", tmp_path / "nope")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"tokpipe status: error: {tmp_path / 'nope'}")


def test_a_prefix_of_no_object_is_one_line_that_names_the_out_it_is_within(finished_stored):
    # As a folder's file (tests/test_cli.py): a reader given a file of an OUT on a store (an object, and a prefix that
    # holds none) said "holds no object" alone; and a prefix of nothing at all says what to give.
    nothing = f"{finished_stored}-nothing"
    for command in (["status"], ["verify"], ["inspect"], ["report"], ["export", "--format", "llmc", "--dest", "d"]):
        for out, message in [
            (f"{finished_stored}/meta.json", f"; it is within the tokpipe OUT {finished_stored}: give that"),
            (nothing, ": give the --out of a tokpipe run"),
        ]:
            result = cli(command[0], out, *command[1:])
            assert (result.returncode, result.stdout) == (2, ""), result.stderr
            assert result.stderr == f"tokpipe {command[0]}: error: {out} holds no object{message}\n"


def test_json_and_durations(killed):
    result = cli("status", killed, "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["state"] == "stopped" and [s["state"] for s in data["shards"]] == ["done", "partial", "pending"]
    assert [duration(s) for s in (0.4, 42, 423, 7500, 273600)] == ["0s", "42s", "7m03s", "2h05m", "3d04h"]


def test_resume_command_gives_switches_without_a_value(killed):
    run = json.loads((killed / "run.json").read_text())
    run["options"].update(bos=True, bos_token="<|im_start|>", no_eos=True, val_fraction=0.05, skip_failed=True)
    (killed / "run.json").write_text(json.dumps(run))
    argv = shlex.split(status(killed).next)
    assert "--bos" in argv and "--no-eos" in argv and "True" not in argv
    args = parser().parse_args(argv[1:])
    assert (args.bos, args.bos_token, args.no_eos, args.val_fraction, args.skip_failed) == (
        True,
        "<|im_start|>",
        True,
        0.05,
        True,
    )


def test_a_train_shard_s_tokens_held_out_for_val_are_said_with_its_split(tmp_path):
    # status counts the work of each split's shards, held-out documents included; the line says how much of it
    # went to val.bin, so that it adds up to what `run` printed for train.bin and val.bin.
    manifest = tmp_path / "m.json"
    write_manifest(build_manifest(EXAMPLE_CACHE), manifest)
    out = tmp_path / "out"
    run = cli("run", "--manifest", manifest, "--tokenizer", QWEN3, "--out", out, "--val-fraction", "0.01")
    assert run.returncode == 0, run.stdout + run.stderr
    tokenizer = QWEN3 / "tokenizer.json"
    held = len(reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, QWEN3_EOS, keep=held_out(0.01, True)))
    kept = len(reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, QWEN3_EOS, keep=held_out(0.01, False)))
    line = next(line for line in cli("status", out).stdout.splitlines() if line.startswith("  train "))
    said = f"{held + kept:>15,} tokens  {293:>12,} documents  ({held:,} of the tokens held out for val.bin)"
    assert line.endswith(said), line


def test_status_counts_each_groups_committed_tokens(finished_grouped, grouped_reference):
    """--group-by: status adds up each split's groups from the shard checkpoints, as they are committed."""
    st = status(finished_grouped)
    for split, stem in (("train", "train"), ("validation", "val")):
        assert st.groups[split] == {g: [len(t), d] for g, (t, d, _) in grouped_reference[stem].items()}
    assert (
        "  train       4 groups, tokens: RedPajamaCommonCrawl 559,471, RedPajamaGithub 210,435, "
        "RedPajamaWikipedia 89,542, RedPajamaC4 255"
    ) in report(st).splitlines()


def test_a_run_refused_before_its_first_token_is_said_with_what_to_change(tmp_path):
    """A refusal that names no option to change (a cluster node that cannot see OUT): status repeats it, and the
    command to run once it is fixed; with other inputs too, since OUT holds no token yet. (A refusal that names
    the option, put into the command: tests/test_runner_identity.py.)"""
    out = tmp_path / "out"
    out.mkdir()
    manifest = build_manifest(EXAMPLE_CACHE)
    record_run(out, manifest, load_tokenizer_info(QWEN3), RunOptions(workers=2))
    write_manifest(manifest, out / "manifest.json")
    error = "node 10.0.0.7 cannot see OUT: mount it there, and rerun the same command"
    with pytest.raises(UserError), refusals_noted(out, lambda: True):
        raise UserError(error)
    st = status(out)
    assert (st.state, st.refused) == ("stopped", error)
    assert report(st).splitlines()[0] == f"{out}: holds no token yet; the last run was refused: {error}"
    assert st.next == (
        f"what the refusal above says, then: tokpipe run --manifest {out}/manifest.json --tokenizer "
        f"{QWEN3}/tokenizer.json --out {out} --workers 2 (with other inputs: OUT holds no token yet)"
    )


def test_a_damaged_log_is_said_in_a_warning_and_status_goes_on(killed):
    """logs/ is not the run's state: a damaged progress.json or failed.json (a JSONDecodeError traceback before) is
    said in a warning naming it, and the rest of what status says stands; the next run writes them anew."""
    (killed / "logs").mkdir()
    (killed / "logs" / "failed.json").write_text('{"train/chunk1/example_train_1.jsonl.zst": "SourceEr')
    (killed / "logs" / "progress.json").write_text('{"pid": 4242, "updated_at": 17')
    result = cli("status", killed)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1] == "shards: 1 done, 1 partial, 1 pending, 0 failed (of 3)"
    assert result.stdout.splitlines()[-3:-1] == [
        f"warning: {killed}/logs/failed.json is damaged (JSONDecodeError: Unterminated string starting at: line 1"
        " column 44 (char 43)): a log, not the run's state: the next run writes it anew",
        f"warning: {killed}/logs/progress.json is damaged (JSONDecodeError: Expecting ',' delimiter: line 1 column 31"
        " (char 30)): a log, not the run's state: the next run writes it anew",
    ]
    assert result.stdout.splitlines()[-1].startswith(f"next: tokpipe run --manifest {killed}/manifest.json ")

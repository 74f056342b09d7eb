"""runner/storage.py's Prefix (with write/stored.py and write/segments.py): `tokpipe run --out s3://BUCKET/PREFIX`
against the session's real S3 server (SeaweedFS). The objects a run leaves are downloaded, as `aws s3 sync` copies
them, and compared with the reference (tests/helpers.py), never with tokpipe's own output: the split files and their
indexes byte for byte; a kill -9 at a chosen point of the run, then the same command: the same bytes, what was
committed kept; a second run refused while the first holds OUT's lease; no multipart upload left open, no segment
left."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    KILL_WORKER_SITE,
    QWEN3_EOS,
    checkpoint_names,
    cli,
    forget_stored_checkpoints,
    held_out,
    kill_9,
    open_uploads,
    out_files,
    plain_copy_of_example,
    reference_ids,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    repeated_example,
    repeated_reference,
    run_args,
    start,
    store_out_run,
    store_requests,
    stored_objects,
    tokpipe,
    wait_for,
    write_jsonl,
)

from tokpipe.commands.inspect import open_source
from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.layout.stored import StoredOut
from tokpipe.runner.storage import storage_of
from tokpipe.store import Bucket, Lease, Url

# What a finished run leaves on the store, besides its checkpoints (shards/) and logs (logs/).
FINISHED = {"run.json", "manifest.json", "meta.pkl", "meta.json"}
FINISHED |= {f"{stem}.{suffix}" for stem in ("train", "val") for suffix in ("bin", "idx", "parts")}
COPIES = 9  # of the example's first train shard: 13.3 MB of tokens (600 ids), train.bin of 3 segments (4, 4, 1)


def _ends(tokens: np.ndarray, eos: int = QWEN3_EOS) -> np.ndarray:
    """The documents' ends of a split file whose every document ends with EOS: what its .idx holds."""
    return np.flatnonzero(tokens == eos).astype(np.int64) + 1


def _assert_split(objects: dict[str, bytes], stem: str, expected: np.ndarray) -> None:
    """A split file and its index: the reference's tokens (in its dtype: Qwen3's uint32, the small tokenizer's uint16),
    and each document's end, after its EOS (the reference's last token)."""
    tokens = np.frombuffer(objects[f"{stem}.bin"], dtype=expected.dtype)
    assert np.array_equal(tokens, expected), f"{stem}.bin differs from the reference"
    assert np.array_equal(np.frombuffer(objects[f"{stem}.idx"], dtype=np.int64), _ends(expected, expected[-1]))


def _keys(asked: list[tuple[str, dict]], operation: str, prefix: str) -> list[str]:
    """The keys the requests of `operation` named, relative to OUT's prefix."""
    return [params["Key"].removeprefix(f"{prefix}/") for o, params in asked if o == operation]


def _finished_names(objects: dict[str, bytes]) -> set[str]:
    return {name for name in objects if not name.startswith(("shards/", "logs/"))}


def _assert_finished_as(server, prefix: str, reference: dict[str, np.ndarray]) -> None:
    """OUT's objects: each split file the reference's, exactly OUT's files left (no segment, source or kept part), no
    multipart upload open."""
    objects = stored_objects(server, prefix)
    for stem, expected in reference.items():
        _assert_split(objects, stem, expected)
    assert _finished_names(objects) == FINISHED
    assert open_uploads(server, prefix) == []


def test_an_out_at_a_bucket_s_root_is_named_as_every_other_url():
    """s3://b, whose files are s3://b/NAME: its run said `meta: s3://b//meta.pkl. Next: tokpipe verify s3://b/`."""
    for given in ("s3://b", "s3://b/"):
        out = storage_of(given)
        assert (out.name, out.where, out.show("meta.pkl"), out.out.key("meta.pkl")) == (
            "s3://b", "s3://b", "s3://b/meta.pkl", "meta.pkl"
        )  # fmt: skip
    tok = storage_of("s3://b/tok/")
    assert (tok.where, tok.show("meta.pkl")) == ("s3://b/tok", "s3://b/tok/meta.pkl")


def test_a_run_into_a_store_is_the_reference_and_leaves_no_segment_and_no_open_upload(
    s3_server, s3_prefix, manifest, small_tokenizer, small_reference
):
    url = s3_server.url(s3_prefix)
    run = store_out_run(manifest, url, tokenizer=small_tokenizer)
    assert run.returncode == 0, run.stdout + run.stderr
    tokens = len(small_reference["train"])
    assert f"train: {tokens:,} tokens, 293 documents, 2 lines skipped (empty_text 2) -> {url}/train.bin" in run.stdout
    assert not any(line.startswith("disk:") for line in run.stdout.splitlines())  # no file system's free space
    objects = stored_objects(s3_server, s3_prefix)
    for stem, expected in small_reference.items():
        _assert_split(objects, stem, expected)
    assert _finished_names(objects) == FINISHED
    assert checkpoint_names(objects) == [
        "shards/train/train__chunk1__example_train_0.json",
        "shards/train/train__chunk1__example_train_1.json",
        "shards/validation/validation__chunk1__example_holdout_0.json",
    ]
    meta = json.loads(objects["meta.json"])
    assert (meta["splits"]["train"]["file"], meta["splits"]["train"]["tokens"]) == ("train.bin", tokens)
    assert open_uploads(s3_server, s3_prefix) == []
    assert not StoredOut.of(url).work.exists()  # the run's local records, uploaded, are gone from this machine
    secret = s3_server.secret.encode()  # in no object of OUT (run.json, the logs, ...), and in nothing printed
    assert [name for name, body in objects.items() if secret in body] == []
    assert secret.decode() not in run.stdout + run.stderr
    # A rerun has nothing to do; the logs stay the run's (appended to, as on disk, not replaced by the rerun's own).
    rerun = store_out_run(manifest, url, tokenizer=small_tokenizer)
    assert rerun.stdout.startswith(f"{url} is already finished"), rerun.stdout + rerun.stderr
    logs = {name: body for name, body in objects.items() if name.startswith("logs/")}
    assert set(logs) == {"logs/run.log", "logs/progress.json", "logs/series.jsonl", "logs/skipped.json"}
    assert {name: body for name, body in stored_objects(s3_server, s3_prefix).items() if name in logs} == logs


@pytest.fixture
def repeated(tmp_path, small_tokenizer) -> tuple[Path, dict[str, np.ndarray]]:
    """A manifest of COPIES copies of the example's first train shard and its validation shard, and its reference
    with the 600-id tokenizer (the runs' subject is the store, not Qwen3, whose load cost each process ~1.3 CPU-s)."""
    path = tmp_path / "repeated.json"
    write_manifest(build_manifest(repeated_example(tmp_path / "data", COPIES)), path)
    return path, repeated_reference(COPIES, small_tokenizer)


# Every moment of a run into a store that a kill -9 lands at, in the order a run comes to them: each the n-th call of a
# function (module.function or module.Class.method, where the call looks it up), before it runs. Its segments over
# 1 MiB are multipart uploads. After each, the same command resumes and is killed at the next.
KILLED_AT = {
    "the lease taken, the run not yet recorded": ("tokpipe.runner.storage.record_run", 1),
    "inside a segment: its .json and .idx up, its .bin's upload open": ("tokpipe.store.upload.Upload.finish", 1),
    "a segment committed, its shards not yet checkpointed": ("tokpipe.write.stored.StoreAssembly.commit", 1),
    "in finalize, before the parts lists": ("tokpipe.write.finalize._parts_list", 1),
    "train.bin composed, val.bin not": ("tokpipe.write.stored._compose", 2),
    "the split files made, meta not": ("tokpipe.write.finalize.meta_of", 1),
    "meta.json written, the segments not yet removed": ("tokpipe.layout.stored.StoredOut.leftovers", 1),
    "the rerun removing what that finish left": ("tokpipe.store.bucket.Bucket.delete_many", 1),
    "the logs uploaded at the end": ("tokpipe.layout.stored.StoredOut.upload_logs", 1),
}


def test_a_kill_9_at_every_moment_of_a_run_into_a_store_then_the_same_command_is_the_reference(
    s3_server, s3_prefix, manifest, small_tokenizer, small_reference
):
    url = s3_server.url(s3_prefix)
    found = {}
    for moment, kill in KILLED_AT.items():
        killed = store_out_run(manifest, url, whole_put=1 << 20, kill=kill, tokenizer=small_tokenizer)
        assert killed.returncode == -9, f"{moment}: {killed.stdout}{killed.stderr}"
        objects, uploads = stored_objects(s3_server, s3_prefix), open_uploads(s3_server, s3_prefix)
        found[moment] = (killed.stdout, set(objects), uploads, cli("status", url).stdout.splitlines())
    # What each kill left, as the next run found it.
    segment = "segments/train/train__chunk1__example_train_0"

    def trains(names: set[str]) -> set[str]:
        """Of train's segment and OUT's records: val.bin's segment, ready with train's, is uploaded beside it
        (StoreAssembly.place_ready), and how much of it is up (and checkpointed by a rerun) is which ends first."""
        return {name for name in names if not name.startswith(("segments/val/", "shards/validation/"))}

    _, left, uploads, _ = found["inside a segment: its .json and .idx up, its .bin's upload open"]
    assert trains(left) == {".lock", "run.json", "manifest.json", f"{segment}.json", f"{segment}.idx"}
    assert uploads == [f"{s3_prefix}/{segment}.bin"]
    _, left, _, _ = found["a segment committed, its shards not yet checkpointed"]
    committed = {f"{segment}.json", f"{segment}.idx", f"{segment}.bin"}
    assert trains(left) == {".lock", "run.json", "manifest.json", *committed}
    said, left, _, _ = found["train.bin composed, val.bin not"]
    assert "3 shards, 1.1 MiB; 3 done, 0 partial, 0 to start" in said  # none tokenized again
    assert {"train.bin", "train.idx", "train.parts"} <= left and not {"val.bin", "meta.json"} & left
    for moment in ("meta.json written, the segments not yet removed", "the rerun removing what that finish left"):
        _, left, _, status = found[moment]
        assert len([name for name in left if name.startswith("segments/")]) == 6, moment  # 2 segments' 3 objects
        assert "logs/skipped.json" in left, moment  # of OUT's files, before meta as on disk
        assert status[:2] == [
            f"{url}: finished",
            f"LEFT OVER: 6 objects under {url} that a finish killed after meta.json left (a second copy of tokens,"
            " segments/ or kept parts): the run's command removes them",
        ]
    said, _, _, status = found["the logs uploaded at the end"]
    assert said.splitlines()[-2:] == [
        f"removed 6 objects that a finish killed after meta.json left under {url}",
        f"{url} is already finished ({url}/meta.json); nothing to do. Check it with: tokpipe verify {url}",
    ]
    assert status[1] == "shards: 3 done, 0 partial, 0 pending, 0 failed (of 3)"
    rerun = store_out_run(manifest, url, whole_put=1 << 20, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert rerun.stdout.splitlines()[-1].startswith(f"{url} is already finished")
    _assert_finished_as(s3_server, s3_prefix, small_reference)


def test_the_command_status_gives_for_a_killed_run_on_a_store_resumes_it_from_anywhere(
    s3_server, s3_prefix, manifest, small_tokenizer, small_reference, tmp_path
):
    # It names OUT's own manifest on the store, which the run reads a copy of (the one it was started with is local
    # to another folder, or machine): it was read as ./s3:/…/manifest.json, "does not exist".
    url = s3_server.url(s3_prefix)
    kill = KILLED_AT["a segment committed, its shards not yet checkpointed"]
    assert store_out_run(manifest, url, whole_put=1 << 20, kill=kill, tokenizer=small_tokenizer).returncode == -9
    said = cli("status", url).stdout.splitlines()[-1]
    argv = shlex.split(said.removeprefix("next: "))
    assert argv[:4] == ["tokpipe", "run", "--manifest", f"{url}/manifest.json"], said
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = tokpipe(*argv[1:], cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    _assert_finished_as(s3_server, s3_prefix, small_reference)
    assert list(elsewhere.iterdir()) == []  # no s3: folder here
    log = stored_objects(s3_server, s3_prefix)["logs/run.log"].decode()
    named = [line.split(" run: manifest ")[1].split(" (")[0] for line in log.splitlines() if " run: manifest " in line]
    assert named[-1] == f"{url}/manifest.json", log  # the resume's, as given: not its copy's path
    missing = tokpipe(*run_args(f"{url}/nothing.json", url, tokenizer=small_tokenizer))
    assert (missing.returncode, missing.stderr) == (
        2,
        f"tokpipe run: error: manifest {url}/nothing.json does not exist (an OUT on a store keeps its own:"
        " OUT/manifest.json)\n",
    )


def _example_and_its_first_train_shard_added(tmp_path: Path):
    """The manifest of the example less its first train shard (before.json), and what puts the shard back and writes
    after.json (it sorts first: every finished part of train.bin moves)."""
    data = plain_copy_of_example(tmp_path / "data")
    first = data / "train" / "chunk1" / "example_train_0.jsonl.zst"
    aside = first.read_bytes()
    first.unlink()
    write_manifest(build_manifest(data), tmp_path / "before.json")

    def after() -> None:
        first.write_bytes(aside)
        write_manifest(build_manifest(data), tmp_path / "after.json")

    return tmp_path / "before.json", after


# The moments of an append to a finished OUT on a store that a kill -9 lands at: as its split files are copied to
# sources/ (the second copy), once run.json is this run's (the first thing a resume does), as a segment takes a
# finished part from the sources, as that segment is uploaded (its .json and .idx sent, not its .bin: the commit).
APPEND_KILLED_AT = {
    "copying the split files": ("tokpipe.layout.stored.compose", 2),
    "run.json written, meta not yet removed": ("tokpipe.write.stored.StoreAssembly.resume", 1),
    "a part read from the sources": ("tokpipe.write.segments.Kept.arrays", 1),
    "its segment half uploaded": ("tokpipe.write.stored.put_buffers", 1),
}


@pytest.mark.parametrize("moment", APPEND_KILLED_AT)
def test_an_append_killed_at_any_moment_then_the_same_command_is_one_run_over_all_shards(
    s3_server, s3_prefix, tmp_path, small_tokenizer, small_reference, moment
):
    # The example less its first train shard, finished; then the manifest gains it (it sorts first: every finished
    # part of train.bin moves). Killed at a moment of the append, the same command ends at one run's bytes.
    before, after = _example_and_its_first_train_shard_added(tmp_path)
    url = s3_server.url(s3_prefix)
    assert store_out_run(before, url, tokenizer=small_tokenizer).returncode == 0
    after()
    killed = store_out_run(tmp_path / "after.json", url, kill=APPEND_KILLED_AT[moment], tokenizer=small_tokenizer)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    # Meanwhile a reader (inspect, report) reads the shards done before the append where they are: in the sources,
    # in the segments committed; the first shard is read too once it is done.
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    train_1 = reference_tokens(EXAMPLE_TRAIN_FILES[1:], tokenizer, eos, np.uint16)
    for split, expected in (("train", (train_1, small_reference["train"])), ("validation", (small_reference["val"],))):
        read = np.concatenate([np.asarray(f.tokens) for f in open_source(url, split).files])
        assert any(np.array_equal(read, tokens) for tokens in expected), (split, read.size)
    rerun = store_out_run(tmp_path / "after.json", url, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(r": 3 shards, .*; 2 done, 0 partial, 1 to start$", rerun.stdout, re.M), rerun.stdout
    _assert_finished_as(s3_server, s3_prefix, small_reference)  # no source, no segment left
    assert tokpipe("verify", url).returncode == 0


def test_an_append_to_an_unfinished_out_on_a_store_is_refused_in_one_line(
    s3_server, s3_prefix, tmp_path, small_tokenizer
):
    before, after = _example_and_its_first_train_shard_added(tmp_path)
    url = s3_server.url(s3_prefix)
    killed = store_out_run(before, url, kill=("tokpipe.write.finalize.compose_split", 1), tokenizer=small_tokenizer)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    after()
    refused = tokpipe(*run_args(tmp_path / "after.json", url, tokenizer=small_tokenizer))
    assert refused.returncode == 2
    assert refused.stderr == (
        f"tokpipe run: error: {url} holds an unfinished run of fewer shards: shards are appended to a finished OUT"
        " on a store; finish it first (the command that started it), then run this one\n"
    )


def test_the_store_killed_mid_upload_and_started_again_is_waited_for(s3_server, s3_prefix, repeated, small_tokenizer):
    manifest, reference = repeated
    url = s3_server.url(s3_prefix)
    # At the second segment's .bin (its .json and .idx sent): the server killed, then started again on its data;
    # the PUT is retried with backoff (botocore's standard mode) until it answers.
    run = store_out_run(
        manifest, url, kill=("tokpipe.write.stored.put_buffers", 2), server=s3_server, tokenizer=small_tokenizer
    )
    assert run.returncode == 0, run.stdout + run.stderr
    _assert_finished_as(s3_server, s3_prefix, reference)


def test_a_second_run_is_refused_in_one_line_while_the_first_holds_the_lease(
    s3_server, s3_prefix, manifest, small_tokenizer
):
    url = s3_server.url(s3_prefix)
    with Lease(Bucket.of(Url.parse(url)), f"{s3_prefix}/.lock"):  # a live run of this process holds OUT
        refused = tokpipe(*run_args(manifest, url, tokenizer=small_tokenizer))
    assert refused.returncode == 2
    assert re.fullmatch(
        rf"tokpipe run: error: {re.escape(url)} is in use by another tokpipe run \(pid {os.getpid()} on "
        rf"{re.escape(socket.gethostname())}\); wait for it to finish or stop it \(a run killed without a word frees "
        r"it within \d+ s, when its lease ends\)\n",
        refused.stderr,
    )
    assert set(stored_objects(s3_server, s3_prefix)) == set()  # refused before any work: not even run.json


# A run stopped (Ctrl-Z, a paused VM) past its lease while another run on this machine took OUT over: at its first
# checkpoint, OUT/.lock is the other run's, the records folder holds the other's log (its start removed this run's),
# and this run's last renewal is a lease's length ago. The driver tokenizes alone (no Ray).
TAKEN_OVER_RUN = """
import json, shutil, sys, time
import tokpipe.runner.driver, tokpipe.write.stored
tokpipe.runner.driver.RAY_PAYS = tokpipe.runner.driver.LOCAL_SECONDS = float("inf")
checkpoint = tokpipe.write.stored.StoreAssembly.checkpoint
def taken_over(assembly, relpaths):
    lease = assembly.lease
    if lease.etag is not None and lease.bucket.get(lease.key)[1] == lease.etag:  # still this run's: take it
        other = {"host": "another-machine", "pid": 1, "renewed": time.time(), "seconds": 60.0, "machine": None}
        lease.bucket.put(lease.key, json.dumps(other).encode())
        shutil.rmtree(assembly.out.work)
        (assembly.out.work / "logs").mkdir(parents=True)
        (assembly.out.work / "logs" / "run.log").write_text("the other run's log\\n")
        lease.renewed -= lease.seconds + 1
    return checkpoint(assembly, relpaths)
tokpipe.write.stored.StoreAssembly.checkpoint = taken_over
from tokpipe import cli
cli.main(sys.argv[1:])
"""


def test_a_run_stopped_while_another_took_its_out_over_stops_saying_so_and_leaves_the_other_s_files_alone(
    s3_server, s3_prefix, manifest, small_tokenizer
):
    url = s3_server.url(s3_prefix)
    args = run_args(manifest, url, tokenizer=small_tokenizer)
    stopped = subprocess.run([sys.executable, "-c", TAKEN_OVER_RUN, *map(str, args)], capture_output=True, text=True)
    assert stopped.returncode == 2, stopped.stdout + stopped.stderr
    assert stopped.stderr.splitlines()[-1] == (
        f"tokpipe run: error: {url}/.lock: another tokpipe run took over OUT's lease (this run did not renew it in"
        " time); nothing it wrote is lost: rerun the command"
    )
    objects = stored_objects(s3_server, s3_prefix)
    assert json.loads(objects[".lock"])["host"] == "another-machine"
    assert not [name for name in objects if name.startswith(("logs/", "shards/"))]  # nothing written once taken
    assert (StoredOut.of(url).work / "logs" / "run.log").read_text() == "the other run's log\n"  # no stop note in it


# A run into a store that uploads its logs every 0.1 s, killed (SIGKILL) at its second shard's encode once they have
# been uploaded since the first's. The driver tokenizes alone (no Ray).
LOGS_KILLED_RUN = """
import os, signal, sys, time
import tokpipe.runner.driver, tokpipe.runner.storage, tokpipe.write.shard
tokpipe.runner.driver.RAY_PAYS = tokpipe.runner.driver.LOCAL_SECONDS = float("inf")
tokpipe.runner.storage.LOGS_EVERY = 0.1
encode, calls = tokpipe.write.shard.ShardWriter._encode, []
def killed_at_the_second(writer, *args, **kw):
    calls.append(1)
    if len(calls) == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    return encode(writer, *args, **kw)
tokpipe.write.shard.ShardWriter._encode = killed_at_the_second
from tokpipe import cli
cli.main(sys.argv[1:])
"""


def test_a_run_killed_on_a_store_loses_only_the_last_moments_of_its_logs(
    s3_server, s3_prefix, manifest, small_tokenizer
):
    url = s3_server.url(s3_prefix)
    args = run_args(manifest, url, tokenizer=small_tokenizer)
    killed = subprocess.run([sys.executable, "-c", LOGS_KILLED_RUN, *map(str, args)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    logs = {name: body for name, body in stored_objects(s3_server, s3_prefix).items() if name.startswith("logs/")}
    said = [line.split(" ", 2)[2].split(":")[0] for line in logs["logs/run.log"].decode().splitlines()]
    assert said == ["run", "backend fastokens"]
    assert {"logs/progress.json", "logs/series.jsonl"} <= set(logs)  # its last progress report, and report's chart
    rerun = store_out_run(manifest, url, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    said = stored_objects(s3_server, s3_prefix)["logs/run.log"].decode().splitlines()
    assert [line.split(" ", 2)[2].split(":")[0] for line in said][:3] == ["run", "backend fastokens", "run"]


def test_a_refused_run_is_noted_on_the_store_and_its_fix_is_what_status_says_next(
    s3_server, s3_prefix, manifest, small_tokenizer
):
    # As in a folder (test_runner_identity.py): a run refused before OUT holds a token notes it in logs/refused.json,
    # and status gives the corrected command; the corrected run removes the note, and its log follows the refused one.
    url = s3_server.url(s3_prefix)
    refused = cli(*run_args(manifest, url, "--text-field", "body", tokenizer=small_tokenizer))
    error = (
        "no document has a 'body' field in the first lines of each split's first shard; their fields: meta, text: pass"
        " --text-field NAME (e.g. --text-field text)"
    )
    assert (refused.returncode, refused.stderr) == (2, f"tokpipe run: error: {error}\n")
    status = cli("status", url).stdout.splitlines()
    assert status[0] == f"{url}: holds no token yet; the last run was refused: {error}"
    assert status[-1].endswith(f"--out {url} --text-field text")
    corrected = store_out_run(manifest, url, "--text-field", "text", tokenizer=small_tokenizer)
    assert corrected.returncode == 0, corrected.stdout + corrected.stderr
    logs = {name: body for name, body in stored_objects(s3_server, s3_prefix).items() if name.startswith("logs/")}
    assert "logs/refused.json" not in logs
    said = [line.split(" ", 2)[2].split(":")[0] for line in logs["logs/run.log"].decode().splitlines()]
    assert said == ["run", "stopped", "run", "backend fastokens", "phases", "finished"]


def test_held_out_documents_through_the_store(s3_server, s3_prefix, manifest, small_tokenizer, small_reference):
    url = s3_server.url(s3_prefix)
    run = store_out_run(manifest, url, "--val-fraction", "0.1", tokenizer=small_tokenizer)
    assert run.returncode == 0, run.stdout + run.stderr
    objects = stored_objects(s3_server, s3_prefix)
    tokenizer, eos = small_tokenizer / "tokenizer.json", int(small_reference["val"][-1])
    train = reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, eos, np.uint16, keep=held_out(0.1, False))
    held = reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, eos, np.uint16, keep=held_out(0.1, True))
    val = small_reference["val"]
    _assert_split(objects, "train", train)
    _assert_split(objects, "val", np.concatenate([held, val]))  # in manifest order: train, then validation
    assert open_uploads(s3_server, s3_prefix) == []


def test_groups_through_the_store(s3_server, s3_prefix, manifest, grouped_reference):
    url = s3_server.url(s3_prefix)
    run = store_out_run(manifest, url, "--group-by", GROUP_FIELD)
    assert run.returncode == 0, run.stdout + run.stderr
    objects = stored_objects(s3_server, s3_prefix)
    meta = json.loads(objects["meta.json"])
    for split, stem in (("train", "train"), ("validation", "val")):
        groups = meta["splits"][split]["groups"]
        assert list(groups) == list(grouped_reference[stem])
        for value, (tokens, documents, text_bytes) in grouped_reference[stem].items():
            entry = groups[value]
            assert (entry["documents"], entry["text_bytes"]) == (documents, text_bytes)
            assert np.array_equal(np.frombuffer(objects[entry["file"]], dtype=np.uint32), tokens)
            assert np.array_equal(np.frombuffer(objects[entry["idx"]], dtype=np.int64), _ends(tokens))
    assert not any(name.startswith("segments/") for name in objects)
    assert open_uploads(s3_server, s3_prefix) == []


def test_no_concat_through_the_store_keeps_each_part_as_an_object(
    s3_server, s3_prefix, manifest, small_tokenizer, small_reference
):
    url = s3_server.url(s3_prefix)
    run = store_out_run(manifest, url, "--no-concat", tokenizer=small_tokenizer)
    assert run.returncode == 0, run.stdout + run.stderr
    objects = stored_objects(s3_server, s3_prefix)
    meta = json.loads(objects["meta.json"])
    files = meta["splits"]["train"]["files"]
    assert [f["bin"] for f in files] == [
        "segments/train/train__chunk1__example_train_0.bin",
        "segments/train/train__chunk1__example_train_1.bin",
    ]
    tokens = np.concatenate([np.frombuffer(objects[f["bin"]], dtype=np.uint16) for f in files])
    assert np.array_equal(tokens, small_reference["train"])
    assert "train.bin" not in objects
    assert open_uploads(s3_server, s3_prefix) == []


def test_no_concat_shards_are_checkpointed_together_and_a_reader_of_the_finished_out_gets_no_segment_record(
    s3_server, s3_prefix, tmp_path, small_tokenizer, monkeypatch
):
    # 40 shards of 2 documents, each its own segment: their checkpoints went to an object each (a PUT during the run,
    # a GET for every reader), and status, verify and report copied each segment's .json, which the parts list says.
    texts, data = reference_texts(EXAMPLE_TRAIN_FILES[0])[:80], tmp_path / "data" / "train"
    for n in range(40):
        write_jsonl(data / f"s{n:02}.jsonl", [json.dumps({"text": text}) for text in texts[2 * n : 2 * n + 2]])
    write_manifest(build_manifest(data.parent), tmp_path / "m.json")
    url = s3_server.url(s3_prefix)
    run = store_out_run(tmp_path / "m.json", url, "--no-concat", tokenizer=small_tokenizer, index_every=1)
    assert run.returncode == 0, run.stdout + run.stderr
    objects = stored_objects(s3_server, s3_prefix)
    assert not [name for name in objects if name.startswith("segments/index/")]  # a finished OUT keeps none
    files = json.loads(objects["meta.json"])["splits"]["train"]["files"]
    tokens = np.concatenate([np.frombuffer(objects[f["bin"]], dtype=np.uint16) for f in files])
    ids = reference_ids(texts, small_tokenizer / "tokenizer.json")
    assert tokens.tolist() == [i for document in ids for i in [*document, 0]]  # <|endoftext|> is id 0
    assert len(files) == len(checkpoint_names(objects)) == 40
    assert 1 <= len([name for name in objects if "/placed/" in name]) <= 10  # one a placing at most: 40 before

    asked = store_requests(monkeypatch)
    said = cli("status", url)
    assert said.stdout.splitlines()[1] == "shards: 40 done, 0 partial, 0 pending, 0 failed (of 40)", said.stderr
    records = {name for name in objects if not name.startswith("segments/")}  # one GET each, and no other
    assert sorted(_keys(asked, "GetObject", s3_prefix)) == sorted(records)


def test_status_of_an_unfinished_run_on_a_store_lists_and_reads_no_segment(
    s3_server, s3_prefix, manifest, small_tokenizer, monkeypatch
):
    # A live run's segments are three objects a 5 MiB of tokens (1.5 million for 2.5 TB): status, which says which
    # shards are done, not where their tokens are, had each listed and its .json copied. Now its LIST stops at them
    # (past the page that reaches them) and goes on after them.
    url = s3_server.url(s3_prefix)
    kill = ("tokpipe.write.stored.StoreAssembly.commit", 1)
    assert store_out_run(manifest, url, kill=kill, tokenizer=small_tokenizer).returncode == -9
    objects = stored_objects(s3_server, s3_prefix)
    assert len([name for name in objects if name.startswith("segments/")]) == 6  # train's and validation's
    asked = store_requests(monkeypatch)
    said = cli("status", url)
    assert said.stdout.splitlines()[:2] == [
        f"{url}: stopped before finishing: no run holds it (killed or crashed)",
        "shards: 0 done, 0 partial, 3 pending, 0 failed (of 3)",
    ], said.stderr
    records = sorted(name for name in objects if not name.startswith("segments/"))
    assert sorted(_keys(asked, "GetObject", s3_prefix)) == records
    lists = [(params.get("MaxKeys"), params.get("StartAfter")) for o, params in asked if o == "ListObjectsV2"]
    assert lists == [(1, None), (None, None), (None, f"{s3_prefix}/segments0")]  # OUT's check, then its records


def test_a_run_on_ray_into_a_store_is_the_reference(
    s3_server, s3_prefix, manifest, small_tokenizer, small_reference, ray_address
):
    # The 600-id tokenizer: each of the run's processes loading Qwen3 took ~1.3 CPU-s more (Qwen3 on Ray into a
    # store: tests/test_runner_nodes.py).
    url = s3_server.url(s3_prefix)  # the session's Ray, whose workers have the server's key in their environment
    run = tokpipe(*run_args(manifest, url, "--ray-only", "--workers", "2", tokenizer=small_tokenizer), ray=ray_address)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"ray: cluster {ray_address}, 2 workers" in run.stdout
    assert "finalizing: composing the split files from their 2 segments on the store (a copy each)\n" in run.stdout
    _assert_finished_as(s3_server, s3_prefix, small_reference)


def _mixed(tmp_path: Path, copies: list[int], tokenizer: Path) -> tuple[Path, np.ndarray]:
    """A manifest of train shards of these many copies each of the example's first train shard (with the 600-id
    tokenizer, 4: 5.6 MiB of tokens, a large part; 1: 1.4 MiB, a small one; with Qwen3, 6.0 and 1.5), and its
    train.bin's reference."""
    data = tmp_path / "mixed" / "train"
    data.mkdir(parents=True)
    for n, count in enumerate(copies):
        (data / f"part-{n:02d}.jsonl.zst").write_bytes(EXAMPLE_TRAIN_FILES[0].read_bytes() * count)
    write_manifest(build_manifest(data.parent), tmp_path / "m.json")
    return tmp_path / "m.json", repeated_reference(sum(copies), tokenizer)["train"]  # the same shard, as many times


@pytest.mark.parametrize("buffer", [[], ["--shard-buffer", "1"]], ids=["in memory", "past the shard buffer"])
def test_large_parts_are_uploaded_where_they_are_and_the_file_keeps_split_order(
    s3_server, s3_prefix, tmp_path, buffer, ray_address, small_tokenizer
):
    # Shards of 4 copies of the example's first train shard (5.6 MiB of tokens: a segment of its own, uploaded by the
    # node that tokenized it) and of 1 (1.4 MiB: gathered with the next parts): segments [0], [1, 2, 3], [4], [5],
    # uploaded at once, in any order, composed in the order of their first parts (test_write_segments.py). Past
    # the shard buffer, the large parts wait in files of their node's (write/shard.py Spilled), removed once up.
    manifest, reference = _mixed(tmp_path, [4, 1, 1, 4, 4, 1], small_tokenizer)
    url = s3_server.url(s3_prefix)
    args = run_args(manifest, url, "--ray-only", "--workers", "2", *buffer, tokenizer=small_tokenizer)
    run = tokpipe(*args, ray=ray_address)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not StoredOut.of(url).work.exists()  # spilled files included
    _assert_split(stored_objects(s3_server, s3_prefix), "train", reference)
    assert open_uploads(s3_server, s3_prefix) == []


def test_a_segment_not_committed_before_one_that_is_is_made_again_with_the_same_parts(
    s3_server, s3_prefix, tmp_path, small_tokenizer
):
    # What a kill leaves when uploads commit out of order, made exactly: a run killed as it finalizes (every segment
    # committed, every shard checkpointed), then the second of train.bin's four segments and its shards' checkpoints
    # removed, as if its upload had not finished while the third's had. The rerun tokenizes those shards again and
    # gathers their parts from the same first part into the same segment.
    manifest, reference = _mixed(tmp_path, [4, 1, 1, 4, 4, 1], small_tokenizer)
    url = s3_server.url(s3_prefix)
    killed = store_out_run(manifest, url, kill=("tokpipe.write.finalize.compose_split", 1), tokenizer=small_tokenizer)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    left = stored_objects(s3_server, s3_prefix)
    segments = sorted(n for n in left if n.startswith("segments/") and n.endswith(".bin"))
    assert segments == [f"segments/train/train__part-{n:02d}.bin" for n in (0, 1, 4, 5)]
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/segments/train/train__part-01.bin")
    forget_stored_checkpoints(s3_server, s3_prefix, [f"shards/train/train__part-{n:02d}.json" for n in (1, 2, 3)])
    rerun = store_out_run(manifest, url, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "6 shards, 5.2 MiB; 3 done, 0 partial, 3 to start" in rerun.stdout
    assert f"resuming: reading which parts each of the 3 segments committed under {url} holds\n" in rerun.stdout
    _assert_split(stored_objects(s3_server, s3_prefix), "train", reference)
    assert open_uploads(s3_server, s3_prefix) == []


def test_a_rerun_reads_the_committed_segments_records_from_their_index_objects(
    s3_server, s3_prefix, tmp_path, small_tokenizer
):
    # Killed as it finalizes, with an index object written at each commit (INDEX_EVERY 1, of 64). A reader of the
    # unfinished OUT (inspect, report) and the rerun GET no .json of a segment an index holds (each removed here: a GET
    # would fail); and as in the test above, a segment whose .bin is gone is not committed, whatever an index says: its
    # shards are tokenized again, into the same segment.
    manifest, reference = _mixed(tmp_path, [4, 1, 1, 4, 4, 1], small_tokenizer)
    url = s3_server.url(s3_prefix)
    kill = ("tokpipe.write.finalize.compose_split", 1)
    killed = store_out_run(manifest, url, kill=kill, tokenizer=small_tokenizer, index_every=1)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    left = stored_objects(s3_server, s3_prefix)
    indexes = [left[name] for name in left if name.startswith("segments/index/")]
    indexed = [json.loads(line)["name"] for index in indexes for line in index.splitlines()]
    assert sorted(indexed) == [f"segments/train/train__part-{n:02d}" for n in (0, 1, 4, 5)]
    client = s3_server.client()
    for name in indexed:
        client.delete_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/{name}.json")
    assert np.array_equal(np.concatenate([np.asarray(f.tokens) for f in open_source(url, "train").files]), reference)
    client.delete_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/segments/train/train__part-01.bin")
    forget_stored_checkpoints(s3_server, s3_prefix, [f"shards/train/train__part-{n:02d}.json" for n in (1, 2, 3)])
    rerun = store_out_run(manifest, url, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    said = "3 segments committed under {url} holds (3 in index objects, 0 a GET each)\n"
    assert f"resuming: reading which parts each of the {said.format(url=url)}" in rerun.stdout
    objects = stored_objects(s3_server, s3_prefix)
    _assert_split(objects, "train", reference)
    assert not [name for name in objects if name.startswith("segments/")]  # the index objects too
    assert open_uploads(s3_server, s3_prefix) == []


def test_a_ray_run_killed_while_segments_upload_at_once_then_the_same_command_is_the_reference(
    s3_server, s3_prefix, tmp_path, ray_address, small_tokenizer
):
    # Segments commit in any order on Ray (four uploads at a time): a kill -9 of the whole run once one is committed
    # may leave later ones committed and earlier ones not, and large parts in files of the node (--shard-buffer 1).
    manifest, reference = _mixed(tmp_path, [4, 1, 1, 4, 4, 1, 4, 1, 4], small_tokenizer)
    url, args = s3_server.url(s3_prefix), ("--ray-only", "--workers", "2", "--shard-buffer", "1")
    run = start(manifest, url, *args, logs=tmp_path, ray=ray_address, tokenizer=small_tokenizer)

    def committed() -> bool:  # two of its five segments (listed only: a live run removes objects)
        listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{s3_prefix}/segments/")
        return sum(item["Key"].endswith(".bin") for item in listed.get("Contents", [])) >= 2

    wait_for(lambda: committed() or run.poll() is not None)
    kill_9(run)
    assert run.returncode == -signal.SIGKILL, run.log.read_text()  # killed while it ran, not after it finished
    rerun = tokpipe(*run_args(manifest, url, *args, tokenizer=small_tokenizer), ray=ray_address)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    objects = stored_objects(s3_server, s3_prefix)
    _assert_split(objects, "train", reference)
    assert not [name for name in objects if name.startswith("segments/")]
    assert open_uploads(s3_server, s3_prefix) == []


def test_a_placer_killed_inside_an_upload_leaves_no_open_upload_and_the_bytes_are_the_reference(
    s3_server, s3_prefix, repeated, tmp_path, small_tokenizer
):
    # The Placer is killed as it completes its first multipart upload (segments past 1 MiB are): the call fails, the
    # segment goes to a new Placer, and the upload the first one left open is aborted before the run finishes.
    manifest, reference = repeated
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(KILL_WORKER_SITE)
    marker = tmp_path / "killed"
    env = {
        "PYTHONPATH": str(tmp_path / "site"),
        "TOKPIPE_TESTS_KILL_WORKER_AT": f"tokpipe.store.upload.Upload.finish:1:{marker}",
    }
    url = s3_server.url(s3_prefix)
    run = tokpipe(*run_args(manifest, url, "--ray-only", "--workers", "2", tokenizer=small_tokenizer), env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert marker.exists()  # the Placer was killed
    objects = stored_objects(s3_server, s3_prefix)
    for stem, expected in reference.items():
        _assert_split(objects, stem, expected)
    log = objects["logs/run.log"].decode()
    assert re.search(r"^\S+ \S+ placing on node .+ failed \(ActorDiedError: ", log, re.M), log
    assert open_uploads(s3_server, s3_prefix) == []


@pytest.mark.parametrize("out_on", ["a folder", "a store"])
def test_ray_takes_over_from_the_driver_and_tokenizes_only_the_shards_it_did_not(tmp_path, out_on, request):
    # Four copies of a shard: the driver tokenizes two (3.2 MB of tokens: on a store, a segment still open), then
    # Ray's workers the others, and only those: every shard is read once. Before, the driver's went to Ray again:
    # on a folder each said "resumed" from its checkpoint, on a store tokenized again (no checkpoint there yet).
    manifest, reference = tmp_path / "m.json", repeated_reference(4)
    write_manifest(build_manifest(repeated_example(tmp_path / "data", 4)), manifest)
    server = None if out_on == "a folder" else request.getfixturevalue("s3_server")
    out = tmp_path / "out" if server is None else server.url(request.getfixturevalue("s3_prefix"))
    run = store_out_run(manifest, out, "--workers", "2", driver_shards=2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ray: embedded local instance, 2 workers" in run.stdout
    read = sum(Path(s["path"]).stat().st_size for s in json.loads(manifest.read_text())["shards"])
    assert f", {read / 1e6:,.1f} MB of input read" in run.stdout and "resumed" not in run.stdout, run.stdout
    objects = out_files(out, server)
    for stem, expected in reference.items():
        _assert_split(objects, stem, expected)
    if server is not None:
        assert open_uploads(server, str(out).removeprefix(f"s3://{server.bucket}/")) == []


def test_skip_failed_through_the_store_leaves_the_failed_shard_out(
    s3_server, s3_prefix, tmp_path, small_tokenizer, small_reference
):
    data = tmp_path / "with-a-bad-shard" / "train"
    data.mkdir(parents=True)
    shutil.copyfile(EXAMPLE_TRAIN_FILES[0], data / "a.jsonl.zst")
    write_jsonl(data / "b.jsonl", ["not json", "not json either", "nope"])  # between the two good ones
    shutil.copyfile(EXAMPLE_TRAIN_FILES[1], data / "c.jsonl.zst")
    write_manifest(build_manifest(data.parent), tmp_path / "m.json")
    url = s3_server.url(s3_prefix)
    run = store_out_run(tmp_path / "m.json", url, "--skip-failed", tokenizer=small_tokenizer)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "EXCLUDED 1 failed shard (recorded in meta['excluded']): train/b.jsonl" in run.stdout
    objects = stored_objects(s3_server, s3_prefix)
    _assert_split(objects, "train", small_reference["train"])
    assert list(json.loads(objects["meta.json"])["excluded"]) == ["train/b.jsonl"]
    assert open_uploads(s3_server, s3_prefix) == []


def test_a_kill_9_while_a_failed_shard_s_neighbours_are_kept_then_the_fix_and_rerun_are_exact(
    s3_server, s3_prefix, tmp_path, small_tokenizer
):
    # b fails; a (its segment still gathering), c and d are done: each is kept, its parts to its own keys, then its
    # checkpoint. Killed as the second is kept: a is kept, c and d not. Once b is fixed, the rerun takes a from its
    # kept objects, tokenizes b, c and d, and leaves none of the kept objects.
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    shutil.copyfile(EXAMPLE_TRAIN_FILES[0], data / "a.jsonl.zst")
    bad = write_jsonl(data / "b.jsonl", ["not json", "not json either", "nope"])
    shutil.copyfile(EXAMPLE_TRAIN_FILES[1], data / "c.jsonl.zst")
    shutil.copyfile(EXAMPLE_TRAIN_FILES[0], data / "d.jsonl.zst")
    write_manifest(build_manifest(data.parent), tmp_path / "m.json")
    url = s3_server.url(s3_prefix)
    kill = ("tokpipe.runner.storage.Prefix.keep_shard", 2)
    killed = store_out_run(tmp_path / "m.json", url, kill=kill, tokenizer=small_tokenizer)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert [n for n in stored_objects(s3_server, s3_prefix) if n.startswith("shards/")] == [
        "shards/train/train__a.bin",
        "shards/train/train__a.idx",
        "shards/train/train__a.json",
    ]
    write_jsonl(bad, [json.dumps({"text": "b, fixed"})])
    rerun = store_out_run(tmp_path / "m.json", url, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "4 shards, 1.1 MiB; 1 done, 0 partial, 3 to start" in rerun.stdout
    objects = stored_objects(s3_server, s3_prefix)
    files = [data / name for name in ("a.jsonl.zst", "b.jsonl", "c.jsonl.zst", "d.jsonl.zst")]
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    _assert_split(objects, "train", reference_tokens(files, tokenizer, eos, np.uint16))
    assert not [n for n in objects if n.startswith(("shards/", "segments/")) and n.endswith((".bin", ".idx"))]
    assert open_uploads(s3_server, s3_prefix) == []

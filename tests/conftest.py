"""The suite's fixtures: OUTs built once per session (copy before changing them), the one Ray
cluster that every `tokpipe run` not testing Ray's own start joins, and the one S3 server of the tests of a
corpus on an object store. Helpers and the independent reference are in helpers.py."""

from __future__ import annotations

import compileall
import functools
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_HOLDOUT_FILES,
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    QWEN3,
    QWEN3_EOS,
    SESSION_RAY_ENV,
    SESSION_RAYS,
    Crash,
    S3Server,
    build_out,
    built_once,
    crash_in_batch,
    kill_until_gone,
    plain_copy_of_example,
    reference_by_group,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    session_processes,
    shard_workers,
    store_out_run,
    unguarded,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tokpipe

# tokpipe's bytecode, written once: where Python writes none (PYTHONDONTWRITEBYTECODE=1, as on this project's
# machines) each process a test starts (~300 runs, their Ray workers) compiled tokpipe's source again: 0.91 CPU-s
# a small run, 0.81 with the .pyc files there (8 alternated runs each). Python reads them whatever that says.
compileall.compile_dir(Path(tokpipe.__file__).parent, quiet=2)

# The session's Ray: started by a helper process that holds it (an `address="local"` ray.init, so it
# never joins another Ray on this machine, in a temp dir of its own) and ends it, with every Ray
# process it started, when its stdin closes: at the session's end, or when pytest itself dies. Under
# pytest-xdist each worker is a session of its own, with its own holder, Ray and temp dir; the workers
# of a run are told apart by the temp dir in their environment (helpers.SESSION_RAY_ENV).
RAY_HOLDER = """
import sys, ray
ray.init(address="local", num_cpus=int(sys.argv[2]), include_dashboard=False, object_store_memory=128 << 20,
         _temp_dir=sys.argv[1], configure_logging=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


def _start_ray_holder() -> tuple[subprocess.Popen, str]:
    temp = tempfile.mkdtemp(prefix="tpray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    holder = subprocess.Popen(
        [sys.executable, "-c", RAY_HOLDER, temp, str(os.cpu_count() or 1)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        # A local ray.init turns token authentication on, which drivers joining by address lack. Ray starts a worker
        # per CPU for the first driver's job, the holder's, which runs no task: idle all session, they took ~1 CPU-s a
        # minute together (measured), ~9 CPU-s of each pytest process's session.
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_prestart_worker_first_driver": "0", SESSION_RAY_ENV: temp},
        start_new_session=True,  # every process of its Ray in its session: found at the end, whoever adopted it
    )
    return holder, temp


_ray_holder: list = []  # (holder, temp dir), started once per session


# The files of the longest tests (10-50 s each on 2 loaded cores, --durations), run first: by file name they
# come last, where under pytest-xdist the last of them ran alone while the other worker had nothing left.
LONGEST_FIRST = ("test_errors.py", "test_runner_schedule.py", "test_runner_nodes.py", "test_runner_driver.py")


def pytest_collection_modifyitems(session, config, items):
    """The longest tests first (LONGEST_FIRST, the same order in every xdist worker, as xdist requires). When
    a collected test will join the session's Ray, start it now: it comes up while the tests before the first
    that needs it run. So for the S3 server, first: its credentials in this process's environment before the
    Ray holder starts, whose workers inherit them (a user's nodes read theirs from theirs)."""
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)
    if any("s3_server" in item.fixturenames for item in items) and not _s3_servers:
        _s3_servers.append(_launch_s3_server())
    if any("ray_cluster" in item.fixturenames for item in items) and not _ray_holder:
        _ray_holder.append(_start_ray_holder())


# The session's S3 server (SeaweedFS's weed mini, helpers.S3Server), per xdist worker as the Ray holder is: on
# ports of its own, with a key made for the session, which the environment of this process (and so of every
# `tokpipe` it starts) holds, as the AWS SDKs read it. Ended by its PID at the session's end.
_s3_servers: list[S3Server] = []


def _launch_s3_server() -> S3Server:
    server = S3Server(Path(tempfile.mkdtemp(prefix="tps3-", dir="/tmp")))
    server.launch()
    os.environ.update(server.env)
    return server


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """A real S3 server on 127.0.0.1 with the bucket `tokpipe-tests`; every test puts its objects under a prefix of
    its own (s3_prefix). This process's environment holds its endpoint and key."""
    if not _s3_servers:
        _s3_servers.append(_launch_s3_server())
    _s3_servers[0].ready()
    return _s3_servers[0]


@pytest.fixture
def s3_prefix(s3_server, request) -> str:
    """A prefix of the bucket that no other test writes under."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', request.node.name)[:60]}-{secrets.token_hex(3)}"


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a local Ray with this machine's CPUs (so a run on it gets the workers an embedded Ray
    would), shared by the session: a run joins it in ~1 s instead of starting its own (3-5 s)."""
    if not _ray_holder:
        _ray_holder.append(_start_ray_holder())
    holder, temp = _ray_holder[0]
    ready, _, _ = select.select([holder.stdout], [], [], 180)  # Ray's start, on a loaded machine
    address = holder.stdout.readline().strip() if ready else ""
    assert address, "the session's Ray did not start"
    SESSION_RAYS[address] = temp
    return address


def pytest_sessionfinish(session, exitstatus):
    """The session's Ray, if started, ends with the session: its holder and every process of its session killed
    (SIGKILL), again until none is left (a worker forked meanwhile); not ray.shutdown, which took ~5 s of each
    xdist worker's end. By session, not by the marker in their environment: Ray's agents write their titles over
    theirs, and under xdist both outlived every suite (orphans, for ~6 minutes). So does its S3 server, killed
    (SIGKILL), its data removed."""
    while _s3_servers:
        server = _s3_servers.pop()
        server.kill()
        shutil.rmtree(server.folder, ignore_errors=True)
    while _ray_holder:
        holder, temp = _ray_holder.pop()
        holder.kill()
        holder.wait()
        kill_until_gone(functools.partial(session_processes, holder.pid))
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_address(ray_cluster):
    """The session's Ray, once no shard task of an earlier test (a killed driver's) still runs on it."""
    deadline = time.monotonic() + 30
    while shard_workers("", ray_cluster) and time.monotonic() < deadline:
        time.sleep(0.1)
    return ray_cluster


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE of 600 ids trained here, so the uint16 path is real. eos <|endoftext|>."""
    return built_once(tmp_path_factory, "small_tokenizer0", _train_small_tokenizer)


def _train_small_tokenizer(folder: Path) -> None:
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(reference_texts(EXAMPLE_HOLDOUT_FILES[0]), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="session")
def finished_example(tmp_path_factory) -> Path:
    """A finished OUT of the shipped example with Qwen3 (uint32), built without Ray (fast). Copy before changing it."""
    return built_once(tmp_path_factory, "finished/out", lambda out: build_out(out, QWEN3))


@pytest.fixture(scope="session")
def finished_small(tmp_path_factory, small_tokenizer) -> Path:
    """The same with the 600-id tokenizer: a uint16 OUT. Copy before changing it."""
    return built_once(tmp_path_factory, "finished_small/out", lambda out: build_out(out, small_tokenizer, backend="hf"))


@pytest.fixture(scope="session")
def finished_bos(tmp_path_factory) -> Path:
    """A finished OUT of the example with --bos --bos-token '<|im_start|>' (and EOS). Copy before changing it."""
    from tokpipe.options import RunOptions

    options = RunOptions(bos=True, bos_token="<|im_start|>")
    return built_once(tmp_path_factory, "finished_bos/out", lambda out: build_out(out, QWEN3, options=options))


@pytest.fixture(scope="session")
def finished_grouped(tmp_path_factory) -> Path:
    """A finished OUT of the example with --group-by meta.redpajama_set_name (4 groups a split). Copy before
    changing it."""
    from tokpipe.options import RunOptions

    options = RunOptions(group_by=GROUP_FIELD)
    return built_once(tmp_path_factory, "finished_grouped/out", lambda out: build_out(out, QWEN3, options=options))


@pytest.fixture(scope="session")
def grouped_reference() -> dict[str, dict[str, tuple]]:
    """The example's groups by meta.redpajama_set_name, per split stem: group -> (tokens, documents, text bytes)."""
    tokenizer = QWEN3 / "tokenizer.json"
    return {
        stem: reference_by_group(files, tokenizer, GROUP_FIELD, QWEN3_EOS)
        for stem, files in (("train", EXAMPLE_TRAIN_FILES), ("val", EXAMPLE_HOLDOUT_FILES))
    }


@pytest.fixture(params=["in a folder", "on a store"])
def finished_either(request) -> str:
    """A finished OUT of the example in a folder (the test's own copy) or on the session's S3 server (shared: readers
    only): what a reader does alike on both."""
    return str(request.getfixturevalue("out" if request.param == "in a folder" else "finished_stored"))


@pytest.fixture
def out(finished_example, tmp_path) -> Path:
    """A copy of finished_example that a test may damage."""
    copy = tmp_path / "out"
    shutil.copytree(finished_example, copy)
    return copy


@pytest.fixture
def small_out(finished_small, tmp_path) -> Path:
    """A copy of finished_small that a test may damage."""
    copy = tmp_path / "out"
    shutil.copytree(finished_small, copy)
    return copy


@pytest.fixture(scope="session")
def killed_example(tmp_path_factory) -> Path:
    """An OUT as `kill -9` leaves it mid-run: the first train shard done, the second partial (with bytes
    written after its last checkpoint), the validation shard never started; run with --workers 2
    --checkpoint-interval 1. Copy before changing it."""
    return built_once(tmp_path_factory, "killed/out", _kill_example)


def _kill_example(out: Path) -> None:
    from tokpipe.inputs.manifest import build_manifest, write_manifest
    from tokpipe.inputs.tokenizer import load_tokenizer_info
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import encode_spec, record_run
    from tokpipe.write.shard import tokenize_shard

    out.mkdir()
    manifest = build_manifest(EXAMPLE_CACHE)
    info = load_tokenizer_info(QWEN3)
    record_run(out, manifest, info, RunOptions(workers=2, checkpoint_interval=1.0))
    write_manifest(manifest, out / "manifest.json")
    spec = unguarded(encode_spec(RunOptions(), info, "gigatoken"), batch_bytes=64 << 10, checkpoint_interval=0.0)
    first, second, *_ = manifest.shards()
    tokenize_shard(first, out, spec)
    with pytest.raises(Crash):
        tokenize_shard(second, out, spec, on_batch=crash_in_batch(3))


@pytest.fixture(scope="session")
def example_reference(tmp_path_factory) -> dict[str, np.ndarray]:
    """The reference tokens of the shipped example, per output file stem (train, val): encoded once for the
    run (4-5 s of `tokenizers` on 2 loaded cores, which each xdist worker paid)."""
    folder = built_once(tmp_path_factory, "example_reference", _encode_example_reference)
    return {stem: np.load(folder / f"{stem}.npy") for stem in ("train", "val")}


def _encode_example_reference(folder: Path) -> None:
    folder.mkdir()
    np.save(folder / "train.npy", reference_tokens(EXAMPLE_TRAIN_FILES, QWEN3 / "tokenizer.json", QWEN3_EOS))
    np.save(folder / "val.npy", reference_tokens(EXAMPLE_HOLDOUT_FILES, QWEN3 / "tokenizer.json", QWEN3_EOS))


@pytest.fixture(scope="session")
def small_reference(small_tokenizer) -> dict[str, np.ndarray]:
    """The same with the 600-id tokenizer (uint16), for the runs whose subject is not Qwen3: such a run starts
    in 0.6 CPU-s where Qwen3's takes 2.2 (loading it twice and its backend check)."""
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    return {
        "train": reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, eos, np.uint16),
        "val": reference_tokens(EXAMPLE_HOLDOUT_FILES, tokenizer, eos, np.uint16),
    }


@pytest.fixture
def dataset(tmp_path) -> Path:
    """The example's shards as a plain folder that a test may change."""
    return plain_copy_of_example(tmp_path / "data")


@pytest.fixture
def manifest(dataset, tmp_path) -> Path:
    """A manifest of `dataset`."""
    from tokpipe.inputs.manifest import build_manifest, write_manifest

    path = tmp_path / "m.json"
    write_manifest(build_manifest(dataset), path)
    return path


@pytest.fixture(scope="session")
def unfinished_stored(s3_server, tmp_path_factory, small_tokenizer) -> str:
    """The URL of an OUT of the example (600-id tokenizer) on the session's S3 server as a run killed (SIGKILL) as its
    finish began leaves it: every shard done and checkpointed, its tokens in segments, no split file, no meta. Readers
    only."""
    from tokpipe.inputs.manifest import build_manifest, write_manifest

    manifest = tmp_path_factory.mktemp("unfinished-stored") / "example.json"
    write_manifest(build_manifest(EXAMPLE_CACHE), manifest)
    url = s3_server.url(f"unfinished-stored-{secrets.token_hex(3)}")
    killed = store_out_run(manifest, url, kill=("tokpipe.write.finalize.compose_split", 1), tokenizer=small_tokenizer)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    return url


@pytest.fixture(scope="session")
def finished_stored(s3_server, tmp_path_factory) -> str:
    """The URL of a finished OUT of the example on the session's S3 server (`tokpipe run --out s3://...`). Readers
    only: a test that changes it makes its own."""
    from tokpipe.inputs.manifest import build_manifest, write_manifest

    manifest = tmp_path_factory.mktemp("stored") / "example.json"
    write_manifest(build_manifest(EXAMPLE_CACHE), manifest)
    url = s3_server.url(f"finished-stored-{secrets.token_hex(3)}")
    run = store_out_run(manifest, url)
    assert run.returncode == 0, run.stdout + run.stderr
    return url

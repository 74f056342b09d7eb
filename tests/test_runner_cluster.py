"""runner/cluster: as many workers as the machine (or the cluster) has CPUs for and memory for, said
in one line; `--text-field` checked against the data before anything is tokenized; a run leaves no
process of its own behind."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    REPO,
    RayNodes,
    assert_out_is,
    bind_mount,
    cli,
    plain_copy_of_example,
    run_args,
    tokpipe,
    write_jsonl,
)

from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.options import RunOptions
from tokpipe.runner import cluster
from tokpipe.runner.cluster import available_cpus, fit_workers
from tokpipe.runner.sample import CHAT_TURNS

GIB = 1 << 30


def test_workers_are_capped_by_the_cpus_and_by_their_memory():
    assert fit_workers(None, 16, 64 * GIB, 768, cluster=False) == (16, "")
    assert fit_workers(2, 1, 64 * GIB, 768, cluster=True) == (
        1,
        "--workers 2 is more than the 1 CPU of the cluster: running 1",
    )
    assert fit_workers(128, 2, 64 * GIB, 768, cluster=False) == (
        2,
        "--workers 128 is more than the 2 CPUs this process may use (its CPU affinity and cgroup quota): running 2",
    )
    # 128 workers of 768 MiB on a 64 GiB machine: 96 GiB asked for.
    assert fit_workers(128, 128, 64 * GIB, 768, cluster=False) == (
        85,
        "128 workers x --worker-memory 768 MiB do not fit the 64.0 GiB Ray can use here: running 85",
    )
    assert fit_workers(300, 256, 100 * GIB, 768, cluster=True) == (
        133,
        "--workers 300 is more than the 256 CPUs of the cluster: running 256; "
        "256 workers x --worker-memory 768 MiB do not fit the 100.0 GiB Ray can use in the cluster: running 133",
    )


def test_available_cpus_follow_affinity_and_the_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(cluster, "_cgroup", lambda v2, v1: None)
    assert available_cpus() == 8
    monkeypatch.setattr(cluster, "_cgroup", lambda v2, v1: ["250000", "100000"] if v2 == "cpu.max" else None)
    assert available_cpus() == 3  # Slurm --cpus-per-task=2.5, or a container's --cpus
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert available_cpus() == 2


def test_more_workers_than_cpus_run_with_the_cpus_and_say_so(tmp_path, small_tokenizer, small_reference):
    write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), tmp_path / "m.json")
    result = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out", "--workers", "128", tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    cpus = len(os.sched_getaffinity(0))
    assert (
        f"--workers 128 is more than the {cpus} CPUs this process may use (its CPU affinity and cgroup quota):"
        f" running {cpus}" in result.stdout.splitlines()
    )
    assert_out_is(tmp_path / "out", small_reference)


def test_a_text_field_no_document_has_stops_the_run_before_tokenizing(tmp_path, small_tokenizer):
    lines = [json.dumps({"content": f"def f{i}(): pass", "lang": "python"}) for i in range(3)]
    write_jsonl(tmp_path / "data" / "train" / "code.jsonl", lines)
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    result = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "tokpipe run: error: no document has a 'text' field in the first lines of each split's first shard;"
        " their fields: content, lang: pass --text-field NAME (e.g. --text-field content)"
    )
    assert not list((tmp_path / "out").glob("shards/*/*.json"))  # nothing tokenized
    # A text nested in an object: the object is no field to suggest (naming it, the run was refused again, each
    # line's "text" not a string).
    write_jsonl(tmp_path / "data" / "train" / "code.jsonl", [json.dumps({"doc": {"body": "hello"}, "n": 1})])
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    nested = cli(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert (nested.returncode, nested.stderr) == (
        2,
        "tokpipe run: error: no document has a 'text' field in the first lines of each split's first shard, and none"
        " of their fields (doc, n) holds text at a document's top level, which --text-field names: move the text up"
        f" (e.g. with `datasets`' map), into a dataset of its own; {CHAT_TURNS}\n",
    )
    # A chat dataset: its id is no text to suggest (a run of it made a corpus of ids, exit 0), nor its turns.
    chat = [json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "hi there"}]}) for i in range(3)]
    write_jsonl(tmp_path / "data" / "train" / "code.jsonl", chat)
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    for field, said in (
        (
            "text",
            "no document has a 'text' field in the first lines of each split's first shard, and none of their"
            " fields (id, messages) holds text at a document's top level",
        ),
        (
            "messages",
            "the 'messages' field holds no text (a string) in the first lines of each split's first shard:"
            " tokpipe tokenizes a string a document",
        ),
    ):
        refused = cli(
            *run_args(tmp_path / "m.json", tmp_path / "out", "--text-field", field, tokenizer=small_tokenizer)
        )
        assert refused.returncode == 2 and refused.stderr.startswith(f"tokpipe run: error: {said}"), refused.stderr
        assert refused.stderr.endswith(f"; {CHAT_TURNS}\n")
    # A short sentence without spaces is text all the same, where it is not ASCII.
    cjk = [json.dumps({"id": "s1", "sentence": "我们试试看！", "lang": "cmn"}, ensure_ascii=False)]
    write_jsonl(tmp_path / "data" / "train" / "code.jsonl", cjk)
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    refused = cli(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert refused.stderr.endswith(": pass --text-field NAME (e.g. --text-field sentence)\n"), refused.stderr
    # A chat dataset with its prompt beside its turns (HuggingFaceH4/ultrachat_200k's columns), JSON Lines or Parquet:
    # the prompt is suggested, and the turns, which hold most of its text, are named (a run of the prompt alone left
    # them out without a word).
    prompt = "Write a haiku about the sea, please."
    turns = [{"content": prompt, "role": "user"}, {"content": "Waves fold into foam.", "role": "assistant"}]
    ultrachat = {"prompt": [prompt], "prompt_id": ["9f2c41"], "messages": [turns]}
    write_jsonl(tmp_path / "data" / "train" / "code.jsonl", [json.dumps({k: v[0] for k, v in ultrachat.items()})])
    (tmp_path / "parquet" / "data").mkdir(parents=True)
    pq.write_table(pa.table(ultrachat), tmp_path / "parquet" / "data" / "train-00000-of-00001.parquet")
    for data in ("data", "parquet"):
        write_manifest(build_manifest(tmp_path / data), tmp_path / "m.json")
        refused = cli(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
        assert refused.stderr == (
            "tokpipe run: error: no document has a 'text' field in the first lines of each split's first shard; their"
            " fields: messages, prompt, prompt_id: pass --text-field NAME (e.g. --text-field prompt); messages holds"
            f" lists of texts: {CHAT_TURNS}\n"
        ), data
    assert not list((tmp_path / "out").glob("shards/*/*.json"))


def test_a_shard_mostly_without_the_text_field_is_named(tmp_path, small_tokenizer):
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", [json.dumps({"text": "prose here"})] * 4)
    write_jsonl(tmp_path / "data" / "train" / "b.jsonl", [json.dumps({"content": "x = 1"})] * 3 + ['{"text": "y"}'])
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    result = tokpipe(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    assert (
        "NOTE: 1 shard has no 'text' field on most lines (e.g. train/b.jsonl: 3 of 4 lines):"
        " is --text-field right for them?" in result.stdout.splitlines()
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_finished_run_leaves_no_process_behind_nor_a_file_in_a_home_it_cannot_write(tmp_path, small_tokenizer):
    # Ray (2.59 on) writes a token to ~/.ray/auth_token for a local instance where none is: a read-only home (a
    # compute node's, a container's) stopped its start ("Ray did not start (OSError: [Errno 30] Read-only file
    # system: '/home/.../.ray')").
    write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), tmp_path / "m.json")
    args = run_args(tmp_path / "m.json", tmp_path / "out", "--ray-only", tokenizer=small_tokenizer)
    command = [sys.executable, "-m", "tokpipe.cli", *map(str, args)]
    (tmp_path / "empty").mkdir()
    with bind_mount(tmp_path / "empty", tmp_path / "home", read_only=True) as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
        # A fresh session: every process the run starts carries its session id, whoever adopts it.
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env
        )
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()
    assert "ray: embedded local instance" in stdout.decode() and not os.listdir(tmp_path / "empty")
    left = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = open(f"/proc/{entry.name}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == proc.pid and fields[0] != "Z":  # its session
                left.append(stat[: stat.rindex(")") + 1])
    assert left == []


def test_the_private_ray_that_tokpipe_touches_is_there_in_the_pinned_version():
    """pyproject pins ray to the versions tokpipe was tested with, because tokpipe reaches past Ray's public
    API in four places (runner/cluster.py, runner/task.py). A Ray without one of them fails here, loudly,
    rather than in a run: SIGTERM printing Ray's stack again, or ray.init failing in its thread."""
    import importlib.metadata
    import inspect
    import re

    import ray
    import ray._private.node
    import ray._private.utils
    import ray._private.worker
    from packaging.requirements import Requirement

    pin = Requirement(re.search(r'^    "(ray[<>=].*)",$', (REPO / "pyproject.toml").read_text(), re.M)[1])
    assert pin.specifier.contains(importlib.metadata.version("ray")), f"ray {ray.__version__} is not in {pin}"

    # Cluster._start replaces this function; ray.init's Node and worker look it up on the module when they
    # call it, so the replacement is what they call (from a thread, where the original raises ValueError).
    assert list(inspect.signature(ray._private.utils.set_sigterm_handler).parameters) == ["sigterm_handler"]
    for module in (ray._private.node, ray._private.worker):
        assert "ray._private.utils.set_sigterm_handler(sigterm_handler)" in inspect.getsource(module)
    # The switch Cluster._start sets before Ray's import, as Ray reads it.
    read = subprocess.run(
        [sys.executable, "-c", "import ray._private.ray_constants as c; print(c.RAY_DISABLE_FAILURE_SIGNAL_HANDLER)"],
        env={**os.environ, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"},
        capture_output=True,
        text=True,
    )
    assert read.stdout == "True\n", read.stderr
    # The shard tasks' process titles (`ps`, and the tests' worker killers, find workers by them).
    assert callable(ray._raylet.setproctitle)
    # RayLines._route replaces this function: the driver's thread that prints the errors the cluster
    # publishes looks it up on the module when it calls it.
    assert list(inspect.signature(ray._private.worker.print_to_stdstream).parameters) == ["data", "ignore_prefix"]
    assert "print_to_stdstream(" in inspect.getsource(ray._private.worker.listen_error_messages)


def test_ray_that_does_not_start_is_one_line_saying_what_ray_said(tmp_path, small_tokenizer):
    # TMPDIR on a full tmpfs: Ray's GCS cannot write the file with its port, which ray.init waits for (30 s; Ray's
    # own switch makes it 3 here) and then says only that. The run says Ray did not start, what Ray said, and the
    # temp folder's free space; before, it exited 1 with nothing printed.
    full = Path(tempfile.mkdtemp(prefix="tpfull-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True).returncode:
        full.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with open(full / "filler", "wb") as f:
            with contextlib.suppress(OSError):  # ENOSPC: full
                f.write(bytes(2 << 20))
        write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), tmp_path / "m.json")
        command = [sys.executable, "-m", "tokpipe.cli", *map(str, run_args(tmp_path / "m.json", tmp_path / "out"))]
        env = {**os.environ, "TMPDIR": str(full), "RAY_gcs_server_port_wait_time_s": "3"}
        env.pop("RAY_ADDRESS", None)
        result = subprocess.run([*command, "--ray-only"], capture_output=True, text=True, timeout=300, env=env)
    finally:
        subprocess.run(["umount", "-l", str(full)])
        full.rmdir()
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.fullmatch(
        rf"tokpipe run: error: Ray did not start \(RuntimeError: Timed out waiting for file {full}/ray/session_\S+"
        rf"/gcs_server_port_[0-9a-f]+\); its temp folder {full} has 0\.0 kB free \(RAY_TMPDIR moves it\): fix the"
        r" cause and rerun the same command",
        result.stderr.splitlines()[-1],
    ), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("listener", ["none", "http"])
def test_an_address_where_ray_does_not_answer_is_one_line_at_once(tmp_path, small_tokenizer, listener):
    # A typo in --address, a dashboard's port (HTTP): Ray's client tried each 20 times, ~40 s a try holding the GIL,
    # 14 minutes without a word; a Ctrl-C or SIGTERM waited for it. (A port that takes connections and says nothing
    # is told so after 10 s.)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{server.getsockname()[1]}"
        if listener == "http":
            server.listen()
            answer = threading.Thread(target=lambda: server.accept()[0].sendall(b"HTTP/1.0 400 Bad request\r\n\r\n"))
            answer.start()
        write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), tmp_path / "m.json")
        args = run_args(
            tmp_path / "m.json", tmp_path / "out", "--address", address, "--ray-only", tokenizer=small_tokenizer
        )
        result = tokpipe(*args, timeout=120)
    said = {
        "none": f"nothing answers at {address}: Connection refused",
        "http": f"what answers at {address} is not Ray (a dashboard's port?): a cluster's address is its head's GCS"
        " port, 6379 unless `ray start --head --port` said another",
    }[listener]
    assert (result.returncode, result.stderr.splitlines()[-1]) == (
        1,
        f"tokpipe run: error: could not join the Ray cluster at {address} (ConnectionError: {said}): is it up (`ray"
        " status`)? Then rerun",
    )


def test_a_cluster_that_asks_for_its_token_says_so_and_its_token_joins_it(tmp_path, small_tokenizer, small_reference):
    # Ray 2.59 on: `ray start --head` where a token is (a ray.init() leaves one in ~/.ray/auth_token) turns token
    # authentication on, and a driver given an address sends none unless RAY_AUTH_MODE=token (Ray's rule): the run
    # said "Failed to connect to Ray cluster at ...: is it up (`ray status`)?", after 20 s of Ray's tries.
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    write_manifest(build_manifest(plain_copy_of_example(tmp_path / "data")), tmp_path / "m.json")
    nodes = RayNodes(tmp_path)
    nodes.env |= {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}  # a cluster's nodes each hold its token
    with nodes:
        nodes.add("d3" * 28, "127.0.0.2")
        args = run_args(tmp_path / "m.json", tmp_path / "out", "--address", nodes.address, tokenizer=small_tokenizer)
        env = {"HOME": str(tmp_path), "RAY_AUTH_MODE": None, "RAY_gcs_server_port_wait_time_s": "1"}  # one try
        refused = tokpipe(*args, "--ray-only", env=env)
        assert refused.returncode == 1 and refused.stderr.splitlines()[-1] == (
            f"tokpipe run: error: could not join the Ray cluster at {nodes.address}: it asks for its token (Ray's token"
            " authentication: a `ray start` turns it on where a token is, as a ray.init() leaves one in"
            " ~/.ray/auth_token), and this run sent none: run with RAY_AUTH_MODE=token and the cluster's token (`ray"
            " get-auth-token` on its head) in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, then rerun"
        ), refused.stderr
        joined = tokpipe(*args, "--ray-only", env=env | {"RAY_AUTH_MODE": "token"})
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert_out_is(tmp_path / "out", small_reference)


def test_a_run_that_its_head_watch_ends_saves_its_stop_note_where_out_s_readers_look(monkeypatch, tmp_path):
    # The CLI's process ends there at once (os._exit): on a store, OUT's logs are uploaded first (Storage.save_logs),
    # or `tokpipe status s3://...` on any machine said "killed or crashed", the note left in the driver's folder.
    said = []
    monkeypatch.setattr(cluster, "_kill_descendants", lambda: said.append("Ray's processes killed"))
    monkeypatch.setattr(cluster.os, "_exit", lambda code: said.append(f"exit {code}"))
    ray = cluster.Cluster(RunOptions(), exits_after=True)
    ray.log_to(tmp_path / "ray.log", said.append, lambda: said.append("logs saved"))
    ray._head_lost("Ray's head (its GCS at 10.0.0.1:6379) has taken no connection for 30 s")
    assert said == [
        "stopped: Ray's head (its GCS at 10.0.0.1:6379) has taken no connection for 30 s",
        "logs saved",
        "Ray's processes killed",
        "exit 1",
    ]


# Ray's logger writes to the stderr object of its import, fd 2: OUT/logs/ray.log once RayLines routes it. /dev/full
# stands for OUT's disk full.
FULL_RAY_LOG = """
import logging, sys
from pathlib import Path
from tokpipe.runner.cluster import RayLines
logging.getLogger("ray").addHandler(logging.StreamHandler(sys.stderr))
lines = RayLines()
lines.path = Path("/dev/full")
lines.open()
logging.getLogger("ray").error("Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): ...")
"""


def test_a_line_ray_cannot_write_to_a_full_disk_is_no_traceback_on_the_terminal():
    # A CI run of the full-disk test on Ray ended with logging's own traceback of the ENOSPC ("--- Logging error ---").
    ran = subprocess.run([sys.executable, "-c", FULL_RAY_LOG], capture_output=True, text=True)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "", "")

"""runner/nodes: with --address, every node must see the shards, the tokenizer and OUT at the driver's
paths. What a node checks, one path at a time; then a real two-node cluster on this machine whose
second node runs in a mount namespace of its own, with a tmpfs over OUT's parent folder (a node-local
disk at the same path): the run refuses before any shard is tokenized, in one line naming the node and
the path, and a node that joins mid-run stops the run with the same line at its first shard."""

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    LOSE_NODE_SITE,
    QWEN3,
    RAY_HEAD_PORTS,
    RayNodes,
    can_make_mount_namespaces,
    checkpoints,
    gate_env,
    kill_9,
    kill_until_gone,
    open_uploads,
    repeated_example,
    repeated_reference,
    run_args,
    session_processes,
    start,
    stored_objects,
    tokpipe,
    wait_for,
    write_jsonl,
)

from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.files import Layout
from tokpipe.runner import nodes
from tokpipe.runner.nodes import NodeCheck, unseen
from tokpipe.runner.storage import storage_of


def test_a_node_checks_out_the_tokenizer_and_a_shard_of_each_folder(tmp_path, monkeypatch):
    data = tmp_path / "data"
    for name in ("a/1", "a/2", "b/1", "b/2", "c/1"):
        write_jsonl(data / "train" / f"{name}.jsonl", ['{"text": "hello"}'] * int(name[-1]))
    manifest = build_manifest(data)
    shutil.copytree(QWEN3, tmp_path / "tok")
    info = load_tokenizer_info(tmp_path / "tok")
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    monkeypatch.setattr(nodes, "SAMPLE", 2)  # every second shard of five
    monkeypatch.setattr(nodes, "MAX_FOLDERS", 2)  # the first shard of every second folder of three
    check = NodeCheck.of(manifest, info, out)
    shard = {name: (str(data / "train" / f"{name}.jsonl"), 18) for name in ("a/1", "b/1", "c/1")}
    assert check.shards == (shard["a/1"], shard["c/1"], shard["b/1"])  # folders a and c, then shards 0, 2, 4
    assert (check.out, check.tokenizer, check.tokenizer_sha256) == (str(out), info.path, info.sha256)

    Layout(out).node_check().write_text(check.token)  # what the driver writes
    assert unseen(check, "n1") is None
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["node-check.txt"]  # the node's own file removed

    Layout(out).node_check().write_text("another run's token")  # a folder of the node's own at OUT's path
    assert unseen(check, "n1") == (
        f"sees another folder at OUT {out} than the driver's (without this run's node-check.txt)"
    )
    Layout(out).node_check().write_text(check.token)
    Layout(out).node_check("n1").mkdir()  # its write fails
    assert unseen(check, "n1") == f"cannot write under OUT {out} (Is a directory)"
    Layout(out).node_check("n1").rmdir()
    out.rename(tmp_path / "elsewhere")
    assert unseen(check, "n1") == f"cannot see OUT {out} (No such file or directory)"
    (tmp_path / "elsewhere").rename(out)

    tokenizer = Path(info.path)
    original = tokenizer.read_bytes()
    tokenizer.write_bytes(original + b" ")
    theirs = hashlib.sha256(original + b" ").hexdigest()
    assert unseen(check, "n1") == (
        f"sees another tokenizer at {tokenizer} (sha256 {theirs[:16]}, not the run's {info.sha256[:16]})"
    )
    tokenizer.unlink()
    assert unseen(check, "n1") == f"cannot read the tokenizer {tokenizer} (No such file or directory)"
    tokenizer.write_bytes(original)

    Path(shard["c/1"][0]).write_text("")  # truncated
    assert unseen(check, "n1") == f"sees the shard {shard['c/1'][0]} with 0 bytes, not the driver's 18"
    (data / "train" / "c").rename(tmp_path / "c")  # a folder not mounted there
    assert unseen(check, "n1") == f"cannot read the shard {shard['c/1'][0]} (No such file or directory)"

    # The shards at the size the driver sees when the run starts, not the manifest's: one fixed since (a cut download
    # fetched again) at its new size; one the driver cannot see (a driver with --ray-only need not) at the manifest's.
    Path(shard["a/1"][0]).write_text('{"text": "hello again"}\n')
    again = NodeCheck.of(manifest, info, out)
    assert again.shards == ((shard["a/1"][0], 24), shard["c/1"], shard["b/1"])
    (tmp_path / "c").rename(data / "train" / "c")
    Path(shard["c/1"][0]).write_text('{"text": "hello"}\n')  # as listed
    Layout(out).node_check().write_text(again.token)
    assert unseen(again, "n1") is None


def test_a_node_that_runs_another_tokpipe_is_named_before_it_takes_a_shard(tmp_path):
    """Tasks and their results pass between the driver and the nodes pickled, by module and class name: a node with
    another tokpipe (a class moved) failed each placing call, made again for good. A node is a process here, its
    tokpipe a copy of this one's, as installed elsewhere: the same code passes, a line changed does not."""
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", ['{"text": "hello"}'])
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    check = NodeCheck.of(build_manifest(tmp_path / "data"), load_tokenizer_info(QWEN3), out)
    Layout(out).node_check().write_text(check.token)
    node = (
        "import pickle, sys; from tokpipe.runner import nodes; print(nodes.unseen(pickle.load(sys.stdin.buffer), 'n1'))"
    )
    said = {}
    for version in ("the same", "another"):
        install = tmp_path / version.replace(" ", "-")
        shutil.copytree(
            Path(nodes.__file__).parents[1], install / "tokpipe", ignore=shutil.ignore_patterns("__pycache__")
        )
        if version == "another":
            with open(install / "tokpipe" / "layout" / "stored.py", "a") as f:
                f.write("# a line of another version\n")
        env = {**os.environ, "PYTHONPATH": str(install)}  # (from tmp_path: -c puts the current folder first)
        command = [sys.executable, "-c", node]
        child = subprocess.run(command, input=pickle.dumps(check), env=env, cwd=tmp_path, capture_output=True)
        assert child.returncode == 0, child.stderr.decode()
        said[version] = child.stdout.decode().strip()
    assert said["the same"] == "None"
    other = rf"runs another tokpipe than the driver \({re.escape(str(install / 'tokpipe'))}: sha256 [0-9a-f]{{16}}, not"
    assert re.fullmatch(rf"{other} the driver's {check.code[:16]}\)", said["another"]), said["another"]
    assert nodes.refusal([f"node 10.0.0.7 (ab) {said['another']}"], storage_of(out)).endswith(
        ": every node must run the driver's tokpipe (the same install), and rerun the same command"
    )


def test_a_node_whose_encoder_or_reader_libraries_are_not_the_driver_s_is_named(tmp_path):
    # The driver checked its encoder against `tokenizers` on a sample; a node's other fastokens (or tokenizers, or
    # reader of the text) could write other ids. A node here is the driver's check with another version in it.
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", ['{"text": "hello"}'])
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    check = NodeCheck.of(build_manifest(tmp_path / "data"), load_tokenizer_info(QWEN3), out)
    Layout(out).node_check().write_text(check.token)
    assert [name for name, _ in check.libraries] == list(nodes.LIBRARIES) and unseen(check, "n1") is None
    version = dict(check.libraries)["fastokens"]
    other = tuple((name, "0.0.1" if name == "fastokens" else v) for name, v in check.libraries)
    assert unseen(replace(check, libraries=other), "n1") == (
        f"runs another tokpipe than the driver (fastokens {version}, not the driver's 0.0.1)"
    )


def test_threads_of_one_worker_that_check_a_node_at_once_all_pass(tmp_path, monkeypatch):
    # A Placer runs two calls at once in one process; on a node the driver's probe missed, each checks it. With
    # one file per process, one thread removed the file the other had just written: "cannot write under OUT".
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", ['{"text": "hello"}'])
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    check = NodeCheck.of(build_manifest(tmp_path / "data"), load_tokenizer_info(QWEN3), out)
    Layout(out).node_check().write_text(check.token)
    monkeypatch.setattr(nodes.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "n1"))
    for _ in range(20):
        nodes._passed.clear()
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda _: nodes.ensure_seen(check), range(8))) == [None] * 8
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["node-check.txt"]


# -- a cluster whose second node does not see OUT ---------------------------------------------------------

HF = ("--backend", "hf")  # no backend check to wait for: seconds per run on a busy machine
# The runs use the 600-id tokenizer (small_tokenizer): Qwen3's load is ~1.8 CPU-s a run, and not the subject.


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _start_head(address: str, temp: str, env: dict, cpus: int, sessions: list[int]) -> None:
    """A Ray head at `address` on 127.0.0.1, started (`ray start --head`) in a session of its own, added to
    `sessions` before it is waited for: every process of the cluster is found at the end, and stopped."""
    ray = str(Path(sys.executable).parent / "ray")
    head = [ray, "start", "--head", "--port", address.split(":")[1], "--node-ip-address", "127.0.0.1"]
    head += ["--num-cpus", str(cpus), "--include-dashboard", "false", "--temp-dir", temp, "--disable-usage-stats"]
    first = subprocess.Popen(head, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    sessions.append(first.pid)
    assert first.wait(timeout=120) == 0, first.stdout.read()


def _stop(run, sessions: list[int], temp: str, node: subprocess.Popen | None = None) -> None:
    """A run still going killed (kill -9), every process of the cluster's sessions too (its nodes', their workers'),
    a node started here reaped, and the cluster's temp folder removed."""
    if run is not None and run.poll() is None:
        kill_9(run)
    kill_until_gone(lambda: [pid for session in sessions for pid in session_processes(session)])
    if node is not None:
        node.wait()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.skipif(not can_make_mount_namespaces(), reason="needs root and unshare -m")
def test_with_address_a_node_that_cannot_see_out_stops_the_run_naming_node_and_path(tmp_path, small_tokenizer):
    # A folder of the same name on the second node's own disk: a tmpfs over OUT's parent, in its namespace.
    node_local = tmp_path / "node-local"
    node_local.mkdir()
    write_jsonl(tmp_path / "data" / "train" / "a.jsonl", ['{"text": "one document"}'] * 3)
    write_jsonl(tmp_path / "data" / "train" / "b.jsonl", ['{"text": "another"}'] * 3)
    write_manifest(build_manifest(tmp_path / "data"), tmp_path / "m.json")
    node_id = "ab" * 28  # Ray's testing hook names the second node, for the exact line
    blind = f"node 127.0.0.2 ({node_id}) cannot see OUT"
    advice = (
        ": every node must see the shards, the tokenizer and OUT at the driver's paths (storage they all mount"
        " alike); mount it there or take the node out of the cluster, and rerun the same command"
    )
    # A head with no CPUs (as large clusters run theirs): a shard waits for a node that has some.
    with RayNodes(tmp_path) as cluster:
        # A node that joins mid-run was not probed at the start: it checks itself at its first shard.
        late_out = node_local / "late"
        late = start(tmp_path / "m.json", late_out, *HF, ray=cluster.address, tokenizer=small_tokenizer)
        probed = late_out / "logs" / "run.log"
        wait_for(lambda: "node check: 1 node sees" in _text(probed), run=late)
        second = cluster.add(node_id, "127.0.0.2", blind=node_local)
        assert late.wait(timeout=180) == 2, late.log.read_text()
        output = late.log.read_text().splitlines()
        assert output[-1] == f"tokpipe run: error: {blind} {late_out} (No such file or directory){advice}"
        assert not any(line.startswith(("FAILED", "Traceback")) for line in output), output
        assert checkpoints(late_out) == []

        # With that node in the cluster from the start, the run refuses before any shard is tokenized.
        out = node_local / "out"
        refused = tokpipe(
            *run_args(tmp_path / "m.json", out, "--address", cluster.address, *HF, tokenizer=small_tokenizer)
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.splitlines() == [f"tokpipe run: error: {blind} {out} (No such file or directory){advice}"]
        assert not (out / "shards").exists()
        assert session_processes(second)  # the node was there all along


@pytest.mark.skipif(not can_make_mount_namespaces(), reason="needs root and unshare -m")
def test_on_a_store_a_node_that_shares_no_file_system_is_lost_mid_run_and_the_bytes_are_the_reference(
    tmp_path, s3_server, s3_prefix
):
    # The corpus and OUT on the store; the manifest and the tokenizer in tmp_path, which the second node does not
    # see (a tmpfs over it in its mount namespace): the store is all the two nodes share, but the code.
    copies = 8  # 13 MB of tokens: 9 shards, gathered by four into segments (S3's 5 MiB parts)
    corpus = s3_server.upload(repeated_example(tmp_path / "data", copies), f"{s3_prefix}/data")
    assert tokpipe("manifest", "--dataset-dir", corpus, "-o", tmp_path / "m.json").returncode == 0
    shutil.copytree(QWEN3, tmp_path / "tok")
    url = s3_server.url(f"{s3_prefix}/out")
    ray = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="tpnodes-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # The second node is lost in its first shard (LOSE_NODE_SITE in its processes, from outside tmp_path, which it
    # does not see: at its 3rd batch of ~6 a shard). Not later: lost at its 10th batch, the node was not lost at all in
    # 2 of 9 runs under load (CI once): the run had ended first.
    (Path(temp) / "site").mkdir()
    (Path(temp) / "site" / "sitecustomize.py").write_text(LOSE_NODE_SITE)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    lose = {"TOKPIPE_TESTS_LOSE_NODE_AT": "tokpipe.write.shard.ShardWriter._encode:3", "PYTHONPATH": f"{temp}/site"}
    # The head begins no shard before the second node has begun one (LOSE_NODE_SITE's gate): left to Ray, the head
    # once took all 25 and the node was never lost.
    gate = Path(temp) / "shut"
    lose |= gate_env(gate, "opens")
    waits = gate_env(gate, "waits") | {"PYTHONPATH": f"{temp}/site"}
    address = f"127.0.0.1:{random.randint(*RAY_HEAD_PORTS)}"
    run = second = None
    sessions = []
    try:
        _start_head(address, temp, {**env, **waits}, 1, sessions)
        inner = (
            f"mount -t tmpfs none {tmp_path} && exec {ray} start --address {address} --node-ip-address 127.0.0.2"
            " --num-cpus 1 --block"
        )
        second = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", "-c", inner],
            env={**env, **lose},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        sessions.append(second.pid)
        # Joined before the run starts, which fits its workers to the CPUs it finds.
        assert any("Ray runtime started" in line for line in second.stdout), "the second node did not start"
        # --ray-only: every shard on the nodes' workers, none in the driver, which could leave the second node few.
        args = ("--workers", "2", "--ray-only")
        gate.touch()
        run = start(tmp_path / "m.json", url, *args, ray=address, tokenizer=tmp_path / "tok", logs=tmp_path)
        assert run.wait(timeout=600) == 0, run.log.read_text()
        assert not gate.exists()  # the second node began a shard
        objects = stored_objects(s3_server, f"{s3_prefix}/out")
        terminal = run.log.read_text()
        said = terminal + objects["logs/run.log"].decode()  # the latter: which node assembled what
        assert re.search(r"^ray: node 127\.0\.0\.2 \S+ lost: ", terminal, re.M), said
        for stem, expected in repeated_reference(copies).items():
            assert np.array_equal(np.frombuffer(objects[f"{stem}.bin"], dtype=np.uint32), expected), stem
        assert open_uploads(s3_server, f"{s3_prefix}/out") == []
    finally:
        _stop(run, sessions, temp, second)


def test_on_a_store_a_node_checks_out_with_its_own_credentials(s3_server, s3_prefix):
    manifest = build_manifest(EXAMPLE_CACHE)
    url = s3_server.url(f"{s3_prefix}/out")
    check = NodeCheck.of(manifest, load_tokenizer_info(QWEN3), url)
    token = f"{s3_prefix}/out/logs/node-check.txt"
    s3_server.put(token, check.token.encode())  # what the driver writes
    assert unseen(check, "n1") is None
    assert list(stored_objects(s3_server, f"{s3_prefix}/out")) == ["logs/node-check.txt"]  # the node's own removed

    s3_server.put(token, b"another run's token")
    assert unseen(check, "n1") == f"sees another OUT at {url} than the driver's (without this run's node-check.txt)"
    s3_server.put(token, check.token.encode())
    # A node whose environment holds another secret: a process of its own, as a node's worker is.
    node = "import json, sys; from tokpipe.runner.nodes import NodeCheck, unseen;"
    node += " print(unseen(NodeCheck(*json.loads(sys.argv[1])), 'n1'))"
    fields = json.dumps([check.out, check.token, check.tokenizer, check.tokenizer_sha256, []])
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    child = subprocess.run([sys.executable, "-c", node, fields], env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    problem = child.stdout.strip()
    assert re.fullmatch(
        rf"cannot read OUT {re.escape(url)} \({re.escape(url)}/logs/node-check\.txt: the store at "
        rf"{re.escape(s3_server.endpoint)} answered SignatureDoesNotMatch: the secret key does not match the access"
        r" key \(AWS_SECRET_ACCESS_KEY\) \(.+\)\)",
        problem,
    )
    assert nodes.refusal([f"node 127.0.0.2 (ab) {problem}"], storage_of(url)).endswith(
        ": every node reads OUT on the store with its own credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,"
        " AWS_ENDPOINT_URL in the environment of its `ray start`, or an instance role); give them to it or take the"
        " node out of the cluster, and rerun the same command"
    )

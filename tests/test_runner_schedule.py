"""runner/schedule.py: one Ray task per unfinished shard, or per pack of consecutive small ones. A worker
killed mid-shard is retried from the shard's checkpoint, and a shard whose workers keep dying is reported by
name after --max-retries; a task that stops making progress for --stall-timeout is cancelled with a stack
dump, retried, then reported, while the other shards finish. A pack that fails or stalls is not retried as
one: its shards go again one by one, so only the shard at fault is reported. Workers are really SIGKILLed;
the stuck shard is a file replaced, once the manifest is built, by a FIFO nobody writes. Runs join the
session's Ray (the `ray_address` fixture); those that kill workers run every shard on Ray's workers
(--ray-only), none in the driver."""

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import (
    EXAMPLE_TRAIN_FILES,
    RayNodes,
    assert_out_is,
    can_make_mount_namespaces,
    checkpoints,
    cli,
    keep_killing,
    launch,
    lost_node_run,
    output,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    run_args,
    session_processes,
    slow_driver_run,
    stopped_as_status_says,
    tokpipe,
    wait_for,
    write_jsonl,
)

from tokpipe.inputs.manifest import Shard, build_manifest, load_manifest, write_manifest
from tokpipe.layout.checkpoints import Checkpoints
from tokpipe.runner.schedule import PACK_SHARDS, packs

HF = ("--backend", "hf")  # the slow reference encoder: runs last long enough to be hit mid-way


def test_killed_workers_are_retried_and_a_shard_that_keeps_dying_is_reported(
    manifest, tmp_path, small_tokenizer, small_reference, ray_address
):
    # The 600-id tokenizer: each of the run's Ray workers loads it, and Qwen3's load (~1.3 CPU-s a worker, on
    # every retry) is not the subject.
    out = tmp_path / "out"
    args = ("--workers", "2", "--checkpoint-interval", "0.2", "--ray-only", *HF)
    stop = threading.Event()
    killed = keep_killing("example_train_0", stop, session_ray=ray_address)
    failing = tokpipe(*run_args(manifest, out, *args, "--max-retries", "1", tokenizer=small_tokenizer), ray=ray_address)
    stop.set()
    assert failing.returncode == 1 and len(killed) == 2  # the first attempt and its one retry
    assert "FAILED train/chunk1/example_train_0.jsonl.zst" in failing.stderr and "Traceback" not in failing.stderr
    assert not (out / "meta.json").exists()
    assert Checkpoints(out).of(next(s for s in load_manifest(manifest).shards() if "holdout" in s.key)).done
    assert "example_train_0" in json.loads((out / "logs" / "failed.json").read_text()).popitem()[0]

    # The rerun tries again; one of its workers is killed once mid-shard and Ray retries it from the checkpoint.
    stop = threading.Event()
    killed = keep_killing("example_train_0", stop, once=True, session_ray=ray_address)
    rerun = tokpipe(*run_args(manifest, out, *args, tokenizer=small_tokenizer), ray=ray_address)
    stop.set()
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert len(killed) == 1
    assert_out_is(out, small_reference)
    assert not (out / "logs" / "failed.json").exists()


def test_a_stuck_shard_is_cancelled_with_a_stack_dump_and_reported(dataset, tmp_path, ray_address, small_tokenizer):
    # A shard that turns into a FIFO nobody writes once the manifest is built (which refuses one): opening it for
    # reading blocks forever, as a file on a hung network mount would.
    (dataset / "train" / "zz_stuck.jsonl").touch()
    write_manifest(build_manifest(dataset), tmp_path / "m.json")
    (dataset / "train" / "zz_stuck.jsonl").unlink()
    os.mkfifo(dataset / "train" / "zz_stuck.jsonl")
    out = tmp_path / "out"
    # 3 s without progress is a stall. A shard's clock starts when a worker takes it (its first report), so the
    # seconds its worker takes to start on a busy machine are not counted (from submission, under pytest -n 2 on
    # 2 cores, real shards were reported stalled at 5 s). The 600-id tokenizer: the stall, not Qwen3, is the subject.
    # The driver held up after each submission: a worker free at once reports before the driver goes on, and that
    # report still starts the clock (taken for an earlier attempt's, the stuck shard was never cancelled: a hang).
    args = ("--stall-timeout", "3", "--max-retries", "1")
    result = slow_driver_run(*run_args(tmp_path / "m.json", out, *args, tokenizer=small_tokenizer), ray=ray_address)
    assert result.returncode == 1
    dump = out / "logs" / "stall-train-train__zz_stuck.txt"
    assert [line for line in result.stderr.splitlines() if not line.startswith("[tokpipe]")][:1] == [
        f"FAILED train/zz_stuck.jsonl: stalled 2 times (no progress for 3s); stacks in {dump}"
    ]
    assert "format_of" in dump.read_text()  # the stack shows where it hangs
    log = (out / "logs" / "run.log").read_text()
    assert log.count("shard train/zz_stuck.jsonl: no progress for") == 2
    assert [c["done"] for c in checkpoints(out)] == [True, True, True]  # the other shards finished


def test_consecutive_small_shards_go_in_packs_up_to_the_limit_and_a_large_one_alone():
    # 1 worker: a pack takes at most a quarter of what is left (206 bytes: 51; then 176: 44; 141: 35; 41: 10).
    sizes = [10, 20, 30, 5, 100, 0, 1, 40]
    shards = [Shard("train", f"s{i}", f"/s{i}", size, f"s{i}") for i, size in enumerate(sizes)]
    assert [[s.size for s in pack] for pack in packs(iter(shards), sum(sizes), lambda: 1)] == [
        [10, 20],
        [30, 5],
        [100],
        [0, 1],
        [40],
    ]
    many = [Shard("train", f"t{i}", f"/t{i}", 0, f"t{i}") for i in range(PACK_SHARDS + 1)]
    assert [len(pack) for pack in packs(iter(many), 0, lambda: 1)] == [PACK_SHARDS, 1]


def test_packs_shrink_with_what_is_left_and_the_last_shards_go_alone():
    # 16 shards of 10 bytes, 2 workers: a quarter of a worker's share of what is left, 160 // 8 = 20, then
    # 140 // 8 = 17 (one shard)... so no worker is left with a pack to finish while the other has nothing.
    shards = [Shard("train", f"s{i:02d}", f"/s{i}", 10, f"s{i}") for i in range(16)]
    assert [len(pack) for pack in packs(iter(shards), 160, lambda: 2)] == [2] + [1] * 14
    # A larger run starts with the full PACK_BYTES and ends alone all the same.
    big = [Shard("train", f"b{i:03d}", f"/b{i}", 4 << 20, f"b{i}") for i in range(300)]
    sized = [len(pack) for pack in packs(iter(big), 300 * (4 << 20), lambda: 2)]
    assert sized[:3] == [8, 8, 8] and sized[-8:] == [1] * 8 and sum(sized) == 300


def test_in_packs_a_failing_and_a_stuck_shard_are_reported_alone_and_the_rest_is_exact(
    tmp_path, ray_address, small_tokenizer
):
    # 40 shards of real words, all of one size S, a truncated download (T < S) among them and a FIFO nobody
    # writes (0): with 2 workers a task takes the shards that fit a quarter of a worker's share of what is left,
    # (40S + T) / 8 first, then 36S / 8. So: [s00 s01 truncated s02 s03] [s04 s05 s06 stuck s07] [s08 s09 s10] ...
    words = " ".join(reference_texts(EXAMPLE_TRAIN_FILES[0]))
    plain = "".join(c for c in words if c.isascii() and (c.isalnum() or c in " .,;:"))  # one byte a character
    data = tmp_path / "data"
    for k in range(40):
        docs = [plain[1200 * k + 300 * d :][:300] for d in range(4)]
        write_jsonl(data / "train" / f"s{k:02d}.jsonl", [json.dumps({"text": t}) for t in docs])
    whole = zstandard.ZstdCompressor().compress((data / "train" / "s05.jsonl").read_bytes())
    (data / "train" / "s01x_truncated.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    (data / "train" / "s06x_stuck.jsonl").touch()
    write_manifest(build_manifest(data), tmp_path / "m.json")
    (data / "train" / "s06x_stuck.jsonl").unlink()
    os.mkfifo(data / "train" / "s06x_stuck.jsonl")  # after the manifest, which refuses one
    out = tmp_path / "out"
    args = ("--workers", "2", "--ray-only", "--stall-timeout", "3", "--max-retries", "0", "--skip-failed")
    result = tokpipe(*run_args(tmp_path / "m.json", out, *args, tokenizer=small_tokenizer), ray=ray_address)

    assert result.returncode == 0, result.stderr
    log = (out / "logs" / "run.log").read_text()
    assert "a pack of 5 shards (train/s00.jsonl ... train/s03.jsonl) failed (SourceError:" in log
    assert "its shards go again one by one" in log
    assert "a pack of 5 shards (train/s04.jsonl ... train/s07.jsonl): no progress for" in log
    # Alone it has its own tries: one, with --max-retries 0 (the pack's stall is not counted against it).
    assert log.count("shard train/s06x_stuck.jsonl: no progress for") == 1
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(meta["excluded"]) == ["train/s01x_truncated.jsonl.zst", "train/s06x_stuck.jsonl"]
    good = [data / "train" / f"s{k:02d}.jsonl" for k in range(40)]
    tokenizer = small_tokenizer / "tokenizer.json"
    expected = reference_tokens(good, tokenizer, reference_tokenizer(tokenizer).token_to_id("<|endoftext|>"), np.uint16)
    assert np.array_equal(np.fromfile(out / "train.bin", dtype=np.uint16), expected)


# -- a node lost ---------------------------------------------------------------------------------------------------

# The moments a node is lost at, each a point in the code, where it lands however loaded the machine: in the node's
# own processes (RayNodes.add's lose_at), or in the driver for what only the driver sees (helpers.LOST_NODE_RUN),
# there at the first call given a shard's tokens stored on the node ("driver, its tokens") or at the first call.
NODE_LOST = {
    "while its worker tokenizes a shard": ("node", "tokpipe.write.shard.ShardWriter._encode"),
    "while its Placer writes a part": ("node", "tokpipe.write.place.write_at"),
    "while a shard done there waits in its store": ("driver, its tokens", "tokpipe.write.assembly.Assembler.done"),
    "as the last parts are placed (finalize)": ("driver", "tokpipe.runner.schedule.Scheduler.drain"),
}
ON_THE_NODES = ("--workers", "2", "--ray-only")  # every shard on the nodes' workers, none in the driver
LOST_LINE = re.compile(
    r"ray: node 127\.0\.0\.2 \([0-9a-f]{8}\) lost: (it held no shard of the run|(?P<shards>\d+) shards? to"
    r" tokenize again \((?P<running>\d+) running there, (?P<waiting>\d+) done and waiting there to be placed\))"
)


def test_a_node_lost_at_any_moment_costs_its_shards_never_the_run(dataset, tmp_path, small_tokenizer, small_reference):
    # Two copies of the example (6 shards, each's tokens in Ray's object store, not inline: over 100 KiB). A head
    # with no CPUs, so the shards run on the nodes, and each node runs its workers and its Placer; --ray-only, so
    # none in the driver (which, done before the node began, once left it nothing to lose it in).
    for split in ("train", "validation"):
        shutil.copytree(dataset / split / "chunk1", dataset / split / "chunk2")
    manifest = tmp_path / "m.json"
    write_manifest(build_manifest(dataset), manifest)
    expected = {stem: np.concatenate([tokens] * 2) for stem, tokens in small_reference.items()}
    with RayNodes(tmp_path) as cluster:
        # The only node with CPUs lost mid-shard: no node left can run a shard; one line says so, exit 1.
        first = cluster.add("a0" * 28, "127.0.0.2", lose_at="tokpipe.write.shard.ShardWriter._encode:1")
        out = tmp_path / "out"
        args = run_args(manifest, out, "--address", cluster.address, *ON_THE_NODES, tokenizer=small_tokenizer)
        stopped = tokpipe(*args)
        assert stopped.returncode == 1, stopped.stdout + stopped.stderr
        why = (
            "node 127.0.0.2 (a0a0a0a0) was lost, and no node left in the cluster can run a shard (1 CPU): start one"
            " (`ray start --address ...`) and rerun the same command"
        )
        assert stopped.stderr.splitlines()[-1] == f"tokpipe run: error: {why}"
        said = stopped_as_status_says(out)
        assert said == f"{out}: stopped before finishing: no run holds it; the last one stopped: {why}"
        assert not session_processes(first)
        # A node that stays joins; the same command resumes and finishes.
        cluster.add("b1" * 28, "127.0.0.3", gate="waits")
        resumed = tokpipe(*args)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert_out_is(out, expected)

        for n, (moment, (where, target)) in enumerate(NODE_LOST.items()):
            node_id = f"c{n}" * 28
            # The node that stays begins no shard before this one has begun one: each moment is one of its shards'.
            session = cluster.add(node_id, "127.0.0.2", f"{target}:1" if where == "node" else None, gate="opens")
            cluster.shut_gate()
            out = tmp_path / f"out-{n}"
            args = run_args(manifest, out, "--address", cluster.address, *ON_THE_NODES, tokenizer=small_tokenizer)
            if where == "node":
                run = tokpipe(*args)
            else:
                run = lost_node_run(target, 1, node_id if where.endswith("tokens") else "", session, *args)
            assert run.returncode == 0, f"{moment}: {run.stdout}{run.stderr}"
            assert not cluster.gate.exists(), moment  # the node began a shard
            left = session_processes(session)
            assert not left, f"{moment}: {[_cmdline(pid) for pid in left]}\n{run.stderr}"  # lost there
            # (The node of the moment before may be said lost too: Ray's GCS finds it dead 14-17 s after.)
            said = [LOST_LINE.fullmatch(line) for line in run.stderr.splitlines() if node_id[:8] in line]
            assert len(said) == 1 and said[0], f"{moment}: {run.stderr}"
            if moment.startswith("while its worker"):
                assert int(said[0]["running"]) >= 1, said[0][0]
            elif moment.startswith("while"):
                assert int(said[0]["waiting"]) >= 1, said[0][0]
            # tokpipe speaks, Ray logs: no line of Ray's on the terminal; they are in OUT/logs/ray.log.
            terminal = run.stdout + run.stderr
            assert "(raylet)" not in terminal and "\x1b[" not in terminal and "Traceback" not in terminal, terminal
            assert (out / "logs" / "ray.log").exists()
            assert_out_is(out, expected)
            assert cli("verify", out).returncode == 0

        # The head's GCS lost (the driver's raylet, there too, stays: tests/test_runner_head.py has its loss), the
        # shards waiting at the gate on the node that stays: Ray's client ended the driver a minute later, exit 1, its
        # one line in OUT/logs/ray.log, none on the terminal. One line says it once the GCS has taken no connection
        # for HEAD_SECONDS (2 s here), and the run ends, exit 1.
        cluster.shut_gate()
        args = run_args(manifest, tmp_path / "out-head", "--address", cluster.address, *ON_THE_NODES,
                        tokenizer=small_tokenizer)  # fmt: skip
        started = time.monotonic()
        head = {"TOKPIPE_TESTS_HEAD_SECONDS": "2", "TOKPIPE_TESTS_LOSE_ONLY": "gcs_server"}
        run = lost_node_run("tokpipe.runner.schedule.Tasks.read_board", 2, "", cluster.sessions[0], *args, env=head)
        assert (run.returncode, time.monotonic() - started < 40) == (1, True), run.stdout + run.stderr
        port = cluster.address.rsplit(":", 1)[1]  # at the head's own address, as Ray names it
        why = (
            rf"Ray's head \(its GCS at [0-9.]+:{port}\) has taken no connection for 2 s: it was stopped, killed or cut"
            r" off, and Ray cannot go on without it; what is done is kept: rerun the same command \(on a cluster, once"
            r" its head is up again\)"
        )
        assert re.fullmatch(f"tokpipe run: error: {why}", run.stderr.splitlines()[-1]), run.stderr
        said = stopped_as_status_says(tmp_path / "out-head")
        assert re.fullmatch(
            f".*/out-head: stopped before finishing: no run holds it; the last one stopped: {why}", said
        )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"


@pytest.mark.skipif(not can_make_mount_namespaces(), reason="needs root and unshare -m")
def test_the_run_follows_the_cluster_as_nodes_join_fail_their_check_and_are_lost_and_replaced(
    dataset, tmp_path, small_tokenizer, small_reference
):
    # Four copies of the example, OUT in a folder a blind node cannot see, on one node of 1 CPU (a head with none):
    # --workers 2 runs 1 until a second node joins; a node that joins with a tmpfs over OUT's parent is named in one
    # line and gets no shard; the first node lost leaves 1 worker, and its replacement brings the run back to 2, as an
    # autoscaler replaces a lost spot node. Every node's shards wait at the gate (RayNodes) until the last has joined:
    # each step happens while shards run, whatever the machine's load (the reference encoder's slowness did it once,
    # at 53 CPU-s), and each node that joins is the one free CPU when it gets its first task.
    copies = 4
    for split in ("train", "validation"):
        for n in range(2, copies + 1):
            shutil.copytree(dataset / split / "chunk1", dataset / split / f"chunk{n}")
    manifest, node_local = tmp_path / "m.json", tmp_path / "node-local"
    write_manifest(build_manifest(dataset), manifest)
    node_local.mkdir()
    out = node_local / "out"
    with RayNodes(tmp_path) as cluster:
        first = cluster.add("a0" * 28, "127.0.0.2", gate="waits")
        cluster.shut_gate()
        args = run_args(manifest, out, "--address", cluster.address, *ON_THE_NODES, tokenizer=small_tokenizer)
        run = launch(["-m", "tokpipe.cli", *args], tmp_path)
        wait_for(cluster.held, run=run)  # a shard waits: the run is past its node check
        cluster.add("cd" * 28, "127.0.0.4", blind=node_local, gate="waits")
        wait_for(lambda: f"({'cd' * 28}) cannot see OUT" in output(run), run=run)
        cluster.add("b1" * 28, "127.0.0.3", gate="waits")
        wait_for(lambda: "(b1b1b1b1) joined" in output(run), run=run)
        cluster.lose(first)
        wait_for(lambda: "(a0a0a0a0) lost" in output(run), run=run)
        cluster.add("e2" * 28, "127.0.0.5", gate="waits")
        wait_for(lambda: "(e2e2e2e2) joined" in output(run), run=run)
        cluster.open_gate()
        assert run.wait(timeout=300) == 0, output(run)
    said = output(run).splitlines()
    assert "--workers 2 is more than the 1 CPU of the cluster: running 1" in said
    port = cluster.address.split(":")[1]  # the cluster as the GCS names it: this machine's address
    assert any(re.fullmatch(rf"ray: cluster [\d.]+:{port}, 1 worker on 2 nodes", line) for line in said), said
    blind = [line for line in said if "(cdcdcdcd" in line]  # its join said before its first task, or not at all
    assert blind[-1] == (
        f"ray: node 127.0.0.4 ({'cd' * 28}) cannot see OUT {out} (No such file or directory): it joined the cluster"
        " and gets no shard of this run"
    )
    assert blind[:-1] in ([], ["ray: node 127.0.0.4 (cdcdcdcd) joined (1 CPU): 2 workers now"]), blind
    nodes = [line for line in said if line.startswith("ray: node") and line not in blind]
    assert [nodes[0], nodes[2]] == [
        "ray: node 127.0.0.3 (b1b1b1b1) joined (1 CPU): 2 workers now",
        "ray: node 127.0.0.5 (e2e2e2e2) joined (1 CPU): 2 workers now",
    ], nodes
    assert len(nodes) == 3 and LOST_LINE.fullmatch(nodes[1]), nodes  # what it cost is the moment's
    # The busy share is of the workers it had: 1, then 2, 1 and 2 again.
    phases = next(line for line in said if line.startswith("phases: "))
    assert re.search(r"workers busy \d+% \(1-2 workers, [\d.]+s of worker time, [\d.]+s on shards\)", phases), phases
    assembled = next(line for line in (out / "logs" / "run.log").read_text().splitlines() if "assembled by" in line)
    for joined in ("b1b1b1b1", "e2e2e2e2"):  # what each tokenized, placed by its Placer
        assert joined in assembled, assembled
    assert "cdcdcdcd" not in assembled, assembled
    assert_out_is(out, {stem: np.concatenate([tokens] * copies) for stem, tokens in small_reference.items()})
    assert cli("verify", out).returncode == 0


class _Watch:
    """What Losses asks of NodeWatch: a cluster where every node stays up."""

    lost: set = set()

    def name(self, node: str) -> str:
        return f"10.0.0.7 ({node[:8]})"

    def confirms(self, node: str) -> bool:
        return False


def test_placing_that_fails_with_its_placer_up_or_never_started_stops_the_run_at_the_third_failure():
    """A Placer killed is made again and goes on (tests/test_runner_storage.py kills them). A call whose Placer stays
    up and that fails alike each time (here, as on a node with another tokpipe: its result cannot be read in the
    driver) was made again for good, a core spinning, no word."""
    from collections import deque

    import ray

    from tokpipe.errors import RayUnavailable
    from tokpipe.runner.schedule import PLACING_TRIES, Losses

    tasks = type("Tasks", (), {"watch": _Watch(), "again": deque(), "log": lambda self, line: None})()
    losses = Losses(tasks, tell=lambda said: None)

    def stopped_at_the_last_try(node: str, error: Exception) -> str:
        for _ in range(PLACING_TRIES - 1):
            losses.placing_failed(None, node, [], error)
        with pytest.raises(RayUnavailable) as stopped:
            losses.placing_failed(None, node, [], error)
        return str(stopped.value)

    unreadable = ray.exceptions.RaySystemError("AttributeError: Can't get attribute 'Segment' on <module 'x'>")
    assert stopped_at_the_last_try("ab12cd34ef", unreadable) == (
        "placing on node 10.0.0.7 (ab12cd34) failed 3 times, its Placer up (RaySystemError: System error:"
        " AttributeError: Can't get attribute 'Segment' on <module 'x'>); details in OUT/logs/run.log"
    )
    # A Placer that never starts (a driver in RAY_AUTH_MODE=token, a cluster not) was made again 6,278 times in 40 s,
    # without a word; one killed is made again and goes on.
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    killed = ray.exceptions.ActorDiedError(ActorDiedErrorContext(actor_id=bytes(16), error_message="killed"))
    unborn = ray.exceptions.ActorDiedError(
        ActorDiedErrorContext(never_started=True, actor_id=bytes(16), error_message="Actor creation cancelled.")
    )
    for _ in range(2 * PLACING_TRIES):
        losses.placing_failed(None, "ef56ab78cd", [], killed)
    assert stopped_at_the_last_try("ef56ab78cd", unborn) == (
        "placing on node 10.0.0.7 (ef56ab78) failed 3 times, its Placer never started (ActorDiedError: The actor never"
        " ran - it was cancelled before it started running.); details in OUT/logs/run.log"
    )

"""runner/head.py: what the driver cannot work without, watched by plain sockets for the whole run: the raylet of its
own node, gone, ends the run at its second look; the head's GCS, silent for HEAD_SECONDS (one with fault tolerance
comes back in seconds). Left to Ray, its client ended the driver without a word on the terminal. Real sockets here:
one that listens, one that refuses; a run whose head is killed is in tests/test_runner_schedule.py."""

import socket
import threading
import time

import pytest

from tokpipe.runner import head


@pytest.fixture
def listening():
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def refusing() -> str:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    return f"127.0.0.1:{port}"  # closed: a connection is refused, as where the process was killed


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(head, "WATCH_EVERY", 0.01)
    monkeypatch.setattr(head, "HEAD_SECONDS", 1.0)


def test_the_driver_s_raylet_gone_ends_the_run_at_the_second_look(listening, refusing):
    said = []
    head.watch(refusing, listening, threading.Event(), said.append)
    assert said == [
        f"Ray's node on this machine (its raylet at {refusing}), through which the run works, is gone: it was killed"
        " or stopped; what is done is kept: rerun the same command (on a cluster, once Ray runs on this machine again)"
    ]


def test_the_head_s_gcs_ends_the_run_once_silent_for_head_seconds(listening, refusing):
    said, started = [], time.monotonic()
    head.watch(listening, refusing, threading.Event(), said.append)
    assert time.monotonic() - started >= 1.0
    assert said == [
        f"Ray's head (its GCS at {refusing}) has taken no connection for 1 s: it was stopped, killed or cut off, and"
        " Ray cannot go on without it; what is done is kept: rerun the same command (on a cluster, once its head is"
        " up again)"
    ]


def test_while_both_answer_nothing_is_said_and_the_watch_ends_with_the_run(listening):
    said, done = [], threading.Event()
    watching = threading.Thread(target=head.watch, args=(listening, listening, done, said.append))
    watching.start()
    time.sleep(0.1)  # ~10 looks at each
    done.set()
    watching.join(timeout=5)
    assert not watching.is_alive() and said == []


def test_a_stop_while_it_looks_is_no_news(listening, monkeypatch):
    # The run stops Ray (Cluster.stop) and kills its raylet while the watch looks: that loss is the run's own.
    done, said, looks = threading.Event(), [], []

    def killed_while_looked_at(address):
        looks.append(address)
        if len(looks) == 3:  # the raylet's second look: the stop came meanwhile
            done.set()
        return address != "127.0.0.1:1"

    monkeypatch.setattr(head, "takes_connection", killed_while_looked_at)
    head.watch("127.0.0.1:1", listening, done, said.append)
    assert (said, len(looks)) == ([], 4)

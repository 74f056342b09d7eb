"""store/lease: OUT's lock on an object store, a lease on the real S3 server of the session (SeaweedFS). One run
holds it; another is refused in one line while it is live; it is taken over once it has expired, or at once when
its holder is a process of this machine that is gone (a kill -9); of two runs taking it at once one wins; a run
whose lease was taken learns it at its next renewal; the end removes it."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import wait_for

import tokpipe.store.bucket
from tokpipe.errors import UserError
from tokpipe.store import Bucket, Lease, StoreUnavailable, Url, lease


def _lease(s3_server, s3_prefix, seconds=60.0) -> Lease:
    return Lease(Bucket.of(Url.parse(f"s3://{s3_server.bucket}/{s3_prefix}/")), f"{s3_prefix}/out/.lock", seconds)


def _record(lease: Lease) -> dict:
    raw, _ = lease.bucket.get(lease.key)
    return json.loads(raw)


def test_a_live_lease_refuses_another_run_in_one_line_and_its_end_frees_out(s3_server, s3_prefix):
    first, second = _lease(s3_server, s3_prefix), _lease(s3_server, s3_prefix)
    with first:
        held = _record(first)
        assert (held["host"], held["pid"], held["seconds"]) == (socket.gethostname(), os.getpid(), 60.0)
        with pytest.raises(UserError) as refused:
            second.acquire()
        out = f"s3://{s3_server.bucket}/{s3_prefix}/out"
        said = re.fullmatch(
            rf"{re.escape(out)} is in use by another tokpipe run \(pid {os.getpid()} on "
            rf"{re.escape(socket.gethostname())}\); wait for it to finish or stop it \(a run killed without a word "
            r"frees it within (\d+) s, when its lease ends\)",
            str(refused.value),
        )
        # What is left of the lease's minute and the clocks' skew since its last renewal: less where this machine
        # paused between the two (46 s once, in a loaded suite).
        assert said and 0 < int(said[1]) <= 60 + lease.SKEW, str(refused.value)
    assert first.bucket.get(first.key) is None  # released
    with second:
        assert _record(second)["pid"] == os.getpid()


def test_a_run_the_store_stopped_says_what_stopped_it_not_that_its_lease_stays(s3_server, s3_prefix, monkeypatch):
    # A store that fell silent stopped the run; the lease's removal then fails too. The run's error is said, and
    # the lease ends by itself. (Its removal's error replaced the run's: the user read of OUT/.lock.)
    monkeypatch.setattr(tokpipe.store.bucket, "TRIES", 1)
    held = _lease(s3_server, s3_prefix)
    with pytest.raises(StoreUnavailable, match="^s3://tokpipe-tests/.*/train.bin: cannot reach"):
        with held:
            held.bucket = Bucket(s3_server.bucket, "http://127.0.0.1:9")  # where nothing answers
            held.bucket.put(f"{s3_prefix}/out/train.bin", b"")
    # Ended by no error: the removal's is said.
    with pytest.raises(StoreUnavailable, match=r"^s3://tokpipe-tests/.*/other/\.lock: cannot reach"):
        with Lease(_lease(s3_server, s3_prefix).bucket, f"{s3_prefix}/other/.lock") as alone:
            alone.bucket = Bucket(s3_server.bucket, "http://127.0.0.1:9")


def test_a_lease_is_renewed_while_held_and_taken_over_once_it_has_expired(s3_server, s3_prefix, monkeypatch):
    monkeypatch.setattr(lease, "SKEW", 0.2)  # the clocks are one: no need to wait out another machine's
    with _lease(s3_server, s3_prefix, seconds=0.6) as held:
        renewed = _record(held)["renewed"]
        wait_for(lambda: _record(held)["renewed"] > renewed, timeout=30)  # renewed every third of its 0.6 s
        held._stop.set()  # the holder falls silent (a machine lost): nothing renews it any more
        held._thread.join()
        taker = _lease(s3_server, s3_prefix)
        # Its last renewal as another machine's (only its end counts, not its process): just now, of a lease of a
        # minute, then that minute and the clocks' skew ago. Written, not waited for: a loaded machine's pauses
        # change nothing.
        record = _record(held) | {"host": "another-machine", "renewed": time.time(), "seconds": 60.0}
        held.etag = held.bucket.put(held.key, json.dumps(record).encode(), if_match=held.etag)
        with pytest.raises(UserError):
            taker.acquire()
        record["renewed"] -= 60.0 + lease.SKEW + 1
        held.etag = held.bucket.put(held.key, json.dumps(record).encode(), if_match=held.etag)
        taker.acquire()
        assert _record(taker)["host"] == socket.gethostname()
        held.renew()
        assert held.lost == "another tokpipe run took over OUT's lease (this run did not renew it in time)"
        with pytest.raises(UserError, match="took over OUT's lease"):
            held.check()
    assert _record(taker)["pid"] == os.getpid()  # the loser's end leaves the winner's lease alone
    taker.release()


def test_a_run_stopped_past_its_lease_learns_at_its_next_write_that_another_took_it(s3_server, s3_prefix):
    # Ctrl-Z, a paused VM: the holder's process stood still past its lease's end, and another run took OUT over. On
    # going on, its first check before a write asks the store, not its renewal thread (due at its next third of the
    # lease, or yet to run: the write came first).
    with _lease(s3_server, s3_prefix) as held:
        held.check()  # renewed just now: no request
        record = _record(held) | {"host": "another-machine", "renewed": time.time()}
        held.bucket.put(held.key, json.dumps(record).encode())  # the other run's lease
        held.check()  # within its lease: OUT is still this run's, by its own clock, whatever the store holds
        held.renewed -= 60.0 + 1  # stood still past its lease
        with pytest.raises(UserError, match="took over OUT's lease"):
            held.check()
    assert _record(held)["host"] == "another-machine"  # the other run's lease left alone


def test_a_lease_held_by_a_process_of_this_machine_that_is_gone_is_taken_at_once(s3_server, s3_prefix):
    # A run killed with kill -9: its lease lives on for a minute, but its process is gone.
    code = (
        "import sys; from tokpipe.store import Lease; from tokpipe.store import Bucket, Url\n"
        f"Lease(Bucket.of(Url.parse('s3://{s3_server.bucket}/')), '{s3_prefix}/out/.lock').acquire()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    taker = _lease(s3_server, s3_prefix)
    # The same PID and host name in another PID namespace (a container on the host's network) is no process of this
    # one's: the lease is live until it ends.
    raw, etag = taker.bucket.get(taker.key)
    dead = json.loads(raw)
    assert dead["machine"] == lease.this_machine() and dead["host"] == socket.gethostname()
    elsewhere = {**dead, "machine": dead["machine"].rsplit(" ", 1)[0] + " pid:[4026531999]"}
    taker.bucket.put(taker.key, json.dumps(elsewhere).encode(), if_match=etag)
    with pytest.raises(UserError, match="is in use by another tokpipe run"):
        taker.acquire()
    raw, etag = taker.bucket.get(taker.key)
    taker.bucket.put(taker.key, json.dumps(dead).encode(), if_match=etag)
    taker.acquire()
    assert _record(taker)["pid"] == os.getpid()
    taker.release()


def test_of_runs_taking_an_expired_lease_at_once_one_wins(s3_server, s3_prefix):
    dead = _lease(s3_server, s3_prefix, seconds=0.0)
    dead.acquire()
    record = _record(dead) | {"host": "another-machine", "renewed": time.time() - lease.SKEW - 1}
    dead.bucket.put(dead.key, json.dumps(record).encode(), if_match=dead.etag)

    def take(_):
        try:
            _lease(s3_server, s3_prefix).acquire()
            return "won"
        except UserError as e:
            return str(e).split(" was taken")[1][:20] if " was taken" in str(e) else "refused"

    with ThreadPoolExecutor(6) as pool:
        outcomes = sorted(pool.map(take, range(6)))
    assert outcomes.count("won") == 1 and len(outcomes) == 6

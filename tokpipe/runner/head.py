"""Ray's head, as the driver finds it: whether an address answers as its GCS does (before a join), whether a
host's port takes a connection (a raylet's, the GCS's), and, while a run goes on, whether the GCS and the driver's
own raylet still do. Plain sockets: Ray's own client waits minutes where nothing answers, and ends the process
without a word where the GCS or that raylet went."""

import re
import socket
import threading
import time
from collections.abc import Callable

CONNECT_SECONDS = 2.0  # to connect to a raylet or the GCS: past it, the node (or the head) is lost
# Between two looks at the cluster while a run goes on (its GCS here, its nodes in NodeWatch.gone): ray.nodes() took
# 0.19 ms of the driver's CPU with 4 nodes, and a connection to each raylet is one round trip.
WATCH_EVERY = 2.0
HEAD_SECONDS = 30.0  # the GCS taking no connection this long ends the run (watch_head)

# How long a join waits for the cluster's address to answer as Ray's GCS does (a live one: in 6 ms here). Ray's own
# client, given an address where nothing of Ray's answers, tried 20 times, ~40 s a try, holding the GIL: 14 minutes
# without a word, and a Ctrl-C or SIGTERM waited for it.
JOIN_ANSWER_SECONDS = 10
HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # preface, empty SETTINGS


def answers_as_ray(address: str) -> None:
    """A ConnectionError that says so, unless `address` (host:port, ray://host:port; a dashboard's http:// URL is
    asked too) answers as Ray's GCS and its client server do: gRPC, whose first frame is SETTINGS. "auto" is Ray's
    to find."""
    if not (match := re.fullmatch(r"(?:\w+://)?\[?([^\]/]+?)\]?:(\d+)/?", address)):
        return
    try:
        connection = socket.create_connection((match[1], int(match[2])), timeout=JOIN_ANSWER_SECONDS)
    except OSError as e:  # refused, no route, no such host
        raise ConnectionError(f"nothing answers at {address}: {e.strerror or e}") from None
    first = b""
    with connection:
        try:
            connection.sendall(HTTP2_HELLO)
            while len(first) < 4 and (more := connection.recv(9)):
                first += more
        except OSError:  # a timeout: the port takes connections, and says nothing
            raise ConnectionError(f"{address} takes a connection and says nothing in {JOIN_ANSWER_SECONDS} s") from None
    if len(first) < 4 or first[3] != 4:
        raise ConnectionError(
            f"what answers at {address} is not Ray (a dashboard's port?): a cluster's address is its head's GCS port,"
            " 6379 unless `ray start --head --port` said another"
        )


def takes_connection(address: str) -> bool:
    """Whether HOST:PORT takes a TCP connection within CONNECT_SECONDS."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), CONNECT_SECONDS).close()
    except OSError:
        return False
    return True


def watch_head(done: threading.Event, lost: Callable[[str], None]) -> None:
    """Until `done`, every WATCH_EVERY, whether the two processes of Ray the driver cannot work without take a
    connection: the raylet of its own node (its object store), and the head's GCS; `lost(what to say)` once the
    raylet has missed two looks, or the GCS HEAD_SECONDS (a GCS with fault tolerance comes back in seconds). Left to
    Ray, its client ended the driver, whatever it waited on (a task, the node check, the progress board), with exit 1
    and not a word on the terminal (its one line in OUT/logs/ray.log): 15 s after the raylet was killed, 60 s after
    the GCS."""
    import ray

    context = ray.get_runtime_context()
    here = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
    watch(f"{here['NodeManagerAddress']}:{here['NodeManagerPort']}", context.gcs_address, done, lost)


def watch(raylet: str, gcs: str, done: threading.Event, lost: Callable[[str], None]) -> None:
    """watch_head's looks, at these addresses (HOST:PORT)."""
    missed, silent = 0, None
    while not done.wait(WATCH_EVERY):
        missed = 0 if takes_connection(raylet) else missed + 1
        silent = None if takes_connection(gcs) else silent or time.monotonic()
        if done.is_set():  # while it looked
            return None
        if missed >= 2:
            return lost(
                f"Ray's node on this machine (its raylet at {raylet}), through which the run works, is gone: it was"
                " killed or stopped; what is done is kept: rerun the same command (on a cluster, once Ray runs on this"
                " machine again)"
            )
        if silent and time.monotonic() - silent >= HEAD_SECONDS:
            return lost(
                f"Ray's head (its GCS at {gcs}) has taken no connection for {HEAD_SECONDS:.0f} s: it was stopped,"
                " killed or cut off, and Ray cannot go on without it; what is done is kept: rerun the same command"
                " (on a cluster, once its head is up again)"
            )

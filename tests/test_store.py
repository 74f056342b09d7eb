"""store: an object read as a file by ranged GETs of a bounded size, every one asking for the ETag the manifest
recorded (a replaced or removed object fails by name); a store restarted mid-read waited for, one that stays away
said in one line past its retries; a wrong key, a missing bucket or no store at all refused in one line, quickly.
An object written in pieces: a multipart upload of data, or of ranges of other objects copied on the server (past
S3's 10,000 parts too), completed create-only, none left open.
Then a corpus on the store as a user runs it (OUT on a local disk): the reference's bytes, on Ray's workers too; no
secret in anything written or printed; a kill -9 mid-shard resumed by a ranged read from the checkpoint's place; an
object replaced after the manifest, a wrong key, a missing bucket, no store, a store gone mid-run, each said in one
line. Against a real S3 server (SeaweedFS, the s3_server fixture)."""

import contextlib
import http.server
import io
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import zstandard
from helpers import (
    SESSION_RAYS,
    TRAIN_1,
    Relay,
    assert_out_is,
    checkpoints,
    cli,
    example_with_train_0_as,
    killed_run,
    run_args,
    store_run,
    tokpipe,
)

from tokpipe import store
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import load_manifest
from tokpipe.store import (
    Bucket,
    Changed,
    Exists,
    Reader,
    StoreRefused,
    StoreUnavailable,
    Upload,
    Url,
    compose,
    open_read,
)
from tokpipe.store import upload as upload_module

MIB = 1 << 20


def _object(s3_server, s3_prefix, size: int) -> tuple[Bucket, str, bytes, str]:
    data = bytes(range(256)) * (size // 256)
    key = f"{s3_prefix}/x.jsonl"
    etag = s3_server.put(key, data)
    return Bucket(s3_server.bucket, s3_server.endpoint), key, data, etag


@pytest.fixture
def gets(monkeypatch) -> list[tuple[int, int]]:
    """The [start, end) every ranged GET asks for, in order (store.Bucket.read, which still reads)."""
    made, read = [], Bucket.read

    def recorded(bucket, key, start, end, etag=None):
        made.append((start, end))
        return read(bucket, key, start, end, etag)

    monkeypatch.setattr(Bucket, "read", recorded)
    return made


def test_an_object_is_read_as_a_file_by_ranged_gets_of_its_read_ahead(s3_server, s3_prefix, gets):
    bucket, key, data, etag = _object(s3_server, s3_prefix, 3 * MIB)
    reader = Reader(bucket, key, etag, ahead=MIB)
    assert reader.read(10) == data[:10] and reader.tell() == 10
    assert reader.read(2 * MIB) == data[10 : 2 * MIB + 10]  # past one GET's bytes: the next GET asks for all it lacks
    reader.seek(3 * MIB - 5)
    assert reader.read(100) == data[-5:] and reader.read(1) == b""
    # Each GET asks for its read-ahead at least, never past the end once a GET said where that is.
    assert gets == [(0, MIB), (MIB, 2 * MIB + 10), (3 * MIB - 5, 3 * MIB)]
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=key)
    assert reader.seek(0, 2) == len(data)  # its size known from the GETs: no HEAD (which would find it gone)


def test_open_read_takes_a_local_path_or_a_url(s3_server, s3_prefix, tmp_path):
    bucket, key, data, etag = _object(s3_server, s3_prefix, 4096)
    (tmp_path / "x").write_bytes(data)
    with open_read(s3_server.url(key), etag) as remote, open_read(str(tmp_path / "x")) as local:
        assert isinstance(remote, Reader) and (remote.bucket, remote.key) == (bucket, key)
        assert remote.read() == local.read() == data


def test_a_replaced_or_removed_object_is_never_read_as_the_one_listed(s3_server, s3_prefix):
    bucket, key, data, etag = _object(s3_server, s3_prefix, 2 * MIB)
    reader = Reader(bucket, key, etag, ahead=MIB)
    assert reader.read(MIB) == data[:MIB]
    s3_server.put(key, data[::-1])  # the same size, other bytes
    url = s3_server.url(key)
    with pytest.raises(Changed) as replaced:
        reader.read(1)
    assert str(replaced.value) == (
        f"{url} is not the object the manifest listed: it was replaced (its ETag is no longer {etag}); put it back, "
        "or rebuild the manifest and rerun with it (OUT keeps every shard it finished)"
    )
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=key)
    with pytest.raises(Changed, match=f"^{url} is not the object the manifest listed: it is gone; "):
        Reader(bucket, key, etag).read(1)
    with pytest.raises(Changed, match="it is gone"):
        Reader(bucket, key, etag).seek(0, 2)  # its size asked for (Parquet's first call): a HEAD


def test_a_store_away_mid_read_is_waited_for(s3_server, s3_prefix):
    _, key, data, etag = _object(s3_server, s3_prefix, 2 * MIB)
    relay = Relay(s3_server.endpoint)
    reader = Reader(Bucket(s3_server.bucket, relay.endpoint), key, etag, ahead=MIB)
    assert reader.read(MIB) == data[:MIB]
    relay.down()  # its connection cut, new ones refused, for a second
    back = threading.Timer(1.0, relay.up)
    back.start()
    assert reader.read(MIB) == data[MIB:]  # botocore's retries, with backoff, until it answers again
    back.join()
    assert relay.accepted == 1  # the second MiB was asked for after the store came back
    relay.down()


def test_a_store_away_past_every_retry_is_one_line_and_an_oserror(s3_server, s3_prefix, monkeypatch):
    # Two tries, not TRIES' ten: their backoff would take a minute or two here.
    monkeypatch.setattr(store.bucket, "TRIES", 2)
    down = Bucket(s3_server.bucket, "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(StoreUnavailable) as away:
        Reader(down, "some/key", '"etag"').read(1)
    assert isinstance(away.value, OSError)
    assert str(away.value) == (
        "s3://tokpipe-tests/some/key: cannot reach the store at http://127.0.0.1:9 after 2 tries (Could not connect to"
        ' the endpoint URL: "http://127.0.0.1:9/tokpipe-tests/some/key")'
    )


def test_check_refuses_what_no_retry_changes_in_one_line(s3_server):
    """In two tries, not TRIES: a command's first request, before any work, says at once that nothing answers."""
    with pytest.raises(StoreRefused) as unreachable:
        Bucket("tokpipe-tests", "http://127.0.0.1:9").check("data/")
    assert str(unreachable.value) == (
        "s3://tokpipe-tests/data/: cannot reach the store at http://127.0.0.1:9 after 2 tries (Could not connect to the"
        ' endpoint URL: "http://127.0.0.1:9/tokpipe-tests?list-type=2&prefix=data%2F&max-keys=1&encoding-type=url")'
    )
    with pytest.raises(StoreRefused) as missing:
        Bucket("no-such-bucket", s3_server.endpoint).check()
    assert str(missing.value) == (
        f"s3://no-such-bucket/: the store at {s3_server.endpoint} answered NoSuchBucket: there is no such bucket (The"
        " specified bucket does not exist)"
    )


def test_check_of_an_endpoint_that_says_nothing_ends_in_its_own_read_timeout(monkeypatch):
    # An endpoint that takes connections and never answers: the preflight waited READ_TIMEOUT (300 s, for a part
    # copy) a try, 10 minutes without a word. Its own timeout here: a second.
    monkeypatch.setattr(store.bucket, "CHECK_READ_TIMEOUT", 1)
    with _silent() as port:
        endpoint, said = f"http://127.0.0.1:{port}", []
        checking = threading.Thread(target=lambda: said.append(_refusal(Bucket("tokpipe-tests", endpoint).check)))
        checking.start()
        checking.join(timeout=60)
    assert not checking.is_alive() and said == [
        f"s3://tokpipe-tests/: cannot reach the store at {endpoint} after 2 tries (Read timeout on endpoint URL:"
        f' "{endpoint}/tokpipe-tests?list-type=2&prefix=&max-keys=1&encoding-type=url")'
    ]


def test_a_store_that_falls_silent_is_waited_for_a_copy_s_time_only_by_a_copy(monkeypatch):
    # A copy on the server answers when it is done (a 5 GiB UploadPartCopy: minutes); any other request at once. With
    # the copy's timeout for all, a store that fell silent held a run or a training loader 10 tries x 5 minutes.
    monkeypatch.setattr(store.bucket, "TRIES", 1)
    monkeypatch.setattr(store.bucket, "READ_TIMEOUT", 0.5)
    monkeypatch.setattr(store.bucket, "COPY_READ_TIMEOUT", 2)
    with _silent() as port:
        bucket = Bucket("tokpipe-tests", f"http://127.0.0.1:{port}")
        waited = {}
        for name, call in (("get", lambda: bucket.get("k")), ("copy", Upload(bucket, "k", "u", [(1, "e")]).finish)):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable, match="Read timeout"):
                call()
            waited[name] = time.monotonic() - began
    assert waited["get"] < 2 <= waited["copy"], waited


def test_after_a_store_was_found_silent_requests_try_as_the_preflight_until_it_answers_again(monkeypatch):
    # What follows such a failure (the run's logs uploaded and its lease released as it stops, a loader's next batch)
    # waited all the tries again, each: a run into a store stopped 2 s in took 23 minutes to exit (11 now).
    monkeypatch.setattr(store.bucket, "TRIES", 3)
    monkeypatch.setattr(store.bucket, "READ_TIMEOUT", 0.2)
    monkeypatch.setattr(store.bucket, "CHECK_READ_TIMEOUT", 0.2)
    with _silent() as port:
        bucket = Bucket("tokpipe-tests", f"http://127.0.0.1:{port}")
        assert _unavailable(lambda: bucket.get("a")).endswith("after 3 tries (Read timeout on endpoint URL: …)")
        assert _unavailable(lambda: bucket.put("b", b"")).endswith("after 2 tries (Read timeout on endpoint URL: …)")
    answering = http.server.HTTPServer(("127.0.0.1", port), _NotFound)  # the same endpoint answers again
    threading.Thread(target=answering.handle_request).start()
    assert bucket.get("a") is None  # it answered: the next silence is waited for as the first was
    answering.server_close()
    with _silent(port):
        assert _unavailable(lambda: bucket.get("a")).endswith("after 3 tries (Read timeout on endpoint URL: …)")


@contextlib.contextmanager
def _silent(port: int = 0):
    """An endpoint that takes connections and never answers, at `port` (0: a free one)."""
    with socket.socket() as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port again, its connections just closed
        silent.bind(("127.0.0.1", port))
        silent.listen(8)
        yield silent.getsockname()[1]


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _unavailable(call) -> str:
    with pytest.raises(StoreUnavailable) as failed:
        call()
    return re.sub(r'\(Read timeout on endpoint URL: "[^"]*"\)', "(Read timeout on endpoint URL: …)", str(failed.value))


def _refusal(call) -> str | None:
    try:
        call()
    except StoreRefused as e:
        return str(e)
    return None


def test_compose_copies_ranges_of_objects_on_the_server_into_one_create_only(s3_server, s3_prefix, monkeypatch):
    bucket = Bucket(s3_server.bucket, s3_server.endpoint)
    a, b, c = (bytes([n]) * size for n, size in ((1, 6 * MIB), (2, 5 * MIB), (3, 1000)))
    for name, data in (("a", a), ("b", b), ("c", c)):
        s3_server.put(f"{s3_prefix}/{name}", data)
    sources = [(f"{s3_prefix}/a", MIB, 6 * MIB), (f"{s3_prefix}/b", 0, 5 * MIB), (f"{s3_prefix}/c", 10, 1000)]
    compose(bucket, f"{s3_prefix}/all", sources)
    assert bucket.get(f"{s3_prefix}/all")[0] == a[MIB:] + b + c[10:]
    with pytest.raises(Exists):  # create-only: the key is taken
        compose(bucket, f"{s3_prefix}/all", sources[:1])
    with pytest.raises(ValueError, match="a part of 990 bytes before the last"):
        compose(bucket, f"{s3_prefix}/small", [sources[2], sources[0]])
    monkeypatch.setattr(upload_module, "MAX_PARTS", 2)  # S3's 10,000: composed in runs of 2, then the runs
    compose(bucket, f"{s3_prefix}/many", [sources[0], sources[1], sources[0], sources[2]])
    assert bucket.get(f"{s3_prefix}/many")[0] == a[MIB:] + b + a[MIB:] + c[10:]
    assert sorted(o.key.rpartition("/")[2] for o in bucket.list(f"{s3_prefix}/")) == ["a", "all", "b", "c", "many"]
    assert bucket.uploads(f"{s3_prefix}/") == []


def test_an_upload_of_parts_is_completed_create_only_or_aborted(s3_server, s3_prefix):
    bucket, key = Bucket(s3_server.bucket, s3_server.endpoint), f"{s3_prefix}/part.bin"
    first, second, last = b"x" * (5 * MIB), b"y" * (6 * MIB), b"z" * 10
    upload = Upload.begin(bucket, key)
    upload.send(first)
    upload.send([second[:MIB], second[MIB:]])
    upload.send(last)
    assert bucket.head(key) is None  # nothing to read before it is completed
    upload.finish()
    assert bucket.get(key)[0] == first + second + last and bucket.uploads(f"{s3_prefix}/") == []
    again = Upload.begin(bucket, key)
    again.send(b"other")
    with pytest.raises(Exists):  # create-only: the finished object stays, the upload that lost is aborted
        again.finish()
    assert bucket.get(key)[0] == first + second + last and bucket.uploads(f"{s3_prefix}/") == []
    aborted = Upload.begin(bucket, f"{s3_prefix}/other.bin")
    aborted.send(first)
    aborted.abort()
    assert bucket.uploads(f"{s3_prefix}/") == []


def test_a_url_names_a_bucket_and_a_key():
    assert Url.parse("s3://bucket/a/b.jsonl") == Url("bucket", "a/b.jsonl")
    assert str(Url.parse("s3://bucket")) == "s3://bucket/"
    with pytest.raises(UserError, match=r"^/data is not an object-store URL: s3://BUCKET/PREFIX$"):
        Url.parse("/data")


# -- a corpus on the store, OUT on a local disk: `tokpipe` as a user runs it ---------------------------------


def _manifest_of(s3_server, s3_prefix, tmp_path, train_0: str = "pzstd") -> Path:
    """The example (its first train shard as `train_0`: example_with_train_0_as) on the store, and its manifest."""
    url = s3_server.upload(example_with_train_0_as(tmp_path / "data", train_0), f"{s3_prefix}/data")
    made = cli("manifest", "--dataset-dir", url, "-o", tmp_path / "m.json")
    assert made.returncode == 0, made.stderr
    return tmp_path / "m.json"


def test_a_run_of_a_corpus_on_a_store_is_the_reference_and_no_secret_is_written_anywhere(
    s3_server, s3_prefix, tmp_path, small_tokenizer, small_reference, ray_address
):
    """On the session's Ray (its workers read the store with their own environment's key), then verify and its
    sample re-read from the store; the secret key is in nothing any of them wrote or printed."""
    manifest, out = _manifest_of(s3_server, s3_prefix, tmp_path), tmp_path / "out"
    run = tokpipe(*run_args(manifest, out, "--ray-only", tokenizer=small_tokenizer), ray=ray_address)
    assert run.returncode == 0, run.stdout + run.stderr
    assert_out_is(out, small_reference)
    checks = [tokpipe("verify", out, "--sample", "40"), tokpipe("status", out)]
    assert [c.returncode for c in checks] == [0, 0], [c.stderr for c in checks]
    assert "train: 28 sampled documents re-tokenized by tokenizers match" in checks[0].stdout
    printed = [run.stdout, run.stderr] + [c.stdout + c.stderr for c in checks]
    written = [p for p in [manifest, *out.rglob("*"), *Path(SESSION_RAYS[ray_address]).rglob("*")] if p.is_file()]
    assert len(written) > 20 and (out / "logs" / "run.log").is_file()
    leaks = [p for p in written if s3_server.secret.encode() in p.read_bytes()]
    assert leaks == [] and not any(s3_server.secret in text for text in printed)


@pytest.mark.parametrize("train_0", ["plain", "pzstd"])
def test_kill_9_mid_shard_then_the_rerun_reads_the_rest_by_a_ranged_get(
    s3_server, s3_prefix, tmp_path, small_tokenizer, small_reference, train_0
):
    """Killed as the first shard's second checkpoint is written; the rerun's first GET of that shard's bytes starts
    where its checkpoint says: plain JSONL at its byte offset, zstd of several frames at the frame that holds it."""
    manifest, out = _manifest_of(s3_server, s3_prefix, tmp_path, train_0), tmp_path / "out"
    extra = ("--workers", "1", "--checkpoint-interval", "0.000001", "--shard-buffer", "0")
    step = ("tokpipe.write.shard.write_atomic", 2)
    killed_run(*step, manifest, out, *extra, batch_bytes=64 << 10, tokenizer=small_tokenizer)
    [ckpt] = [c for c in checkpoints(out) if not c["done"]]
    start = ckpt["offset"] if train_0 == "plain" else ckpt["frame_source_pos"]
    assert start > 0 and (train_0 == "plain" or 0 < ckpt["frame_offset"] < ckpt["offset"])
    rerun, gets = store_run(manifest, out, tokenizer=small_tokenizer)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)
    key = Url.parse(next(load_manifest(manifest).shards()).path).key
    first = [(start, end) for name, start, end in gets if name == key]
    # The backend check reads the first shard of each split from its start; the shard itself, its 4 bytes of
    # format and its text's first 64 KiB (a JSON array?), then the rest from the checkpoint's place.
    assert first[-3:] == [(0, 4), (4, 1 << 16), (start, start + (8 << 20))]


def test_an_object_replaced_after_the_manifest_fails_its_shard_in_one_line(
    s3_server, s3_prefix, tmp_path, small_tokenizer, small_reference
):
    manifest = _manifest_of(s3_server, s3_prefix, tmp_path)
    shard = next(s for s in load_manifest(manifest).shards() if s.relpath == TRAIN_1)
    original = s3_server.client().get_object(Bucket=s3_server.bucket, Key=Url.parse(shard.path).key)["Body"].read()
    # Compressed again (as a download fetched again may be): another object, the same text.
    text = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(original), read_across_frames=True).read()
    s3_server.put(Url.parse(shard.path).key, zstandard.ZstdCompressor(level=1).compress(text))
    out = tmp_path / "out"
    failed = tokpipe(*run_args(manifest, out, "--workers", "1", tokenizer=small_tokenizer))
    assert failed.returncode == 1
    assert (
        f"FAILED {TRAIN_1}: Changed: {shard.path} is not the object the manifest listed: it was replaced (its ETag is"
        f" no longer {shard.etag}); put it back, or rebuild the manifest and rerun with it (OUT keeps every shard it"
        " finished)\n"
    ) in failed.stderr
    # The manifest made again lists the object as it is now; OUT keeps the two shards it finished.
    again = cli("manifest", "--dataset-dir", s3_server.url(f"{s3_prefix}/data"), "-o", tmp_path / "again.json")
    assert again.returncode == 0, again.stderr
    rerun = tokpipe(*run_args(tmp_path / "again.json", out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    said = f"the manifest changed 1 shard that {out} holds no finished work of (e.g. {TRAIN_1})"
    assert rerun.stdout.startswith(said), rerun.stdout
    assert re.search(r": 3 shards, .*; 2 done, 0 partial, 1 to start$", rerun.stdout, re.M), rerun.stdout
    assert_out_is(out, small_reference)


def test_a_run_refuses_a_wrong_key_a_missing_bucket_or_no_store_before_any_work(
    s3_server, s3_prefix, tmp_path, small_tokenizer
):
    manifest, out = _manifest_of(s3_server, s3_prefix, tmp_path), tmp_path / "out"
    base = load_manifest(manifest).base
    client = s3_server.client()
    client.create_bucket(Bucket="tokpipe-gone")
    client.put_object(Bucket="tokpipe-gone", Key="data/a.jsonl", Body=b'{"text": "a"}\n')
    assert cli("manifest", "--dataset-dir", "s3://tokpipe-gone/data", "-o", tmp_path / "gone.json").returncode == 0
    client.delete_object(Bucket="tokpipe-gone", Key="data/a.jsonl")
    client.delete_bucket(Bucket="tokpipe-gone")
    cases = [
        (
            manifest,
            {"AWS_SECRET_ACCESS_KEY": "wrong"},
            f"{base}: the store at {s3_server.endpoint} answered SignatureDoesNotMatch: the secret key does not match"
            " the access key (AWS_SECRET_ACCESS_KEY) (The request signature we calculated does not match the signature"
            " you provided. Check your key and signing method.)",
        ),
        (
            tmp_path / "gone.json",
            {},
            f"s3://tokpipe-gone/data/: the store at {s3_server.endpoint} answered NoSuchBucket: there is no such bucket"
            " (The specified bucket does not exist)",
        ),
        (
            manifest,
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
            f"{base}: cannot reach the store at http://127.0.0.1:9 after 2 tries (Could not connect to the endpoint "
            f'URL: "http://127.0.0.1:9/{s3_server.bucket}?list-type=2&prefix={s3_prefix}%2Fdata%2F&max-keys=1'
            '&encoding-type=url")',
        ),
    ]
    for used, env, message in cases:
        refused = tokpipe(*run_args(used, out, tokenizer=small_tokenizer), env=env)
        assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", f"tokpipe run: error: {message}\n")
        assert not out.exists()  # before any work: no OUT made


def test_a_store_gone_mid_run_stops_it_in_one_line_and_the_rerun_completes(
    s3_server, s3_prefix, tmp_path, small_tokenizer, small_reference
):
    """The server killed as the second train shard's 7th GET is made (its 4 bytes of format and its text's first 64
    KiB, then reads of 64 KiB:
    mid-shard, the first shard done), with 2 tries (TRIES' 10 take a minute or two): the run stops with one line,
    exit 1; the server back on its data, the same command finishes with the reference's bytes."""
    manifest, out = _manifest_of(s3_server, s3_prefix, tmp_path), tmp_path / "out"
    key = Url.parse(next(s for s in load_manifest(manifest).shards() if s.relpath == TRAIN_1).path).key
    extra = ("--workers", "1", "--checkpoint-interval", "0.000001", "--shard-buffer", "0")
    kill = (s3_server, key, 7)
    stopped, gets = store_run(manifest, out, *extra, tokenizer=small_tokenizer, tries=2, read_ahead=64 << 10, kill=kill)
    s3_server.proc.wait(timeout=60)  # killed by the run at that GET (a run that never made it fails here)
    s3_server.proc = None
    s3_server.launch()
    assert stopped.returncode == 1 and [g for g in gets if g[0] == key][-1] == (key, 4 * (64 << 10), 5 * (64 << 10))
    assert [c["done"] for c in checkpoints(out)] == [True]  # the first shard's
    assert "Traceback" not in stopped.stderr
    # botocore's reason: no server, or (its last try made as the server went down) one that closed the connection.
    reasons = "Could not connect to the|Connection was closed before we received a valid response from"
    url = f"{s3_server.endpoint}/{s3_server.bucket}/{key}"
    assert re.fullmatch(
        re.escape(f"tokpipe run: error: s3://{s3_server.bucket}/{key}: cannot reach the store at {s3_server.endpoint}")
        + rf' after 2 tries \(({reasons}) endpoint URL: "{re.escape(url)}"\); fix the cause and rerun the same command',
        stopped.stderr.splitlines()[-1],
    ), stopped.stderr
    s3_server.ready()
    rerun = tokpipe(*run_args(manifest, out, *extra, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)

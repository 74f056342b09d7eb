"""store: an object read as a file by ranged GETs of a bounded size, every one asking for the ETag the manifest
recorded (a replaced or removed object fails by name); a store restarted mid-read waited for, one that stays away
said in one line past its retries; a wrong key, a missing bucket or no store at all refused in one line, quickly.
Against a real S3 server (SeaweedFS, the s3_server fixture)."""

import threading

import pytest

from tokpipe import store
from tokpipe.errors import UserError
from tokpipe.store import Bucket, Changed, Reader, StoreRefused, StoreUnavailable, Url, open_read

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
        "or rebuild the manifest and run into a new --out"
    )
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=key)
    with pytest.raises(Changed, match=f"^{url} is not the object the manifest listed: it is gone; "):
        Reader(bucket, key, etag).read(1)
    with pytest.raises(Changed, match="it is gone"):
        Reader(bucket, key, etag).seek(0, 2)  # its size asked for (Parquet's first call): a HEAD


def test_a_store_restarted_mid_read_is_waited_for(s3_server, s3_prefix):
    bucket, key, data, etag = _object(s3_server, s3_prefix, 2 * MIB)
    reader = Reader(bucket, key, etag, ahead=MIB)
    assert reader.read(MIB) == data[:MIB]
    s3_server.kill()
    restart = threading.Timer(1.0, s3_server.launch)  # on its data: the object is still there
    restart.start()
    assert reader.read(MIB) == data[MIB:]  # botocore's retries, with backoff, until it answers again
    restart.join()
    s3_server.ready()


def test_a_store_away_past_every_retry_is_one_line_and_an_oserror(s3_server, s3_prefix, monkeypatch):
    # Two tries, not TRIES' ten: their backoff would take a minute or two here.
    monkeypatch.setattr(store, "TRIES", 2)
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


def test_a_url_names_a_bucket_and_a_key():
    assert Url.parse("s3://bucket/a/b.jsonl") == Url("bucket", "a/b.jsonl")
    assert str(Url.parse("s3://bucket")) == "s3://bucket/"
    with pytest.raises(UserError, match=r"^/data is not an object-store URL: s3://BUCKET/PREFIX$"):
        Url.parse("/data")


"""Object storage: an S3 bucket (AWS S3, MinIO, SeaweedFS, R2, Ceph, ...) as tokpipe reads and writes it.

The client is boto3's. Credentials, region and endpoint come from where the AWS SDKs read them on each
machine (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, ~/.aws,
an instance role): a `Bucket` holds its name, never a secret, so it pickles into a Ray task's arguments as it
is, and each process makes its own client from its own environment. boto3 over obstore (object_store): the
split files are assembled on the server by multipart part copies (UploadPartCopy), and open multipart uploads
are listed and aborted, which object_store does not offer.

Every create is create-only (`If-None-Match: *`): of two writers of one key exactly one wins, the other is
told (`Exists`). A failure the store may get over (a timeout, a 5xx, throttling, a refused connection) is
retried with backoff by botocore; past its tries it is `StoreUnavailable`, an OSError: it stops a run as a full
disk does, resumable. A refusal that no retry changes (a wrong key, a missing bucket) is `StoreRefused`, a
UserError: one line naming the URL and what the store answered. `Bucket.check`, the preflight of a command,
makes CHECK_TRIES tries only: an unreachable endpoint is refused in seconds, not after minutes of backoff.

A shard on a store is read through `Reader`, a file object over ranged GETs of READ_AHEAD bytes (the sources take
it where they take an open file): a worker holds one such piece, never the object, and a GET that breaks off
mid-transfer is asked again whole. Ranged GETs, not one streaming body per shard: a shard is read at the pace it
is tokenized (minutes for 100 MB), and a connection held that long idle between reads is one a load balancer may
cut, with no retry for the body's reads in botocore. Every GET carries If-Match with the ETag the manifest
recorded: an object replaced since is never read as the one listed (`Changed`, which fails the shard as a file
changed under a run does).
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tokpipe.errors import SourceError, UserError

SCHEME = "s3://"
# S3's rules for a multipart upload: every part but the last at least MIN_PART, none over MAX_PART, at most
# MAX_PARTS parts (AWS's limits; SeaweedFS and MinIO keep the same).
MIN_PART = 5 << 20
MAX_PART = 5 << 30
MAX_PARTS = 10_000
# botocore's "standard" retry mode: exponential backoff with jitter, up to 20 s a wait; 10 tries span ~1-2
# minutes, what a store's restart or a network blip takes (measured: SeaweedFS answers ~1 s after a restart).
TRIES = 10
# A command's first request (Bucket.check): refused after these, so that an endpoint that is not there is said in
# seconds (connection refused: ~1 s) rather than after TRIES' minute or two.
CHECK_TRIES = 2
READ_TIMEOUT = 300  # seconds: a part copy of 5 GiB is one request, answered when it is done
CONNECT_TIMEOUT = 10
# Bytes a sequential Reader asks of each GET (a JSONL shard): a worker holds one such piece. 8 MiB: 13 GETs for a
# 100 MB shard, ~0.2 s of a GET's latency against the ~10-100 s of tokenizing it (1-10 MB/s a core).
READ_AHEAD = 8 << 20


def is_url(path: str | os.PathLike) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


@dataclass(frozen=True)
class Object:
    key: str
    size: int
    etag: str  # as the store quotes it: '"<hex>"', or '"<hex>-<parts>"' for a multipart upload


@dataclass(frozen=True)
class Url:
    """s3://BUCKET/KEY: an object, or with a key that ends in / (or none), a prefix."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, text: str) -> Url:
        bucket, _, key = text.removeprefix(SCHEME).partition("/")
        if not text.startswith(SCHEME) or not bucket:
            raise UserError(f"{text} is not an object-store URL: s3://BUCKET/PREFIX")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def __truediv__(self, name: str) -> Url:
        return Url(self.bucket, f"{self.key.rstrip('/')}/{name}" if self.key else name)


class Exists(Exception):
    """A create-only write found the key taken, or a conditional one found the object changed (412)."""


class StoreRefused(UserError):
    """The store refuses what no retry changes: credentials, a missing bucket, no permission."""


class StoreUnavailable(OSError):
    """The store did not answer (or answered 5xx) through every retry: the run stops, resumable."""


class Changed(SourceError):
    """An object is not the one the manifest recorded (its ETag differs, or it is gone): the shard fails, as a file
    changed under a run does."""


_clients = threading.local()  # boto3's clients are thread-safe but its session is not: one per thread


def _client(endpoint: str | None, tries: int | None = None):
    tries = TRIES if tries is None else tries
    cache = _clients.__dict__.setdefault("by_endpoint", {})
    if (endpoint, tries) not in cache:
        import boto3  # here: only a run that touches a store pays for its import (~0.3 s)
        from botocore.config import Config

        config = Config(
            retries={"mode": "standard", "total_max_attempts": tries},
            read_timeout=READ_TIMEOUT,
            connect_timeout=CONNECT_TIMEOUT,
            max_pool_connections=32,
        )
        cache[endpoint, tries] = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
    return cache[endpoint, tries]


def endpoint_of_environment() -> str | None:
    """The endpoint the AWS SDKs take from this environment (AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL), or None
    for AWS itself."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


@dataclass(frozen=True)
class Bucket:
    """One bucket, by name and endpoint (no secret: it pickles into Ray's task arguments as it is)."""

    name: str
    endpoint: str | None = None  # None: AWS, or what the environment of the process that uses it says

    @classmethod
    def of(cls, url: Url) -> Bucket:
        return cls(url.bucket, endpoint_of_environment())

    @property
    def client(self):
        return _client(self.endpoint)

    def where(self, key: str = "") -> str:
        return f"{SCHEME}{self.name}/{key}"

    def _call(self, key: str, operation: str, tries: int | None = None, **kw):
        """client.operation(Bucket=..., **kw), its errors as tokpipe's."""
        try:
            return getattr(_client(self.endpoint, tries), operation)(Bucket=self.name, **kw)
        except Exception as e:
            raise _error(e, self.where(key), self.endpoint, tries) from None

    def check(self, prefix: str = "") -> None:
        """Refuse (StoreRefused, one line, after CHECK_TRIES tries) a store that cannot be used: unreachable, a wrong
        key, no bucket. A LIST, not a HEAD: a HEAD's error has no body to say which."""
        try:
            self._call(prefix, "list_objects_v2", CHECK_TRIES, Prefix=prefix, MaxKeys=1)
        except StoreUnavailable as e:  # before any work, nothing to resume: a refusal
            raise StoreRefused(str(e)) from None

    def head(self, key: str) -> Object | None:
        try:
            answer = self.client.head_object(Bucket=self.name, Key=key)
        except Exception as e:
            if _status(e) == 404:
                return None
            raise _error(e, self.where(key), self.endpoint) from None
        return Object(key, answer["ContentLength"], answer["ETag"])

    def list(self, prefix: str) -> Iterator[Object]:
        """Every object under the prefix (a key that starts with it), in key order, a page of 1,000 at a time."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    yield Object(item["Key"], item["Size"], item["ETag"])
        except Exception as e:
            raise _error(e, self.where(prefix), self.endpoint) from None

    def get(self, key: str) -> tuple[bytes, str] | None:
        """The whole object and its ETag, or None where there is none."""
        try:
            answer = self.client.get_object(Bucket=self.name, Key=key)
            return answer["Body"].read(), answer["ETag"]
        except Exception as e:
            if _status(e) == 404:
                return None
            raise _error(e, self.where(key), self.endpoint) from None

    def read(self, key: str, start: int, end: int, etag: str | None = None) -> tuple[bytes, int | None]:
        """Bytes [start, end) of the object (fewer where it ends first) and its size; (b"", None) where it ends at or
        before `start`. With `etag`: Changed if the object is not that one. A transfer that breaks off midway is asked
        again, with backoff, up to TRIES times (botocore retries the requests, not the reading of their bodies)."""
        condition = {"IfMatch": etag} if etag else {}
        attempt = 1
        while True:
            try:
                answer = self.client.get_object(
                    Bucket=self.name, Key=key, Range=f"bytes={start}-{end - 1}", **condition
                )
            except Exception as e:
                if _status(e) == 416:  # InvalidRange: nothing at or after start
                    return b"", None
                if etag and _status(e) in (404, 412):
                    raise self.changed(key, etag, gone=_status(e) == 404) from None
                raise _error(e, self.where(key), self.endpoint) from None
            try:
                return answer["Body"].read(), int(answer["ContentRange"].rpartition("/")[2])
            except Exception as e:
                if attempt == TRIES or not _broke_off(e):
                    raise _error(e, self.where(key), self.endpoint) from None
            time.sleep(random.uniform(0, min(20, 2**attempt)))  # botocore's standard backoff
            attempt += 1

    def changed(self, key: str, etag: str, gone: bool) -> Changed:
        what = "is gone" if gone else f"was replaced (its ETag is no longer {etag})"
        return Changed(
            f"{self.where(key)} is not the object the manifest listed: it {what}; put it back, or rebuild the manifest"
            " and run into a new --out"
        )

    def put(self, key: str, data: bytes, create: bool = False, if_match: str | None = None) -> str:
        """Write the object; `create`: only if there is none (else Exists); `if_match`: only over that version
        (else Exists). Returns its ETag."""
        condition = {"IfNoneMatch": "*"} if create else {"IfMatch": if_match} if if_match else {}
        try:
            return self.client.put_object(Bucket=self.name, Key=key, Body=data, **condition)["ETag"]
        except Exception as e:
            if condition and _status(e) == 412:
                raise Exists(self.where(key)) from None
            raise _error(e, self.where(key), self.endpoint) from None

    def delete(self, key: str, if_match: str | None = None) -> None:
        try:
            self.client.delete_object(Bucket=self.name, Key=key, **({"IfMatch": if_match} if if_match else {}))
        except Exception as e:
            if if_match and _status(e) == 412:
                raise Exists(self.where(key)) from None
            raise _error(e, self.where(key), self.endpoint) from None

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """The multipart uploads begun under the prefix and neither completed nor aborted: (key, upload id)."""
        found = []
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.name, Prefix=prefix):
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        return found

    def abort(self, key: str, upload: str) -> None:
        self._call(key, "abort_multipart_upload", Key=key, UploadId=upload)

    def compose(self, key: str, sources: list[tuple[str, int, int]], create: bool = True) -> None:
        """Make `key` the bytes [start, end) of each source object in turn, on the server (UploadPartCopy): no byte
        reaches this process. Each source but the last must hold at least MIN_PART bytes; one over MAX_PART is
        copied in several parts. Past MAX_PARTS parts, runs of them are composed into objects of their own first
        (key + .compose-N), which the whole is then composed of, and removed. `create`: Exists if the key is taken."""
        if not sources or all(end == start for _, start, end in sources):  # S3 has no multipart upload of 0 parts
            self.put(key, b"", create=create)
            return
        pieces = [
            (source, at, min(at + MAX_PART, end))
            for source, start, end in sources
            for at in range(start, end, MAX_PART)
        ]
        small = [p for p in pieces[:-1] if p[2] - p[1] < MIN_PART]
        if small:
            raise ValueError(
                f"{self.where(small[0][0])}: a part of {small[0][2] - small[0][1]:,} bytes before the last"
            )
        runs = [pieces[i : i + MAX_PARTS] for i in range(0, len(pieces), MAX_PARTS)]
        if len(runs) > 1:
            made = [f"{key}.compose-{n}" for n in range(len(runs))]
            for run, name in zip(runs, made):
                self.compose(name, [(s, a, b) for s, a, b in run], create=False)
            sizes = [sum(b - a for _, a, b in run) for run in runs]
            self.compose(key, [(name, 0, size) for name, size in zip(made, sizes)], create)
            for name in made:
                self.delete(name)
            return
        self._upload_copies(key, pieces, create)

    def _upload_copies(self, key: str, pieces: list[tuple[str, int, int]], create: bool) -> None:
        upload = self._call(key, "create_multipart_upload", Key=key)["UploadId"]
        try:
            etags = []
            for number, (source, start, end) in enumerate(pieces, 1):
                copy = {"Bucket": self.name, "Key": source}
                span = {"CopySourceRange": f"bytes={start}-{end - 1}"} if end > start else {}
                answer = self._call(
                    key, "upload_part_copy", Key=key, UploadId=upload, PartNumber=number, CopySource=copy, **span
                )
                etags.append({"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]})
            condition = {"IfNoneMatch": "*"} if create else {}
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.name, Key=key, UploadId=upload, MultipartUpload={"Parts": etags}, **condition
                )
            except Exception as e:
                if create and _status(e) == 412:
                    raise Exists(self.where(key)) from None
                raise _error(e, self.where(key), self.endpoint) from None
        except BaseException:
            self.abort(key, upload)
            raise


class Reader(io.RawIOBase):
    """An object read as a file (read, seek, tell), for the sources: each read that its buffer does not hold is a
    ranged GET of at least `ahead` bytes, If-Match `etag`. `ahead` 0: of exactly what is asked (Parquet, which reads
    the footer and then whole column chunks: reading ahead would fetch the columns it skips)."""

    def __init__(self, bucket: Bucket, key: str, etag: str | None = None, ahead: int | None = None):
        super().__init__()
        self.bucket, self.key, self.etag = bucket, key, etag
        self.ahead = READ_AHEAD if ahead is None else ahead
        self.pos = 0
        self.length: int | None = None  # the object's size, once a GET or a HEAD said it
        self._buffer, self._at = b"", 0  # bytes of the object from offset _at

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            if self.length is None:
                found = self.bucket.head(self.key)
                if found is None or (self.etag and found.etag != self.etag):
                    raise self.bucket.changed(self.key, self.etag, gone=found is None)
                self.length = found.size
            offset += self.length
        elif whence == io.SEEK_CUR:
            offset += self.pos
        if offset < 0:
            raise ValueError(f"negative seek position {offset}")
        self.pos = offset
        return offset

    def read(self, size: int = -1) -> bytes:
        """`size` bytes from the position (-1: all to the end), fewer only at the end of the object."""
        if size is None or size < 0:
            return self.readall()
        pieces = []
        while size > 0:
            if not 0 <= self.pos - self._at < len(self._buffer) and not self._fetch(size):
                break
            piece = self._buffer[self.pos - self._at : self.pos - self._at + size]
            pieces.append(piece)
            self.pos += len(piece)
            size -= len(piece)
        return b"".join(pieces)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _fetch(self, wanted: int) -> bool:
        """The buffer filled from the position on; False at the end of the object."""
        if self.length is not None and self.pos >= self.length:
            return False
        end = self.pos + max(wanted, self.ahead)
        if self.length is not None:
            end = min(end, self.length)
        data, length = self.bucket.read(self.key, self.pos, end, self.etag)
        self._buffer, self._at = data, self.pos
        self.length = self.length if length is None else length
        return bool(data)


def open_read(path: str, etag: str | None = None, ahead: int | None = None):
    """A shard's bytes as an unbuffered binary file: a local path opened, an s3:// URL as a Reader (If-Match `etag`).
    The one place where a source's path becomes bytes."""
    if is_url(path):
        url = Url.parse(path)
        return Reader(Bucket.of(url), url.key, etag, ahead)
    return open(path, "rb", buffering=0)


def _status(error: Exception) -> int | None:
    return getattr(error, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


def _broke_off(error: Exception) -> bool:
    """Whether reading a body failed midway: a timeout, a closed connection, fewer bytes than announced."""
    from botocore import exceptions as aws

    return isinstance(error, aws.HTTPClientError | aws.IncompleteReadError)


# What the store answers that no retry changes: said in one line, exit 2.
REFUSALS = {
    "InvalidAccessKeyId": "the access key is not the store's (AWS_ACCESS_KEY_ID)",
    "SignatureDoesNotMatch": "the secret key does not match the access key (AWS_SECRET_ACCESS_KEY)",
    "NoSuchBucket": "there is no such bucket",
    "AccessDenied": "the credentials may not do this here",
    "ExpiredToken": "the session token has expired (AWS_SESSION_TOKEN)",
    "InvalidToken": "the session token is not valid (AWS_SESSION_TOKEN)",
}


def _error(error: Exception, where: str, endpoint: str | None, tries: int | None = None) -> Exception:
    """botocore's exception as tokpipe's: StoreRefused (one line, exit 2), StoreUnavailable (an OSError: one line,
    resumable) or, for what is neither, the exception itself."""
    from botocore import exceptions as aws

    tries = TRIES if tries is None else tries
    store = f"the store at {endpoint}" if endpoint else "S3"
    if isinstance(error, aws.NoCredentialsError):
        return StoreRefused(f"{where}: no credentials for {store}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(error, aws.ConnectionError | aws.HTTPClientError | aws.IncompleteReadError):
        return StoreUnavailable(f"{where}: cannot reach {store} after {tries} tries ({error})")
    if isinstance(error, aws.ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        message = error.response.get("Error", {}).get("Message") or code
        if code in REFUSALS:
            return StoreRefused(f"{where}: {store} answered {code}: {REFUSALS[code]} ({message})")
        status = _status(error) or 0
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling"):
            return StoreUnavailable(f"{where}: {store} answered {code or status} after {tries} tries ({message})")
        return StoreRefused(f"{where}: {store} answered {code or status} ({message})")
    return error

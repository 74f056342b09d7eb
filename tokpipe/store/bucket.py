"""An S3 bucket as tokpipe reads and writes it, through boto3: objects listed, read, written create-only,
removed; multipart uploads listed and aborted; each failure told as tokpipe's (StoreRefused, StoreUnavailable,
Exists, Changed)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tokpipe.errors import SourceError, Unavailable, UserError

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
DELETE_BATCH = 1000  # keys a DeleteObjects request may name (S3's most)
CONNECT_TIMEOUT = 10
# Seconds a request waits for its answer. A copy on the server (UploadPartCopy of up to MAX_PART,
# CompleteMultipartUpload of up to MAX_PARTS parts) answers when it is done; every other request at once where a
# store is: botocore's default. With COPY_READ_TIMEOUT for all, a store that fell silent held a run or a training
# loader TRIES x 5 minutes without a word; the preflight (CHECK_TRIES), a command 10 minutes.
READ_TIMEOUT = 60
COPY_READ_TIMEOUT = 300
CHECK_READ_TIMEOUT = 15


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


class StoreUnavailable(Unavailable):
    """The store did not answer (or answered 5xx) through every retry: the run stops, resumable."""


class Changed(SourceError):
    """An object is not the one the manifest recorded (its ETag differs, or it is gone): the shard fails, as a file
    changed under a run does."""


# One client per endpoint and patience (the preflight's, a copy's, the others') for the process, shared by its
# threads: boto3's clients are thread-safe (its sessions are not: each client is made, under the lock, from a session
# of its own). A client a thread, as before, cost 0.24 CPU-s and ~10 MB each (16 threads' made in 3.8 CPU-s here): a
# third of a store run's extra CPU.
_clients: dict = {}
_making = threading.Lock()
# Endpoints that a request of this process found unanswered after its tries: until one answers again, a request
# there is tried as the preflight is (CHECK_TRIES of CHECK_READ_TIMEOUT). What follows such a failure (a run's logs
# uploaded and its lease released as it stops, a loader's next batch) waited a whole TRIES again each: a run into a
# SeaweedFS stopped 2 s in took 1,357 s to exit (683 s with this).
_unanswered: set = set()


def _client(endpoint: str | None, patience: str = "request"):
    """The client of an endpoint for a "request", a "copy" on the server, or the "check" (Bucket.check); a request
    to an endpoint found silent (_unanswered) is tried as the check is."""
    if patience == "request" and endpoint in _unanswered:
        patience = "check"
    if (endpoint, patience) in _clients:
        return _clients[endpoint, patience]
    with _making:
        if (endpoint, patience) not in _clients:
            import boto3  # here: only a run that touches a store pays for its import (~0.3 s)
            from botocore.config import Config

            config = Config(
                retries={"mode": "standard", "total_max_attempts": CHECK_TRIES if patience == "check" else TRIES},
                read_timeout={"check": CHECK_READ_TIMEOUT, "copy": COPY_READ_TIMEOUT}.get(patience, READ_TIMEOUT),
                connect_timeout=CONNECT_TIMEOUT,
                max_pool_connections=32,
            )
            client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
            client.meta.events.register("after-call.s3", lambda **_: _unanswered.discard(endpoint))  # any answer
            _clients[endpoint, patience] = client
    return _clients[endpoint, patience]


@dataclass(frozen=True)
class Bucket:
    """One bucket, by name and endpoint (no secret: it pickles into Ray's task arguments as it is)."""

    name: str
    endpoint: str | None = None  # None: AWS, or what the environment of the process that uses it says

    @classmethod
    def of(cls, url: Url) -> Bucket:
        """URL's bucket at the endpoint the AWS SDKs take from this environment (AWS_ENDPOINT_URL_S3, then
        AWS_ENDPOINT_URL), or None for AWS itself."""
        return cls(url.bucket, os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None)

    @property
    def client(self):
        return _client(self.endpoint)

    def where(self, key: str = "") -> str:
        return f"{SCHEME}{self.name}/{key}"

    def call(self, key: str, operation: str, patience: str = "request", **kw):
        """client.operation(Bucket=..., **kw) about `key` (_client's patience), its errors as tokpipe's; a condition
        that does not hold (412: a create-only write that finds the key taken, an If-Match that finds the object
        changed) is Exists."""
        try:
            return getattr(_client(self.endpoint, patience), operation)(Bucket=self.name, **kw)
        except Exception as e:
            if _status(e) == 412:
                raise Exists(self.where(key)) from None
            tries = {"check": CHECK_TRIES, "copy": TRIES}.get(patience)  # a request's: as _client chose them
            raise _error(e, self.where(key), self.endpoint, tries) from None

    def check(self, prefix: str = "") -> None:
        """Refuse (StoreRefused, one line, after CHECK_TRIES tries) a store that cannot be used: unreachable, a wrong
        key, no bucket. A LIST, not a HEAD: a HEAD's error has no body to say which."""
        try:
            self.call(prefix, "list_objects_v2", "check", Prefix=prefix, MaxKeys=1)
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

    def list(self, prefix: str, after: str = "") -> Iterator[Object]:
        """Every object under the prefix (a key that starts with it), in key order, a page of 1,000 at a time; with
        `after`, those whose keys come after it."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.name, Prefix=prefix, **({"StartAfter": after} if after else {}))
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
                from botocore import exceptions as aws

                # Asked again only where the body broke off midway: a timeout, a closed connection, fewer bytes.
                if attempt == TRIES or not isinstance(e, aws.HTTPClientError | aws.IncompleteReadError):
                    raise _error(e, self.where(key), self.endpoint) from None
            time.sleep(random.uniform(0, min(20, 2**attempt)))  # botocore's standard backoff
            attempt += 1

    def changed(self, key: str, etag: str, gone: bool) -> Changed:
        what = "is gone" if gone else f"was replaced (its ETag is no longer {etag})"
        return Changed(
            f"{self.where(key)} is not the object the manifest listed: it {what}; put it back, or rebuild the manifest"
            " and rerun with it (OUT keeps every shard it finished)"
        )

    def put(self, key: str, data: bytes, create: bool = False, if_match: str | None = None) -> str:
        """Write the object; `create`: only if there is none (else Exists); `if_match`: only over that version
        (else Exists). Returns its ETag."""
        condition = {"IfNoneMatch": "*"} if create else {"IfMatch": if_match} if if_match else {}
        return self.call(key, "put_object", Key=key, Body=data, **condition)["ETag"]

    def delete(self, key: str, if_match: str | None = None) -> None:
        self.call(key, "delete_object", Key=key, **({"IfMatch": if_match} if if_match else {}))

    def delete_many(self, keys: list[str]) -> None:
        """Remove these objects, DELETE_BATCH a request (DeleteObjects): a run's 60,000 segments' 180,000 objects in
        180 requests, not 180,000 (at a cloud store's ~30 ms a request, 90 minutes one by one)."""
        for at in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": key} for key in keys[at : at + DELETE_BATCH]]
            answer = self.call(keys[at], "delete_objects", Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):  # per key, in a 200 answer: said as the store's refusal of that key
                from botocore.exceptions import ClientError

                error = answer["Errors"][0]
                failed = ClientError({"Error": {"Code": error.get("Code"), "Message": error.get("Message")}}, "Delete")
                raise _error(failed, self.where(error.get("Key", keys[at])), self.endpoint)

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """The multipart uploads begun under the prefix and neither completed nor aborted: (key, upload id)."""
        found = []
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.name, Prefix=prefix):
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        return found

    def abort(self, key: str, upload: str) -> None:
        self.call(key, "abort_multipart_upload", Key=key, UploadId=upload)


def _status(error: Exception) -> int | None:
    # (a ReadTimeoutError's response is None: a store that stopped answering mid-request was an AttributeError)
    return (getattr(error, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


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

    tries = tries or (CHECK_TRIES if endpoint in _unanswered else TRIES)
    store = f"the store at {endpoint}" if endpoint else "S3"
    if isinstance(error, aws.NoCredentialsError):
        return StoreRefused(f"{where}: no credentials for {store}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(error, aws.ConnectionError | aws.HTTPClientError | aws.IncompleteReadError):
        _unanswered.add(endpoint)
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

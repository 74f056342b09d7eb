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

bucket.py holds the bucket and its errors; lease.py a lock that ends by itself; reader.py a shard read as a file;
upload.py what writes an object in pieces: a multipart upload of data (`Upload`) or of copies of other objects'
ranges (`compose`).

A shard on a store is read through `Reader`, a file object over ranged GETs of READ_AHEAD bytes (the sources take
it where they take an open file): a worker holds one such piece, never the object, and a GET that breaks off
mid-transfer is asked again whole. Ranged GETs, not one streaming body per shard: a shard is read at the pace it
is tokenized (minutes for 100 MB), and a connection held that long idle between reads is one a load balancer may
cut, with no retry for the body's reads in botocore. Every GET carries If-Match with the ETag the manifest
recorded: an object replaced since is never read as the one listed (`Changed`, which fails the shard as a file
changed under a run does).
"""

from tokpipe.store.bucket import MIN_PART, Bucket, Changed, Exists, Object, StoreRefused, StoreUnavailable, Url, is_url
from tokpipe.store.lease import Holder, Lease
from tokpipe.store.reader import Reader, open_read
from tokpipe.store.upload import Upload, compose, put_buffers

# Requests in flight where a command reads or copies many small objects (segments' .json, checkpoints, a split's
# group files): a request is a round trip (~ms on loopback, 10s of ms to S3) that a thread spends waiting.
REQUESTS_AT_ONCE = 16

__all__ = [
    "MIN_PART",
    "REQUESTS_AT_ONCE",
    "Bucket",
    "Changed",
    "Exists",
    "Holder",
    "Lease",
    "Object",
    "Reader",
    "StoreRefused",
    "StoreUnavailable",
    "Upload",
    "Url",
    "compose",
    "is_url",
    "open_read",
    "put_buffers",
]

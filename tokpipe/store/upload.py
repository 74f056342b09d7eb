"""An object written in pieces, by a multipart upload: of data as it comes (`Upload`: a part's tokens while its
shard is still tokenized, each UploadPart at least MIN_PART), or of ranges of other objects copied on the server
(`compose`: a split file from its parts, UploadPartCopy, no byte through this process). Either is completed
create-only (`If-None-Match: *` on CompleteMultipartUpload): the object appears whole, once, or not at all; an
upload never completed is invisible, and aborted (Bucket.uploads lists what a killed run left open).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokpipe.store.bucket import MAX_PART, MAX_PARTS, MIN_PART, Bucket, Exists

# UploadPartCopy requests in flight while a file is composed: each is a copy on the server (no byte here), ~0.3-1 s
# for a segment of tens of MB on a cloud store, so one at a time, 60,000 segments would take hours after the workers
# finished; the parts of one upload may be copied in any order.
COPIES_AT_ONCE = 32
# An object of up to this many bytes is one PUT (put_buffers); a larger one a multipart upload of UPLOAD_PART_BYTES a
# request.
WHOLE_PUT_BYTES = 64 << 20
UPLOAD_PART_BYTES = 16 << 20


@dataclass
class Upload:
    """A multipart upload of `key` under way: the parts sent so far, (number, ETag) each."""

    bucket: Bucket
    key: str
    upload: str  # the store's UploadId
    parts: list[tuple[int, str]] = field(default_factory=list)

    @classmethod
    def begin(cls, bucket: Bucket, key: str) -> Upload:
        return cls(bucket, key, bucket.call(key, "create_multipart_upload", Key=key)["UploadId"])

    def send(self, data) -> None:
        """Upload `data` (bytes-like, or a list of them) as the next part: at least MIN_PART unless it is the last."""
        body = b"".join(memoryview(d).cast("B") for d in data) if isinstance(data, list) else bytes(data)
        number = len(self.parts) + 1
        answer = self.bucket.call(
            self.key, "upload_part", Key=self.key, UploadId=self.upload, PartNumber=number, Body=body
        )
        self.parts.append((number, answer["ETag"]))

    def finish(self, create: bool = True) -> None:
        """Complete it: the object is the parts, in order. `create`: Exists if the key is taken (and this upload is
        aborted: what it held is not the object's)."""
        parts = {"Parts": [{"PartNumber": number, "ETag": etag} for number, etag in self.parts]}
        try:
            self.bucket.call(
                self.key,
                "complete_multipart_upload",
                "copy",
                Key=self.key,
                UploadId=self.upload,
                MultipartUpload=parts,
                **({"IfNoneMatch": "*"} if create else {}),
            )
        except Exists:
            self.abort()
            raise

    def abort(self) -> None:
        self.bucket.abort(self.key, self.upload)


def compose(bucket: Bucket, key: str, sources: list[tuple[str, int, int]], create: bool = True) -> None:
    """Make `key` the bytes [start, end) of each source object in turn, on the server (UploadPartCopy): no byte
    reaches this process. Each source but the last must hold at least MIN_PART bytes; one over MAX_PART is copied
    in several parts. Past MAX_PARTS parts, runs of them are composed into objects of their own first (key +
    .compose-N), which the whole is then composed of, and removed. `create`: Exists if the key is taken."""
    pieces = [
        (source, at, min(at + MAX_PART, end)) for source, start, end in sources for at in range(start, end, MAX_PART)
    ]
    if not pieces:  # no byte to copy, and S3 has no multipart upload of 0 parts
        bucket.put(key, b"", create=create)
        return
    small = [p for p in pieces[:-1] if p[2] - p[1] < MIN_PART]
    if small:
        raise ValueError(f"{bucket.where(small[0][0])}: a part of {small[0][2] - small[0][1]:,} bytes before the last")
    runs = [pieces[i : i + MAX_PARTS] for i in range(0, len(pieces), MAX_PARTS)]
    if len(runs) > 1:
        made = [f"{key}.compose-{n}" for n in range(len(runs))]
        for run, name in zip(runs, made):
            compose(bucket, name, run, create=False)
        sizes = [sum(end - start for _, start, end in run) for run in runs]
        compose(bucket, key, [(name, 0, size) for name, size in zip(made, sizes)], create)
        for name in made:
            bucket.delete(name)
        return
    upload = Upload.begin(bucket, key)

    def copy(number: int, piece: tuple[str, int, int]) -> tuple[int, str]:
        source, start, end = piece  # never empty: a piece is a step of a range
        answer = bucket.call(
            key,
            "upload_part_copy",
            "copy",
            Key=key,
            UploadId=upload.upload,
            PartNumber=number,
            CopySource={"Bucket": bucket.name, "Key": source},
            CopySourceRange=f"bytes={start}-{end - 1}",
        )
        return number, answer["CopyPartResult"]["ETag"]

    try:
        with ThreadPoolExecutor(COPIES_AT_ONCE) as pool:
            upload.parts = list(pool.map(copy, range(1, len(pieces) + 1), pieces))
    except BaseException:
        upload.abort()
        raise
    upload.finish(create)


def put_buffers(bucket: Bucket, key: str, buffers: list, create: bool = True) -> None:
    """The buffers' bytes (numpy arrays, bytes, ...) as one object, create-only where asked: one PUT, or past
    WHOLE_PUT_BYTES a multipart upload, so that no copy of the whole is made in memory."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    if sum(len(v) for v in views) <= WHOLE_PUT_BYTES:
        bucket.put(key, b"".join(views), create=create)
        return
    upload = Upload.begin(bucket, key)
    try:
        chunk, size = [], 0
        for view in views:
            while len(view):
                take = view[: UPLOAD_PART_BYTES - size]
                chunk.append(take)
                size += len(take)
                view = view[len(take) :]
                if size == UPLOAD_PART_BYTES:
                    upload.send(chunk)
                    chunk, size = [], 0
        if chunk:
            upload.send(chunk)
    except BaseException:
        upload.abort()
        raise
    upload.finish(create=create)

"""An object of the store read as a file: ranged GETs, each If-Match the ETag the manifest recorded."""

from __future__ import annotations

import io

from tokpipe.errors import SourceError
from tokpipe.store.bucket import Bucket, Url, is_url

# Bytes a sequential Reader asks of each GET (a JSONL shard): a worker holds one such piece. 8 MiB: 13 GETs for a
# 100 MB shard, ~0.2 s of a GET's latency against the ~10-100 s of tokenizing it (1-10 MB/s a core).
READ_AHEAD = 8 << 20


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
    try:
        return open(path, "rb", buffering=0)
    except FileNotFoundError:  # the shard's failure, not the run's (a full disk's, say): the others go on
        raise SourceError(
            f"{path} is not there: the dataset moved or changed since the manifest was made; put it back, or make the"
            " manifest again (`tokpipe manifest`): one of the same files elsewhere resumes OUT"
        ) from None

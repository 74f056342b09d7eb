"""One shard -> batches of document texts, every input line accounted for.

Compression is sniffed from magic bytes, never trusted from the file name (a `.jsonl.zst` may be
plain JSONL). Lines are read as bytes: orjson parses bytes directly, and we see the invalid UTF-8
that a text wrapper would replace silently, so each repair is counted.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson
import zstandard

from tokpipe.errors import SourceError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
BOM = b"\xef\xbb\xbf"
READ_CHUNK = 1 << 16
SKIP_LOG_CAP = 100  # per batch; the shard keeps the first ones and counts all
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# Why a line is not a document. Every skipped line carries exactly one of these.
SKIP_REASONS = ("blank", "invalid_json", "not_object", "no_text", "text_not_string", "empty_text", "too_long")


class _ZstdReader(io.RawIOBase):
    """Decompressed bytes of a zstd file, frame after frame, that fails loudly where the stream breaks.

    zstandard's stream_reader ends a truncated frame as if it were a clean end of file; an
    incomplete download must never be tokenized as if it were whole, so we drive decompressobj
    and check that the last frame was finished.
    """

    def __init__(self, raw: io.BufferedReader, path: str):
        self._raw = raw
        self._path = path
        self._frame = None  # the decompressobj of the frame being read, None between frames
        self._pending = b""
        self._compressed_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            chunk = self._raw.read(READ_CHUNK)
            if not chunk:
                if self._frame is not None:
                    raise SourceError(
                        f"{self._path}: zstd stream ends inside a frame at compressed byte {self._compressed_read} "
                        "(truncated download?)"
                    )
                return 0
            self._compressed_read += len(chunk)
            self._feed(chunk)
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _feed(self, data: bytes) -> None:
        out = []
        while data:
            if self._frame is None:
                self._frame = zstandard.ZstdDecompressor().decompressobj()
            try:
                out.append(self._frame.decompress(data))
            except zstandard.ZstdError as e:
                raise SourceError(f"{self._path}: corrupt zstd data near compressed byte {self._compressed_read}: {e}") from None
            if self._frame.eof:
                data = self._frame.unused_data
                self._frame = None
            else:
                data = b""
        self._pending += b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _GzipErrors(io.RawIOBase):
    """gzip bytes with its truncation/CRC errors turned into SourceError naming the file."""

    def __init__(self, raw: io.BufferedReader, path: str):
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self._raw = raw
        self._path = path

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        try:
            return self._gz.readinto(buf)
        except (EOFError, OSError, zlib.error) as e:
            raise SourceError(f"{self._path}: gzip stream broken after {self._gz.tell()} decompressed bytes: {e}") from None

    def close(self) -> None:
        self._gz.close()
        self._raw.close()
        super().close()


def compression_of(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    return "none"


def open_bytes(path: str) -> tuple[io.BufferedReader, io.BufferedReader]:
    """(the shard's decompressed bytes as a buffered stream, the file under it for progress in file bytes)."""
    kind = compression_of(path)
    raw = open(path, "rb", buffering=0)
    if kind == "zstd":
        return io.BufferedReader(_ZstdReader(raw, path), buffer_size=1 << 20), raw
    if kind == "gzip":
        return io.BufferedReader(_GzipErrors(raw, path), buffer_size=1 << 20), raw
    return io.BufferedReader(raw, buffer_size=1 << 20), raw


@dataclass
class Batch:
    texts: list[str]
    lines: int  # input lines this batch consumed (documents + skipped)
    end_offset: int  # decompressed byte offset just past this batch's last line
    source_pos: int  # bytes of the (compressed) file read so far, for progress
    text_bytes: int  # UTF-8 bytes of the lines consumed
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    repaired: Counter = field(default_factory=Counter)  # invalid_utf8 | lone_surrogate | bom -> count
    skip_log: list[tuple[int, str]] = field(default_factory=list)  # (1-based line number, reason)


def _document(line: bytes, text_field: str, repaired: Counter) -> str | tuple[None, str]:
    """The line's text, or (None, reason)."""
    if not line.strip():
        return None, "blank"
    fallback = False
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        fallback = True
        # orjson is strict about UTF-8 and lone surrogate escapes; those lines are still documents.
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError:
            decoded = line.decode("utf-8", errors="replace")
            repaired["invalid_utf8"] += 1
        try:
            obj = json.loads(decoded)
        except ValueError:
            return None, "invalid_json"
    if not isinstance(obj, dict):
        return None, "not_object"
    if text_field not in obj:
        return None, "no_text"
    text = obj[text_field]
    if not isinstance(text, str):
        return None, "text_not_string"
    if not text:
        return None, "empty_text"
    if fallback and LONE_SURROGATE.search(text):  # orjson rejects lone surrogates: only json lets them through
        text = LONE_SURROGATE.sub("\ufffd", text)
        repaired["lone_surrogate"] += 1
    return text


def read_batches(
    path: str,
    text_field: str = "text",
    start_line: int = 0,
    start_offset: int = 0,
    batch_bytes: int = 4 << 20,
    max_line_bytes: int = 64 << 20,  # worker memory grows ~12 MiB per MB of line: keeps it under 1 GiB
) -> Iterator[Batch]:
    """Batches of about `batch_bytes` of input, resuming after `start_line` lines / `start_offset` bytes."""
    stream, raw = open_bytes(path)
    with stream:
        _skip_to(stream, start_offset, path)
        line_no, offset = start_line, start_offset
        batch = Batch([], 0, offset, 0, 0)
        while True:
            line = stream.readline(max_line_bytes + 1)
            if not line:
                break
            line_no += 1
            size = len(line)
            too_long = size > max_line_bytes and not line.endswith(b"\n")
            if too_long:
                size += _drain_line(stream)
            elif offset == 0 and line.startswith(BOM):
                line = line[len(BOM) :]
                batch.repaired["bom"] += 1
            offset += size
            batch.lines += 1
            batch.text_bytes += size
            doc = (None, "too_long") if too_long else _document(line, text_field, batch.repaired)
            if isinstance(doc, str):
                batch.texts.append(doc)
            else:
                reason = doc[1]
                batch.skipped[reason] += 1
                if len(batch.skip_log) < SKIP_LOG_CAP:
                    batch.skip_log.append((line_no, reason))
            if batch.text_bytes >= batch_bytes:
                batch.end_offset, batch.source_pos = offset, raw.tell()
                yield batch
                batch = Batch([], 0, offset, 0, 0)
        if batch.lines:
            batch.end_offset, batch.source_pos = offset, raw.tell()
            yield batch


def _skip_to(stream: io.BufferedReader, offset: int, path: str) -> None:
    remaining = offset
    while remaining:
        got = len(stream.read(min(remaining, 1 << 24)))
        if not got:
            raise SourceError(f"{path} is shorter than its checkpoint says ({offset} bytes): the file changed since the run began")
        remaining -= got


def _drain_line(stream: io.BufferedReader) -> int:
    """Read past the rest of an over-long line without holding it; returns the bytes skipped."""
    skipped = 0
    while True:
        piece = stream.readline(1 << 20)
        skipped += len(piece)
        if not piece or piece.endswith(b"\n"):
            return skipped

"""A JSONL shard (plain, zstd, gzip, bz2 or xz) -> batches of document texts, every input line accounted for.

Compression is sniffed from magic bytes, never trusted from the file name (a `.jsonl.zst` may be
plain JSONL). The decompressed bytes are cut into lines a block at a time (one C `split` per
block), and each line is parsed as bytes: orjson parses bytes directly, and we see the invalid
UTF-8 that a text wrapper would replace silently, so each repair is counted. A line that orjson
takes as a document costs one call; every other line goes through `_document`, which decides what
it is.

A resume reads no byte it does not need where the format allows it (a shard on an object store is read by
ranged GETs: tokpipe/store/): plain JSONL from the checkpoint's byte offset; zstd made of several frames (pzstd,
seekable zstd, any concatenation) from the start of the frame the checkpoint's offset is in, whose place in the
file and in the text each batch says (TextBatch.frame) and the checkpoint keeps. A gzip, bz2 or xz stream, or zstd
of one frame, cannot be entered midway: it is decoded from its start again, and the text before the offset dropped.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import orjson
import zstandard

from tokpipe.errors import SourceError, Unavailable
from tokpipe.inputs.names import BOM
from tokpipe.inputs.source.batch import TextBatch, decode_utf8, document, field_at, group_value

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A zstd skippable frame's magic is 0x184D2A50..0x184D2A5F, little-endian: these three bytes after 0x50..0x5F.
# pzstd begins its files with one (it holds the next frame's size), and any zstd writer may: valid zstd.
SKIPPABLE_MAGIC = b"\x2a\x4d\x18"


class Stream(NamedTuple):
    """A compression read as one stream from its start: its magic bytes, the standard library's file over a file
    object, an incremental decompressor (of a file's first bytes: json_array.is_json_array), and the errors of a
    broken or truncated stream."""

    magic: bytes
    opened: Callable
    decompressor: Callable
    broken: tuple[type[Exception], ...]


# Those Hugging Face datasets reads too (by these magic bytes, as tokpipe: datasets' file_utils), but lz4, a package.
STREAMS = {
    "gzip": Stream(
        b"\x1f\x8b",
        lambda raw: gzip.GzipFile(fileobj=raw, mode="rb"),
        lambda: zlib.decompressobj(wbits=31),
        (EOFError, OSError, zlib.error),
    ),
    "bz2": Stream(b"BZh", bz2.BZ2File, bz2.BZ2Decompressor, (EOFError, OSError)),
    "xz": Stream(b"\xfd7zX", lzma.LZMAFile, lzma.LZMADecompressor, (EOFError, lzma.LZMAError)),
}
COMPRESSED_CHUNK = 1 << 16  # fed to zstd at a time; its output, a few times larger, is one block
BLOCK = 1 << 20  # most decompressed bytes split into lines at once
# zstd's largest window (2 GiB, `zstd --long=31`), where zstandard's default refuses a frame of a window over 128 MiB
# as "Frame requires too much memory for decoding" (`zstd -d` asks for --long=31 or --memory=2048MB). A valid file is
# read: the window holds the frame's text as read, up to its size (peak RSS 670 MiB for 359 MB of text at
# --long=31; 15 MiB at the default window), which counts in --worker-memory as any of a worker's memory.
ZSTD_WINDOW_MAX = 1 << 31


def is_zstd(head: bytes) -> bool:
    """Whether a file's first 4 bytes begin a zstd stream: a frame, or a skippable frame (pzstd's first)."""
    return head == ZSTD_MAGIC or (len(head) == 4 and 0x50 <= head[0] <= 0x5F and head[1:] == SKIPPABLE_MAGIC)


def _zstd_blocks(raw, path: str, start: tuple[int, int]) -> Iterator[tuple[bytes, tuple[int, int]]]:
    """Decompressed bytes of a zstd file, frame after frame, from `start` (a frame's place in the file, and the
    decompressed bytes before it), each block with the same of the frame it came from; failing loudly where the
    stream breaks.

    zstandard's stream_reader ends a truncated frame as if it were a clean end of file; an
    incomplete download must never be tokenized as if it were whole, so we drive decompressobj
    and check that the last frame was finished. A skippable frame, anywhere, is a frame that
    decompressobj finishes with no output; one cut short is a truncated file as any frame is.
    """
    frame = None  # the decompressobj of the frame being read, None between frames
    read, produced = start
    begun = start  # where the frame being read began
    while chunk := raw.read(COMPRESSED_CHUNK):
        read += len(chunk)
        while chunk:
            if frame is None:
                frame = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW_MAX).decompressobj()
                begun = (read - len(chunk), produced)
            try:
                block = frame.decompress(chunk)
            except zstandard.ZstdError as e:
                raise SourceError(f"{path}: corrupt zstd data near compressed byte {read}: {e}") from None
            if block:
                produced += len(block)
                yield block, begun
            chunk, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise SourceError(f"{path}: zstd stream ends inside a frame at compressed byte {read} (truncated download?)")


def _stream_blocks(raw, path: str, kind: str) -> Iterator[tuple[bytes, tuple[int, int]]]:
    """Decompressed bytes of a gzip, bz2 or xz file (STREAMS), with its truncation/CRC errors naming the file; read
    from its start."""
    with STREAMS[kind].opened(raw) as stream:
        while True:
            try:
                block = stream.read(BLOCK)
            except Unavailable:  # an OSError: the store's failure, not the file's; the run stops, resumable
                raise
            except STREAMS[kind].broken as e:
                raise SourceError(
                    f"{path}: {kind} stream broken after {stream.tell()} decompressed bytes: {e}"
                ) from None
            if not block:
                return
            yield block, (0, 0)


def _plain_blocks(raw, path: str, start: int, block_bytes: int) -> Iterator[tuple[bytes, tuple[int, int]]]:
    """The bytes of a plain file from `start` on, where it stands: a checkpoint's offset is a place in the file."""
    while block := raw.read(block_bytes):
        yield block, (0, 0)
    if start and raw.seek(0, io.SEEK_END) < start:  # (an object read from has its size known: no HEAD)
        raise SourceError(f"{path} is shorter than its checkpoint says: the file changed since the run began")


def decompressed_blocks(
    raw, path: str, kind: str, block_bytes: int = BLOCK, start: tuple[int, int] = (0, 0)
) -> Iterator[tuple[bytes, int, tuple[int, int]]]:
    """The shard's decompressed bytes in pieces of at most block_bytes, each with the bytes of the file read so far
    and where its zstd frame began (in the file, in the text; (0, 0) for the other formats). `kind`: its compression,
    as tokpipe.inputs.source.format_of sniffed it (zstd, one of STREAMS, or none). From `start`, a place in the file
    where reading may begin, and the decompressed bytes before it: a frame's of zstd, a byte offset of plain JSONL,
    (0, 0) for a stream. `raw`: the shard's bytes, opened (tokpipe.inputs.source: a file, or a Reader of an object)."""
    raw.seek(start[0])
    if kind == "zstd":
        blocks = _zstd_blocks(raw, path, start)
    elif kind in STREAMS:
        blocks = _stream_blocks(raw, path, kind)
    else:
        blocks = _plain_blocks(raw, path, start[0], block_bytes)
    for block, frame in blocks:
        for at in range(0, len(block), block_bytes):  # only a very compressible zstd block is cut
            yield block[at : at + block_bytes] if len(block) > block_bytes else block, raw.tell(), frame


def _from_offset(
    blocks: Iterator[tuple[bytes, int, tuple[int, int]]], offset: int, path: str
) -> Iterator[tuple[bytes, int, tuple[int, int]]]:
    """The blocks after their first `offset` decompressed bytes (where a checkpoint left off)."""
    for block, source_pos, frame in blocks:
        if offset >= len(block):
            offset -= len(block)
            continue
        yield (block[offset:] if offset else block), source_pos, frame
        offset = 0
    if offset:
        raise SourceError(f"{path} is shorter than its checkpoint says: the file changed since the run began")


def _lines(
    blocks: Iterator[tuple[bytes, int, tuple[int, int]]], max_line_bytes: int
) -> Iterator[tuple[list, int, int, tuple[int, int]]]:
    """The complete lines of each block: (lines without their newline, the bytes they took, file bytes read, where
    the block's zstd frame began: the lines end inside it).

    A line over max_line_bytes is given as its length (an int) instead of its bytes, which were
    dropped as they arrived: it is never held in memory. A line that spans blocks is joined once.
    """
    carry: list[bytes] = []  # the start of a line that goes on in the next block
    carried = 0  # its length, counted on even when its bytes are dropped
    source_pos, frame = 0, (0, 0)
    for block, source_pos, frame in blocks:
        lines = block.split(b"\n")
        tail = lines.pop()  # after the last newline: the start of the next line
        if lines:
            first = carried + len(lines[0])
            if first > max_line_bytes:
                lines[0] = first
            elif carry:
                lines[0] = b"".join([*carry, lines[0]])
            if max_line_bytes < len(block):
                lines[1:] = [line if len(line) <= max_line_bytes else len(line) for line in lines[1:]]
            consumed = carried + len(block) - len(tail)
            carry, carried = [], 0  # before the yield: a long line's pieces must not outlive its join
            yield lines, consumed, source_pos, frame
        carried += len(tail)
        if tail and carried <= max_line_bytes:
            carry.append(tail)
        elif carry and carried > max_line_bytes:
            carry = []
    if carried:  # a last line without a newline
        yield [carried if carried > max_line_bytes else b"".join(carry)], carried, source_pos, frame


def _document(line: bytes, text_field: str, repaired: Counter) -> tuple[str, dict] | tuple[None, str]:
    """The line's (text, object), or (None, reason)."""
    if not line.strip():
        return None, "blank"
    try:
        return document(orjson.loads(line), text_field)
    except orjson.JSONDecodeError:
        pass
    # orjson is strict about UTF-8 and lone surrogate escapes; those lines are still documents.
    decoded = decode_utf8(line, repaired)
    try:
        obj = json.loads(decoded)
    except (ValueError, RecursionError):  # orjson refuses nesting past 1024 levels, json past its recursion limit
        return None, "invalid_json"
    return document(obj, text_field, repaired)


def _parse(lines: list, first_line_no: int, text_field: str, batch: TextBatch, group_by: str | None = None) -> None:
    """Add each line's text (and with `group_by`, its group) to the batch, or count the line as skipped."""
    append, loads, group = batch.texts.append, orjson.loads, batch.groups.append
    for i, line in enumerate(lines):
        try:  # the common case, one orjson call: a JSON object whose text is a non-empty string
            obj = loads(line)
            text = obj[text_field]
            if type(text) is str and text:
                if group_by is not None:
                    group(group_value(field_at(obj, group_by)))
                append(text)
                continue
        except Exception:  # anything else is sorted out below, exactly
            pass
        text, obj = (None, "too_long") if type(line) is int else _document(line, text_field, batch.repaired)
        if text is None:
            batch.skip(first_line_no + i + 1, obj)
            continue
        append(text)
        if group_by is not None:
            group(group_value(field_at(obj, group_by)))


def text_weight(value) -> int:
    # An id, a label, a language's code: one short ASCII word. (A Chinese sentence is one short word too, not ASCII.)
    if isinstance(value, list):  # of texts, or of objects with texts: a conversation's turns
        texts = [v for item in value for v in (item.values() if isinstance(item, dict) else [item])]
        return -1 if any(isinstance(v, str) for v in texts) else 0
    prose = isinstance(value, str) and (len(value) >= 64 or " " in value or "\n" in value or not value.isascii())
    return 1 + len(value) if prose else 0


def jsonl_fields(raw, path: str, kind: str, sample_bytes: int = 1 << 20) -> Counter:
    """Keys of the JSON objects in the first `sample_bytes` of the shard, by the characters of text they hold (0: no
    text: an object, a number, or a string of one short word: an id, a label, a language's code; below 0: a list of
    texts, a conversation's turns)."""
    fields = Counter()
    for lines, *_ in _lines(decompressed_blocks(raw, path, kind, sample_bytes), sample_bytes):
        for line in lines[:-1] if len(lines) > 1 else lines:  # the last may be cut by the sample's end
            try:
                obj = orjson.loads(line)
            except (orjson.JSONDecodeError, TypeError):
                continue
            if isinstance(obj, dict):
                fields.update({key: text_weight(value) for key, value in obj.items()})
        break
    return fields


def read_jsonl_batches(
    raw,
    path: str,
    kind: str,
    text_field: str,
    start_line: int,
    start_offset: int,
    start_frame: tuple[int, int],
    batch_bytes: int,
    max_line_bytes: int,
    group_by: str | None = None,
) -> Iterator[TextBatch]:
    """Batches of about `batch_bytes` of input, resuming after `start_line` lines / `start_offset` bytes; a zstd
    shard from `start_frame`, where the frame that offset is in begins (a checkpoint's; (0, 0): from the start)."""
    start = (start_offset, start_offset) if kind == "none" else start_frame if kind == "zstd" else (0, 0)
    blocks = decompressed_blocks(raw, path, kind, min(BLOCK, batch_bytes), start)
    line_no, offset = start_line, start_offset
    batch = TextBatch([], 0, offset, 0, 0)
    for lines, consumed, source_pos, frame in _lines(
        _from_offset(blocks, start_offset - start[1], path), max_line_bytes
    ):
        if offset == 0 and type(lines[0]) is bytes and lines[0].startswith(BOM):
            lines[0] = lines[0][len(BOM) :]
            batch.repaired["bom"] += 1
        _parse(lines, line_no, text_field, batch, group_by)
        line_no += len(lines)
        offset += consumed
        batch.lines += len(lines)
        lines.clear()  # the batch has the texts; a suspended _lines still holds this list
        batch.text_bytes += consumed
        batch.end_offset, batch.source_pos, batch.frame = offset, source_pos, frame
        if batch.text_bytes >= batch_bytes:
            yield batch
            batch = TextBatch([], 0, offset, 0, 0)
    if batch.lines:
        yield batch

"""One shard -> batches of document texts, every line (or row) accounted for.

The format is sniffed from the file's first bytes, never trusted from its name (a `.jsonl.zst` may be plain JSONL):
zstd, gzip, bz2, xz or plain JSONL (jsonl.py), or one JSON array in them (json_array.py), Parquet (parquet.py) or Arrow
(arrow.py). Each reports through batch.py, the one place where a line becomes a document, a counted skip or a counted
repair.

A shard's path is a local path or an s3:// URL, opened here alone (store.open_read opens either) and handed to the
format's reader; `etag`, the ETag the manifest recorded of a shard on a store, goes with every read of it. Parquet is
read by ranges where its footer says (no read-ahead on a store), JSON Lines from start to end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from tokpipe.inputs.source.batch import TextBatch
from tokpipe.inputs.source.json_array import array_fields, is_json_array, read_array_batches
from tokpipe.inputs.source.jsonl import STREAMS, is_zstd, jsonl_fields, read_jsonl_batches
from tokpipe.store import open_read

HEAD_BYTES = 1 << 16  # sniffed: the magic of a format, and the start of a compressed text (a JSON array's `[`)
BZ2_HEAD_BYTES = 1 << 20  # bz2's: its first text comes out of a whole block, up to 900 kB
PARQUET_MAGIC = b"PAR1"
ARROW_MAGICS = (b"ARRO", b"\xff\xff\xff\xff")  # Arrow's IPC file ("ARROW1"), and stream (its continuation marker)
BATCH_BYTES = 1 << 20  # of input text per batch (per encode call of a shard): bounds memory, paces progress reports


def format_of(path: str, etag: str | None = None) -> tuple[str, bool]:
    """(zstd | gzip | bz2 | xz | parquet | arrow | none (plain JSONL), whether its text is one JSON array), from the
    file's magic bytes, and JSON's first HEAD_BYTES."""
    with open_read(path, etag, ahead=0) as f:  # on a store, a GET of these 4 bytes (and one of JSON's head)
        head = f.read(4)
        if head.startswith(PARQUET_MAGIC):
            return "parquet", False
        if head in ARROW_MAGICS:
            return "arrow", False
        streams = (kind for kind, stream in STREAMS.items() if head.startswith(stream.magic))
        kind = "zstd" if is_zstd(head) else next(streams, "none")
        return kind, is_json_array(head + f.read((BZ2_HEAD_BYTES if kind == "bz2" else HEAD_BYTES) - 4), path, kind)


def fields_of(path: str, etag: str | None = None) -> Counter:
    """The fields documents of this shard have, each weighted by how much text it holds in the first
    lines (JSONL), or the columns (Parquet, a string column 1): what --text-field can name; 0, a field of no text; below
    0, a list of texts (a conversation's turns)."""
    kind, array = format_of(path, etag)
    with open_read(path, etag, ahead=0 if kind == "parquet" else None) as raw:
        if kind == "parquet":
            from tokpipe.inputs.source.parquet import parquet_fields

            return parquet_fields(raw, path)
        if kind == "arrow":
            from tokpipe.inputs.source.arrow import arrow_fields

            return arrow_fields(raw, path)
        if array:
            return array_fields(raw, path, kind)
        return jsonl_fields(raw, path, kind)


def read_batches(
    path: str,
    text_field: str = "text",
    start_line: int = 0,
    start_offset: int = 0,
    batch_bytes: int = BATCH_BYTES,
    max_line_bytes: int = 64 << 20,  # a line costs its process ~8 bytes a byte (bytes, text, ids): under 0.5 GiB
    group_by: str | None = None,
    etag: str | None = None,
    start_frame: tuple[int, int] = (0, 0),
) -> Iterator[TextBatch]:
    """Batches of about `batch_bytes` of input, resuming after `start_line` lines / `start_offset` bytes (for Parquet
    and Arrow, a row is a line and the offset is in rows, and for a JSON array an item; for zstd, decoded from
    `start_frame`, a checkpoint's TextBatch.frame). With `group_by` (a dotted path into a JSON line, or a Parquet
    column or a struct column's field by dot), each batch says each document's group."""
    kind, array = format_of(path, etag)
    with open_read(path, etag, ahead=0 if kind == "parquet" else None) as raw:
        if kind == "parquet":
            from tokpipe.inputs.source.parquet import read_parquet_batches  # pyarrow imported only where Parquet is

            yield from read_parquet_batches(raw, path, text_field, start_line, batch_bytes, max_line_bytes, group_by)
        elif kind == "arrow":
            from tokpipe.inputs.source.arrow import read_arrow_batches

            yield from read_arrow_batches(raw, path, text_field, start_line, batch_bytes, max_line_bytes, group_by)
        elif array:
            yield from read_array_batches(
                raw, path, kind, text_field, start_line, batch_bytes, max_line_bytes, group_by
            )
        else:
            start = (start_line, start_offset, start_frame)
            yield from read_jsonl_batches(raw, path, kind, text_field, *start, batch_bytes, max_line_bytes, group_by)

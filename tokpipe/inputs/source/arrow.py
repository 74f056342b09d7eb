"""An Arrow shard -> batches of document texts, as a Parquet one (parquet.py): its rows are documents or counted
skips by the same rules, and a checkpoint's lines (its offset the same number) are the rows consumed.

Hugging Face datasets writes `.arrow` files in Arrow's IPC stream format (save_to_disk's data-00000-of-00002.arrow,
its cache's files, a hub repo's .arrow files, which load_dataset reads with its Arrow builder); the IPC file format
(Feather v2, "ARROW1") is read too. Both are a series of record batches, each read whole (datasets writes 1,000 rows
a batch) and decoded a piece of about a block of text at a time: memory is bounded by a record batch, never the
file. A stream says nothing of its rows until its end: a resume reads the batches before its row, and skips them.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator

import pyarrow as pa

from tokpipe.errors import SourceError, Unavailable
from tokpipe.inputs.source.batch import TextBatch
from tokpipe.inputs.source.parquet import one_line, table_batches, table_fields


def _open(source, path: str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The file's schema and its record batches, in order: of the IPC file format (its footer at its end), else of
    a stream."""
    try:
        try:
            reader = pa.ipc.open_file(source)
            return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # no footer: a stream, or a file cut short
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            return reader.schema, iter(reader)
    except Unavailable:  # the store's failure, not the file's: the run stops, resumable
        raise
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: not a complete Arrow file (truncated download?): {one_line(e)}") from None


def _pieces(
    batches: Iterator[pa.RecordBatch], source, path: str, size: int, columns: list[str], start_row: int, piece: int
) -> Iterator[tuple[pa.RecordBatch, int, int]]:
    """The columns from row `start_row` on, a piece at a time: (values, number of the first row, file bytes read:
    the file's size at the last piece)."""
    row, number, held = 0, 0, None  # rows and record batches before this one; the last piece, yielded once known
    try:
        for batch in batches:
            rows = batch.num_rows
            if row + rows > start_row:
                batch = batch.select(columns)
                per = max(1, piece * rows // max(1, batch.nbytes))
                for first in range(max(row, start_row), row + rows, per):
                    if held is not None:
                        yield held
                    held = (batch.slice(first - row, per), first, min(size, source.tell()))
            row, number = row + rows, number + 1
    except Unavailable:
        raise
    except (pa.ArrowException, OSError) as e:
        raise SourceError(
            f"{path}: record batch {number} does not decode, the file is corrupt (truncated download?): {one_line(e)}"
        ) from None
    if row < start_row:
        raise SourceError(f"{path} has fewer rows than its checkpoint says: the file changed since the run began")
    if held is not None:
        yield held[0], held[1], size


def arrow_fields(source, path: str) -> Counter:
    return table_fields(_open(source, path)[0])


def read_arrow_batches(
    source,
    path: str,
    text_field: str,
    start_line: int,
    batch_bytes: int,
    max_text_bytes: int,
    group_by: str | None = None,
) -> Iterator[TextBatch]:
    """Batches of about `batch_bytes` of text, resuming after `start_line` rows."""
    size = source.seek(0, 2)
    source.seek(0)
    schema, batches = _open(source, path)
    pieces = functools.partial(_pieces, batches, source, path, size)
    yield from table_batches(schema, pieces, path, text_field, start_line, batch_bytes, max_text_bytes, group_by)

"""One Parquet shard -> batches of document texts, every row accounted for (beside source.py's JSONL reader).

A document is a row whose text column holds a non-empty string. A null is `text_not_string` (as a
JSON `"text": null` is), an empty string `empty_text`, and every row of a column that does not hold
strings `text_not_string`. Rows are read a row group at a time (pyarrow's `iter_batches`), so a
worker holds at most about one row group, never the file. Resuming needs no byte offset: the
footer gives each row group's row count, so the first `start_row` rows are skipped by row group and
then by row. A file pyarrow cannot read (footer missing, a page that does not decode) is a
SourceError naming the file and the row group.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from tokpipe.errors import SourceError
from tokpipe.source import SKIP_LOG_CAP, Batch

ROWS_PER_READ = 1024  # rows pyarrow decodes at a time, within a row group


def _open(path: str, text_field: str) -> tuple[pq.ParquetFile, bool]:
    """The file, and whether its text column holds strings."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: not a readable Parquet file ({e}); an incomplete download? re-download it") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise SourceError(f"{path}: no column {text_field!r} (it has {', '.join(schema.names)}): pass --text-field COLUMN")
    kind = schema.field(text_field).type
    return parquet, pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def read_parquet_batches(path: str, text_field: str = "text", start_row: int = 0, batch_bytes: int = 4 << 20) -> Iterator[Batch]:
    """Batches of about `batch_bytes` of text, resuming after `start_row` rows. A Batch's `lines` are
    rows, its `end_offset` the rows consumed (what resuming needs), `source_pos` the file bytes
    of the row groups read so far (for progress)."""
    parquet, strings = _open(path, text_field)
    meta = parquet.metadata
    row, read_bytes, skip = 0, 0, start_row
    batch, first = Batch([], 0, start_row, 0, 0), start_row  # first: the row the batch starts at
    for group in range(meta.num_row_groups):
        group_rows = meta.row_group(group).num_rows
        group_bytes = sum(meta.row_group(group).column(c).total_compressed_size for c in range(meta.num_columns))
        if skip >= group_rows:  # done before the checkpoint
            skip -= group_rows
            row += group_rows
            read_bytes += group_bytes
            continue
        try:
            for records in parquet.iter_batches(batch_size=ROWS_PER_READ, row_groups=[group], columns=[text_field], use_threads=False):
                values = records.column(0).to_pylist() if strings else [None] * records.num_rows
                if skip:
                    values, row, skip = values[skip:], row + min(skip, len(values)), max(skip - len(values), 0)
                for value in values:
                    row += 1
                    if type(value) is str and value:
                        batch.texts.append(value)
                        batch.text_bytes += len(value)  # characters: close enough to bytes to size a batch
                    else:
                        reason = "empty_text" if value == "" else "text_not_string"
                        batch.skipped[reason] += 1
                        if len(batch.skip_log) < SKIP_LOG_CAP:
                            batch.skip_log.append((row, reason))
                    if batch.text_bytes >= batch_bytes:  # row groups are often 100s of MB: batches end inside them
                        batch.lines, batch.end_offset, batch.source_pos = row - first, row, read_bytes
                        yield batch
                        batch, first = Batch([], 0, row, 0, 0), row
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path}: row group {group} of {meta.num_row_groups} does not decode ({e}); a damaged download? re-download it") from None
        read_bytes += group_bytes
    if row < start_row:
        raise SourceError(f"{path} has {row} rows but its checkpoint says {start_row} were read: the file changed since the run began")
    if row > first:
        batch.lines, batch.end_offset, batch.source_pos = row - first, row, read_bytes
        yield batch

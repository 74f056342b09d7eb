"""A Parquet shard -> batches of document texts, every row accounted for: a row is what a JSONL line is.

A row is a document when its text column holds a non-empty string. Any other row is a counted skip,
with the reason JSONL gives the same value: a null is `text_not_string` (as `{"text": null}` is), `""`
is `empty_text`, a text over the size limit is `too_long`, and in a column of another type (numbers,
lists, structs) every row is `text_not_string`. A `binary` column is text too (writers that store
strings without their UTF-8 annotation make those): its bytes are decoded as a JSONL line's are,
invalid UTF-8 replaced and counted; pyarrow does not check the UTF-8 of a `string` column either, so
the same goes for it. Arrow's view types (`string_view`, `binary_view`), which pyarrow reads back as
such from a file it wrote from them, are text as their plain types are. A file without the column
fails the shard: that is a wrong `--text-field`, not dirty data.

Memory is bounded by READ_BYTES a column read and a piece of about a block of text decoded at a time, never by a
row group: pandas' and pyarrow's writers put up to a million rows in one (GBs of text), whose column chunk pyarrow
would read whole. Resuming is by rows: a checkpoint's lines are the rows consumed (its offset the same number), and
the footer's row counts per row group say where they end.

A shard on a store is read through store.Reader with no read-ahead: pyarrow asks for the footer, then for each
row group from the checkpoint's on, for the column chunks it reads (the text column, and --group-by's), a ranged GET
of READ_BYTES at a time; the columns it skips and the row groups before a resume's are never fetched.
"""

from __future__ import annotations

import functools
import io
from collections import Counter
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokpipe.errors import SourceError, Unavailable
from tokpipe.inputs.source.batch import MISSING_GROUP, TextBatch, decode_utf8, group_value

PIECE_BYTES = 1 << 20  # about this much of a row group is decoded at a time
# Of a column chunk read at a time. Read whole (pyarrow's default), one row group of 234,684 rows (292 MB of zstd)
# took a worker to 753 MiB of anonymous RSS against --worker-memory's 768; read so, 156 MiB peak in pyarrow alone
# (427 whole), in the same time (0.6-0.9 s). On a store, a GET each, as store.READ_AHEAD is.
READ_BYTES = 8 << 20
TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())
# A view column as the plain type of its values, which every kernel takes (binary_length has none for views);
# by name: pyarrow < 16 has no view types, and never reads one.
VIEW_TYPES = {"string_view": pa.large_string(), "binary_view": pa.large_binary()}


def one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _open(source, path: str) -> tuple[pq.ParquetFile, int]:
    """The file with its footer read, and its size. `source`: its bytes, opened (tokpipe.inputs.source: a file, or an
    object read by ranged GETs)."""
    try:
        parquet = pq.ParquetFile(source, page_checksum_verification=True, pre_buffer=False, buffer_size=READ_BYTES)
    except Unavailable:  # the store's failure, not the file's: the run stops, resumable
        raise
    except (pa.ArrowException, OSError) as e:
        raise SourceError(
            f"{path}: not a complete Parquet file, its footer is missing or broken (truncated download?): {one_line(e)}"
        ) from None
    return parquet, source.seek(0, io.SEEK_END)


def _pieces(
    parquet: pq.ParquetFile, path: str, file_size: int, columns: list[str], start_row: int, piece_bytes: int
) -> Iterator[tuple[pa.RecordBatch, int, int]]:
    """The columns from row `start_row` on, a piece at a time: (values, number of the first row, file bytes read).

    File bytes read is for progress only: the file's size in proportion to the row groups' data read
    (the footer's sizes, interpolated by rows inside a row group), so that it ends at the file size.
    """
    groups = [parquet.metadata.row_group(g) for g in range(parquet.num_row_groups)]
    data_size = max(1, sum(g.total_byte_size for g in groups))
    row, data_before = 0, 0  # rows and data of the row groups before this one
    for number, group in enumerate(groups):
        if row + group.num_rows > start_row:
            rows_per_piece = max(1, piece_bytes * group.num_rows // max(1, group.total_byte_size))
            read = row
            try:
                for values in parquet.iter_batches(
                    rows_per_piece, row_groups=[number], columns=columns, use_threads=False
                ):
                    first = read
                    read += len(values)
                    if read <= start_row:
                        continue
                    if first < start_row:
                        values, first = values.slice(start_row - first), start_row
                    data_read = data_before + group.total_byte_size * (read - row) // group.num_rows
                    yield values, first, file_size * data_read // data_size
            except Unavailable:
                raise
            except (pa.ArrowException, OSError) as e:
                raise SourceError(
                    f"{path}: row group {number} (of {len(groups)}) does not decode, the file is corrupt: {one_line(e)}"
                ) from None
        row += group.num_rows
        data_before += group.total_byte_size


def _group_column(schema: pa.Schema, group_by: str) -> tuple[str, list[str]] | None:
    """Where --group-by's values are: (the column read, the struct fields down to them), or None when the file
    has no such column (every row's group is then MISSING_GROUP, as a JSON line without the field)."""
    if group_by in schema.names:
        return group_by, []
    column, *fields = group_by.split(".")
    if column not in schema.names:
        return None
    kind = schema.field(column).type
    for name in fields:
        if not pa.types.is_struct(kind) or kind.get_field_index(name) < 0:
            return None
        kind = kind.field(name).type
    return column, fields


def _groups(values: pa.Array, fields: list[str]) -> list[str]:
    for name in fields:
        values = pc.struct_field(values, name)
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    return [group_value(v) for v in values.to_pylist()]


def _parse(
    values: pa.Array, first_row: int, max_text_bytes: int, batch: TextBatch, groups: list[str] | None = None
) -> None:
    """Add each row's text (and its group, from `groups`, one per row) to the batch, or count the row as skipped."""
    if pa.types.is_dictionary(values.type):  # a column written from a pandas category
        values = values.dictionary_decode()
    if str(values.type) in VIEW_TYPES:
        values = values.cast(VIEW_TYPES[str(values.type)])
    if values.type in TEXT_TYPES:
        sizes = pc.binary_length(values).fill_null(0).to_pylist()
        try:
            texts = values.to_pylist()
        except UnicodeDecodeError:  # pyarrow does not check UTF-8 when reading: the bytes, decoded row by row below
            texts = values.cast(pa.large_binary()).to_pylist()
    else:
        sizes, texts = [0] * len(values), [None] * len(values)  # every row text_not_string, below
    append = batch.texts.append
    for i, (text, size) in enumerate(zip(texts, sizes)):
        if size > max_text_bytes:
            reason = "too_long"
        else:
            if type(text) is bytes:
                text = decode_utf8(text, batch.repaired)
            if type(text) is str and text:
                append(text)
                if groups is not None:
                    batch.groups.append(groups[i])
                continue
            reason = "empty_text" if text == "" else "text_not_string"
        batch.skip(first_row + i + 1, reason)
    batch.lines += len(texts)
    batch.text_bytes += sum(sizes)


def parquet_fields(source, path: str) -> Counter:
    parquet, _ = _open(source, path)
    with parquet:
        return table_fields(parquet.schema_arrow)


def table_fields(schema: pa.Schema) -> Counter:
    """Its columns: 1 a column of text, -1 a list of texts (a conversation's turns), 0 other."""
    return Counter({f.name: _text_weight(f.type) for f in schema})


def _text_weight(kind: pa.DataType) -> int:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        turn = kind.value_type
        parts = [field.type for field in turn] if pa.types.is_struct(turn) else [turn]
        return -1 if any(_text_weight(part) > 0 for part in parts) else 0
    return 1 if kind in TEXT_TYPES or str(kind) in VIEW_TYPES else 0


def read_parquet_batches(
    source,
    path: str,
    text_field: str,
    start_line: int,
    batch_bytes: int,
    max_text_bytes: int,
    group_by: str | None = None,
) -> Iterator[TextBatch]:
    """Batches of about `batch_bytes` of text, resuming after `start_line` rows (a checkpoint's offset
    is the same number)."""
    parquet, size = _open(source, path)
    with parquet:
        if start_line > parquet.metadata.num_rows:
            raise SourceError(f"{path} has fewer rows than its checkpoint says: the file changed since the run began")
        pieces = functools.partial(_pieces, parquet, path, size)
        yield from table_batches(parquet.schema_arrow, pieces, path, text_field, start_line, batch_bytes,
                                 max_text_bytes, group_by)  # fmt: skip


def table_batches(
    schema: pa.Schema,
    pieces: Callable[[list[str], int, int], Iterator[tuple[pa.RecordBatch, int, int]]],
    path: str,
    text_field: str,
    start_line: int,
    batch_bytes: int,
    max_text_bytes: int,
    group_by: str | None,
) -> Iterator[TextBatch]:
    """The batches of a file of columns (Parquet; Arrow, arrow.py): `pieces(columns, start_row, piece_bytes)` gives
    those columns from that row on, a piece at a time (values, number of the first row, file bytes read)."""
    columns = schema.names
    if text_field not in columns:
        shown = ", ".join(columns[:10]) + (", ..." if len(columns) > 10 else "")
        raise SourceError(
            f"{path} has no column {text_field!r} (its columns: {shown}); name the text column with --text-field"
        )
    where = _group_column(schema, group_by) if group_by is not None else None
    columns = [text_field] + ([where[0]] if where and where[0] != text_field else [])
    batch = TextBatch([], 0, start_line, 0, 0)
    for piece, first_row, source_pos in pieces(columns, start_line, min(PIECE_BYTES, batch_bytes)):
        values = piece.column(text_field)
        groups = None
        if group_by is not None:
            groups = _groups(piece.column(where[0]), where[1]) if where else [MISSING_GROUP] * len(values)
        _parse(values, first_row, max_text_bytes, batch, groups)
        batch.end_offset, batch.source_pos = first_row + len(values), source_pos
        if batch.text_bytes >= batch_bytes:
            yield batch
            batch = TextBatch([], 0, batch.end_offset, 0, 0)
    if batch.lines:
        yield batch

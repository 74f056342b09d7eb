"""A shard that is one JSON array (plain, zstd or gzip) -> batches of document texts, every item accounted for.

What `json.dump` of a list and pandas' `to_json(orient="records")` write, and Hugging Face's json builder reads:
an item is a line. An object is a document as a JSON Lines line is (batch.document); a string is the text of a
document whose field is "text", as the json builder makes of a list of strings. The array is decoded a block at a
time and parsed an item at a time (json's raw_decode: 310 MB/s here, ijson's C backend 147 MB/s, which also turns a
lone surrogate escape into "?" unsaid), so memory is bounded by an item, not by the file. A checkpoint's offset
counts items, as Parquet's counts rows: a resume parses the items before it again, and tokenizes none of them.
Invalid UTF-8 stops the shard, naming where (the json builder fails on it too); a lone surrogate becomes U+FFFD,
counted, as in JSON Lines (the json builder drops it).
"""

from __future__ import annotations

import codecs
import io
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterator

from tokpipe.errors import SourceError
from tokpipe.inputs.names import BOM
from tokpipe.inputs.source.batch import TextBatch, document, field_at, group_value
from tokpipe.inputs.source.jsonl import decompressed_blocks, text_weight

BLANK = re.compile(r"\s*")
DECODER = json.JSONDecoder()


def is_json_array(head: bytes, path: str, kind: str) -> bool:
    """Whether the text of a shard whose first bytes are `head` begins with `[` (past a BOM and blank space): a JSON
    array, not JSON Lines."""
    try:
        if kind == "gzip":  # GzipFile gives nothing of a stream cut short
            blocks = [zlib.decompressobj(wbits=31).decompress(head)]
        else:
            blocks = (block for block, *_ in decompressed_blocks(io.BytesIO(head), path, kind, len(head) or 1))
        for block in blocks:
            if text := block.removeprefix(BOM).lstrip():
                return text.startswith(b"[")
    except (SourceError, zlib.error):  # the stream goes on past `head`, or is broken: read as JSON Lines, said there
        pass
    return False


class _Text:
    """The array's text, decoded a block at a time as its parsing needs it; `at`: where the parsing is."""

    def __init__(self, raw, path: str, kind: str, block_bytes: int):
        self.blocks, self.path = decompressed_blocks(raw, path, kind, block_bytes), path
        self.decode, self.block_bytes = codecs.getincrementaldecoder("utf-8")().decode, block_bytes
        self.text, self.at, self.eof, self.read, self.fed = "", 0, False, 0, 0  # fed: the bytes decoded
        self.more(1)
        self.text = self.text.removeprefix(BOM.decode())

    def more(self, need: int) -> bool:
        """At least `need` characters more decoded onto the text, where the file has them; whether any were."""
        pieces = []
        while not self.eof and sum(map(len, pieces)) < need:
            block, self.read, _ = next(self.blocks, (None, self.read, None))
            try:
                pieces.append(self.decode(block or b"", final=block is None))
            except UnicodeDecodeError as e:
                raise SourceError(
                    f"{self.path}: invalid UTF-8 in a JSON array at byte {self.fed + e.start:,}"
                ) from None
            self.fed, self.eof = self.fed + len(block or b""), block is None
        self.text += "".join(pieces)
        return any(pieces)

    def next_char(self) -> str:
        """The next character that is not blank space ("" at the end of the file)."""
        while (at := BLANK.match(self.text, self.at).end()) == len(self.text) and self.more(1):
            self.at = at
        self.at = at
        return self.text[at : at + 1]

    def value(self, number: int) -> tuple[object, int]:
        """The value of item `number`, which begins at `at`, and its characters; `at` past it."""
        if self.at > self.block_bytes:  # what is parsed goes
            self.text, self.at = self.text[self.at :], 0
        while True:
            try:
                (value, end), error = DECODER.raw_decode(self.text, self.at), None
            except json.JSONDecodeError as e:
                error = e
            if error is None and end < len(self.text):
                break
            # A value that ends where the decoded text does may go on (a number), and an error there may be the cut.
            cut = error is None or error.pos >= len(self.text) - 6 or error.msg.startswith("Unterminated string")
            if not (cut and self.more(max(len(self.text) - self.at, 1 << 16))):  # an item's parses add up to 2x it
                if error is None:
                    break
                cut = cut and not self.text.rstrip().endswith("]")  # at the file's end: cut if the array is not closed
                why = "the file ends inside it (truncated?)" if cut else error.msg
                raise SourceError(f"{self.path}: not a valid JSON array at item {number:,}: {why}") from None
        chars, self.at = end - self.at, end
        return value, chars


def _items(raw, path: str, kind: str, block_bytes: int = 1 << 20) -> Iterator[tuple[object, int, int]]:
    """Each item of the array: (its value, the characters of its JSON, file bytes read)."""
    text, number = _Text(raw, path, kind, block_bytes), 0
    if text.next_char() != "[":
        raise SourceError(f"{path}: not a JSON array")
    text.at += 1
    after = text.next_char()
    while after != "]":
        number += 1
        yield *text.value(number), text.read
        if (after := text.next_char()) == ",":
            text.at += 1
            if (after := text.next_char()) == "]":
                raise SourceError(f"{path}: not a valid JSON array: a ',' before its closing ']'")
        elif after != "]":
            raise SourceError(f"{path}: not a valid JSON array after item {number:,}: ',' or ']' expected")
    text.at += 1
    if text.next_char():
        raise SourceError(
            f"{path}: not a valid JSON array: more follows its closing ']' (JSON Lines whose first line is an array?"
            " put a JSON object there)"
        )


def read_array_batches(
    raw,
    path: str,
    kind: str,
    text_field: str,
    start_item: int,
    batch_bytes: int,
    max_line_bytes: int,
    group_by: str | None = None,
) -> Iterator[TextBatch]:
    """Batches of about `batch_bytes` of the array's text, resuming after `start_item` items (a checkpoint's offset
    is the same number)."""
    batch, number = TextBatch([], 0, start_item, 0, 0), 0
    for value, chars, source_pos in _items(raw, path, kind):
        number += 1
        if number <= start_item:
            continue
        if chars > max_line_bytes:
            text, obj = None, "too_long"
        else:
            text, obj = document({"text": value} if type(value) is str else value, text_field, batch.repaired)
        if text is None:
            batch.skip(number, obj)
        else:
            batch.texts.append(text)
            if group_by is not None:
                batch.groups.append(group_value(field_at(obj, group_by)))
        batch.lines += 1
        batch.text_bytes += chars
        batch.end_offset, batch.source_pos = number, source_pos
        if batch.text_bytes >= batch_bytes:
            yield batch
            batch = TextBatch([], 0, number, 0, 0)
    if number < start_item:
        raise SourceError(f"{path} has fewer items than its checkpoint says: the file changed since the run began")
    if batch.lines:
        yield batch


def array_fields(raw, path: str, kind: str, sample_bytes: int = 1 << 20) -> Counter:
    """As jsonl_fields: the keys of the objects in the array's first `sample_bytes`, by the text they hold."""
    fields, seen = Counter(), 0
    try:
        for value, chars, _ in _items(raw, path, kind, sample_bytes):
            value = {"text": value} if type(value) is str else value  # as it is read
            if isinstance(value, dict):
                fields.update({key: text_weight(v) for key, v in value.items()})
            if (seen := seen + chars) >= sample_bytes:
                break
    except SourceError:  # what is not an array is said when the shard is read
        pass
    return fields

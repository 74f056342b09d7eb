"""A shard that is one JSON array (plain or compressed, as JSON Lines are) -> batches of document texts, every item
accounted for.

What `json.dump` of a list and pandas' `to_json(orient="records")` write, and Hugging Face's json builder reads:
an item is a line. An object is a document as a JSON Lines line is (batch.document); a string is the text of a
document whose field is "text", as the json builder makes of a list of strings. The array is decoded a block at a
time, and the items a block holds whole are parsed by one orjson call (_whole; json's scanner where orjson refuses,
and for an item cut by a block's end): 222-325 MB/s of distinct text here, 0.8-1.5 M items/s of 30 characters
(JSON Lines: 405-460 MB/s, 1.6-2.6 M; benchmarks/formats.py). An item at a time by json's raw_decode read 130-211
MB/s and 0.43 M items/s; ijson's C backend 147 MB/s, and it turns a lone surrogate escape into "?" unsaid. Memory
is bounded by a block and an item, not by the file. A checkpoint's
offset counts items, as Parquet's counts rows: a resume parses the items before it again, and tokenizes none.
Invalid UTF-8 stops the shard, naming where (the json builder fails on it too); a lone surrogate becomes U+FFFD,
counted, as in JSON Lines (the json builder drops it).
"""

from __future__ import annotations

import codecs
import io
import json
import re
from collections import Counter
from collections.abc import Iterator

import orjson
import zstandard

from tokpipe.errors import SourceError
from tokpipe.inputs.names import BOM
from tokpipe.inputs.source.batch import LONE_SURROGATE, TextBatch, document, field_at, group_value
from tokpipe.inputs.source.jsonl import STREAMS, ZSTD_WINDOW_MAX, decompressed_blocks, text_weight

BLANK = re.compile(r"[ \t\n\r]*")  # JSON's blank space (not \s: a no-break space between items is no JSON)
SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*").match  # a ',' between items
DECODER = json.JSONDecoder()
FIRST_KEY = re.compile(r'\{[ \t\n\r]*"(?:[^"\\]|\\.)*"')  # an object's `{` and its first key
SCAN = DECODER.scan_once  # raw_decode's scanner, without its wrapping of an error (_Text.value's makes the message)
NUMBER_GOES_ON = re.compile(r"[0-9.eE+-]*")  # what follows a number where the text ends may be more of it


def is_json_array(head: bytes, path: str, kind: str) -> bool:
    """Whether the text of a shard whose first bytes are `head` begins with `[` (past a BOM and blank space): a JSON
    array, not JSON Lines."""
    broken = STREAMS[kind].broken if kind in STREAMS else ()
    try:  # as much text as `head` is long: 64 KiB of zstd or gzip may hold 100s of MB (100 MB of blanks: 3 KB of zstd)
        if kind in STREAMS:
            text = STREAMS[kind].decompressor().decompress(head, len(head))
        elif kind == "zstd":
            zstd = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW_MAX)
            text = zstd.stream_reader(io.BytesIO(head), read_across_frames=True).read(len(head))
        else:
            text = head
    except (zstandard.ZstdError, *broken):  # broken: read as JSON Lines, which says so
        return False
    return text.removeprefix(BOM).lstrip().startswith(b"[")


class _Text:
    """The array's text, decoded a block at a time as its parsing needs it; `at`: where the parsing is."""

    def __init__(self, raw, path: str, kind: str, block_bytes: int, repaired: Counter | None):
        self.blocks, self.path = decompressed_blocks(raw, path, kind, block_bytes), path
        self.decode, self.block_bytes = codecs.getincrementaldecoder("utf-8")().decode, block_bytes
        self.text, self.at, self.eof, self.read, self.fed = "", 0, False, 0, 0  # fed: the bytes decoded
        self.more(1)
        if self.text.startswith(BOM.decode()):  # counted where a reading from the start says so (`repaired`)
            self.text = self.text[1:]
            if repaired is not None:
                repaired["bom"] += 1

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
            except RecursionError:  # JSON Lines skips such a line (invalid_json); an array's next item is past it
                raise SourceError(
                    f"{self.path}: item {number:,} of the JSON array is nested deeper than a JSON reader reads (orjson"
                    " stops at 1,024 levels): remove or flatten it"
                ) from None
            if error is None and not (type(value) in (int, float) and NUMBER_GOES_ON.fullmatch(self.text, end)):
                break
            # A number that ends where the decoded text does, or but for a `.`, `e` or sign after it, may go on (`1.`
            # of `1.5` parses as 1), and an error there may be the cut.
            cut = error is None or error.pos >= len(self.text) - 6 or error.msg.startswith("Unterminated string")
            if not (cut and self.more(max(len(self.text) - self.at, 1 << 16))):  # an item's parses add up to 2x it
                if error is None:
                    break
                cut = cut and not self.text.rstrip().endswith("]")  # at the file's end: cut if the array is not closed
                why = "the file ends inside it (truncated?)" if cut else error.msg
                raise SourceError(f"{self.path}: not a valid JSON array at item {number:,}: {why}") from None
        chars, self.at = end - self.at, end
        return value, chars


def _whole(text: str, at: int, limit: int) -> tuple[list[tuple[object, int]], int, bool]:
    """The items from `at` (an item's start) on that the decoded text holds whole but the last (a ',' follows each),
    each with its characters; where the next item begins; and whether orjson parsed them. Most are parsed in one
    orjson call: the text up to where _item_ends says the last items may end (a wrong guess, inside a string or a
    nested value, is no valid JSON, and the one before is tried), each given the items' mean length, which tells no
    item over `limit` where all of them are not; the rest, an item at a time by json's scanner."""
    for cut in _item_ends(text, at):
        if cut - at > limit:  # one of them may be over it: each one's length
            break
        try:
            values = orjson.loads(f"[{text[at:cut]}]")  # orjson refuses a lone surrogate, NaN, a huge integer: below
        except orjson.JSONDecodeError:
            continue
        share, extra = divmod(cut - at, len(values))
        found = [(value, share + (i < extra)) for i, value in enumerate(values)]  # chars: the items' mean
        return found, BLANK.match(text, cut + 1).end(), True
    found, scan, separator, end_of_text = [], SCAN, SEPARATOR, len(text)
    while True:
        try:
            value, end = scan(text, at)
        except (StopIteration, json.JSONDecodeError, RecursionError):  # broken, cut or too deep: _Text.value says
            return found, at, False
        if end == end_of_text or (after := separator(text, end)) is None:  # what follows is not in the text yet
            return found, at, False
        found.append((value, end - at))
        at = after.end()


def _item_ends(text: str, at: int, tries: int = 4) -> Iterator[int]:
    """Where the last items in the text after `at` may end (their `,`), last first: before the next item's start where
    the items are objects written alike (a `{` and its first key, as the item at `at` begins: a string never holds
    that quote unescaped), else at a `},` or `",` (as json.dump, its indent and pandas write them)."""
    first, end = FIRST_KEY.match(text, at), len(text)
    for _ in range(tries):
        if first:
            start = text.rfind(first[0], at + 1, end)
            cut = text.rfind(",", at, start) if start > at else -1
        else:
            cut = max(text.rfind("},", at, end), text.rfind('",', at, end))
            cut += cut >= 0
        if cut < 0:
            return
        yield cut
        end = cut


def _items(
    raw, path: str, kind: str, block_bytes: int = 1 << 20, repaired: Counter | None = None, limit: int = 64 << 20
) -> Iterator[tuple[list, bool, int]]:
    """The items of the array, a list at a time: (each one's value and the characters of its JSON (exact past
    `limit`), whether orjson parsed them (no lone surrogate then), file bytes read)."""
    text, number = _Text(raw, path, kind, block_bytes, repaired), 0
    if text.next_char() != "[":
        raise SourceError(f"{path}: not a JSON array")
    text.at += 1
    text.next_char()
    while True:  # at an item's start: after the `[`, or a `,`
        found, text.at, clean = _whole(text.text, text.at, limit)
        if found:
            number += len(found)
            yield found, clean, text.read
            continue
        if text.next_char() == "]":  # no item at all, or a ',' before it
            if number:
                raise SourceError(f"{path}: not a valid JSON array: a ',' before its closing ']'")
            break
        number += 1
        yield [text.value(number)], False, text.read
        if (after := text.next_char()) == "]":
            break
        if after != ",":
            raise SourceError(f"{path}: not a valid JSON array after item {number:,}: ',' or ']' expected")
        text.at += 1
        text.next_char()  # the next item's start, for _whole
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
    batch, number, size, first = TextBatch([], 0, start_item, 0, 0), 0, 0, start_item  # first: the batch's start
    repaired = None if start_item else batch.repaired  # a BOM: counted by the reading from the start
    for items, clean, source_pos in _items(raw, path, kind, repaired=repaired, limit=max_line_bytes):
        passed = min(max(start_item - number, 0), len(items))  # read before the checkpoint
        number += passed
        for value, chars in items[passed:] if passed else items:
            number, size = number + 1, size + chars
            text = value.get(text_field) if type(value) is dict else None
            if type(text) is str and text and chars <= max_line_bytes and (clean or not LONE_SURROGATE.search(text)):
                batch.texts.append(text)  # the common case; everything else is sorted out exactly below
            else:
                value = {"text": value} if type(value) is str else value  # as the json builder reads a text
                too_long = chars > max_line_bytes
                text, value = (None, "too_long") if too_long else document(value, text_field, batch.repaired)
                if text is None:
                    batch.skip(number, value)
                else:
                    batch.texts.append(text)
            if group_by is not None and text is not None:
                batch.groups.append(group_value(field_at(value, group_by)))
            if size >= batch_bytes:
                batch.lines, batch.text_bytes, batch.end_offset, batch.source_pos = (
                    number - first,
                    size,
                    number,
                    source_pos,
                )
                yield batch
                batch, size, first = TextBatch([], 0, number, 0, 0), 0, number
        if number > first:
            batch.lines, batch.text_bytes, batch.end_offset, batch.source_pos = number - first, size, number, source_pos
    if number < start_item:
        raise SourceError(f"{path} has fewer items than its checkpoint says: the file changed since the run began")
    if batch.lines:
        yield batch


def array_fields(raw, path: str, kind: str, sample_bytes: int = 1 << 20) -> Counter:
    """As jsonl_fields: the keys of the objects in the array's first `sample_bytes`, by the text they hold."""
    fields, seen = Counter(), 0
    try:
        for items, _, _ in _items(raw, path, kind, sample_bytes):
            for value, chars in items:
                value = {"text": value} if type(value) is str else value  # as it is read
                if isinstance(value, dict):
                    fields.update({key: text_weight(v) for key, v in value.items()})
                seen += chars
            if seen >= sample_bytes:
                break
    except SourceError:  # what is not an array is said when the shard is read
        pass
    return fields

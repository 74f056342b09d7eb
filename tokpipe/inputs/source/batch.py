"""What a source yields, and the one place where a line (or row) is counted: as a document, a skip, or a repair.

Every format reports through `TextBatch`, so the accounting is the same whatever the shard's format:
documents + skipped == lines read, every skip with exactly one reason, every repair counted.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import orjson

SKIP_LOG_CAP = 100  # per batch; the shard keeps the first ones and counts all

MISSING_GROUP = "__missing__"  # --group-by: the group of a document without the field (or with null there)

# Why a line is not a document. Every skipped line carries exactly one of these.
SKIP_REASONS = ("blank", "invalid_json", "not_object", "no_text", "text_not_string", "empty_text", "too_long")
# Dirty data leaves a few lines that are not JSON objects; more than this share of a shard's lines can only
# mean the wrong format (CSV, a Git LFS pointer, a compression tokpipe does not read, a binary
# file), and the shard fails: skipped line by line, it would pass at exit 0 with nothing tokenized.
NOT_JSON_SHARE = 0.5


@dataclass
class TextBatch:
    texts: list[str]
    lines: int  # input lines this batch consumed (documents + skipped)
    end_offset: int  # decompressed byte offset just past this batch's last line (Parquet: rows)
    source_pos: int  # bytes of the (compressed) file read so far, for progress
    text_bytes: int  # decompressed input bytes consumed (the lines, newlines included)
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    repaired: Counter = field(default_factory=Counter)  # invalid_utf8 | lone_surrogate | bom -> count
    skip_log: list[tuple[int, str]] = field(default_factory=list)  # (1-based line number, reason)
    groups: list[str] = field(default_factory=list)  # with --group-by: each text's group, in step with texts
    # zstd: where the frame that end_offset lies in begins, in the file and in the decompressed text: a resume
    # decodes from there (jsonl.py). (0, 0) for the other formats.
    frame: tuple[int, int] = (0, 0)

    def skip(self, line_no: int, reason: str) -> None:
        """Count line `line_no` (1-based) as not a document, for `reason` (one of SKIP_REASONS)."""
        self.skipped[reason] += 1
        if len(self.skip_log) < SKIP_LOG_CAP:
            self.skip_log.append((line_no, reason))


def not_json_lines(lines: int, skipped: Counter) -> str | None:
    """Why a shard whose `lines` read so far were skipped as `skipped` says is not JSON Lines; None while at
    most NOT_JSON_SHARE of them are not JSON objects."""
    wrong = skipped["invalid_json"] + skipped["not_object"]
    if wrong <= lines * NOT_JSON_SHARE:
        return None
    return (
        f"{wrong:,} of the {lines:,} lines read are not JSON objects (invalid_json {skipped['invalid_json']:,}, "
        f"not_object {skipped['not_object']:,}): it is neither JSON Lines nor a JSON array of objects or texts (CSV?"
        " rows as lists? a Git LFS pointer?), or "
        "in a compression tokpipe does not read (it reads zstd, gzip, bz2 and xz), or binary"
    )


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def document(obj, text_field: str, repaired: Counter | None = None) -> tuple[str, dict] | tuple[None, str]:
    """A parsed line's (or item's) (text, object), or (None, why it is no document). `repaired`: where a lone
    surrogate escape may have come through (a parser other than orjson), it becomes U+FFFD there, counted."""
    if not isinstance(obj, dict):
        return None, "not_object"
    if text_field not in obj:
        return None, "no_text"
    text = obj[text_field]
    if not isinstance(text, str):
        return None, "text_not_string"
    if not text:
        return None, "empty_text"
    if repaired is not None and LONE_SURROGATE.search(text):
        text = LONE_SURROGATE.sub("\ufffd", text)
        repaired["lone_surrogate"] += 1
    return text, obj


def decode_utf8(raw: bytes, repaired: Counter) -> str:
    """Text of bytes; invalid UTF-8 is replaced (U+FFFD) and counted, never dropped."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        repaired["invalid_utf8"] += 1
        return raw.decode("utf-8", errors="replace")


def group_value(value) -> str:
    """A document's group, from its --group-by field's value: a string as it is, another value as its JSON
    text (`5`, `true`, `["a"]`), an absent or null field MISSING_GROUP."""
    if type(value) is str:
        return value
    return MISSING_GROUP if value is None else orjson.dumps(value, default=str).decode()


def field_at(obj: dict, path: str):
    """The value at a dotted path (`meta.redpajama_set_name`) of a JSON object; a key that holds the dots
    itself is taken first. None where there is nothing."""
    if path in obj:
        return obj[path]
    for key in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj

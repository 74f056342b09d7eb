"""source/jsonl.py (through tokpipe.inputs.source.read_batches): JSONL plain, zstd or gzip, the compression sniffed from
its magic bytes (source/__init__.py) never its name, pzstd's skippable frames included; every line accounted for,
the same lines whatever the block size; resumable at a line/byte offset; a truncated download fails by name."""

import gzip
from collections import Counter

import pytest
import zstandard
from helpers import pzstd_frames, read_all, skippable_frame, write_jsonl

from tokpipe.errors import SourceError
from tokpipe.inputs.source import format_of

LINES = [
    '{"text": "first"}',
    "",
    '{"text": ""}',
    "not json",
    "[1, 2]",
    '{"body": "no text field"}',
    '{"text": 7}',
    '{"text": "second", "meta": {"x": 1}}',
]


@pytest.mark.parametrize("compression", ["none", "zstd", "gzip"])
def test_compression_is_sniffed_not_taken_from_the_name(tmp_path, compression):
    # Every file is named .jsonl.zst, as the Dolma file that is really plain JSONL.
    path = write_jsonl(tmp_path / "x.jsonl.zst", LINES, compression)
    assert format_of(str(path)) == compression
    texts, skipped, batches = read_all(path)
    assert texts == ["first", "second"]
    assert dict(skipped) == {
        "blank": 1,
        "empty_text": 1,
        "invalid_json": 1,
        "not_object": 1,
        "no_text": 1,
        "text_not_string": 1,
    }
    assert sum(b.lines for b in batches) == len(LINES)
    assert [line for b in batches for line in b.skip_log] == [
        (2, "blank"),
        (3, "empty_text"),
        (4, "invalid_json"),
        (5, "not_object"),
        (6, "no_text"),
        (7, "text_not_string"),
    ]


def test_batches_are_cut_by_bytes_and_resume_exactly(tmp_path):
    lines = [f'{{"text": "doc {i} ' + "x" * (i % 50) + '"}' for i in range(1000)]
    path = write_jsonl(tmp_path / "x.jsonl.zst", lines, "zstd")
    whole, _, batches = read_all(path, batch_bytes=4096)
    assert len(batches) > 5 and all(b.text_bytes >= 4096 for b in batches[:-1])
    # Resume after the third batch: the same documents follow.
    consumed_lines = sum(b.lines for b in batches[:3])
    rest, _, _ = read_all(path, batch_bytes=4096, start_line=consumed_lines, start_offset=batches[2].end_offset)
    assert rest == whole[consumed_lines:]


def test_truncated_zstd_download_fails_loudly_naming_the_file(tmp_path):
    data = b"".join(b'{"text": "line %d"}\n' % i for i in range(50000))
    compressed = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(SourceError, match="cut.jsonl.zst.*truncated"):
        read_all(path)


def test_multi_frame_zstd_reads_every_frame(tmp_path):
    c = zstandard.ZstdCompressor()
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(c.compress(b'{"text": "a"}\n') + c.compress(b'{"text": "b"}\n'))
    assert read_all(path)[0] == ["a", "b"]


def test_a_zstd_file_that_starts_with_a_skippable_frame_is_zstd(tmp_path):
    # pzstd's layout: a skippable frame before each frame, holding that frame's compressed size.
    path = tmp_path / "pzstd.jsonl.zst"
    path.write_bytes(pzstd_frames([b'{"text": "%d"}\n' % i for i in range(3)]))
    assert format_of(str(path)) == "zstd"
    texts, skipped, batches = read_all(path)
    assert (texts, skipped, sum(b.lines for b in batches)) == (["0", "1", "2"], Counter(), 3)


def test_a_truncated_skippable_frame_is_a_truncated_file(tmp_path):
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(skippable_frame(b"x" * 100, 0x184D2A5F)[:40])
    with pytest.raises(SourceError, match="cut.jsonl.zst: zstd stream ends inside a frame at compressed byte 40"):
        read_all(path)


def test_json_nested_deeper_than_any_parser_reads_is_invalid_json(tmp_path):
    # orjson refuses nesting past 1,024 levels, the json module past its recursion limit: a counted skip.
    deep = '{"text": "deep", "x": ' + "[" * 1100 + "]" * 1100 + "}"
    path = write_jsonl(tmp_path / "x.jsonl", ['{"text": "a"}', deep, '{"text": "b"}'])
    texts, skipped, batches = read_all(path)
    assert (texts, skipped) == (["a", "b"], Counter(invalid_json=1))
    assert [line for b in batches for line in b.skip_log] == [(2, "invalid_json")]


def test_over_long_line_is_skipped_without_being_held(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", ['{"text": "' + "y" * 10000 + '"}', '{"text": "after"}'])
    texts, skipped, batches = read_all(path, max_line_bytes=1000)
    assert texts == ["after"] and skipped == {"too_long": 1}
    assert batches[-1].end_offset == path.stat().st_size


BLOCK_EDGE_LINES = [
    b'\xef\xbb\xbf{"text": "a BOM, then a line that spans blocks ' + b"x" * 300 + b'"}',
    b"\r",
    b'{"text": "' + b"too long " * 100 + b'"}',
    b'{"text": "crlf"}\r',
    b"not json",
    b'{"text": "bad \xff utf8"}',
    b'{"text": "lone \\ud800"}',
    b"",
    b'{"text": "last, with no newline"}',
]


@pytest.mark.parametrize("compression", ["none", "zstd", "gzip"])
def test_lines_are_the_same_whatever_the_block_size(tmp_path, compression):
    # batch_bytes also caps the block the bytes are split in: 1 byte makes every line span blocks.
    data = b"\n".join(BLOCK_EDGE_LINES)
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(
        zstandard.ZstdCompressor().compress(data)
        if compression == "zstd"
        else gzip.compress(data)
        if compression == "gzip"
        else data
    )
    expected_texts = [
        "a BOM, then a line that spans blocks " + "x" * 300,
        "crlf",
        "bad \ufffd utf8",
        "lone \ufffd",
        "last, with no newline",
    ]
    for batch_bytes in (1, 7, 100, 4 << 20):
        texts, skipped, batches = read_all(path, batch_bytes=batch_bytes, max_line_bytes=500)
        assert texts == expected_texts, batch_bytes
        assert dict(skipped) == {"blank": 2, "too_long": 1, "invalid_json": 1}
        assert [line for b in batches for line in b.skip_log] == [
            (2, "blank"),
            (3, "too_long"),
            (5, "invalid_json"),
            (8, "blank"),
        ]
        assert sum((b.repaired for b in batches), start=Counter()) == {"bom": 1, "invalid_utf8": 1, "lone_surrogate": 1}
        assert sum(b.lines for b in batches) == len(BLOCK_EDGE_LINES)
        assert batches[-1].end_offset == len(data)
        # Resuming at any batch's end, as a checkpoint would, reads exactly the rest.
        for k in range(len(batches)):
            done = sum(b.lines for b in batches[: k + 1])
            rest, _, _ = read_all(
                path, batch_bytes=batch_bytes, max_line_bytes=500, start_line=done, start_offset=batches[k].end_offset
            )
            assert rest == texts[sum(len(b.texts) for b in batches[: k + 1]) :]


def test_a_checkpoint_past_the_end_of_the_file_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", ['{"text": "short"}'])
    with pytest.raises(SourceError, match="shorter than its checkpoint"):
        read_all(path, start_line=5, start_offset=1000)


def test_group_by_takes_each_documents_value_at_a_dotted_path_as_a_string(tmp_path):
    """--group-by: the value at the path, a string as it is and any other value as its JSON text; a line
    without it (or with null there) is in group __missing__; skipped lines have no group."""
    path = write_jsonl(
        tmp_path / "g.jsonl",
        [
            '{"text": "a", "meta": {"set": "Books"}}',
            '{"text": "", "meta": {"set": "Skipped"}}',
            '{"text": "b", "meta": {"set": 5}}',
            '{"text": "c", "meta": {}}',
            '{"text": "d"}',
            '{"text": "e", "meta": {"set": null}}',
            '{"text": "f", "meta": "flat"}',
            '{"text": "g", "meta.set": "dotted key"}',
            '{"text": "h", "meta": {"set": ["x", 1]}}',
            b'{"text": "i \xff", "meta": {"set": "repaired line"}}',
        ],
    )
    texts, skipped, batches = read_all(path, group_by="meta.set", batch_bytes=40)
    assert texts == ["a", "b", "c", "d", "e", "f", "g", "h", "i \ufffd"]
    assert [g for b in batches for g in b.groups] == [
        "Books",
        "5",
        "__missing__",
        "__missing__",
        "__missing__",
        "__missing__",
        "dotted key",
        '["x",1]',
        "repaired line",
    ]
    assert skipped == Counter(empty_text=1)
    assert all(b.groups == [] for b in read_all(path)[2])  # without --group-by

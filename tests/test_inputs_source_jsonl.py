"""source/jsonl.py (through tokpipe.inputs.source.read_batches): JSONL plain, zstd, gzip, bz2 or xz, the compression
sniffed from its magic bytes (source/__init__.py) never its name, pzstd's skippable frames included; every line
accounted for, the same lines whatever the block size; resumable at a line/byte offset; a truncated download fails by
name, a store that stops answering stops the read, resumable. A shard
on an object store reads as its local copy, and a resume fetches from the checkpoint's place: plain JSONL's byte
offset, the frame it is in of zstd made of several."""

from collections import Counter

import pytest
import zstandard
from helpers import COMPRESS, pzstd_frames, read_all, skippable_frame, write_jsonl

from tokpipe.errors import SourceError
from tokpipe.inputs.source import format_of
from tokpipe.store import Bucket, StoreUnavailable

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


@pytest.mark.parametrize("compression", ["none", "zstd", "gzip", "bz2", "xz"])
def test_compression_is_sniffed_not_taken_from_the_name(tmp_path, compression):
    # Every file is named .jsonl.zst, as the Dolma file that is really plain JSONL.
    path = write_jsonl(tmp_path / "x.jsonl.zst", LINES, compression)
    assert format_of(str(path)) == (compression, False)
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


@pytest.mark.parametrize("compression", ["gzip", "bz2", "xz"])
def test_a_truncated_or_corrupt_stream_fails_naming_the_file(tmp_path, compression):
    compressed = COMPRESS[compression](b"".join(b'{"text": "line %d"}\n' % i for i in range(50000)))
    cut, flipped = tmp_path / "cut.jsonl.gz", tmp_path / "flipped.jsonl.gz"
    cut.write_bytes(compressed[: len(compressed) // 2])
    middle = len(compressed) // 2
    flipped.write_bytes(
        compressed[:middle] + bytes(b ^ 0xFF for b in compressed[middle : middle + 64]) + compressed[middle + 64 :]
    )
    for path in (cut, flipped):
        with pytest.raises(SourceError, match=rf"^{path}: {compression} stream broken after \d+ decompressed bytes: "):
            read_all(path)


def test_multi_frame_zstd_reads_every_frame(tmp_path):
    c = zstandard.ZstdCompressor()
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(c.compress(b'{"text": "a"}\n') + c.compress(b'{"text": "b"}\n'))
    assert read_all(path)[0] == ["a", "b"]


def test_a_zstd_file_of_the_largest_window_is_read(tmp_path):
    # What `cat *.jsonl | zstd --long=31` writes: a frame that declares a 2 GiB window (its size unknown when
    # streamed), which zstandard's decoder refuses by default, as `zstd -d` does without --long=31.
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=31, enable_ldm=True)
    path = tmp_path / "long.jsonl.zst"
    with open(path, "wb") as f, zstandard.ZstdCompressor(compression_params=params).stream_writer(f) as writer:
        writer.write(b"".join(b'{"text": "line %d"}\n' % i for i in range(1000)))
    assert zstandard.get_frame_parameters(path.read_bytes()).window_size == 1 << 31
    assert read_all(path)[0] == [f"line {i}" for i in range(1000)]


def test_a_zstd_file_that_starts_with_a_skippable_frame_is_zstd(tmp_path):
    # pzstd's layout: a skippable frame before each frame, holding that frame's compressed size.
    path = tmp_path / "pzstd.jsonl.zst"
    path.write_bytes(pzstd_frames([b'{"text": "%d"}\n' % i for i in range(3)]))
    assert format_of(str(path)) == ("zstd", False)
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


@pytest.mark.parametrize("compression", ["none", "zstd", "gzip", "bz2", "xz"])
def test_lines_are_the_same_whatever_the_block_size(tmp_path, compression):
    # batch_bytes also caps the block the bytes are split in: 1 byte makes every line span blocks.
    data = b"\n".join(BLOCK_EDGE_LINES)
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(COMPRESS[compression](data))
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


# -- a shard on an object store, against a real S3 server --------------------------------------------------


@pytest.fixture
def gets(monkeypatch) -> list[tuple[str, int, int]]:
    """The (key, start, end) of every ranged GET tokpipe makes, in order (store.Bucket.read, which still reads)."""
    made, read = [], Bucket.read

    def recorded(bucket, key, start, end, etag=None):
        made.append((key.rsplit("/", 1)[1], start, end))
        return read(bucket, key, start, end, etag)

    monkeypatch.setattr(Bucket, "read", recorded)
    return made


@pytest.mark.parametrize("compression", ["none", "zstd", "gzip", "bz2", "xz"])
def test_a_shard_on_a_store_reads_as_its_local_copy(tmp_path, s3_server, s3_prefix, compression):
    path = write_jsonl(tmp_path / "x.jsonl.zst", BLOCK_EDGE_LINES * 50, compression)
    etag = s3_server.put(f"{s3_prefix}/x.jsonl.zst", path.read_bytes())
    url = s3_server.url(f"{s3_prefix}/x.jsonl.zst")
    assert format_of(url, etag) == (compression, False)
    for batch_bytes in (7, 4 << 20):
        local = read_all(path, batch_bytes=batch_bytes, max_line_bytes=500)
        remote = read_all(url, batch_bytes=batch_bytes, max_line_bytes=500, etag=etag)
        assert remote[:2] == local[:2] and local[0]
        assert [(b.lines, b.end_offset, b.source_pos, b.frame) for b in remote[2]] == [
            (b.lines, b.end_offset, b.source_pos, b.frame) for b in local[2]
        ]


@pytest.mark.parametrize("compression", ["none", "zstd", "gzip", "bz2", "xz"])
def test_a_store_away_mid_read_stops_the_read_resumable_and_fails_no_shard(
    tmp_path, s3_server, s3_prefix, monkeypatch, compression
):
    # The store's StoreUnavailable is an OSError, which a stream's reader takes for a broken stream: a gzip shard read
    # while the store was away failed as "gzip stream broken" (left out with --skip-failed), the run not stopped.
    path = write_jsonl(tmp_path / "x.jsonl", [f'{{"text": "{i}"}}' for i in range(3000)], compression)
    etag = s3_server.put(f"{s3_prefix}/x.jsonl", path.read_bytes())
    read, reads = Bucket.read, []

    def away(bucket, key, start, end, etag=None):
        reads.append(start)
        if len(reads) > 2:  # past the format's two GETs
            raise StoreUnavailable(f"s3://{bucket.name}/{key}: cannot reach the store")
        return read(bucket, key, start, end, etag)

    monkeypatch.setattr(Bucket, "read", away)
    with pytest.raises(StoreUnavailable, match="cannot reach the store"):
        read_all(s3_server.url(f"{s3_prefix}/x.jsonl"), etag=etag)
    assert len(reads) == 3


def test_a_plain_shard_resumes_on_a_store_by_a_ranged_get_at_its_checkpoints_offset(
    tmp_path, s3_server, s3_prefix, gets
):
    lines = [f'{{"text": "document {i} {"word " * (i % 40)}"}}' for i in range(2000)]
    path = write_jsonl(tmp_path / "x.jsonl", lines)
    etag = s3_server.put(f"{s3_prefix}/x.jsonl", path.read_bytes())
    url = s3_server.url(f"{s3_prefix}/x.jsonl")
    texts, _, batches = read_all(path, batch_bytes=20_000)
    at = batches[3]  # a checkpoint after the fourth batch
    done = sum(b.lines for b in batches[:4])
    del gets[:]
    rest, _, _ = read_all(url, batch_bytes=20_000, start_line=done, start_offset=at.end_offset, etag=etag)
    assert rest == texts[sum(len(b.texts) for b in batches[:4]) :]
    size = path.stat().st_size
    # The format's 4 bytes and its text's first 64 KiB (a JSON array?), then the rest from the checkpoint's offset:
    # not a byte before it.
    reads = [("x.jsonl", 0, 4), ("x.jsonl", 4, 1 << 16), ("x.jsonl", at.end_offset, at.end_offset + (8 << 20))]
    assert gets == reads
    assert 0 < at.end_offset < size < at.end_offset + (8 << 20)


def test_zstd_of_several_frames_resumes_from_the_frame_its_checkpoint_is_in(tmp_path, s3_server, s3_prefix, gets):
    """pzstd's layout (a skippable frame before each frame): each batch says where the frame its end is in begins,
    in the file and in the text, and a resume decodes from there; on a store, a ranged GET from there."""
    parts = [b"".join(b'{"text": "frame %d line %d"}\n' % (f, i) for i in range(300)) for f in range(4)]
    data = pzstd_frames(parts)
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(data)
    frames = [zstandard.ZstdCompressor().compress(part) for part in parts]
    starts = [(sum(12 + len(f) for f in frames[:k]) + 12, sum(len(p) for p in parts[:k])) for k in range(4)]
    texts, _, batches = read_all(path, batch_bytes=3000)
    assert len(batches) > 4
    for b in batches:  # the frame whose text the batch's end is in (or ends at)
        assert b.frame == starts[max(k for k in range(4) if starts[k][1] < b.end_offset)]
    k = next(i for i, b in enumerate(batches) if b.frame == starts[2] and b.end_offset > starts[2][1] + 100)
    done, at = sum(b.lines for b in batches[: k + 1]), batches[k]
    expected = texts[sum(len(b.texts) for b in batches[: k + 1]) :]
    resumed = dict(batch_bytes=3000, start_line=done, start_offset=at.end_offset, start_frame=at.frame)
    assert read_all(path, **resumed)[0] == expected
    etag = s3_server.put(f"{s3_prefix}/x.jsonl.zst", data)
    del gets[:]
    assert read_all(s3_server.url(f"{s3_prefix}/x.jsonl.zst"), etag=etag, **resumed)[0] == expected
    head = ("x.jsonl.zst", 4, min(1 << 16, len(data)))  # its text's first bytes: a JSON array?
    assert gets == [("x.jsonl.zst", 0, 4), head, ("x.jsonl.zst", starts[2][0], starts[2][0] + (8 << 20))]


@pytest.mark.parametrize("compression", ["zstd", "gzip", "bz2", "xz"])
def test_one_zstd_frame_or_a_stream_is_decoded_from_its_start_again(tmp_path, s3_server, s3_prefix, gets, compression):
    path = write_jsonl(tmp_path / "x.jsonl.gz", [f'{{"text": "{i}"}}' for i in range(3000)], compression)
    texts, _, batches = read_all(path, batch_bytes=5000)
    assert {b.frame for b in batches} == {(0, 0)}
    etag = s3_server.put(f"{s3_prefix}/x.jsonl.gz", path.read_bytes())
    del gets[:]
    done = sum(b.lines for b in batches[:2])
    rest = read_all(
        s3_server.url(f"{s3_prefix}/x.jsonl.gz"), start_line=done, start_offset=batches[1].end_offset, etag=etag
    )[0]
    assert rest == texts[done:] and gets[2][1] == 0  # after the format's GETs, from the start

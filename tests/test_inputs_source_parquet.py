"""parquet: Parquet shards give the same tokens as the same documents in JSONL; every row is a document or
a counted skip, as JSONL would count it; resumable at any row; memory bounded by a row group; a cut or
corrupt file fails by name; through `tokpipe run`, a kill -9 mid-file (at a shard checkpoint,
helpers.killed_run) resumes to the same bytes and a cut shard fails by name. On an object store, a shard reads as
its local copy, fetching the footer and the column chunks read, and a resume not the row groups before it. (The
reader's tests here came from a second implementation of this issue.)"""

import io
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    EXAMPLE_CACHE,
    PARQUET_CACHE,
    QWEN3,
    REPO,
    VAL_DOCUMENTS,
    Crash,
    assert_out_is,
    cli,
    crash_in_batch,
    killed_run,
    read_all,
    run_args,
    tokpipe,
    unguarded,
    write_jsonl,
)

from tokpipe.errors import SourceError
from tokpipe.inputs import source
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.source import read_batches
from tokpipe.inputs.source.parquet import READ_BYTES
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.checkpoints import Checkpoint
from tokpipe.layout.files import ShardFiles
from tokpipe.options import RunOptions
from tokpipe.runner.identity import encode_spec
from tokpipe.store import Bucket
from tokpipe.write.finalize import finalize
from tokpipe.write.shard import tokenize_shard

MANIFEST = build_manifest(PARQUET_CACHE)
INFO = load_tokenizer_info(QWEN3)
ROW_GROUP = 64  # rows per row group in the example (examples/make_parquet_example.py --row-group 64)
EXAMPLE_TRAIN = Path(MANIFEST.source[0].path)


def test_the_parquet_example_gives_the_bytes_of_the_same_documents_in_jsonl(tmp_path, example_reference):
    assert [(s.split, s.relpath) for s in MANIFEST.shards()] == [
        ("train", "data/train-00000-of-00002.parquet"),
        ("train", "data/train-00001-of-00002.parquet"),
        ("validation", "data/validation-00000-of-00001.parquet"),
    ]
    spec = unguarded(encode_spec(RunOptions(), INFO, "gigatoken"))
    for shard in MANIFEST.shards():
        tokenize_shard(shard, tmp_path, spec)
    meta = finalize(tmp_path, MANIFEST, INFO, RunOptions().output)
    assert_out_is(tmp_path, example_reference)  # the reference reads the JSONL example by hand
    rows = sum(pq.ParquetFile(s.path).metadata.num_rows for s in MANIFEST.shards() if s.split == "train")
    assert meta["splits"]["train"]["lines"] == rows == 295 and meta["splits"]["train"]["skipped"] == {"empty_text": 2}


def write_parquet(path, columns: dict, **options):
    pq.write_table(pa.table(columns), path, **options)
    return path


def test_rows_are_documents_or_skips_counted_as_the_same_values_in_jsonl(tmp_path):
    values = ["first", None, "", "second"]
    parquet = write_parquet(tmp_path / "x.parquet", {"id": [1, 2, 3, 4], "text": values})
    jsonl = write_jsonl(
        tmp_path / "x.jsonl", ['{"text": "first"}', '{"text": null}', '{"text": ""}', '{"text": "second"}']
    )
    texts, skipped, batches = read_all(parquet)
    assert texts == ["first", "second"]
    assert dict(skipped) == {"text_not_string": 1, "empty_text": 1}
    assert [entry for b in batches for entry in b.skip_log] == [(2, "text_not_string"), (3, "empty_text")]
    assert sum(b.lines for b in batches) == len(values)
    jsonl_texts, jsonl_skipped, jsonl_batches = read_all(jsonl)
    assert (texts, skipped) == (jsonl_texts, jsonl_skipped)
    assert [e for b in batches for e in b.skip_log] == [e for b in jsonl_batches for e in b.skip_log]


@pytest.mark.parametrize(
    "column, texts, skipped, repaired",
    [
        (pa.array(["a", "b"], pa.large_string()), ["a", "b"], {}, {}),
        (pa.array(["a", "b", "a"]).dictionary_encode(), ["a", "b", "a"], {}, {}),  # a pandas category
        # Writers that store strings without the UTF-8 annotation make binary columns: decoded, repaired.
        (
            pa.array([b"ok", b"bad \xff utf8", None], pa.binary()),
            ["ok", "bad \ufffd utf8"],
            {"text_not_string": 1},
            {"invalid_utf8": 1},
        ),
        # pyarrow reads a string column without checking its UTF-8: the same repair.
        (
            pa.array([b"ok", b"bad \xff utf8"], pa.binary()).view(pa.string()),
            ["ok", "bad \ufffd utf8"],
            {},
            {"invalid_utf8": 1},
        ),
        (pa.array([1, 2, None]), [], {"text_not_string": 3}, {}),
        (pa.array([["a"], ["b"]]), [], {"text_not_string": 2}, {}),
        # Arrow's view types, which pyarrow writes to Parquet and reads back as such.
        (pa.array(["a", None, "", "b"], pa.string_view()), ["a", "b"], {"text_not_string": 1, "empty_text": 1}, {}),
        (pa.array([b"ok", b"bad \xff utf8"], pa.binary_view()), ["ok", "bad \ufffd utf8"], {}, {"invalid_utf8": 1}),
    ],
    ids=["large_string", "dictionary", "binary", "invalid_utf8_string", "int64", "list", "string_view", "binary_view"],
)
def test_column_types(tmp_path, column, texts, skipped, repaired):
    path = write_parquet(tmp_path / "x.parquet", {"text": column})
    got, got_skipped, batches = read_all(path)
    assert got == texts and dict(got_skipped) == skipped
    assert sum((b.repaired for b in batches), start=Counter()) == repaired
    assert sum(b.lines for b in batches) == len(column)


def test_the_format_is_sniffed_not_taken_from_the_name(tmp_path):
    parquet_named_jsonl = write_parquet(tmp_path / "x.jsonl.zst", {"text": ["from parquet"]})
    jsonl_named_parquet = write_jsonl(tmp_path / "y.parquet", ['{"text": "from jsonl"}'])
    assert read_all(parquet_named_jsonl)[0] == ["from parquet"]
    assert read_all(jsonl_named_parquet)[0] == ["from jsonl"]


def test_batches_are_cut_by_bytes_and_resume_at_any_row(tmp_path):
    texts = [f"document {i} " + "word " * (i % 37) for i in range(200)]
    path = write_parquet(tmp_path / "x.parquet", {"text": texts}, row_group_size=16)
    for batch_bytes in (1, 700, 4 << 20):
        got, _, batches = read_all(path, batch_bytes=batch_bytes)
        assert got == texts, batch_bytes
        assert all(b.text_bytes >= batch_bytes for b in batches[:-1])
        assert [b.end_offset for b in batches] == [sum(b.lines for b in batches[: k + 1]) for k in range(len(batches))]
        positions = [b.source_pos for b in batches]
        assert positions == sorted(positions) and positions[-1] == os.path.getsize(path)
        for b in batches:  # a checkpoint after any batch: the rest follows
            assert (
                read_all(path, batch_bytes=batch_bytes, start_line=b.end_offset, start_offset=b.end_offset)[0]
                == texts[b.end_offset :]
            )
    # Rows inside a row group, at its edges, and at the end.
    for row in (0, 5, 15, 16, 17, 199, 200):
        rest, _, batches = read_all(path, batch_bytes=700, start_line=row, start_offset=row)
        assert rest == texts[row:] and sum(b.lines for b in batches) == 200 - row


def test_memory_is_bounded_by_a_row_group_not_the_file(tmp_path):
    # 64 row groups of ~240 KB of text: pyarrow holds a piece of one at a time, never the 15 MB file.
    texts = [f"{i} " + "a large document " * 3750 for i in range(256)]
    path = write_parquet(tmp_path / "big.parquet", {"text": texts}, row_group_size=4, compression="none")
    peak = 0
    for _ in read_batches(str(path), batch_bytes=256 << 10):
        peak = max(peak, pa.total_allocated_bytes())
    assert peak < 1 << 20, f"{peak:,} bytes held by pyarrow at once"


def test_a_row_group_of_any_size_is_read_a_few_mib_at_a_time(tmp_path, monkeypatch):
    # One row group of 20,000 rows, as pandas' and pyarrow's writers make by default (up to a million rows): its
    # 16 MB column chunk, read whole, was held whole by every worker reading it.
    random.seed(0)
    words = [f"w{random.randrange(10**6):x}" for _ in range(5000)]
    texts = [f"{i} " + " ".join(random.choices(words, k=120)) for i in range(20000)]
    path = write_parquet(tmp_path / "one.parquet", {"text": texts}, row_group_size=len(texts), compression="none")
    assert pq.ParquetFile(path).metadata.row_group(0).total_byte_size > 2 * READ_BYTES
    reads = []

    class Recorded(io.FileIO):
        def read(self, size=-1):
            reads.append(len(data := super().read(size)))
            return data

    monkeypatch.setattr(source, "open_read", lambda path, etag=None, ahead=None: Recorded(path, "rb"))
    assert read_all(path)[0] == texts
    assert max(reads) == READ_BYTES and sum(reads) > path.stat().st_size


def test_a_missing_column_fails_naming_the_file_and_the_column(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"body": ["a"], "id": [1]})
    with pytest.raises(
        SourceError,
        match=r"x.parquet has no column 'text' \(its columns: body, id\); name the text column with --text-field",
    ):
        read_all(path)
    assert read_all(path, text_field="body")[0] == ["a"]


def test_a_cut_download_fails_naming_the_file(tmp_path):
    data = EXAMPLE_TRAIN.read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(data[: len(data) * 6 // 10])
    with pytest.raises(SourceError, match=r"cut.parquet: not a complete Parquet file.*truncated download"):
        read_all(path)


def test_a_corrupt_page_fails_naming_the_row_group(tmp_path):
    path = write_parquet(
        tmp_path / "x.parquet",
        {"text": [f"row {i} " * 20 for i in range(200)]},
        row_group_size=50,
        compression="zstd",
        use_dictionary=False,
    )
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    end = (
        chunk.data_page_offset + chunk.total_compressed_size
    )  # the page's compressed values end there (its header, first, holds statistics)
    data[end - 48 : end - 32] = b"\xff" * 16
    path.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"x.parquet: row group 2 \(of 4\) does not decode"):
        read_all(path)


def test_a_checkpoint_past_the_last_row_is_an_error(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"text": ["short"]})
    with pytest.raises(SourceError, match="fewer rows than its checkpoint"):
        read_all(path, start_line=5, start_offset=5)


def test_a_shard_interrupted_inside_a_row_group_resumes_to_identical_bytes(tmp_path):
    shard = MANIFEST.source[1]
    spec = unguarded(encode_spec(RunOptions(), INFO, "gigatoken"))
    small = type(spec)(**{**spec.__dict__, "batch_bytes": 16 << 10, "checkpoint_interval": 0.0})
    tokenize_shard(shard, tmp_path / "whole", small)
    with pytest.raises(Crash):
        tokenize_shard(shard, tmp_path / "cut", small, on_batch=crash_in_batch(6))
    ckpt = Checkpoint.load(ShardFiles.of(tmp_path / "cut", shard).checkpoint)
    assert 0 < ckpt.lines and ckpt.lines % ROW_GROUP  # the checkpoint is inside a row group
    tokenize_shard(shard, tmp_path / "cut", spec)
    for name in ("bin", "idx"):
        assert (
            getattr(ShardFiles.of(tmp_path / "cut", shard), name).read_bytes()
            == getattr(ShardFiles.of(tmp_path / "whole", shard), name).read_bytes()
        )


@pytest.fixture
def parquet_copy(tmp_path) -> Path:
    """The example's Parquet shards as a plain folder (same relative paths)."""
    for shard in MANIFEST.shards():
        target = tmp_path / "data" / shard.relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shard.path, target)
    return tmp_path / "data"


def test_kill_9_mid_file_at_one_worker_then_two_workers_gives_identical_bytes(
    parquet_copy, tmp_path, small_tokenizer, small_reference
):
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", parquet_copy, "-o", manifest).returncode == 0
    # --shard-buffer 0: the shard writes its own files as it goes, checkpointed: the kill lands mid-file after one.
    # Batches of 64 KiB and a checkpoint after each (the interval a microsecond): killed as the first shard's
    # second checkpoint is to be written, its first written, the second batch's tokens beyond it.
    extra = ("--workers", "1", "--checkpoint-interval", "0.000001", "--shard-buffer", "0")
    step = ("tokpipe.write.shard.write_atomic", 2)
    killed_run(*step, manifest, out, *extra, batch_bytes=64 << 10, tokenizer=small_tokenizer)
    assert any(
        0 < json.loads(p.read_text())["lines"] and not json.loads(p.read_text())["done"]
        for p in (out / "shards" / "train").glob("*.json")
    )
    rerun = tokpipe(*run_args(manifest, out, "--workers", "2", tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)
    assert cli("verify", out, "--sample", "50").returncode == 0


def test_a_cut_parquet_shard_fails_by_name_and_skip_failed_finalizes_without_it(
    parquet_copy, tmp_path, small_tokenizer
):
    cut = parquet_copy / "data" / "train-00001-of-00002.parquet"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size * 6 // 10])
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", parquet_copy, "-o", manifest).returncode == 0
    failing = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert failing.returncode == 1 and "Traceback" not in failing.stderr
    assert (
        "FAILED data/train-00001-of-00002.parquet: SourceError:" in failing.stderr
        and "not a complete Parquet file" in failing.stderr
    )
    skipping = tokpipe(*run_args(manifest, out, "--skip-failed", tokenizer=small_tokenizer))
    assert skipping.returncode == 0, skipping.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert (
        list(meta["excluded"]) == ["data/train-00001-of-00002.parquet"]
        and meta["splits"]["validation"]["documents"] == VAL_DOCUMENTS
    )


def test_group_by_reads_a_column_or_a_structs_field_by_dot(tmp_path):
    """--group-by on Parquet: a column, or a struct column's field by dot; a file without it puts every
    document in group __missing__, as JSON lines without the field are."""
    path = tmp_path / "g.parquet"
    meta = pa.array([{"set": "Books"}, {"set": None}, None, {"set": "Web"}], pa.struct([("set", pa.string())]))
    table = pa.table({"text": ["a", "b", "", "d"], "lang": ["en", "de", "fr", None], "meta": meta})
    pq.write_table(table, path, row_group_size=2)
    for group_by, expected in [
        ("meta.set", ["Books", "__missing__", "Web"]),
        ("lang", ["en", "de", "__missing__"]),
        ("meta.nothing", ["__missing__"] * 3),
        ("absent", ["__missing__"] * 3),
    ]:
        texts, skipped, batches = read_all(path, group_by=group_by, batch_bytes=1)
        assert texts == ["a", "b", "d"] and skipped == Counter(empty_text=1)
        assert [g for b in batches for g in b.groups] == expected, group_by
    # resumed after a row: the groups stay in step with the texts
    batches = list(read_batches(str(path), start_line=1, group_by="meta.set"))
    assert [t for b in batches for t in b.texts] == ["b", "d"]
    assert [g for b in batches for g in b.groups] == ["__missing__", "Web"]


def test_the_shipped_parquet_example_is_what_its_script_makes_of_the_jsonl_example(tmp_path):
    script = REPO / "examples" / "make_parquet_example.py"
    repo = "tokpipe-realdata/slimpajama-mini-parquet"
    made = subprocess.run([sys.executable, script, EXAMPLE_CACHE, tmp_path, "--repo", repo], capture_output=True)
    assert made.returncode == 0, made.stderr.decode()
    shipped = sorted(p.relative_to(PARQUET_CACHE) for p in PARQUET_CACHE.rglob("*.parquet"))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.parquet")) == shipped
    assert all((tmp_path / name).read_bytes() == (PARQUET_CACHE / name).read_bytes() for name in shipped)


def _chunk(metadata, group: int, column: int) -> tuple[int, int]:
    """[start, end) of a column chunk in the file, from the footer."""
    chunk = metadata.row_group(group).column(column)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    return start, start + chunk.total_compressed_size


def test_a_shard_on_a_store_fetches_only_the_row_groups_and_columns_it_reads(
    tmp_path, s3_server, s3_prefix, monkeypatch
):
    texts = [f"document {i} " + "word " * (i % 37) for i in range(200)]
    meta = [f"{i} " + "metadata nobody reads " * 100 for i in range(200)]  # a column 20x the text's size
    path = write_parquet(tmp_path / "x.parquet", {"text": texts, "meta": meta}, row_group_size=40, compression="none")
    etag = s3_server.put(f"{s3_prefix}/x.parquet", path.read_bytes())
    url = s3_server.url(f"{s3_prefix}/x.parquet")
    gets, read = [], Bucket.read
    monkeypatch.setattr(
        Bucket,
        "read",
        lambda b, key, start, end, etag=None: gets.append((start, end)) or read(b, key, start, end, etag),
    )
    local, remote = read_all(path, batch_bytes=700), read_all(url, batch_bytes=700, etag=etag)
    assert remote[:2] == local[:2] and [b.source_pos for b in remote[2]] == [b.source_pos for b in local[2]]
    metadata = pq.ParquetFile(path).metadata
    size = path.stat().st_size
    footer = (max(0, size - (64 << 10)), size)  # pyarrow reads the last 64 KiB first, or all of a smaller file
    text_chunks = [_chunk(metadata, g, 0) for g in range(5)]
    assert gets[1:] == [footer, *text_chunks] and gets[0] == (0, 4)  # no byte of `meta` beyond the footer's
    del gets[:]
    # A resume at row 130 (row group 3): the row groups before it are not fetched.
    assert read_all(url, start_line=130, start_offset=130, etag=etag)[0] == texts[130:]
    assert gets[2:] == text_chunks[3:]

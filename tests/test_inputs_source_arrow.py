"""arrow: Hugging Face datasets' own files (save_to_disk's data-00000-of-00003.arrow: Arrow's IPC stream) and Arrow's
IPC file format give the tokens of the documents `datasets` reads from them; every row is a document or a counted
skip, as in Parquet; resumable at any row, also inside a record batch; a cut file fails by name; on an object store,
a shard reads as its local copy."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import read_all, reference_tokenizer, unguarded

from tokpipe.errors import SourceError
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.runner.identity import encode_spec
from tokpipe.write.finalize import finalize
from tokpipe.write.shard import tokenize_shard

TEXTS = [f"document {i} " + "word " * (i % 37) for i in range(200)]


def write_arrow(path, columns: dict, stream: bool = True, batch_rows: int = 16):
    """`columns` as Arrow's IPC stream (what datasets writes) or file format, in record batches of `batch_rows`."""
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with writer(sink, table.schema) as out:
            out.write_table(table, max_chunksize=batch_rows)
    return path


def test_a_save_to_disk_dataset_gives_the_tokens_of_the_documents_datasets_reads(tmp_path, small_tokenizer):
    import datasets

    datasets.disable_progress_bars()
    texts = TEXTS + ["", "last one"]
    splits = {"train": texts[:150], "test": texts[150:]}
    saved = datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()})
    saved.save_to_disk(str(tmp_path / "saved"), num_shards={"train": 3, "test": 1})
    manifest = build_manifest(tmp_path / "saved")
    assert [(s.split, s.relpath) for s in manifest.shards()] == [
        ("test", "test/data-00000-of-00001.arrow"),
        ("train", "train/data-00000-of-00003.arrow"),
        ("train", "train/data-00001-of-00003.arrow"),
        ("train", "train/data-00002-of-00003.arrow"),
    ]
    metadata = [f"{split}/{name}" for split in ("test", "train") for name in ("dataset_info.json", "state.json")]
    assert manifest.files_passed_over == tuple(
        (name, "Hugging Face datasets' metadata, never data") for name in ["dataset_dict.json", *metadata]
    )
    info = load_tokenizer_info(small_tokenizer)
    spec = unguarded(encode_spec(RunOptions(), info, "hf"))
    out = tmp_path / "out"
    for shard in manifest.shards():
        tokenize_shard(shard, out, spec)
    meta = finalize(out, manifest, info, RunOptions().output)
    tokenizer = reference_tokenizer(small_tokenizer / "tokenizer.json")
    loaded = datasets.load_from_disk(tmp_path / "saved")  # the reference reader
    for split in ("train", "test"):
        documents = [text for text in loaded[split]["text"] if text]
        reference = [i for e in tokenizer.encode_batch(documents) for i in (*e.ids, info.eos_id)]
        assert np.array_equal(np.fromfile(out / f"{split}.bin", np.uint16), reference), split
    assert meta["splits"]["test"]["skipped"] == {"empty_text": 1}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "file"])
def test_rows_are_documents_or_skips_counted_as_in_parquet(tmp_path, stream):
    columns = {"id": [1, 2, 3, 4, 5], "text": ["first", None, "", b"bad \xff utf8".decode(errors="replace"), "x"]}
    arrow = write_arrow(tmp_path / "x.arrow", columns, stream, batch_rows=2)
    parquet = tmp_path / "x.parquet"
    pq.write_table(pa.table(columns), parquet)
    texts, skipped, batches = read_all(arrow)
    assert (texts, dict(skipped)) == (["first", "bad \ufffd utf8", "x"], {"text_not_string": 1, "empty_text": 1})
    assert [e for b in batches for e in b.skip_log] == [e for b in read_all(parquet)[2] for e in b.skip_log]
    with pytest.raises(SourceError, match=r"x.arrow has no column 'body' \(its columns: id, text\)"):
        read_all(arrow, text_field="body")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "file"])
def test_batches_are_cut_by_bytes_and_resume_at_any_row(tmp_path, stream):
    path = write_arrow(tmp_path / "x.arrow", {"text": TEXTS}, stream)
    for batch_bytes in (1, 700, 4 << 20):
        got, _, batches = read_all(path, batch_bytes=batch_bytes)
        assert got == TEXTS, batch_bytes
        assert [b.end_offset for b in batches] == [sum(b.lines for b in batches[: k + 1]) for k in range(len(batches))]
        positions = [b.source_pos for b in batches]
        assert positions == sorted(positions) and positions[-1] == path.stat().st_size
    for row in (0, 5, 15, 16, 17, 199, 200):  # inside a record batch, at its edges, at the end
        rest, _, batches = read_all(path, batch_bytes=700, start_line=row, start_offset=row)
        assert rest == TEXTS[row:] and sum(b.lines for b in batches) == 200 - row
    with pytest.raises(SourceError, match="x.arrow has fewer rows than its checkpoint says"):
        read_all(path, start_line=201, start_offset=201)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "file"])
def test_a_cut_download_fails_naming_the_file(tmp_path, stream):
    data = write_arrow(tmp_path / "whole.arrow", {"text": TEXTS}, stream).read_bytes()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(data[: len(data) * 6 // 10])
    with pytest.raises(SourceError, match=r"cut.arrow: .*(not a complete Arrow file|does not decode).*truncated"):
        read_all(cut)


def test_on_a_store_an_arrow_shard_reads_as_its_local_copy(tmp_path, s3_server, s3_prefix):
    path = write_arrow(tmp_path / "x.arrow", {"text": TEXTS})
    etag = s3_server.put(f"{s3_prefix}/x.arrow", path.read_bytes())
    url = s3_server.url(f"{s3_prefix}/x.arrow")
    for row in (0, 17):
        assert read_all(url, etag=etag, start_line=row, start_offset=row)[0] == TEXTS[row:]

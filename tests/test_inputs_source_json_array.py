"""source/json_array.py: a shard that is one JSON array, as `json.dump` of a list, pandas' `to_json(orient="records")`
and alpaca_data.json hold their records, plain, zstd, gzip, bz2 or xz: read as Hugging Face `datasets` reads it (the
reference), every item accounted for, resumable at an item, a broken array refused naming where; and a run over a repo
of them."""

import json

import numpy as np
import pandas
import pytest
import zstandard
from helpers import (
    COMPRESS,
    EXAMPLE_TRAIN_FILES,
    cli,
    killed_run,
    pzstd_frames,
    read_all,
    reference_texts,
    reference_tokenizer,
    run_args,
    tokpipe,
)

from tokpipe.errors import SourceError
from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.source import fields_of, format_of
from tokpipe.inputs.source.json_array import _items

# Real text (the example's first train shard: web pages, escapes, CJK, emoji) with the fields a record carries.
RECORDS = [
    {"text": text, "meta": {"n": n, "score": n / 7, "tags": ["a", None]}}
    for n, text in enumerate(reference_texts(EXAMPLE_TRAIN_FILES[0])[:60])
]
WRITERS = {
    "json.dump": lambda records: json.dumps(records).encode(),
    "json.dump, indent 4, UTF-8": lambda records: json.dumps(records, indent=4, ensure_ascii=False).encode(),
    "pandas to_json records": lambda records: pandas.DataFrame(records).to_json(orient="records").encode(),
}


def _load(path, tmp_path) -> list[str]:
    """The texts `datasets.load_dataset("json", ...)` gives of the file: the reference."""
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))["text"]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("compression", ["none", "gzip", "bz2", "xz", "zstd", "pzstd"])
def test_an_array_of_records_is_read_as_datasets_reads_it(tmp_path, writer, compression):
    data = WRITERS[writer](RECORDS)
    half = len(data) // 2
    data = pzstd_frames([data[:half], data[half:]]) if compression == "pzstd" else COMPRESS[compression](data)
    path = tmp_path / ("alpaca.json" + {"none": "", "gzip": ".gz", "bz2": ".bz2", "xz": ".xz"}.get(compression, ".zst"))
    path.write_bytes(data)
    assert format_of(str(path)) == (compression.removeprefix("p"), True)
    texts, skipped, batches = read_all(path, batch_bytes=20_000)
    assert texts == _load(path, tmp_path) == [r["text"] for r in RECORDS]
    assert not skipped and len(batches) > 3
    assert [b.end_offset for b in batches][-1] == len(RECORDS)  # an item is a line: its offset counts items


def test_an_array_of_texts_is_a_text_field_s_documents_as_datasets_makes_them(tmp_path):
    path = tmp_path / "texts.json"
    path.write_text(json.dumps(["one text", "another, with \u00e9 and \U0001f600", "three"]))
    assert read_all(path)[0] == _load(path, tmp_path) == ["one text", "another, with \u00e9 and \U0001f600", "three"]
    assert fields_of(str(path)) == {"text": 9 + 22}  # what --text-field can name, by its texts (a word, an id: 0)


def test_every_item_is_accounted_for_and_a_lone_surrogate_is_repaired_counted(tmp_path):
    items = [{"text": "first"}, {"text": ""}, {"body": "no text"}, 5, [1], {"text": 7}, "a text", {"text": "\ud800!"}]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(items))  # the lone surrogate as Python writes it: an escape
    texts, skipped, [batch] = read_all(path)
    assert texts == ["first", "a text", "\ufffd!"]
    assert dict(skipped) == {"empty_text": 1, "no_text": 1, "not_object": 2, "text_not_string": 1}
    assert batch.skip_log == [(2, "empty_text"), (3, "no_text"), (4, "not_object"), (5, "not_object"),
                              (6, "text_not_string")]  # fmt: skip
    assert (batch.lines, dict(batch.repaired)) == (8, {"lone_surrogate": 1})


def test_an_item_over_the_line_limit_is_too_long_among_short_ones(tmp_path):
    """Items parsed together get their mean length: one over the limit among short ones is still found."""
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"text": "a" * 10}, {"text": "b" * 600}, {"text": "c" * 10}] * 3))
    texts, skipped, [batch] = read_all(path, max_line_bytes=500)
    assert (texts, dict(skipped)) == (["a" * 10, "c" * 10] * 3, {"too_long": 3})
    assert [line for line, _ in batch.skip_log] == [2, 5, 8]


def test_a_byte_order_mark_is_dropped_counted_and_windows_line_ends_are_blank_space(tmp_path):
    path = tmp_path / "windows.json"
    path.write_bytes(b'\xef\xbb\xbf[\r\n  {"text": "one"},\r\n  {"text": "two"}\r\n]\r\n')
    texts, _, [batch] = read_all(path)
    assert (texts, dict(batch.repaired)) == (["one", "two"], {"bom": 1})
    assert read_all(path, start_line=1, start_offset=1)[2][0].repaired == {}  # counted once, by the first reading


def test_a_resume_after_any_batch_reads_the_items_after_it(tmp_path):
    path = tmp_path / "a.json.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(WRITERS["json.dump, indent 4, UTF-8"](RECORDS)))
    texts, _, batches = read_all(path, batch_bytes=20_000)
    for k, at in enumerate(batches[:-1]):
        done = sum(b.lines for b in batches[: k + 1])
        resumed = read_all(path, batch_bytes=20_000, start_line=done, start_offset=at.end_offset)[0]
        assert resumed == texts[done:], k


@pytest.mark.parametrize("block", [7, 100, 4096])
def test_items_cut_anywhere_by_the_blocks_are_whole(tmp_path, block):
    """Blocks of a few bytes cut every item, string and escape of the array somewhere: a number cut where a block ends
    would parse as a shorter number, and a `},` or `",` inside an item (code, a nested object before more keys), or an
    item's first key nested in one, is no item's end; items orjson refuses (a lone surrogate, NaN, an integer past 64
    bits) are json's. Each item is what json.loads makes of the whole file."""
    items = [
        {"text": 'x\\"\u00e9\U0001f600', "n": 1234567890123, "f": 2.5e-10, "ok": True, "none": None},
        {"text": 'f({"a": 1}, "b",) }, ",', "meta": {"a": {"b": [1, {"c": 2}]}, "d": "e"}, "id": 3},
        "a text },",
        {"text": "outer", "children": [{"text": "inner", "n": 1}, {"text": "x"}]},  # its first key's start, nested
        {"text": "lone \ud800", "big": 2**70, "nan": float("nan")},
    ]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(items * 20, indent=1) + "\n")
    with open(path, "rb") as raw:
        found = [value for values, *_ in _items(raw, str(path), "none", block) for value, _ in values]
    assert json.dumps(found) == json.dumps(json.loads(path.read_text()))  # (NaN is no NaN's equal)



def test_a_number_cut_where_a_block_ends_is_read_whole(tmp_path):
    """Items that are numbers (no documents: skipped, counted), in blocks of every size up to a number's length: cut
    after its `.`, `e` or `+`, a number parsed as far as the block goes (`1.` of `1.5` as 1, then a `.` where a `,`
    should be) refused a valid array."""
    path = tmp_path / "numbers.json"
    path.write_text("[1.5, -2.5e+20, 1234567, 1E-3, 0.25]")
    for block in range(1, 10):
        with open(path, "rb") as raw:
            found = [value for values, *_ in _items(raw, str(path), "none", block) for value, _ in values]
        assert found == [1.5, -2.5e20, 1234567, 1e-3, 0.25], block

BROKEN = {
    b'[{"text": "a"},': "not a valid JSON array at item 2: the file ends inside it (truncated?)",
    b'[{"text": "a"}': "not a valid JSON array after item 1: ',' or ']' expected",
    b'[{"text": "a"} {"text": "b"}]': "not a valid JSON array after item 1: ',' or ']' expected",
    b'[{"text": "a"}, {"text": b}]': "not a valid JSON array at item 2: Expecting value",
    b'[{"text": "a"},]': "not a valid JSON array: a ',' before its closing ']'",
    b'[{"text": "a"},\xc2\xa0{"text": "b"}]': "not a valid JSON array at item 2: Expecting value",  # no-break space
    b'[{"text": "a\xff"}]': "invalid UTF-8 in a JSON array at byte 12",
    b'[{"text": "a"}]\n{"text": "b"}\n': "not a valid JSON array: more follows its closing ']' (JSON Lines whose"
    " first line is an array? put a JSON object there)",
}


def test_an_item_nested_past_what_json_readers_read_stops_the_shard_saying_which(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('[{"text": "ok"}, ' + "[" * 100_000 + "]" * 100_000 + ', {"text": "after"}]')
    with pytest.raises(SourceError) as e:  # was Python's RecursionError
        read_all(path)
    assert str(e.value) == (
        f"{path}: item 2 of the JSON array is nested deeper than a JSON reader reads (orjson stops at 1,024 levels):"
        " remove or flatten it"
    )


@pytest.mark.parametrize("data", BROKEN)
def test_a_broken_array_stops_the_shard_saying_where(tmp_path, data):
    path = tmp_path / "broken.json"
    path.write_bytes(data)
    with pytest.raises(SourceError) as e:
        read_all(path)
    assert str(e.value) == f"{path}: {BROKEN[data]}"


def test_a_run_over_arrays_killed_mid_shard_and_rerun_is_the_reference(tmp_path, small_tokenizer):
    """`tokpipe manifest` takes .json arrays as shards; a run killed mid-array (a checkpoint after every batch of
    64 KiB) and rerun writes each document's ids and EOS, in order, as tokenizers encodes datasets' texts."""
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    records = [{"instruction": "say it", "text": t} for t in reference_texts(EXAMPLE_TRAIN_FILES[1])]
    (data / "train.json").write_text(json.dumps(records[:100], indent=2))
    (data / "validation.json").write_text(json.dumps(records[100:]))
    write_manifest(build_manifest(data.parent), tmp_path / "m.json")
    out, mid_shard = tmp_path / "out", ("--checkpoint-interval", "0.000001", "--shard-buffer", "0", "--workers", "1")
    killed_run("tokpipe.write.shard.write_atomic", 3, tmp_path / "m.json", out, *mid_shard, batch_bytes=64 << 10,
               tokenizer=small_tokenizer)  # fmt: skip
    rerun = tokpipe(*run_args(tmp_path / "m.json", out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resumed" in rerun.stdout
    tokenizer = reference_tokenizer(small_tokenizer / "tokenizer.json")
    eos = tokenizer.token_to_id("<|endoftext|>")
    for stem, name in (("train", "train.json"), ("val", "validation.json")):
        texts = _load(data / name, tmp_path)
        expected = np.concatenate([[*e.ids, eos] for e in tokenizer.encode_batch(texts, add_special_tokens=False)])
        assert np.array_equal(np.fromfile(out / f"{stem}.bin", np.uint16), expected), stem
    assert cli("verify", out).returncode == 0

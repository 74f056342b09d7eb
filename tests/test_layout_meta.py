"""layout/meta.py: meta.json and meta.pkl as a record. A run's meta, read and written again from the record's fields,
is the same bytes (meta.pkl: the same dict, key for key), in the order output-format.md lists them, whatever the
split's layout (one file, --no-concat's files, --group-by's groups, both); an earlier tokpipe's meta reads with
what its absent keys meant, and gives back the dict as read."""

import json
import pickle
from dataclasses import replace

import pytest
from helpers import GROUP_FIELD, build_out

from tokpipe.durability import write_json_atomic
from tokpipe.layout.meta import Delimiters, Meta, SplitFile

KEYS = [  # meta's, in output-format.md's order (group_by: with --group-by only)
    "dtype", "vocab_size", "eos_token_id", "eos_token", "bos_token_id", "bos_token", "delimiters", "val_fraction",
    "concat", "tokenizer", "tokenizer_sha256", "tokenizer_repo_id", "tokenizer_revision", "tokenizer_path",
    "text_field", "splits", "excluded", "manifest_sha256", "tokpipe_version",
]  # fmt: skip
ACCOUNTING = ["parts", "tokens", "documents", "lines", "held_out", "held_in", "skipped", "repaired", "shards"]


@pytest.fixture(scope="module")
def no_concat(tmp_path_factory, small_tokenizer) -> dict:
    """The example with --no-concat, and with --group-by too (the 600-id tokenizer's, uint16)."""
    from tokpipe.options import RunOptions

    folder = tmp_path_factory.mktemp("meta")
    return {
        name: build_out(folder / name, small_tokenizer, backend="hf", options=RunOptions(no_concat=True, **options))
        for name, options in {"no-concat": {}, "grouped no-concat": {"group_by": GROUP_FIELD}}.items()
    }


def test_a_runs_meta_written_from_the_record_is_the_same_bytes_in_every_layout(
    finished_example, finished_grouped, no_concat, tmp_path
):
    outs = {"concatenated": finished_example, "grouped": finished_grouped, **no_concat}
    for name, out in outs.items():
        raw = json.loads((out / "meta.json").read_text())
        grouped, concat = "grouped" in name, "no-concat" not in name
        assert list(raw) == KEYS[:15] + ["group_by"] * grouped + KEYS[15:], name
        own = (["file", "idx"] if concat else ["files"]) * (not grouped)
        for entry in raw["splits"].values():
            assert list(entry) == own + ACCOUNTING + ["groups"] * grouped + ["parts_sha256"], name
            for group in entry.get("groups", {}).values():
                assert list(group) == (["file", "idx"] if concat else ["files"]) + ["tokens", "documents", "text_bytes"]
        meta = Meta.of(raw)
        written = replace(meta, raw=None)  # as a run makes it: from its fields
        assert written == meta and written.as_dict() == raw
        write_json_atomic(tmp_path / "meta.json", written.as_dict())
        assert (tmp_path / "meta.json").read_bytes() == (out / "meta.json").read_bytes(), name
        pickled = pickle.loads((out / "meta.pkl").read_bytes())  # (its bytes share objects json cannot say)
        assert pickled == written.as_dict() and json.dumps(pickled) == json.dumps(written.as_dict()), name


def test_a_split_entry_gives_its_files_in_order_whatever_its_layout(finished_grouped, no_concat):
    meta = Meta.of(json.loads((finished_grouped / "meta.json").read_text()))
    train = meta.splits["train"]
    assert train.file is None and list(train.groups) == sorted(train.groups)
    assert [f.bin for f in train.token_files()] == [f"train/{group}.bin" for group in train.groups]
    train = Meta.of(json.loads((no_concat["no-concat"] / "meta.json").read_text())).splits["train"]
    assert train.file is None and train.groups is None
    shards = [f"shards/train/train__chunk1__example_train_{i}" for i in range(len(train.files))]
    assert train.token_files() == [
        SplitFile(f"{shard}.bin", f"{shard}.idx", f.tokens, f.documents) for shard, f in zip(shards, train.files)
    ]


def test_an_earlier_tokpipes_meta_reads_with_what_its_absent_keys_meant():
    """tokpipe 0.1's: no delimiters, val_fraction, concat or excluded; a split's file without its .idx named, a
    whole-file sha256 instead of a parts list."""
    raw = {
        "dtype": "uint32",
        "vocab_size": 151669,
        "eos_token_id": 151643,
        "splits": {"train": {"file": "train.bin", "tokens": 10, "documents": 2, "sha256": "ab", "idx_sha256": "cd"}},
    }
    meta = Meta.of(raw)
    assert (meta.delimiters, meta.val_fraction, meta.concat, meta.excluded) == (Delimiters(False, True), 0.0, True, {})
    assert meta.bos_placed is None and meta.as_dict() is raw
    train = meta.splits["train"]
    assert train.token_files() == [SplitFile("train.bin", "train.idx", 10, 2)]
    assert (train.file, train.parts, train.lines, train.sha256, train.idx_sha256) == (
        "train.bin",
        None,
        None,
        "ab",
        "cd",
    )

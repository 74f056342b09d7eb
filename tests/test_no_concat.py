"""--no-concat: a split is its shards' own token files, in manifest order, listed in meta; every reader
of OUT (open_output, verify, inspect, export, status) reads it as it reads a concatenated one."""

import json
import shutil

import numpy as np
import pytest
from helpers import EXAMPLE_CACHE, QWEN3, build_out

from tokpipe.commands.export import export
from tokpipe.commands.inspect import inspect
from tokpipe.commands.status import status
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.read.output import open_output
from tokpipe.read.sample import verify_sample
from tokpipe.read.verify import verify
from tokpipe.runner.identity import record_run


@pytest.fixture(scope="module")
def files_out(tmp_path_factory):
    return build_out(tmp_path_factory.mktemp("no_concat") / "out", QWEN3, options=RunOptions(no_concat=True))


def test_open_output_reads_the_files_as_one_split(files_out, example_reference):
    data = open_output(files_out)
    train = data.splits["train"]
    assert [f.name for f in train.files] == [
        "shards/train/train__chunk1__example_train_0.bin",
        "shards/train/train__chunk1__example_train_1.bin",
    ]
    assert len(train.tokens) == len(example_reference["train"]) == 859_703
    assert np.array_equal(train.tokens[:], example_reference["train"])
    # A window across the two files, and document ends counted from the split's start.
    cut = len(train.files[0].tokens)
    assert np.array_equal(train.tokens[cut - 5 : cut + 5], example_reference["train"][cut - 5 : cut + 5])
    assert len(train.ends) == 293 and train.ends[128] == cut + train.files[1].ends[0]
    assert np.array_equal(train.document(128), example_reference["train"][cut : cut + train.files[1].ends[0]])


def test_verify_checks_every_file_and_names_the_damaged_one(files_out, tmp_path):
    assert [c.name for c in verify(files_out) if not c.ok] == []
    assert all(c.ok for c in verify_sample(files_out, 40))
    damaged = shutil.copytree(files_out, tmp_path / "out")
    second = damaged / "shards/train/train__chunk1__example_train_1.bin"
    tokens = np.fromfile(second, dtype=np.uint32)
    tokens[[10, 11]] = tokens[[11, 10]]
    tokens.tofile(second)
    failed = {c.name: c.detail for c in verify(damaged) if not c.ok}
    assert failed == {
        "train: sha256 matches meta": "the token bytes changed since finalize, in the range of "
        "train/chunk1/example_train_1.jsonl.zst"
    }


def test_a_cut_file_is_named(files_out, tmp_path):
    damaged = shutil.copytree(files_out, tmp_path / "out")
    first = damaged / "shards/train/train__chunk1__example_train_0.bin"
    first.write_bytes(first.read_bytes()[:-2])
    failed = {c.name: c.detail for c in verify(damaged) if not c.ok}
    assert failed == {
        "train: sizes match meta": "1 of 2 files, e.g. shards/train/train__chunk1__example_train_0.bin: "
        "1,581,678 bytes is not a whole number of uint32 tokens: the file was cut"
    }


def test_exports_are_those_of_a_concatenated_run(files_out, finished_example, tmp_path):
    for fmt in ("megatron", "llmc"):
        export(files_out, fmt, tmp_path / fmt / "files")
        export(finished_example, fmt, tmp_path / fmt / "concat")
        names = sorted(p.name for p in (tmp_path / fmt / "concat").iterdir())
        assert names == sorted(p.name for p in (tmp_path / fmt / "files").iterdir())
        for name in names:
            assert (tmp_path / fmt / "files" / name).read_bytes() == (tmp_path / fmt / "concat" / name).read_bytes()


def test_inspect_and_status_read_it(files_out):
    ins = inspect(files_out, n=3, seed=2)
    assert ins.ok and {w.file.name for w in ins.windows} <= {f.name for f in ins.source.files}
    assert status(files_out).state == "finished"


def test_whether_a_run_concatenates_is_part_of_its_identity(files_out, tmp_path):
    manifest, info = build_manifest(EXAMPLE_CACHE), load_tokenizer_info(QWEN3)
    with pytest.raises(UserError, match="concat: was False, now True"):
        record_run(files_out, manifest, info, RunOptions())
    assert json.loads((files_out / "run.json").read_text())["concat"] is False

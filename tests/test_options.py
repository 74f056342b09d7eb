"""options: what each option of `tokpipe run` does to OUT, documented option by option. Every option is
defined once in options.py (default, help, parsing) and the CLI's flags come from there; run.json records
those given other than their defaults. --bos and --no-eos place BOS and/or EOS around every document (and
verify and inspect check them); --val-fraction holds out train documents chosen by the hash of their text,
making a validation split where the dataset has none. (The refusals of impossible delimiters are
runner/identity's: test_runner_identity.py.)"""

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_HOLDOUT_FILES,
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    QWEN3,
    QWEN3_EOS,
    QWEN3_IM_START,
    TRAIN_DOCUMENTS,
    TRAIN_LINES,
    build_out,
    cli,
    failed_checks,
    grouped_copy_of_example,
    held_out,
    is_held_out,
    reference_by_group,
    reference_texts,
    reference_tokenizer,
    reference_tokens,
    run_args,
    snapshot_files,
    tokpipe,
    write_jsonl,
)

import tokpipe as tokpipe_api
from tokpipe.cli import parser
from tokpipe.commands.export import export
from tokpipe.commands.inspect import BOS_MARK, inspect
from tokpipe.commands.status import status
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest, write_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.files import group_stem
from tokpipe.options import RunOptions
from tokpipe.read.output import open_output
from tokpipe.read.sample import verify_sample
from tokpipe.read.verify import verify
from tokpipe.runner.identity import record_run

IM_START = QWEN3_IM_START
TRAIN, HOLDOUT = EXAMPLE_TRAIN_FILES, EXAMPLE_HOLDOUT_FILES


def tokens(out, stem, dtype=np.uint32):
    return np.fromfile(out / f"{stem}.bin", dtype=dtype)


def run_flags() -> dict:
    """`tokpipe run`'s flags -> their argparse actions."""
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.option_strings[-1]: a for a in commands.choices["run"]._actions if a.dest != "help"}


def test_every_option_is_a_flag_with_its_default_and_help():
    flags = run_flags()
    assert sorted(flags) == sorted(
        ["--manifest", "--tokenizer", "--out"] + [f"--{f.name.replace('_', '-')}" for f in fields(RunOptions)]
    )
    for f in fields(RunOptions):
        action = flags[f"--{f.name.replace('_', '-')}"]
        assert action.dest == f.name and action.default == f.default and action.help == f.metadata["help"]
        assert (action.nargs == 0) == (f.default is False)  # a False default makes a switch
    args = parser().parse_args(["run", "--manifest", "m", "--tokenizer", "t", "--out", "o", "--val-fraction", "0.1"])
    assert args.val_fraction == 0.1 and args.workers is None and args.checkpoint_interval == 30.0


def test_ray_only_is_parsed_but_not_in_run_help(capsys):
    """--ray-only is for tests of Ray's own paths: it parses, and `run --help` does not offer it."""
    args = parser().parse_args(["run", "--manifest", "m", "--tokenizer", "t", "--out", "o", "--ray-only"])
    assert args.ray_only is True
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["run", "--help"])
    assert exit.value.code == 0
    shown = capsys.readouterr().out
    assert "--stall-timeout" in shown and "--ray-only" not in shown and "ray_only" not in shown


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--workers", "0", "must be > 0, got 0"),
        ("--workers", "1.5", "must be an integer > 0, got 1.5"),
        ("--val-fraction", "-0.1", "must be >= 0 and < 1, got -0.1"),
        ("--val-fraction", "1", "must be >= 0 and < 1, got 1"),
        ("--checkpoint-interval", "0", "must be > 0, got 0"),
        ("--stall-timeout", "nan", "must be a finite number > 0, got nan"),
        ("--stall-timeout", "inf", "must be a finite number > 0, got inf"),
        ("--max-retries", "-1", "must be >= 0, got -1"),
        ("--worker-memory", "1", "must be >= 256, got 1"),
        ("--shard-buffer", "-1", "must be >= 0, got -1"),
        ("--backend", "fast", "invalid choice: 'fast' (choose from 'auto', 'fastokens', 'gigatoken', 'hf')"),
    ],
)
def test_a_value_an_option_cannot_take_is_a_usage_error_in_one_line(flag, value, message, tmp_path):
    """Every numeric option of `run` refuses what makes no sense, before any work (-1 retries, a NaN timeout,
    stored as NaN in run.json, and 1 MiB workers were taken while 0 was refused); in one line, no usage block."""
    result = cli(*run_args(tmp_path / "m.json", tmp_path / "out", flag, value))
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        f"tokpipe run: error: argument {flag}: {message}\n",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("workers", 0, "must be > 0, got 0"),
        ("workers", 1.5, "must be an integer > 0, got 1.5"),
        ("val_fraction", 1.0, "must be >= 0 and < 1, got 1.0"),
        ("checkpoint_interval", 0.0, "must be > 0, got 0.0"),
        ("stall_timeout", float("nan"), "must be a finite number > 0, got nan"),
        ("max_retries", -1, "must be >= 0, got -1"),
        ("max_retries", "3", "must be an integer >= 0, got '3'"),
        ("worker_memory", 1, "must be >= 256, got 1"),
        ("shard_buffer", -1, "must be >= 0, got -1"),
        ("address", "", "is empty: give a value, or leave it out for the default"),
        ("eos", " ", "is empty: give a value, or leave it out for the default"),
    ],
)
def test_the_python_api_refuses_what_the_command_line_refuses_in_the_same_words(name, value, message, tmp_path):
    """tokpipe.run(..., max_retries=-1) as `--max-retries -1`: refused before any work, the option by its name."""
    with pytest.raises(UserError) as refused:
        tokpipe_api.run(tmp_path / "m.json", QWEN3, tmp_path / "out", **{name: value})
    assert str(refused.value) == f"{name} {message}"
    assert not (tmp_path / "out").exists()


def test_bos_then_text_then_eos_for_every_document(finished_bos):
    reference = reference_tokens(TRAIN, QWEN3 / "tokenizer.json", QWEN3_EOS, bos_id=IM_START)
    assert np.array_equal(tokens(finished_bos, "train"), reference)
    meta = json.loads((finished_bos / "meta.json").read_text())
    assert (
        meta["delimiters"] == {"bos": True, "eos": True}
        and meta["bos_token_id"] == IM_START
        and meta["bos_token"] == "<|im_start|>"
    )
    ends = np.fromfile(finished_bos / "train.idx", dtype="<i8")
    assert ends[-1] == len(reference) and tokens(finished_bos, "train")[np.concatenate([[0], ends[:-1]])].tolist() == [
        IM_START
    ] * len(ends)
    assert failed_checks(finished_bos) == [] and all(c.ok for c in verify_sample(finished_bos, 50))
    checks = [c.name for c in verify(finished_bos)]
    assert "train: every document starts with BOS" in checks and "train: BOS count == documents" in checks


@pytest.mark.parametrize(
    "delimiters, said",
    [
        ({}, "eos '<|endoftext|>' = 0"),
        ({"bos": True}, "bos '<|endoftext|>' = 0 before each document, eos '<|endoftext|>' = 0 after it"),
        ({"bos": True, "no_eos": True}, "bos '<|endoftext|>' = 0 before each document, no eos"),
    ],
    ids=["eos", "bos and eos", "bos alone"],
)
def test_the_first_line_says_the_ids_placed_around_every_document(
    manifest, tmp_path, small_tokenizer, delimiters, said
):
    # What a trainer's config must match, as the run places it (the 600-id tokenizer: its <|endoftext|> is id 0).
    heard = []
    options = {"bos_token": "<|endoftext|>", **delimiters} if delimiters else {}
    tokpipe_api.run(manifest, small_tokenizer, tmp_path / "out", workers=1, tell=heard.append, **options)
    first = str(heard[0])
    assert first.startswith("tokenizer small_tokenizer") and first.endswith(
        f": vocab_size 600 (len(tokenizer), added tokens included), {said}, dtype uint16"
    ), first


def test_bos_without_eos_places_no_eos_anywhere(tmp_path):
    out = build_out(tmp_path / "out", QWEN3, options=RunOptions(bos=True, bos_token="<|im_start|>", no_eos=True))
    assert np.array_equal(
        tokens(out, "train"), reference_tokens(TRAIN, QWEN3 / "tokenizer.json", None, bos_id=IM_START)
    )
    assert not np.any(tokens(out, "train") == QWEN3_EOS) and not np.any(tokens(out, "val") == QWEN3_EOS)
    assert failed_checks(out) == [] and "train: no EOS anywhere (--no-eos)" in [c.name for c in verify(out)]
    assert all(c.ok for c in verify_sample(out, 20))
    result = inspect(out, n=2, window=10_000, seed=1)  # longer than any document here: each window crosses a start
    assert result.ok and any(BOS_MARK in text for text in result.texts)
    assert "share of BOS (id 151644)" in [c.name for c in result.flags]


def test_verify_names_a_document_that_lost_its_bos(finished_bos, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_bos, out)
    ends = np.fromfile(out / "val.idx", dtype="<i8")
    damaged = np.memmap(out / "val.bin", dtype=np.uint32, mode="r+")
    damaged[ends[4]] = 42
    damaged.flush()
    assert failed_checks(out) == [
        "validation: sha256 matches meta",
        "validation: BOS count == documents",
        "validation: every document starts with BOS",
    ]


def test_val_fraction_holds_out_train_documents_chosen_by_their_text(tmp_path, small_tokenizer):
    # The 600-id tokenizer (uint16): which documents are held out is the subject, not Qwen3.
    out = build_out(tmp_path / "out", small_tokenizer, options=RunOptions(val_fraction=0.2))
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    kept = reference_tokens(TRAIN, tokenizer, eos, np.uint16, keep=held_out(0.2, False))
    # val.bin: each shard's part in manifest order, train/ before validation/: the held-out train
    # documents, then the holdout shard.
    val = np.concatenate(
        [
            reference_tokens(TRAIN, tokenizer, eos, np.uint16, keep=held_out(0.2, True)),
            reference_tokens(HOLDOUT, tokenizer, eos, np.uint16),
        ]
    )
    assert np.array_equal(tokens(out, "train", np.uint16), kept) and np.array_equal(tokens(out, "val", np.uint16), val)
    meta = json.loads((out / "meta.json").read_text())
    train, validation = meta["splits"]["train"], meta["splits"]["validation"]
    held = sum(is_held_out(t, 0.2) for path in TRAIN for t in reference_texts(path))
    assert 0 < held < TRAIN_DOCUMENTS and meta["val_fraction"] == 0.2
    assert train["held_out"] == validation["held_in"] == held and train["documents"] + held == TRAIN_DOCUMENTS
    assert train["documents"] + train["held_out"] + sum(train["skipped"].values()) == train["lines"] == TRAIN_LINES
    assert failed_checks(out) == [] and all(c.ok for c in verify_sample(out, 500))


def train_only(root: Path) -> Path:
    """The example's train shards alone, in a dataset with no validation split."""
    data = root / "data" / "train"
    data.mkdir(parents=True)
    for i, path in enumerate(TRAIN):
        shutil.copy(path, data / f"part-{i}.jsonl.zst")
    return root / "data"


def test_val_fraction_makes_a_validation_split_when_the_dataset_has_none(tmp_path):
    options = RunOptions(val_fraction=0.5)
    out = build_out(tmp_path / "out", QWEN3, "gigatoken", options, dataset=train_only(tmp_path))
    meta = json.loads((out / "meta.json").read_text())
    assert list(meta["splits"]) == ["train", "validation"] and meta["splits"]["validation"]["file"] == "val.bin"
    assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == TRAIN_DOCUMENTS


def test_an_unfinished_run_is_inspected_with_its_held_out_documents_in_val(tmp_path):
    # A dataset with no validation split, tokenized with --val-fraction and not finalized: val.bin is yet to be.
    options = RunOptions(val_fraction=0.2)
    out = build_out(tmp_path / "out", QWEN3, "gigatoken", options, dataset=train_only(tmp_path), finalized=False)
    held = sum(is_held_out(t, 0.2) for path in TRAIN for t in reference_texts(path))
    val = inspect(out, split="val", n=1, seed=0)
    assert not val.source.finished and val.source.documents == held and val.source.split == "validation"
    assert inspect(out, split="train", n=1, seed=0).source.documents == TRAIN_DOCUMENTS - held


def test_group_by_keeps_each_group_in_files_of_its_own_with_exact_counts(tmp_path, small_tokenizer):
    """--group-by FIELD: each split's documents by their value of FIELD, each group in its own file, in
    manifest order; meta's counts per group are those of an independent count (json, the reference
    encoder); groups in the order of their values. A resume with another field is refused. The 600-id
    tokenizer (uint16): the groups are the subject, not Qwen3."""
    dataset = grouped_copy_of_example(tmp_path / "dataset")
    manifest = tmp_path / "manifest.json"
    write_manifest(build_manifest(dataset), manifest)
    out = tmp_path / "out"
    result = tokpipe(*run_args(manifest, out, "--group-by", GROUP_FIELD, tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stdout + result.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["group_by"] == GROUP_FIELD and meta["dtype"] == "uint16"
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    for split, stem, folder in (("train", "train", "train"), ("validation", "val", "validation")):
        files = snapshot_files(dataset, folder)
        reference = reference_by_group(files, tokenizer, GROUP_FIELD, eos)
        groups = meta["splits"][split]["groups"]
        assert list(groups) == sorted(reference)  # in the order of their values
        assert "Web/Forum ö" in groups and "__missing__" in groups
        for value, (tokens, documents, text_bytes) in reference.items():
            assert groups[value] == {
                "file": f"{stem}/{group_stem(value)}.bin",
                "idx": f"{stem}/{group_stem(value)}.idx",
                "tokens": len(tokens),
                "documents": documents,
                "text_bytes": text_bytes,
            }
            assert np.array_equal(np.fromfile(out / groups[value]["file"], dtype=np.uint16), tokens)
        assert meta["splits"][split]["documents"] == sum(d for _, d, _ in reference.values())
        missing = reference["__missing__"][1]
        assert f"{missing:,} documents without {GROUP_FIELD} are in group __missing__" in result.stdout
    skipped = json.loads((out / "logs" / "skipped.json").read_text())["shards"]  # each shard's documents
    by_shard = {path.name: len(reference_texts(path)) for path in snapshot_files(dataset, "train")}
    assert {
        s["shard"].rsplit("/", 1)[1]: s["documents"] for s in skipped if s["shard"].startswith("train/")
    } == by_shard
    assert not failed_checks(out)
    assert all(c.ok for c in verify_sample(out, 40))

    other = cli(*run_args(manifest, out, "--group-by", "meta.other", tokenizer=small_tokenizer))
    assert other.returncode == 2
    assert f"group_by: was '{GROUP_FIELD}', now 'meta.other'" in other.stderr


def test_group_by_a_field_with_a_value_per_document_is_refused_before_tokenizing(tmp_path):
    """At most 4,096 groups per split: a field such as an id is refused in one line, before any shard is
    tokenized, naming the field and a few of its values."""
    lines = [json.dumps({"text": f"document {i}", "id": f"doc-{i:05d}"}) for i in range(5_000)]
    write_jsonl(tmp_path / "dataset" / "train" / "a.jsonl", lines)
    manifest = tmp_path / "manifest.json"
    write_manifest(build_manifest(tmp_path / "dataset"), manifest)
    result = cli(*run_args(manifest, tmp_path / "out", "--group-by", "id"))
    assert result.returncode == 2
    assert result.stderr == (
        "tokpipe run: error: --group-by id: split train has more than 4,096 distinct values in its first shard alone"
        " (e.g. 'doc-00000', 'doc-00001', 'doc-00002'), and a split may have at most 4,096 groups: group by a field"
        " with a few values (a source, a language), not one per document (an id, a url)\n"
    )
    assert not list((tmp_path / "out").glob("shards/**/*.json"))  # nothing tokenized


def test_group_by_a_field_no_document_has_is_refused_before_tokenizing(tmp_path):
    """A field nested deeper than named (or misspelt) would put every document in group __missing__: refused in one
    line, naming the fields the documents have."""
    lines = [json.dumps({"text": f"document {i}", "meta": {"source": "web"}}) for i in range(30)]
    write_jsonl(tmp_path / "dataset" / "train" / "a.jsonl", lines)
    write_jsonl(tmp_path / "dataset" / "validation" / "a.jsonl", lines[:5])
    manifest = tmp_path / "manifest.json"
    write_manifest(build_manifest(tmp_path / "dataset"), manifest)
    result = cli(*run_args(manifest, tmp_path / "out", "--group-by", "source"))
    assert (result.returncode, result.stderr) == (
        2,
        "tokpipe run: error: --group-by source: none of the 35 documents read of each split's first shard (nor of 8"
        " more across it) has it: every document would be in group __missing__; their fields: meta, text: name the"
        " field by its path (a JSON line's by dots, as meta.redpajama_set_name; a Parquet column, or a struct's"
        " field)\n",
    )
    assert not list((tmp_path / "out").glob("shards/**/*.json"))  # nothing tokenized


def test_group_by_a_field_a_first_shard_lacks_and_a_later_one_has_is_no_typo(tmp_path, small_tokenizer):
    """A corpus of sources, the first of which lacks the field: read, its documents in group __missing__ (before, the
    run was refused as for a typo, with no way on but reordering the shards)."""
    for n, source in enumerate([None, None, None, "web"]):
        meta = {} if source is None else {"source": source}
        write_jsonl(tmp_path / "dataset" / "train" / f"{n}.jsonl", [json.dumps({"text": f"doc {n}", **meta})])
    manifest = tmp_path / "manifest.json"
    write_manifest(build_manifest(tmp_path / "dataset"), manifest)
    run = tokpipe(*run_args(manifest, tmp_path / "out", "--group-by", "source", tokenizer=small_tokenizer))
    assert run.returncode == 0, run.stderr
    assert "  2 groups by source (tokens: __missing__ " in run.stdout
    assert "3 documents without source are in group __missing__" in run.stdout


# -- no concat ------------------------------------------------------------------------------------------------
# --no-concat: a split is its shards' own token files, in manifest order, listed in meta; every reader of OUT
# (open_output, verify, inspect, export, status) reads it as it reads a concatenated one.


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

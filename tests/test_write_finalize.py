"""finalize: split files assembled from shards in any order, surviving a crash at any point, to the
reference bytes; a placed shard's own token files removed, so the tokens are on disk once."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    QWEN3,
    QWEN3_EOS,
    assert_out_is,
    build_out,
    cli,
    failed_checks,
    held_out,
    reference_by_group,
    reference_tokens,
    tokpipe,
    unguarded,
    write_jsonl,
)

from tokpipe.errors import UserError
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.files import ShardFiles
from tokpipe.options import RunOptions
from tokpipe.read.verify import verify
from tokpipe.runner.identity import encode_spec
from tokpipe.write.assembly import Assembler
from tokpipe.write.finalize import finalize
from tokpipe.write.place import place
from tokpipe.write.shard import tokenize_shard

MANIFEST = build_manifest(EXAMPLE_CACHE)
INFO = load_tokenizer_info(QWEN3)
OPTIONS = RunOptions()


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """OUT with every shard of the example tokenized and nothing assembled. Copy before changing it."""
    out = tmp_path_factory.mktemp("tokenized") / "out"
    spec = unguarded(encode_spec(OPTIONS, INFO, "gigatoken"))
    for shard in MANIFEST.shards():
        tokenize_shard(shard, out, spec)
    return out


@pytest.fixture
def out(tokenized, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(tokenized, copy)
    return copy


def reopened(out, options=OPTIONS) -> Assembler:
    """An Assembler that took up OUT's split files, as a run's resume step does."""
    assembler = Assembler(out, 4, options.output)
    assembler.resume(MANIFEST)
    return assembler


def listed(out, stem) -> list[str]:
    return [json.loads(line)["shard"] for line in (out / f"{stem}.parts.tmp").read_text().splitlines()]


def test_parts_copied_in_any_order_are_listed_in_split_order(out, example_reference):
    assembler = reopened(out)
    parts = assembler.ready()
    assert [(p.stem, p.seq) for p in parts] == [("train", 0), ("train", 1), ("val", 0)]
    assert parts[1].token_offset == parts[0].record["tokens"] and parts[1].doc_offset == parts[0].record["documents"]
    second, first = parts[1], parts[0]
    assembler.placed([second], place(out, [second], 4))
    assert listed(out, "train") == []  # on disk, but the part before it is not yet: a crash now recopies it
    assembler.placed([first], place(out, [first], 4))
    assert listed(out, "train") == ["train/chunk1/example_train_0.jsonl.zst", "train/chunk1/example_train_1.jsonl.zst"]
    assembler.placed([parts[2]], place(out, [parts[2]], 4))
    assert assembler.complete
    finalize(out, MANIFEST, INFO, OPTIONS.output, assembler=assembler)
    assert_out_is(out, example_reference)
    assert not list(out.glob("*.tmp"))


def test_a_rerun_keeps_what_was_listed_and_recopies_what_was_not(out, example_reference):
    first_run = reopened(out)
    train_0, train_1, _ = first_run.ready()
    first_run.placed([train_0], place(out, [train_0], 4))
    place(out, [train_1], 4)  # copied, then killed before it was listed
    with open(out / "train.parts.tmp", "ab") as f:
        f.write(b'{"shard": "train/chunk1/exa')  # and a line cut by the crash
    rerun = reopened(out)
    assert [(p.stem, p.seq) for p in rerun.ready()] == [("train", 1), ("val", 0)]
    assert listed(out, "train") == ["train/chunk1/example_train_0.jsonl.zst"]  # the cut line is gone


def test_a_rerun_finishes_an_assembly_killed_midway_to_the_reference(out, example_reference):
    first_run = reopened(out)
    train_0, *_ = first_run.ready()
    first_run.placed([train_0], place(out, [train_0], 4))
    (out / "train.bin.tmp").open("ab").write(b"\xff" * 1000)  # stray bytes past what is listed
    finalize(out, MANIFEST, INFO, OPTIONS.output)  # a new process: assembles the rest here
    assert_out_is(out, example_reference)


def test_a_listed_shard_that_is_no_longer_first_in_the_split_is_copied_again(out, example_reference):
    first_run = reopened(out)
    train_0, train_1, _ = first_run.ready()
    place(out, [train_1], 4)
    # As if an earlier layout (before an append, or with train_0 excluded) had put train_1 first.
    (out / "train.parts.tmp").write_text(json.dumps(train_1.record) + "\n")
    assert [(p.stem, p.seq) for p in reopened(out).ready()] == [("train", 0), ("train", 1), ("val", 0)]
    finalize(out, MANIFEST, INFO, OPTIONS.output)
    assert_out_is(out, example_reference)


def test_every_range_carries_the_checksums_of_the_worker_that_wrote_it(out):
    meta = finalize(out, MANIFEST, INFO, OPTIONS.output)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint32)
    ends = np.fromfile(out / "train.idx", dtype="<i8")
    start, first_doc = 0, 0
    for line in (out / "train.parts").read_text().splitlines():
        record = json.loads(line)
        span = tokens[start : start + record["tokens"]]
        relative_ends = ends[first_doc : first_doc + record["documents"]] - start
        assert hashlib.sha256(span.tobytes()).hexdigest() == record["sha256"]
        assert hashlib.sha256(relative_ends.astype("<i8").tobytes()).hexdigest() == record["idx_sha256"]
        start, first_doc = start + record["tokens"], first_doc + record["documents"]
    assert start == meta["splits"]["train"]["tokens"] == len(tokens)
    assert meta["splits"]["train"]["parts_sha256"] == hashlib.sha256((out / "train.parts").read_bytes()).hexdigest()


def test_shards_finished_by_an_earlier_tokpipe_are_hashed_when_placed(out, tokenized, tmp_path):
    # Checkpoints written before workers hashed their shards have no sha256 (nor a format, nor parts: format 1).
    for shard in MANIFEST.shards():
        path = ShardFiles.of(out, shard).checkpoint
        ckpt = json.loads(path.read_text())
        del ckpt["format"], ckpt["parts"]
        path.write_text(json.dumps(ckpt))
    finalize(out, MANIFEST, INFO, OPTIONS.output)
    fresh = finalize(shutil.copytree(tokenized, tmp_path / "fresh"), MANIFEST, INFO, OPTIONS.output)
    assert (out / "train.parts").read_bytes() == (tmp_path / "fresh" / "train.parts").read_bytes()
    assert json.loads((out / "meta.json").read_text())["splits"] == fresh["splits"]


def _as_format_1(ckpt: dict) -> dict:
    """A done shard's checkpoint as a tokpipe of checkpoint format 1 wrote it: no `format` and no `parts`; its own
    part's counts and checksums in its own fields (with --group-by, its groups' counts summed there, no checksums,
    and each group's entry in `groups`), those of the documents it held out in val_* fields (and `val_groups`)."""
    old = {key: value for key, value in ckpt.items() if key not in ("format", "parts")}
    for held, prefix in ((False, ""), (True, "val_")):
        parts = [part for part in ckpt["parts"] if part["held"] == held]
        whole = next((part for part in parts if part["group"] is None), {})
        old[f"{prefix}tokens"] = sum(part["tokens"] for part in parts)
        old[f"{prefix}documents"] = sum(part["documents"] for part in parts)
        old[f"{prefix}sha256"], old[f"{prefix}idx_sha256"] = whole.get("sha256"), whole.get("idx_sha256")
        counts = ("tokens", "documents", "text_bytes", "sha256", "idx_sha256")
        old[f"{prefix}groups"] = {p["group"]: {k: p[k] for k in counts} for p in parts if p["group"] is not None}
    return old


@pytest.mark.parametrize("group_by", [None, GROUP_FIELD])
def test_shards_done_under_checkpoint_format_1_are_placed_as_that_tokpipe_placed_them(
    tmp_path, example_reference, grouped_reference, group_by
):
    """A run killed once its shards were done under checkpoint format 1, finished by this tokpipe (--val-fraction,
    with and without --group-by): each file is its reference, every range checks, and the parts lists and meta
    are those of a run never interrupted."""
    options = RunOptions(val_fraction=0.3, group_by=group_by)
    out = build_out(tmp_path / "out", QWEN3, options=options, finalized=False)
    never_interrupted = shutil.copytree(out, tmp_path / "never-interrupted")
    for path in (out / "shards").glob("*/*.json"):
        path.write_text(json.dumps(_as_format_1(json.loads(path.read_text()))))
    meta = finalize(out, MANIFEST, INFO, options.output)

    tokenizer, train, val = QWEN3 / "tokenizer.json", held_out(0.3, False), held_out(0.3, True)
    if group_by is None:
        assert_out_is(
            out,
            {
                "train": reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, QWEN3_EOS, keep=train),
                "val": np.concatenate(
                    [reference_tokens(EXAMPLE_TRAIN_FILES, tokenizer, QWEN3_EOS, keep=val), example_reference["val"]]
                ),
            },
        )
    else:
        sources = {  # each file's groups, in the order the split's sources give them
            "train": [reference_by_group(EXAMPLE_TRAIN_FILES, tokenizer, group_by, QWEN3_EOS, keep=train)],
            "validation": [
                reference_by_group(EXAMPLE_TRAIN_FILES, tokenizer, group_by, QWEN3_EOS, keep=val),
                grouped_reference["val"],  # the validation shard's own documents, never held out
            ],
        }
        for split, groups in sources.items():
            entries = meta["splits"][split]["groups"]
            assert list(entries) == sorted({group for found in groups for group in found})
            for group, entry in entries.items():
                expected = np.concatenate([found[group][0] for found in groups if group in found])
                assert np.array_equal(np.fromfile(out / entry["file"], dtype=np.uint32), expected)
    assert failed_checks(out) == []
    assert meta == finalize(never_interrupted, MANIFEST, INFO, options.output)
    for stem in ("train", "val"):
        assert (out / f"{stem}.parts").read_bytes() == (never_interrupted / f"{stem}.parts").read_bytes()


def test_an_unfinished_shard_stops_finalize_and_skip_failed_leaves_it_out(out):
    holdout = list(MANIFEST.shards())[-1]
    checkpoint = ShardFiles.of(out, holdout).checkpoint
    checkpoint.write_text(json.dumps({**json.loads(checkpoint.read_text()), "done": False}))
    with pytest.raises(RuntimeError, match="example_holdout_0.jsonl.zst is unfinished"):
        finalize(out, MANIFEST, INFO, OPTIONS.output)
    meta = finalize(out, MANIFEST, INFO, OPTIONS.output, excluded={holdout.relpath: "SourceError: truncated"})
    assert meta["splits"]["validation"]["tokens"] == 0 and (out / "val.bin").stat().st_size == 0
    assert meta["excluded"] == {holdout.relpath: "SourceError: truncated"}


def shard_token_files(out) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in (out / "shards").rglob("*") if p.suffix in (".bin", ".idx"))


def test_a_placed_shard_gives_its_space_back_and_keeps_its_checkpoint(out, example_reference):
    assembler = reopened(out)
    train_0, train_1, val_0 = assembler.ready()
    assembler.placed([train_1], place(out, [train_1], 4))
    assert Path(train_1.bin).exists()  # copied, but not listed: a crash now copies it again
    assembler.placed([train_0], place(out, [train_0], 4))
    assert shard_token_files(out) == [
        "shards/validation/validation__chunk1__example_holdout_0.bin",
        "shards/validation/validation__chunk1__example_holdout_0.idx",
    ]
    assert ShardFiles.of(out, MANIFEST.shards().__next__()).checkpoint.exists()
    assembler.placed([val_0], place(out, [val_0], 4))
    finalize(out, MANIFEST, INFO, OPTIONS.output, assembler=assembler)
    assert_out_is(out, example_reference)
    assert shard_token_files(out) == []
    assert sorted(p.name for p in out.iterdir()) == [
        "logs",
        "meta.json",
        "meta.pkl",
        "shards",
        "train.bin",
        "train.idx",
        "train.parts",
        "val.bin",
        "val.idx",
        "val.parts",
    ]


# A real kill -9 of a process finalizing, at each step of place-then-remove: (what to wrap, which of
# its calls kills, counting only calls whose first argument names a shard's token file when "shards").
KILL_POINTS = {
    "while copying a part": ("tokpipe.write.place.copy_range", 2, ""),
    "after the copies are fsynced, before they are listed": ("tokpipe.write.assembly.Assembler.placed", 1, ""),
    "after the listing, before the part's .bin is removed": ("pathlib.Path.unlink", 1, "/shards/"),
    "between removing a part's .bin and its .idx": ("pathlib.Path.unlink", 2, "/shards/"),
    "after the removal, before the split files are renamed": ("tokpipe.write.assembly.Assembler.finish", 1, ""),
}

KILLED_FINALIZE = """
import importlib, os, signal, sys
module_name, _, attr = sys.argv[2].rpartition(".")
owner_name, _, cls = module_name.rpartition(".") if module_name.endswith(("Assembler", "Path")) else ("", "", "")
owner = getattr(importlib.import_module(owner_name), cls) if cls else importlib.import_module(module_name)
original, calls = getattr(owner, attr), []
def killing(*args, **kw):
    if sys.argv[6] not in str(args[0]):
        return original(*args, **kw)
    calls.append(args[0])
    if len(calls) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kw)
setattr(owner, attr, killing)
import json
from tokpipe.write.finalize import finalize
from tokpipe.inputs.manifest import build_manifest
from tokpipe.options import RunOptions
from tokpipe.inputs.tokenizer import TokenizerInfo
finalize(sys.argv[1], build_manifest(sys.argv[4]), TokenizerInfo(**json.loads(sys.argv[5])), RunOptions().output)
"""


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_9_anywhere_in_place_then_remove_loses_and_leaks_nothing(out, example_reference, point):
    target, call, which = KILL_POINTS[point]
    # The run's tokenizer info as this process has it: finalize reads no tokenizer, and loading Qwen3's again (its
    # parse, ~1 CPU-s) in each killed process is no part of the test.
    argv = [str(out), target, str(call), str(EXAMPLE_CACHE), json.dumps(dataclasses.asdict(INFO)), which]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_FINALIZE, *argv],
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "meta.json").exists()
    finalize(out, MANIFEST, INFO, OPTIONS.output)  # the rerun
    assert_out_is(out, example_reference)
    assert shard_token_files(out) == []
    assert [c.name for c in verify(out) if not c.ok] == []


def test_placed_shards_whose_place_was_not_kept_are_tokenized_again(out, example_reference):
    first_run = reopened(out)
    parts = first_run.ready()
    first_run.placed(parts[:2], place(out, parts[:2], 4))
    with open(out / "train.bin.tmp", "r+b") as f:
        f.truncate(1000)  # damaged since: nothing listed can be trusted, and the shards' own files are gone
    rerun = reopened(out)
    assert rerun.lost == ["train/chunk1/example_train_0.jsonl.zst", "train/chunk1/example_train_1.jsonl.zst"]
    assert [(p.stem, p.seq) for p in rerun.ready()] == [("val", 0)]  # train waits for them
    spec = unguarded(encode_spec(OPTIONS, INFO, "gigatoken"))
    for shard in MANIFEST.shards():
        tokenize_shard(shard, out, spec)
    finalize(out, MANIFEST, INFO, OPTIONS.output)
    assert_out_is(out, example_reference)


def test_no_concat_lists_the_shards_own_files_in_order_and_copies_nothing(out, example_reference):
    options = RunOptions(no_concat=True)
    meta = finalize(out, MANIFEST, INFO, options.output)
    assert meta["concat"] is False
    for split, stem in (("train", "train"), ("validation", "val")):
        files = meta["splits"][split]["files"]
        assert all(set(f) == {"bin", "idx", "tokens", "documents"} for f in files)
        tokens = np.concatenate([np.fromfile(out / f["bin"], dtype=np.uint32) for f in files])
        assert np.array_equal(tokens, example_reference[stem])
        assert [f["tokens"] for f in files] == [len(np.fromfile(out / f["bin"], dtype=np.uint32)) for f in files]
        assert not (out / f"{stem}.bin").exists()
    assert [f["bin"] for f in meta["splits"]["train"]["files"]] == [
        "shards/train/train__chunk1__example_train_0.bin",
        "shards/train/train__chunk1__example_train_1.bin",
    ]
    assert [c.name for c in verify(out) if not c.ok] == []


TRAIN_0, TRAIN_1 = "train/chunk1/example_train_0.jsonl.zst", "train/chunk1/example_train_1.jsonl.zst"


@pytest.mark.parametrize("left_out", [TRAIN_1, TRAIN_0])
def test_a_split_rewritten_later_leaves_its_exported_links_alone(out, example_reference, tmp_path, left_out):
    # `export --format megatron` hard-links a finished split file. A run that extends the split (a shard
    # excluded, then back) writes it again: after the kept start (TRAIN_1 back), or anew (TRAIN_0 back: TRAIN_1
    # moves to its new offset, copied from the split file as it was, the export's inode). Neither may write
    # through the export's name.
    finalize(out, MANIFEST, INFO, OPTIONS.output, excluded={left_out: "failed"})
    exported = tmp_path / "megatron.bin"
    os.link(out / "train.bin", exported)
    before = exported.read_bytes()
    if left_out == TRAIN_0:
        resumed = reopened(out)
        assert (resumed.lost, resumed.moved) == ([], {"train": 1})
    finalize(out, MANIFEST, INFO, OPTIONS.output)
    assert_out_is(out, example_reference)
    assert exported.read_bytes() == before and os.stat(exported).st_nlink == 1


def test_a_split_with_more_groups_than_allowed_is_refused_as_its_shards_show_it(tmp_path, monkeypatch):
    """--group-by: shards with few values each can add up to more than a split may have groups; the
    assembly refuses the split as soon as the done shards show it, naming the field and a few values."""
    from tokpipe.errors import TooManyGroups

    options = RunOptions(group_by=GROUP_FIELD)
    out = build_out(tmp_path / "out", QWEN3, options=options, finalized=False)
    monkeypatch.setattr("tokpipe.write.assembly.split.MAX_GROUPS", 3)
    with pytest.raises(
        TooManyGroups,
        match=r"^--group-by meta.redpajama_set_name: split train has more than 3 distinct values \(e.g. 'RedPajamaC4',"
        r" 'RedPajamaCommonCrawl', 'RedPajamaGithub'\)",
    ):
        finalize(out, MANIFEST, INFO, options.output)
    assert not (out / "meta.json").exists()


@pytest.mark.parametrize("part_gone", [False, True])
def test_a_grouped_split_resumes_after_some_of_a_shards_group_parts_were_listed(tmp_path, grouped_reference, part_gone):
    """--group-by: a crash after some of a shard's parts were placed and listed (its accounting line and two
    of its groups) and the rest not: the rerun keeps exactly those, places the others at their offsets in
    their groups' files, and every group's file is its reference. If a part not yet placed lost its file,
    the shard is tokenized again, and its listed parts stay where they are."""
    options = RunOptions(group_by=GROUP_FIELD)
    out = build_out(tmp_path / "out", QWEN3, options=options, finalized=False)
    first = reopened(out, options)
    parts = first.ready()
    assert [(p.name, p.group) for p in parts[:5]] == [
        (TRAIN_0, None),
        (TRAIN_0, "RedPajamaC4"),
        (TRAIN_0, "RedPajamaCommonCrawl"),
        (TRAIN_0, "RedPajamaGithub"),
        (TRAIN_0, "RedPajamaWikipedia"),
    ]
    first.placed(parts[:3], place(out, parts[:3], 4))  # then the process dies
    assert len((out / "train.parts.tmp").read_bytes().splitlines()) == 3
    if part_gone:
        ShardFiles.of(out, next(MANIFEST.shards())).part((False, "RedPajamaGithub"))[0].unlink()
    resumed = reopened(out, options)
    assert resumed.lost == ([TRAIN_0] if part_gone else []) and resumed.splits[0].listed == 3
    if part_gone:  # as the run does: the shard again, to the same bytes
        tokenize_shard(next(MANIFEST.shards()), out, unguarded(encode_spec(options, INFO, "gigatoken")))
    assert [p.group for p in resumed.ready()][:2] == ["RedPajamaGithub", "RedPajamaWikipedia"]
    meta = finalize(out, MANIFEST, INFO, options.output)
    for split, stem in (("train", "train"), ("validation", "val")):
        for group, (tokens, documents, _) in grouped_reference[stem].items():
            entry = meta["splits"][split]["groups"][group]
            assert (entry["tokens"], entry["documents"]) == (len(tokens), documents)
            assert np.array_equal(np.fromfile(out / entry["file"], dtype=np.uint32), tokens)
    assert [c.name for c in verify(out) if not c.ok] == []


# -- empty split ----------------------------------------------------------------------------------------------
# A split whose lines were read but none became a document is an error, not a run of 0 tokens: one line naming the
# split, its lines, its skip reasons and --text-field; exit 2; no meta (OUT unfinished).


CODE = [json.dumps({"content": f"def f{i}():\n    return {i}\n", "lang": "python"}) for i in range(3)]
PROSE = [json.dumps({"text": f"Document number {i} is plain prose."}) for i in range(4)]


def tokenized_shards(tmp_path, shards: dict[str, list[str]], options=RunOptions(), skip=()):
    """OUT with the dataset's shards tokenized (those named in `skip` never ran), nothing assembled."""
    for relpath, lines in shards.items():
        write_jsonl(tmp_path / "data" / relpath, lines)
    manifest = build_manifest(tmp_path / "data")
    out = tmp_path / "out"
    spec = unguarded(encode_spec(options, INFO, "hf"))
    for shard in manifest.shards():
        if shard.relpath not in skip:
            tokenize_shard(shard, out, spec)
    return out, manifest


def test_a_split_of_lines_without_documents_is_refused_and_meta_not_written(tmp_path):
    out, manifest = tokenized_shards(tmp_path, {"train/code.jsonl": CODE, "validation/prose.jsonl": PROSE})
    with pytest.raises(UserError) as e:
        finalize(out, manifest, INFO, RunOptions().output)
    assert str(e.value) == (
        "split train: 3 lines read, none became a document (skipped: no_text 3): is the text in another field "
        f"than 'text'? Rerun with --text-field FIELD and a new --out; the first skipped lines are in "
        f"{out / 'logs' / 'skipped.json'}"
    )
    assert not (out / "meta.json").exists() and not (out / "meta.pkl").exists()
    # Finalizing again (a rerun of the same command) says the same, and still writes no meta.
    with pytest.raises(UserError, match="split train: 3 lines read, none became a document"):
        finalize(out, manifest, INFO, RunOptions().output)
    assert not (out / "meta.json").exists()


def test_every_empty_split_is_named_in_the_one_line(tmp_path):
    shards = {"train/code.jsonl": CODE, "validation/code.jsonl": CODE[:1] + ["", "{"]}
    out, manifest = tokenized_shards(tmp_path, shards)
    with pytest.raises(UserError) as e:
        finalize(out, manifest, INFO, RunOptions().output)
    assert str(e.value).startswith(
        "split train: 3 lines read, none became a document (skipped: no_text 3); split validation: 3 lines read, "
        "none became a document (skipped: blank 1, invalid_json 1, no_text 1): is the text in another field "
    )


def test_a_split_left_empty_by_skip_failed_still_finishes(tmp_path):
    # Its only shard failed and was excluded: no line of it was read (lines 0), so nothing is refused.
    out, manifest = tokenized_shards(
        tmp_path, {"train/prose.jsonl": PROSE, "validation/prose.jsonl": PROSE}, skip={"validation/prose.jsonl"}
    )
    excluded = {"validation/prose.jsonl": "SourceError: truncated"}
    meta = finalize(out, manifest, INFO, RunOptions().output, excluded=excluded)
    assert meta["splits"]["validation"]["lines"] == 0 and meta["splits"]["validation"]["documents"] == 0
    assert meta["splits"]["train"]["documents"] == 4 and (out / "meta.json").exists()


def test_a_train_split_whose_documents_all_went_to_val_is_not_empty(tmp_path):
    # --val-fraction near 1: every train document is held out for val.bin; they are documents all the same.
    options = RunOptions(val_fraction=0.999999)
    out, manifest = tokenized_shards(tmp_path, {"train/prose.jsonl": PROSE}, options)
    meta = finalize(out, manifest, INFO, options.output)
    train, val = meta["splits"]["train"], meta["splits"]["validation"]
    assert (train["lines"], train["documents"], train["held_out"], val["documents"]) == (4, 0, 4, 4)


def test_run_says_it_in_one_line_and_exits_2(tmp_path, small_tokenizer):
    # The validation split holds lines whose text is empty: read, counted, and none a document.
    write_jsonl(tmp_path / "data" / "train" / "prose.jsonl", PROSE)
    write_jsonl(tmp_path / "data" / "validation" / "empty.jsonl", [json.dumps({"text": ""})] * 2)
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    assert cli("manifest", "--dataset-dir", tmp_path / "data", "-o", manifest).returncode == 0
    # A process of its own, as every run that tokenizes: on a loaded machine the driver may start Ray, whose
    # stop takes over stderr and would end an in-process caller's Ray under it (an xdist worker crashed so).
    # The 600-id tokenizer: Qwen3's load would be most of the run's CPU.
    run = tokpipe("run", "--manifest", manifest, "--tokenizer", small_tokenizer, "--out", out, "--workers", "1")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.splitlines()[-1] == (
        "tokpipe run: error: split validation: 2 lines read, none became a document (skipped: empty_text 2): is the "
        "text in another field than 'text'? Rerun with --text-field FIELD and a new --out; the first skipped lines "
        f"are in {out / 'logs' / 'skipped.json'}"
    )
    assert "Traceback" not in run.stderr and not (out / "meta.json").exists()
    assert cli("status", out).stdout.startswith(f"{out}: stopped before finishing")  # not finished

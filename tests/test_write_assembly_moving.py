"""write/assembly/moving.py: shards appended before finished ones move those to their new offsets, copied from the
split file as it was. A kill -9 at each step of the move leaves an OUT that the same command finishes with the
reference's bytes, tokenizing no finished shard again and leaving no source behind; a second append before the
move is done moves parts from both sources."""

import os
import re
import shutil

import numpy as np
import pytest
from helpers import (
    EXAMPLE_HOLDOUT_FILES,
    GROUP_FIELD,
    add_shards,
    assert_out_is,
    cli,
    killed_run,
    plain_copy_of_example,
    reference_by_group,
    reference_tokenizer,
    reference_tokens,
    run_args,
    snapshot_files,
    tokpipe,
)

from tokpipe.inputs.manifest import build_manifest, write_manifest

# Added to the example's train shards: one before them all, one between the two.
FIRST, BETWEEN = "train/chunk0/example_train_a.jsonl.zst", "train/chunk1/example_train_0a.jsonl.zst"


@pytest.fixture(scope="module")
def appended(tmp_path_factory, small_tokenizer):
    """For a run's options: (the dataset, its manifest after the append, an OUT finished before it): the example's
    three shards run with the 600-id tokenizer, then FIRST and BETWEEN added. Copy the OUT before changing it."""
    made = {}

    def make(*options):
        if options not in made:
            root = tmp_path_factory.mktemp("appended")
            dataset = plain_copy_of_example(root / "data")
            write_manifest(build_manifest(dataset), root / "before.json")
            first = tokpipe(*run_args(root / "before.json", root / "out", *options, tokenizer=small_tokenizer))
            assert first.returncode == 0, first.stderr
            add_shards(dataset, FIRST, BETWEEN)
            write_manifest(build_manifest(dataset), root / "after.json")
            made[options] = dataset, root / "after.json", root / "out"
        return made[options]

    return make


def reference(dataset, small_tokenizer, grouped: bool = False) -> dict:
    """Each split file's tokens (by stem); grouped, each group's of each split (by stem, then value)."""
    tokenizer = small_tokenizer / "tokenizer.json"
    eos = reference_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    files = {"train": snapshot_files(dataset, "train"), "val": EXAMPLE_HOLDOUT_FILES}
    if grouped:
        return {stem: reference_by_group(paths, tokenizer, GROUP_FIELD, eos) for stem, paths in files.items()}
    return {stem: reference_tokens(paths, tokenizer, eos, np.uint16) for stem, paths in files.items()}


def moving_line(moved: str) -> str:
    return (
        f"moving finished shards to their new offsets, after the shards added before them ({moved}): copied from the"
        " split files as they were, none tokenized again"
    )


def assert_finished_clean(out, dataset, small_tokenizer, grouped: bool = False) -> None:
    """OUT is the reference's, its sources of moved parts gone, no shard token file left, and verify holds."""
    if grouped:
        for stem, groups in reference(dataset, small_tokenizer, grouped).items():
            for group, (tokens, _, _) in groups.items():
                assert np.array_equal(np.fromfile(out / stem / f"{group}.bin", dtype=np.uint16), tokens), group
    else:
        assert_out_is(out, reference(dataset, small_tokenizer))
    assert not (out / "moving").exists()
    assert not [p for p in (out / "shards").rglob("*") if p.suffix in (".bin", ".idx")]
    assert cli("verify", out).returncode == 0


# Where the run appending FIRST and BETWEEN is killed (KILLED_RUN: the driver tokenizes alone, in manifest order,
# and places what it can after each shard: FIRST with example_train_0 moved after it, then BETWEEN with
# example_train_1; validation's place is unchanged): which call of what.
KILL_POINTS = {
    "after the split's files are linked as a source, before its parts list": ("tokpipe.write.assembly.moving.link", 3),
    "after the source's parts list, before the new split files": ("tokpipe.write.assembly.recovery._prepare_files", 1),
    "after the new split files, before their parts list": ("tokpipe.layout.files.LayoutWriter.start_parts_list", 1),
    "while copying a moved part": ("tokpipe.write.place.copy_range", 2),
    "after moved parts are placed, before they are listed": ("tokpipe.write.assembly.Assembler.placed", 1),
    "after the last moved part is listed, before the source goes": ("tokpipe.write.assembly.moving.Moving.end", 1),
    "after the source's parts list is removed, before its files": ("tokpipe.write.assembly.moving._remove", 1),
}
# What the kill leaves: whether the source's parts list is there (the move's commit; a source without it is a
# start that never committed, or an end half done) and whether train.bin.tmp is still the source's file (the new
# split file not made yet); then the shards the rerun finds done, and those it moves.
AFTER_THE_KILL = {
    "after the split's files are linked as a source, before its parts list": (False, True, 3, 2),
    "after the source's parts list, before the new split files": (True, True, 3, 2),
    "after the new split files, before their parts list": (True, False, 3, 2),
    "while copying a moved part": (True, False, 4, 1),  # FIRST and example_train_0 listed, BETWEEN never fsynced
    "after moved parts are placed, before they are listed": (True, False, 4, 1),  # kept: their checksums match
    "after the last moved part is listed, before the source goes": (True, False, 5, 0),
    "after the source's parts list is removed, before its files": (False, False, 5, 0),
}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_9_at_each_step_of_a_move_loses_nothing(appended, tmp_path, small_tokenizer, point):
    dataset, manifest, finished = appended()
    out = shutil.copytree(finished, tmp_path / "out")
    target, call = KILL_POINTS[point]
    killed_run(target, call, manifest, out, tokenizer=small_tokenizer)
    assert not (out / "meta.json").exists()
    committed, unmade, done, moved = AFTER_THE_KILL[point]
    source = out / "moving" / "train" / "0"
    assert (source / "train.parts").exists() == committed
    assert os.path.samefile(out / "train.bin.tmp", source / "train.bin") == unmade
    rerun = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(rf": 5 shards, .*; {done} done, 0 partial, {5 - done} to start$", rerun.stdout, re.M), rerun.stdout
    assert [line for line in rerun.stdout.splitlines() if line.startswith("moving")] == (
        [moving_line(f"{moved} in train")] if moved else []
    )
    assert "tokenizing again" not in rerun.stdout  # no finished shard's tokens are lost
    assert_finished_clean(out, dataset, small_tokenizer)


@pytest.mark.parametrize(
    "point", ["after the source's parts list, before the new split files", "while copying a moved part"]
)
def test_a_kill_9_in_a_move_of_groups_loses_nothing(appended, tmp_path, small_tokenizer, point):
    """--group-by: each group's file of the split is a file of the source, and the new split's group files are made
    anew (the example's groups are safe file names)."""
    dataset, manifest, finished = appended("--group-by", GROUP_FIELD)
    out = shutil.copytree(finished, tmp_path / "out")
    target, call = KILL_POINTS[point]
    killed_run(target, call, manifest, out, "--group-by", GROUP_FIELD, tokenizer=small_tokenizer)
    groups = sorted(p.name for p in (out / "moving" / "train" / "0").iterdir())
    assert groups == [
        "RedPajamaC4.bin",
        "RedPajamaC4.idx",
        "RedPajamaCommonCrawl.bin",
        "RedPajamaCommonCrawl.idx",
        "RedPajamaGithub.bin",
        "RedPajamaGithub.idx",
        "RedPajamaWikipedia.bin",
        "RedPajamaWikipedia.idx",
        "train.parts",
    ]
    rerun = tokpipe(*run_args(manifest, out, "--group-by", GROUP_FIELD, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "tokenizing again" not in rerun.stdout
    assert_finished_clean(out, dataset, small_tokenizer, grouped=True)


def test_an_append_before_a_move_is_done_moves_parts_from_both_sources(dataset, tmp_path, small_tokenizer):
    """A run moving example_train_0 and _1 after FIRST and BETWEEN is killed with FIRST and example_train_0 listed in
    the new split file; then a shard is added between those two: the new split file becomes a second source, and
    the run takes each part from whichever source holds it."""
    out = tmp_path / "out"
    write_manifest(build_manifest(dataset), tmp_path / "before.json")
    assert tokpipe(*run_args(tmp_path / "before.json", out, tokenizer=small_tokenizer)).returncode == 0
    add_shards(dataset, FIRST, BETWEEN)
    write_manifest(build_manifest(dataset), tmp_path / "after.json")
    killed_run("tokpipe.write.place.copy_range", 2, tmp_path / "after.json", out, tokenizer=small_tokenizer)
    assert os.listdir(out / "moving" / "train") == ["0"]
    done_at = {p: p.stat().st_mtime_ns for p in (out / "shards").rglob("*.json")}  # FIRST's too

    add_shards(dataset, "train/chunk0/example_train_b.jsonl.zst")
    write_manifest(build_manifest(dataset), tmp_path / "again.json")
    # Killed again once every moved part is listed: both sources were there until then.
    killed_run("tokpipe.write.assembly.moving.Moving.end", 1, tmp_path / "again.json", out, tokenizer=small_tokenizer)
    assert sorted(os.listdir(out / "moving" / "train")) == ["0", "1"]
    rerun = tokpipe(*run_args(tmp_path / "again.json", out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(r": 6 shards, .*; 6 done, 0 partial, 0 to start$", rerun.stdout, re.M), rerun.stdout
    assert {p: p.stat().st_mtime_ns for p in done_at} == done_at  # none of the finished shards tokenized again
    assert_finished_clean(out, dataset, small_tokenizer)

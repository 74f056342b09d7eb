"""place: a shard's buffered tokens are written once, at their offset, then its checkpoint, then its line in
.parts; a kill -9 of the run at each of those steps loses nothing, and a rerun keeps what is in place."""

import re

import numpy as np
import pytest
from helpers import (
    EXAMPLE_CACHE,
    EXAMPLE_HOLDOUT_FILES,
    EXAMPLE_TRAIN_FILES,
    GROUP_FIELD,
    assert_out_is,
    cli,
    killed_run,
    reference_by_group,
    reference_tokenizer,
    run_args,
    tokpipe,
)

from tokpipe.inputs.manifest import build_manifest, write_manifest

# Which call of what kills the run (with the 600-id tokenizer: placing, not Qwen3, is the subject; its driver
# tokenizes the example alone, Ray never started: every placing happens in that one process, shard after shard:
# train's two, then validation's), and how many shards the rerun finds done: train's first when it was listed,
# or in place with its checkpoint but unlisted (kept by its checksums); none when the kill came before its
# checkpoint (its bytes in place are written again).
KILL_POINTS = {
    "while writing a part's tokens": ("tokpipe.write.place.write_at", 2, 1),
    "after its bytes are fsynced, before its checkpoint": ("tokpipe.write.place.write_placed", 1, 0),
    "after its checkpoint, before its line in .parts": ("tokpipe.write.assembly.Assembler.placed", 1, 1),
}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_9_at_each_step_of_placing_a_buffered_shard_loses_nothing(
    tmp_path, small_tokenizer, small_reference, point
):
    target, call, done = KILL_POINTS[point]
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    write_manifest(build_manifest(EXAMPLE_CACHE), manifest)
    killed_run(target, call, manifest, out, tokenizer=small_tokenizer)
    assert not list((out / "shards").rglob("*.bin"))  # the shards buffered: no token written but into place
    rerun = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(rf": 3 shards, .*; {done} done, 0 partial, {3 - done} to start$", rerun.stdout, re.M), rerun.stdout
    assert "tokenizing again" not in rerun.stdout  # no token that was on disk is lost
    assert_out_is(out, small_reference)
    assert not [p for p in (out / "shards").rglob("*") if p.suffix in (".bin", ".idx")]
    assert cli("verify", out).returncode == 0


def test_with_group_by_parts_in_place_with_their_checkpoint_but_unlisted_are_kept(tmp_path, small_tokenizer):
    """--group-by: a shard whose parts went to its groups' files and whose checkpoint was written, killed before its
    lines in .parts, is done as status says: the rerun keeps its parts by their checksums, tokenizing none again
    (they were tokenized again, after status had counted the shard done)."""
    manifest, out = tmp_path / "m.json", tmp_path / "out"
    write_manifest(build_manifest(EXAMPLE_CACHE), manifest)
    options = ("--group-by", GROUP_FIELD)
    killed_run("tokpipe.write.assembly.Assembler.placed", 1, manifest, out, *options, tokenizer=small_tokenizer)
    assert "train       1/2 done" in cli("status", out).stdout
    rerun = tokpipe(*run_args(manifest, out, *options, tokenizer=small_tokenizer))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert re.search(r": 3 shards, .*; 1 done, 0 partial, 2 to start$", rerun.stdout, re.M), rerun.stdout
    assert "tokenizing again" not in rerun.stdout
    eos = reference_tokenizer(small_tokenizer / "tokenizer.json").token_to_id("<|endoftext|>")
    for stem, files in (("train", EXAMPLE_TRAIN_FILES), ("val", EXAMPLE_HOLDOUT_FILES)):
        groups = reference_by_group(files, small_tokenizer / "tokenizer.json", GROUP_FIELD, eos)
        for group, (tokens, documents, _) in groups.items():
            assert np.array_equal(np.fromfile(out / stem / f"{group}.bin", np.uint16), tokens), (stem, group)
            assert len(np.fromfile(out / stem / f"{group}.idx", "<i8")) == documents
    assert cli("verify", out).returncode == 0


def test_a_buffered_part_is_written_at_its_offset_and_its_checkpoint_after(tmp_path):
    """place() of a part from memory: the tokens at the part's offset, its document ends moved by it, and the
    checkpoint it carries written once the bytes are fsynced."""
    from tokpipe.inputs.manifest import Shard
    from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
    from tokpipe.layout.files import Layout
    from tokpipe.layout.records import Part
    from tokpipe.write.place import place

    bin_tmp, idx_tmp, _ = Layout(tmp_path).assembly("train")
    bin_tmp.write_bytes(np.arange(5, dtype=np.uint32).tobytes())
    idx_tmp.write_bytes(np.array([2, 5], dtype="<i8").tobytes())
    tokens = [np.array([7, 8, 9], dtype=np.uint32), np.array([10], dtype=np.uint32)]
    ends = [np.array([3], dtype="<i8"), np.array([4], dtype="<i8")]
    record = {"shard": "train/b.jsonl", "tokens": 4, "documents": 2, "sha256": "x", "idx_sha256": "y"}
    checkpoint = ("train", "train__b", Checkpoint(tokens=4, documents=2, done=True))
    part = Part(
        "train", 1, 5, 2, record, buffered=({(False, None): (tokens, ends)}, (False, None)), checkpoint=checkpoint
    )
    assert place(tmp_path, [part], 4) == [record]
    assert np.fromfile(bin_tmp, dtype=np.uint32).tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10]
    assert np.fromfile(idx_tmp, dtype="<i8").tolist() == [2, 5, 8, 9]
    [placed] = (tmp_path / "shards" / "train" / "placed").iterdir()  # one file a placing, its shards' by key
    assert placed.read_bytes() == checkpoint[2].encoded().join([b'{"train__b":', b"}"])
    shard = Shard(split="train", relpath="train/b.jsonl", path="b.jsonl", size=0, key="train__b")
    assert Checkpoints(tmp_path).of(shard) == checkpoint[2]


def test_a_moved_part_is_copied_from_where_it_was_and_its_document_ends_rebased(tmp_path):
    """place() of a part moved in its split (shards were added before it): its tokens copied from its offset in the
    split file as it was, its document ends counted from its new offset, its checksums (an earlier tokpipe's
    record has none) of its own bytes."""
    import hashlib

    from tokpipe.layout.files import Layout
    from tokpipe.layout.records import Part
    from tokpipe.write.place import place

    # The split file as it was: documents of 3, 4 and 3 tokens; the part is the last two, from token 3, document 1.
    was_bin, was_idx = tmp_path / "was.bin", tmp_path / "was.idx"
    was_bin.write_bytes(np.arange(100, 110, dtype=np.uint32).tobytes())
    was_idx.write_bytes(np.array([3, 7, 10], dtype="<i8").tobytes())
    bin_tmp, idx_tmp, _ = Layout(tmp_path).assembly("train")
    bin_tmp.write_bytes(np.arange(5, dtype=np.uint32).tobytes())  # a shard added before it: 5 tokens, 2 documents
    idx_tmp.write_bytes(np.array([2, 5], dtype="<i8").tobytes())
    record = {"shard": "train/b.jsonl", "tokens": 7, "documents": 2, "sha256": None, "idx_sha256": None}
    part = Part("train", 1, 5, 2, record, str(was_bin), str(was_idx), moved_from=(3, 1))
    [placed] = place(tmp_path, [part], 4)
    assert np.fromfile(bin_tmp, dtype=np.uint32).tolist() == [0, 1, 2, 3, 4, 103, 104, 105, 106, 107, 108, 109]
    assert np.fromfile(idx_tmp, dtype="<i8").tolist() == [2, 5, 9, 12]
    assert placed == record | {
        "sha256": hashlib.sha256(np.arange(103, 110, dtype=np.uint32).tobytes()).hexdigest(),
        "idx_sha256": hashlib.sha256(np.array([4, 7], dtype="<i8").tobytes()).hexdigest(),
    }


# A run's placing of 1,000 groups' parts at once (--group-by's most) in a process of 64 descriptors: a login shell
# allows 1,024, which three a group held open together ran past at 990 groups (EMFILE).
MANY_GROUPS = """
import resource, sys
from pathlib import Path
import numpy as np
from tokpipe.layout.files import Layout
from tokpipe.layout.records import Part
from tokpipe.write.place import place

out, parts = Path(sys.argv[1]), []
for g in range(1000):
    group = f"g{g:04d}"
    bin_tmp, idx_tmp, _ = Layout(out).assembly("train", group)
    bin_tmp.parent.mkdir(exist_ok=True)
    bin_tmp.touch()
    idx_tmp.touch()
    record = {"shard": "train/s.jsonl", "group": group, "tokens": 1, "documents": 1, "sha256": "x", "idx_sha256": "y"}
    tokens = {(False, group): ([np.array([g], dtype=np.uint32)], [np.array([1], dtype="<i8")])}
    parts.append(Part("train", g, 0, 0, record, buffered=(tokens, (False, group))))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
place(out, parts, 4)
"""


def test_the_parts_of_a_thousand_groups_are_placed_one_file_at_a_time(tmp_path):
    import subprocess
    import sys

    from tokpipe.layout.files import Layout

    placed = subprocess.run([sys.executable, "-c", MANY_GROUPS, str(tmp_path)], capture_output=True, text=True)
    assert placed.returncode == 0, placed.stderr[-2000:]
    for g in range(1000):
        bin_tmp, idx_tmp, _ = Layout(tmp_path).assembly("train", f"g{g:04d}")
        assert (np.fromfile(bin_tmp, np.uint32).tolist(), np.fromfile(idx_tmp, "<i8").tolist()) == ([g], [1])

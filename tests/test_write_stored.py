"""write/stored.py: the driver's side of an OUT on a store, which walks each split in order and closes segments from
the parts of the shards done. What it holds of a shard's tokens is where they wait, never the tokens: a node lost,
each of them is found (runner/copies.py marks those of that node lost), whichever step of the walk it is at."""

import json
import threading

import numpy as np
import pytest
from helpers import EXAMPLE_CACHE, store_requests, write_jsonl

import tokpipe.write.stored
from tokpipe.inputs.manifest import Manifest, build_manifest
from tokpipe.layout.checkpoints import Checkpoint, PartCounts
from tokpipe.layout.run import WriteSpec
from tokpipe.layout.stored import Entry, Segment, StoredOut, reader_out
from tokpipe.store import Bucket
from tokpipe.write.segments import ClosedSegment, Kept
from tokpipe.write.stored import PartTokens, StoreAssembly, StoredCheckpoints, compose_split, upload_closed


def test_a_done_shard_s_tokens_are_held_until_its_segment_is_handed_out():
    manifest = build_manifest(EXAMPLE_CACHE)
    assembly = StoreAssembly(StoredOut.of("s3://b/out"), WriteSpec(), manifest, itemsize=4)
    first, second = list(manifest.shards("train"))[:2]
    ckpt = Checkpoint(done=True, tokens=1000, documents=3, parts=[PartCounts(tokens=1000, documents=3)])

    # Done, its part joins the train file's segment, which gathers on (4,000 bytes of 5 MiB): held there.
    assembly.done(first, ckpt, "where the first's tokens wait")
    assert assembly.ready() == []
    assert assembly.held() == ["where the first's tokens wait"]
    # The file's last shard done: the segment closes, and what it holds is handed out.
    assembly.done(second, ckpt, "where the second's tokens wait")
    (planned,) = assembly.ready()
    assert [step.buffered for step in planned.sources] == [
        "where the first's tokens wait",
        "where the second's tokens wait",
    ]
    assert assembly.held() == []


def test_a_part_uploaded_is_let_go_while_its_shard_s_other_parts_wait(s3_server, s3_prefix):
    # A shard of two groups: its common part fills a segment, its rare part waits in one still gathering (until the
    # split's end). The uploaded part's tokens must not wait with it: a rare group held every shard's tokens.
    out = StoredOut.of(s3_server.url(s3_prefix))
    common, rare = (False, "common"), (False, "rare")
    tokens = np.arange(1000, dtype="<u2")
    buffered = {common: ([tokens], [np.array([1000])]), rare: ([tokens[:2]], [np.array([2])])}
    name = out.name(out.segment("train", "common", "s0"))
    segment = Segment("train", "common", name, [Entry("train/s0.jsonl", False, "common", 1000, 1)], 1000, 1)
    upload_closed(out, ClosedSegment(segment, [PartTokens(buffered, common)]))
    assert out.bucket.get(f"{out.key(name)}.bin")[0] == tokens.tobytes()
    assert list(buffered) == [rare]


def test_a_segment_of_kept_parts_reads_them_at_once(s3_server, s3_prefix, monkeypatch):
    # A rare group's segment can hold thousands of parts kept on the store (runner/copies.py SegmentUploads._unpin),
    # each two GETs: one after another, ~11 min at a cloud store's ~25 ms an answer for 13,000 of them.
    out = StoredOut.of(s3_server.url(s3_prefix))
    together = threading.Barrier(2, timeout=10)  # each read waits for the other: read in turn, neither comes

    def read(kept: Kept):
        together.wait()
        return [np.full(2, int(kept.bin[-1]), "<u2")], [np.array([2])]

    monkeypatch.setattr(Kept, "arrays", read)
    entries = [Entry(f"train/s{n}.jsonl", False, "rare", 2, 1) for n in range(2)]
    name = out.name(out.segment("train", "rare", "s0"))
    steps = [PartTokens({(False, "rare"): Kept(out, f"b{n}", f"i{n}", "<u2")}, (False, "rare")) for n in range(2)]
    upload_closed(out, ClosedSegment(Segment("train", "rare", name, entries, 4, 2), steps))
    assert out.bucket.get(f"{out.key(name)}.bin")[0] == np.array([0, 0, 1, 1], "<u2").tobytes()


def test_a_grouped_split_of_no_part_composes_no_file():
    """--group-by with every shard left out (--skip-failed): no group has a file to compose (finalize then refuses the
    empty split in one line), and no request is made."""
    assembly = StoreAssembly(StoredOut.of("s3://b/out"), WriteSpec(group_by="g"), build_manifest(EXAMPLE_CACHE), 4)
    assert assembly.made == {}
    compose_split(assembly, "train")


def test_a_rerun_removes_what_killed_attempts_left_uncommitted_in_one_request(s3_server, s3_prefix, monkeypatch):
    # Three segments whose .json and .idx were sent, not their .bin (uploads in flight at a kill), and a split file of
    # a finalize killed before meta.json: one DeleteObjects, not a DELETE each (a round trip each, ~30 ms at a cloud
    # store; a killed run on Ray leaves 4 segments uploading a node).
    out = StoredOut.of(s3_server.url(s3_prefix))
    left = [f"{out.segments}train/train__s{n}.{suffix}" for n in range(3) for suffix in ("json", "idx")]
    left.append(out.of_local(out.layout.split("train", None)) + ".bin")
    for key in left:
        out.bucket.put(key, b"left")
    asked = store_requests(monkeypatch)
    StoreAssembly(out, WriteSpec(), build_manifest(EXAMPLE_CACHE), itemsize=4).resume(print)
    assert [operation for operation, _ in asked] == [
        "ListMultipartUploads",
        "DeleteObject",  # meta.json, meta.pkl: an OUT appended to is unfinished at once
        "DeleteObject",
        "ListObjectsV2",
        "DeleteObjects",
    ]
    assert sorted(o["Key"] for o in asked[-1][1]["Delete"]["Objects"]) == sorted(left)
    assert list(out.bucket.list(out.prefix)) == []


def seventy_shards(folder) -> Manifest:
    for n in range(70):
        write_jsonl(folder / "data" / "train" / f"s{n:02}.jsonl", [json.dumps({"text": f"document {n}"})])
    return build_manifest(folder / "data")


def placed_objects(out: StoredOut) -> list[str]:
    return [o.key for o in out.bucket.list(out.checkpoints) if "/placed/" in o.key]


def killed(*_):  # as a kill -9 before the removal leaves OUT
    raise KeyboardInterrupt


def test_a_run_merges_its_last_64_placed_objects_of_a_split_into_one_and_a_kill_between_loses_none(
    s3_server, s3_prefix, tmp_path, monkeypatch
):
    # On Ray a commit completes about a shard: 70 commits of one checkpoint each. At the 64th the run merges its 64
    # objects into one, from memory, and removes them once it is up.
    manifest = seventy_shards(tmp_path)
    shards, done = list(manifest.shards()), [Checkpoint(done=True, lines=n, tokens=3 * n) for n in range(70)]
    out, killed_out = (StoredOut.of(s3_server.url(f"{s3_prefix}/{name}")) for name in ("whole", "killed"))
    written = StoredCheckpoints(out)
    for shard, ckpt in zip(shards, done):
        written.write({"train": {shard.key: (shard, ckpt)}})
    assert len(placed_objects(out)) == 7 and StoredCheckpoints.listed(out).of(shards) == done
    by_object = sorted(sorted(json.loads(out.bucket.get(key)[0])) for key in placed_objects(out))
    assert by_object == sorted([[s.key for s in shards[:64]]] + [[s.key] for s in shards[64:]])

    monkeypatch.setattr(Bucket, "delete_many", killed)
    written = StoredCheckpoints(killed_out)
    with pytest.raises(KeyboardInterrupt):
        for shard, ckpt in zip(shards, done):
            written.write({"train": {shard.key: (shard, ckpt)}})
    # Killed after the merged object was up: both are there, holding the same checkpoints.
    assert len(placed_objects(killed_out)) == 65
    assert StoredCheckpoints.listed(killed_out).of(shards[:64]) == done[:64]


def test_a_reader_that_listed_the_objects_a_run_then_merged_copies_the_merged_one(
    s3_server, s3_prefix, tmp_path, monkeypatch
):
    manifest, out = seventy_shards(tmp_path), StoredOut.of(s3_server.url(s3_prefix))
    shards, written = list(manifest.shards())[:64], StoredCheckpoints(out)
    for shard in shards[:63]:
        written.write({"train": {shard.key: (shard, Checkpoint(done=True))}})
    out.bucket.put(f"{out.checkpoints}train/{shards[0].key}.bin", b"tokens")  # a part kept for a rerun: no record
    get, merging = Bucket.get, threading.Lock()

    def merged_after_the_list(bucket, key, *args):  # `status` of a live run: its 64th commit between LIST and GETs
        with merging:
            if written.recent["train"]:
                written.write({"train": {shards[63].key: (shards[63], Checkpoint(done=True))}})
        return get(bucket, key, *args)

    monkeypatch.setattr(Bucket, "get", merged_after_the_list)
    copy = reader_out(str(out))
    assert len(placed_objects(out)) == 1
    held = [json.loads(path.read_bytes()) for path in copy.rglob("*.json") if path.parent.name == "placed"]
    assert sorted(key for found in held for key in found) == sorted(shard.key for shard in shards)
    assert list(copy.rglob("*.bin")) == []


def test_a_finished_out_s_checkpoints_are_compacted_in_manifest_order_and_a_kill_between_loses_none(
    s3_server, s3_prefix, tmp_path, monkeypatch
):
    # 70 shards, each checkpointed in an object of its own (70 runs of one commit: a run merges only its own objects);
    # finalize merges them into objects of PLACED_MOST (32 here), in manifest order, and removes the others once
    # those are up.
    manifest, out = seventy_shards(tmp_path), StoredOut.of(s3_server.url(s3_prefix))
    shards = list(manifest.shards())
    for n, shard in enumerate(shards):
        StoredCheckpoints(out).write({"train": {shard.key: (shard, Checkpoint(done=True, lines=n, tokens=3 * n))}})
    monkeypatch.setattr(tokpipe.write.stored, "PLACED_MOST", 32)

    def checkpoints() -> list[Checkpoint]:
        return StoredCheckpoints.listed(out).of(shards)

    assert len(placed_objects(out)) == 70
    before = checkpoints()
    monkeypatch.setattr(Bucket, "delete_many", killed)
    with pytest.raises(KeyboardInterrupt):
        StoredCheckpoints(out).compact(manifest)
    assert len(placed_objects(out)) == 73 and checkpoints() == before  # both: the same checkpoints
    monkeypatch.undo()
    monkeypatch.setattr(tokpipe.write.stored, "PLACED_MOST", 32)
    StoredCheckpoints(out).compact(manifest)  # the rerun's finalize
    assert len(placed_objects(out)) == 3 and checkpoints() == before
    by_object = sorted(tuple(json.loads(out.bucket.get(key)[0])) for key in placed_objects(out))
    assert by_object == sorted(tuple(shard.key for shard in shards[at : at + 32]) for at in (0, 32, 64))


def test_finalize_s_merge_reads_no_placed_object_again_that_the_parts_lists_read(
    s3_server, s3_prefix, tmp_path, monkeypatch
):
    manifest, out = seventy_shards(tmp_path), StoredOut.of(s3_server.url(s3_prefix))
    shards = list(manifest.shards())
    for n, shard in enumerate(shards):  # 70 objects of one checkpoint, as 70 runs leave them
        StoredCheckpoints(out).write({"train": {shard.key: (shard, Checkpoint(done=True, lines=n))}})
    found = StoredCheckpoints.listed(out)
    before = found.of(shards)  # as finalize's parts lists read them
    asked = store_requests(monkeypatch)
    found.compact(manifest)
    assert [operation for operation, _ in asked] == ["ListObjectsV2", "PutObject", "DeleteObjects"]
    assert StoredCheckpoints.listed(out).of(shards) == before

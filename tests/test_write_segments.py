"""write/segments.py: which parts a segment of an OUT on a store holds, decided from the parts' counts alone, in
split order: a part joins its file's open segment, closed once it holds SEGMENT_BYTES; a large part that comes with
no segment open is a segment of its own (uploaded where its tokens are); a file's last segment may be short. And a
segment's upload checks its parts' tokens against their counts before a byte is sent."""

import tempfile

import numpy as np
import pytest
from helpers import EXAMPLE_CACHE

import tokpipe.write.segments
from tokpipe.inputs.manifest import build_manifest
from tokpipe.layout.checkpoints import Checkpoint, PartCounts
from tokpipe.layout.files import ShardFiles
from tokpipe.layout.run import WriteSpec
from tokpipe.layout.stored import SEGMENT_BYTES, StoredOut, part_name
from tokpipe.store.bucket import Bucket
from tokpipe.write.segments import Entry, Gatherer, Kept, Segment
from tokpipe.write.stored import StoreAssembly, StoredCheckpoints, upload_segment

TOKENS_A_MIB = (1 << 20) // 4  # uint32


def _closed(segments: Gatherer, sizes_mib: list[float], group=None) -> list[list[str]]:
    """The segments closed as parts of these sizes (MiB, named p0, p1, ...) come to train's file, then its end: each
    as the names of the parts it holds."""
    closed = []
    for n, mib in enumerate(sizes_mib):
        entry = Entry(f"train/p{n}.jsonl", False, group, int(mib * TOKENS_A_MIB), 1)
        closed += segments.add("train", f"p{n}", entry, source=n)
    closed += segments.end("train")
    return [[f"p{source}" for source in planned.sources] for planned in closed]


def test_large_parts_stand_alone_and_small_ones_gather_until_the_least_part():
    assert SEGMENT_BYTES == 5 << 20  # S3's least part of a multipart upload, which the composing of a file needs
    segments = Gatherer(StoredOut.of("s3://b/out"), concat=True, itemsize=4)
    # p0 large and no segment open: alone. p1..p3 small: gathered, then p3 (large) closes their segment (9 MiB).
    # p4 large: alone. p5, p6: 4 MiB, the file's last segment, short.
    closed = _closed(segments, [6, 2, 1.5, 5.5, 8, 3, 1])
    assert closed == [["p0"], ["p1", "p2", "p3"], ["p4"], ["p5", "p6"]]


def test_a_segment_is_named_by_its_first_part_and_counts_its_parts():
    segments = Gatherer(StoredOut.of("s3://b/out"), concat=True, itemsize=4)
    segments.add("val", "a", Entry("train/a.jsonl", True, None, 100, 2), source="a")
    (planned,) = segments.end("val") + segments.end("train")
    assert planned.segment == Segment(
        "val", None, "segments/val/a", [Entry("train/a.jsonl", True, None, 100, 2)], tokens=100, documents=2
    )


def test_each_group_s_file_has_segments_of_its_own():
    segments = Gatherer(StoredOut.of("s3://b/out"), concat=True, itemsize=4)
    segments.add("train", "p0", Entry("train/p0.jsonl", False, "en", TOKENS_A_MIB, 1), source=0)
    segments.add("train", "p0", Entry("train/p0.jsonl", False, "de", TOKENS_A_MIB, 1), source=1)
    names = [planned.segment.name for planned in segments.end("train")]
    assert names == ["segments/train/groups/en/p0", "segments/train/groups/de/p0"]


def test_with_no_concat_every_part_is_a_segment_of_its_own():
    segments = Gatherer(StoredOut.of("s3://b/out"), concat=False, itemsize=4)
    assert _closed(segments, [0.001, 0.001, 7]) == [["p0"], ["p1"], ["p2"]]


def test_an_upload_whose_tokens_are_not_the_counted_ones_sends_nothing():
    segment = Segment("train", None, "segments/train/a", [Entry("train/a.jsonl", False, None, 3, 1)], 3, 1)
    arrays = [([np.array([1, 2], np.uint32)], [np.array([2], np.int64)])]
    # No bucket is reached: the store of this URL does not exist, and the count is checked first.
    with pytest.raises(ValueError, match="the tokens of train/a.jsonl's part are not the 3 counted"):
        upload_segment(StoredOut.of("s3://no-such-bucket/out"), segment, arrays)


def test_parts_a_keep_left_without_its_checkpoint_are_passed_over_for_a_shard_done_since(s3_server, s3_prefix):
    # A keep (write/stored.py keep: a shard's parts, then its checkpoint) killed between the two; a rerun tokenized the
    # shard again, committed its part in a segment and checkpointed it with others. The next rerun takes its checkpoint
    # from there (it has none of its own), and its part, committed, is not taken again from what the keep left.
    out = StoredOut.of(s3_server.url(s3_prefix))
    manifest = build_manifest(EXAMPLE_CACHE)
    shard = next(manifest.shards("train"))
    bin_path, idx_path = ShardFiles.of(out.work, shard).part((False, None))
    for path in (idx_path, bin_path):
        out.bucket.put(out.of_local(path), b"\0" * 8)
    entry = Entry(shard.relpath, False, None, 2, 1)
    name = out.name(out.segment("train", None, part_name(shard, (False, None))))
    upload_segment(out, Segment("train", None, name, [entry], 2, 1), [([np.array([7, 7], "<u4")], [np.array([2])])])
    ckpt = Checkpoint(done=True, tokens=2, documents=1, parts=[PartCounts(tokens=2, documents=1)])
    StoredCheckpoints(out).write({"train": {shard.key: (shard, ckpt)}})
    assembly = StoreAssembly(out, WriteSpec(), manifest, itemsize=4)
    assembly.resume(print)
    assert assembly.ready() == [] and assembly.segments.open == {}


def test_a_kept_part_is_read_in_ranges_into_a_file_that_an_error_midway_leaves_nowhere(
    s3_server, s3_prefix, tmp_path, monkeypatch
):
    # A kept part may be gigabytes: read in ranges into a file of the node's, which stayed there (named) when a read
    # failed or the process was killed midway.
    out = StoredOut.of(s3_server.url(s3_prefix))
    tokens = np.arange(10, dtype="<u2")
    s3_server.put(f"{s3_prefix}/k.bin", tokens.tobytes())
    s3_server.put(f"{s3_prefix}/k.idx", np.array([4, 10], "<u8").tobytes())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tokpipe.write.segments, "KEPT_READ_BYTES", 6)  # 3 tokens a range
    kept = Kept(out, out.key("k.bin"), out.key("k.idx"), "<u2", start=2, tokens=7, doc_start=0, documents=2)
    (read,), (ends,) = kept.arrays()
    assert read.tolist() == [2, 3, 4, 5, 6, 7, 8] and ends.tolist() == [2, 8] and list(tmp_path.iterdir()) == []
    ranges, reading = [], Bucket.read

    def fails_the_second(bucket, key, start, end, etag=None):
        ranges.append((start, end))
        if len(ranges) == 2:
            raise OSError("the store went away")
        return reading(bucket, key, start, end, etag)

    monkeypatch.setattr(Bucket, "read", fails_the_second)
    with pytest.raises(OSError, match="the store went away"):
        kept.arrays()
    assert ranges == [(4, 10), (10, 16)] and list(tmp_path.iterdir()) == []

"""write/stored.py: the driver's side of an OUT on a store, which walks each split in order and closes segments from
the parts of the shards done. What it holds of a shard's tokens is where they wait, never the tokens: a node lost,
each of them is found (runner/copies.py marks those of that node lost), whichever step of the walk it is at."""

from helpers import EXAMPLE_CACHE

from tokpipe.inputs.manifest import build_manifest
from tokpipe.layout.checkpoints import Checkpoint, PartCounts
from tokpipe.layout.run import WriteSpec
from tokpipe.layout.stored import StoredOut
from tokpipe.write.stored import StoreAssembly, compose_split


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


def test_a_grouped_split_of_no_part_composes_no_file():
    """--group-by with every shard left out (--skip-failed): no group has a file to compose (finalize then refuses the
    empty split in one line), and no request is made."""
    assembly = StoreAssembly(StoredOut.of("s3://b/out"), WriteSpec(group_by="g"), build_manifest(EXAMPLE_CACHE), 4)
    assert assembly.made == {}
    compose_split(assembly, "train")

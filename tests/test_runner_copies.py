"""runner/copies.py: the writes that assemble OUT on Ray. A node lost, every shard whose tokens waited in its object
store is marked lost at once, wherever its parts wait: none may go to a Placer made on the lost node, which would
wait for Ray's GCS to find it dead (~14 s). Parts the driver holds in its own memory are placed too."""

import json
import subprocess
import sys

import pytest
from helpers import EXAMPLE_CACHE, assert_out_is

# A driver joined to the session's Ray (argv: its address) with a SplitFileWrites whose parts wait in each place a
# part can wait, their tokens on node "x" or "y"; prints the shards `lose("x")` returned, and those whose tokens are
# marked lost (ref None).
LOSE = """
import json, sys
from types import SimpleNamespace
import ray
from tokpipe.runner.copies import SplitFileWrites
from tokpipe.runner.task import OnNode

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
def part(shard, node):
    return SimpleNamespace(buffered=[OnNode(shard, ray.put(shard), node, 0)])
held = [part("done, its turn to come, on x", "x").buffered[0]]
assembler = SimpleNamespace(held=lambda: held)
copies = SplitFileWrites(SimpleNamespace(name="out"), assembler, 4, 2, None, None)
copies.queue.append(part("queued, on x", "x"))
copies.parked += [part("parked for another lost shard, on x", "x"), part("parked, on y", "y")]
everything = [*held, *(p.buffered[0] for p in [*copies.queue, *copies.parked])]
print(json.dumps([sorted(s.shard for s in copies.lose("x")), sorted(s.shard for s in everything if s.ref is None)]))
"""


def test_a_node_lost_marks_lost_every_shard_whose_tokens_waited_there(ray_address):
    found = subprocess.run([sys.executable, "-c", LOSE, ray_address], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    on_x = ["done, its turn to come, on x", "parked for another lost shard, on x", "queued, on x"]
    assert json.loads(found.stdout.splitlines()[-1]) == [on_x, on_x]


# A driver joined to the session's Ray (argv: its address) with SegmentUploads (made without warming a Placer on each
# node) whose three uploads came back before it looked; prints what its assembler was given to commit, call by call,
# and the bytes it counts by node.
COMMITS = """
import json, sys
from types import SimpleNamespace
import ray
from tokpipe.runner.copies import Placers, SegmentUploads

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
commits = []
copies = SegmentUploads.__new__(SegmentUploads)
Placers.__init__(copies, SimpleNamespace(name="out"), SimpleNamespace(commit=commits.append), 4, 1, None, None)
for n in range(3):  # as Placer.upload returns: its node, the segment, the bytes sent
    copies.running[ray.put(("node", f"segment {n}", 10))] = ("node", [], [])
ray.wait(list(copies.running), num_returns=3)
assert copies.collect() == []
print(json.dumps([sorted(map(sorted, commits)), copies.bytes_by_node]))
"""


def test_segments_that_came_back_together_are_committed_together(ray_address):
    # Each commit checkpoints the shards it completes in one object a split: one a segment was one a shard with
    # --no-concat, a PUT in the run and a GET for every reader of OUT's records.
    found = subprocess.run([sys.executable, "-c", COMMITS, ray_address], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout.splitlines()[-1]) == [[["segment 0", "segment 1", "segment 2"]], {"node": 30}]


# A driver joined to the session's Ray (argv: its address, the example's dataset, the tokenizer, OUT) whose every
# shard was tokenized in its own process, their tokens in its memory (as its helpers leave the shards they finished
# after one that stopped for Ray's workers), placed by SplitFileWrites' Placers, then finalized.
IN_DRIVER = """
import sys
from pathlib import Path
import ray
from tokpipe.inputs.manifest import build_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.options import RunOptions
from tokpipe.runner.copies import SplitFileWrites
from tokpipe.runner.identity import encode_spec
from tokpipe.runner.progress import RunLog
from tokpipe.runner.storage import Folder
from tokpipe.write.assembly import Assembler
from tokpipe.write.finalize import finalize
from tokpipe.write.shard import tokenize_shard

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
manifest, info, out = build_manifest(Path(sys.argv[2])), load_tokenizer_info(sys.argv[3]), Path(sys.argv[4])
opts = RunOptions()
out.mkdir()
assembler = Assembler(out, 2, opts.output)
assembler.resume(manifest)
spec = encode_spec(opts, info, "hf")
for shard in reversed(list(manifest.shards())):  # the last first: its place is not known when it is done
    result = tokenize_shard(shard, out, spec)
    assert isinstance(result.buffered, dict)
    assembler.done(shard, result.checkpoint, result.buffered)
copies = SplitFileWrites(Folder(out), assembler, 2, 1, None, RunLog(out))
copies.feed()
while copies.busy:
    ray.wait(list(copies.running), num_returns=1)
    assert copies.collect() == []
    copies.feed()
finalize(out, manifest, info, opts.output, assembler=assembler)
"""


def test_shards_whose_tokens_the_driver_holds_are_placed_by_the_placers(
    ray_address, tmp_path, small_tokenizer, small_reference
):
    """Before, such a part was taken for one in a node's object store: AttributeError ('dict' object has no
    attribute 'node'), and the run stopped (seen on 20,000 two-document shards with the driver's helpers, 1 run in
    3)."""
    out = tmp_path / "out"
    args = [sys.executable, "-c", IN_DRIVER, ray_address, EXAMPLE_CACHE, small_tokenizer, out]
    placed = subprocess.run(args, capture_output=True, text=True)
    assert placed.returncode == 0, placed.stderr
    assert_out_is(out, small_reference)


# A driver joined to the session's Ray (argv: its address, OUT's URL, the example's dataset, the tokens of a shard's
# common part) with SegmentUploads over a StoreAssembly of the example's train shards, --group-by, no room for shards
# that wait alone for segments still gathering. Each shard has a part of group "common" and one of group "rare" (2
# tokens), whose segment gathers until the split's end. Prints, after the first shard's turn and its uploads: whether
# the run waits on a keep, where the tokens of the segments gathering are, how many of the run's records still hold
# the first's object, OUT's checkpoints and kept parts, where a rerun begun then takes them from; then, the second
# shard done, the rare group's file and whether the common one's is the parts in order.
UNPIN = """
import json, sys
import numpy as np, ray
from tokpipe.inputs.manifest import build_manifest
from tokpipe.layout.checkpoints import Checkpoint, PartCounts
from tokpipe.layout.run import WriteSpec
from tokpipe.layout.stored import StoredOut
from tokpipe.runner.copies import SegmentUploads
from tokpipe.runner.progress import RunLog
from tokpipe.runner.storage import Prefix
from tokpipe.runner.task import OnNode
from tokpipe.write.stored import StoreAssembly

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
out = StoredOut.of(sys.argv[2])
manifest = build_manifest(sys.argv[3])
shards = list(manifest.shards("train"))
assembler = StoreAssembly(out, WriteSpec(group_by="g"), manifest, itemsize=2)
room = [1 << 40]  # read at each look, as the workers are refitted to the cluster: as it is when the shards are done
copies = SegmentUploads(Prefix(out), assembler, 1, None, RunLog(out.work), room=lambda: room[0])
room[0] = int(sys.argv[5])
here = ray.get_runtime_context().get_node_id()
sizes = {(False, "common"): int(sys.argv[4]), (False, "rare"): 2}
def done(n):
    arrays = {key: ([np.full(size, n, "<u2")], [np.array([size])]) for key, size in sizes.items()}
    parts = [PartCounts(False, group, size, 1) for (_, group), size in sizes.items()]
    on_node = OnNode(shards[n], ray.put([arrays]), here, 0)
    assembler.done(shards[n], Checkpoint(done=True, tokens=sum(sizes.values()), documents=2, parts=parts), on_node)
    return on_node
def uploaded():
    while copies.running:
        ray.wait(list(copies.running), num_returns=len(copies.running))
        assert copies.collect() == []
        copies.feed()
def where(assembly):
    return sorted(type(s.buffered[s.key] if isinstance(s.buffered, dict) else s.buffered).__name__
                  for segment in assembly.segments.open.values() for s in segment.sources)
first = done(0)
copies.feed()  # its turn: a large common part is a segment of its own, uploaded; its rare part gathers
uploaded()
busy = copies.busy  # (no upload is: the run's end waits for a keep)
ray.wait(list(copies.keeping)) if copies.keeping else None
copies.feed()
rerun = StoreAssembly(out, WriteSpec(group_by="g"), manifest, itemsize=2)
rerun.resume(print)
rerun.ready()
print(json.dumps([
    busy,
    where(assembler),
    [s is first for s in assembler.held()].count(True) + (shards[0].relpath in assembler.waiting),
    sorted(out.name(o.key).replace(o.key.rpartition("/")[2], "*") if "/placed/" in o.key else out.name(o.key)
           for o in out.bucket.list(out.checkpoints)),
    where(rerun),
]))
done(1)
copies.feed()  # the split's end: its segments close
while copies.busy:
    uploaded()
    copies.feed()
def file(group):  # its segments in order (the first's shard before the second's), as finalize composes them
    segments = sorted(assembler.made["train", group], key=lambda segment: segment.entries[0].shard)
    return np.concatenate([np.frombuffer(out.bucket.get(out.key(s.name) + ".bin")[0], "<u2") for s in segments])
common = np.concatenate([np.full(sizes[False, "common"], n, "<u2") for n in range(2)])
print(json.dumps([file("rare").tolist(), np.array_equal(file("common"), common)]))
"""

LARGE = 3_000_000  # tokens of uint16: a common part over 5 MiB, a segment of its own


@pytest.mark.parametrize(
    "common, room",
    [(LARGE, 0), (1000, 0), (LARGE, 4 * LARGE)],
    ids=["a rare part waits", "most of the shard waits", "the cluster has room for it"],
)
def test_a_shard_that_waits_alone_for_segments_still_gathering_is_kept_on_the_store_and_let_go(
    common, room, ray_address, s3_server, s3_prefix
):
    # A rare --group-by group's segment gathers until the split's end: until then it held each shard's whole object in
    # Ray's object store (spilled to the node's disk once that was full: a second copy of every token), and no
    # checkpoint covered a shard (a kill lost every one done). Kept where the parts that wait are a small share of it.
    url = s3_server.url(s3_prefix)
    command = [sys.executable, "-c", UNPIN, ray_address, url, EXAMPLE_CACHE, str(common), str(room)]
    found = subprocess.run(command, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    gathered, files = map(json.loads, found.stdout.splitlines()[-2:])
    key = "train__chunk1__example_train_0"
    if (common, room) == (LARGE, 0):
        assert gathered == [
            True,  # while it is kept: the run's end waits, or its objects would outlive the finalize that removes them
            ["Kept"],  # the first's rare part, from the store
            0,  # nothing holds the first's object
            [f"shards/train/groups/rare/{key}.bin", f"shards/train/groups/rare/{key}.idx", "shards/train/placed/*"],
            ["Kept"],  # a rerun begun then: the first is done, its rare part taken from the store
        ]
    elif room == 0:  # kept, its common part (most of it) would be uploaded twice to free little more
        assert gathered == [False, ["OnNode", "OnNode"], 3, [], []]
    else:  # its object held in Ray's object store, within the room of the workers the run has now
        assert gathered == [False, ["OnNode"], 2, [], []]
    assert files == [[0, 0, 1, 1], True]

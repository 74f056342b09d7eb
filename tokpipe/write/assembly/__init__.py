"""Finished shards -> their split files, assembled in place while later shards still tokenize.

A split file is assembled in place, not concatenated at the end: a shard's tokens go to their offset
as soon as that offset is known, i.e. once every shard before it in the split is done. So the done
prefix of each split is assembled while later shards still tokenize (the runner sends the writes to
Placer actors on the nodes that hold the tokens), and when the last shard is done only the last few remain.
This package decides what goes where: recovery.py (what a rerun keeps), plan.py (which part goes at which
offset), listing.py (the parts lists, the end); place.py writes the bytes.

While a split is assembled, OUT/<stem>.bin.tmp and .idx.tmp receive the parts, and
OUT/<stem>.parts.tmp lists, in split order, the shards whose bytes are in them: one JSON line per
shard with its token and document counts, its accounting and the sha256 of its ranges (computed by
the worker that encoded the shard). A line is appended only after its bytes are fsynced, so after a
crash the list describes a prefix of what is on disk; a rerun keeps that prefix where it is still the
start of the split in manifest order, and the parts after it that match their checksums, and writes
the rest again, to the same offsets: the same bytes.
With --group-by each group of a split has such a file (OUT/<stem>/<group>.bin.tmp), and the one
parts list of the split says which part went into which. `finalize` renames them when all is placed.
"""

from __future__ import annotations

import os

from tokpipe.inputs.manifest import Manifest, Shard
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
from tokpipe.layout.files import LayoutWriter
from tokpipe.layout.meta import SplitEntry
from tokpipe.layout.records import Part
from tokpipe.layout.run import WriteSpec
from tokpipe.write.assembly.listing import Listing
from tokpipe.write.assembly.plan import Plan
from tokpipe.write.assembly.recovery import Recovery
from tokpipe.write.assembly.split import Groups, SplitAssembly
from tokpipe.write.place import place

COPY_BATCH_BYTES = 1 << 30  # of tokens per placing call: one fsync covers many small shards


class Assembler:
    """One run's assembly, driven three ways (runner/local.py in the driver, runner/schedule.py's SplitFileWrites on
    Ray, finalize.py for what is left): `resume` first (recovery.py); then feed it finished shards (`done`),
    hand what `ready` returns (plan.py) to `place` (anywhere, any order, in batches, or here: `place_ready`),
    report what came back (`placed`: listing.py); `finish` when `complete`."""

    def __init__(self, out: str | os.PathLike, itemsize: int, spec: WriteSpec = WriteSpec(), checkpoints=None):
        """`checkpoints`: OUT's Checkpoints as the run that drives it lists them (runner/storage.py), not listed again
        here (each split's folders, and every placed file read)."""
        self.out, self.itemsize, self.concat = LayoutWriter(out), itemsize, spec.concat
        groups, checkpoints = Groups(spec.group_by), checkpoints or Checkpoints(out)
        self.recovery = Recovery(self.out, itemsize, spec, groups, checkpoints)
        self.plan = Plan(self.out, spec, groups, checkpoints)
        self.listing = Listing(self.out, itemsize, spec)
        self.splits: list[SplitAssembly] = []  # by `resume`

    def resume(self, manifest: Manifest) -> None:
        """Take up OUT's split files where an earlier attempt left them, before anything is tokenized or placed."""
        self.splits = self.recovery.resume(manifest)

    @property
    def lost(self) -> list[str]:
        """Shards tokenized again: their placed files were gone, their place not kept."""
        return self.recovery.lost

    @property
    def moved(self) -> dict[str, int]:
        """Split stem -> finished shards moved to new offsets in it, after shards added before them (moving.py)."""
        return self.recovery.moved

    @property
    def placed_tokens(self) -> int:
        return self.listing.placed_tokens

    def done(self, shard: Shard, ckpt: Checkpoint, buffered: object = None) -> None:
        self.plan.done(shard, ckpt, buffered)

    def unplaced(self) -> list[tuple[Shard, Checkpoint, object]]:
        """Done shards whose parts wait in memory for a place not known yet: (shard, checkpoint, buffered)."""
        return self.plan.unplaced()

    def held(self) -> list:
        """Where the tokens of the parts not yet handed out wait (the buffered of their shards)."""
        return [buffered for _, _, buffered in self.plan.unplaced()]

    def ready(self, excluded: frozenset[str] = frozenset()) -> list[Part]:
        return self.plan.ready(self.splits, excluded)

    def placed(self, parts: list[Part], records: list[dict]) -> None:
        self.listing.placed(self.splits, parts, records)

    @property
    def complete(self) -> bool:
        return all(s.head is None and s.listed == s.scheduled for s in self.splits)

    def place_here(self, excluded: frozenset[str]) -> None:
        """Place whatever is left, in this process (all of it without Ray; nothing after a run that placed it)."""
        self.place_ready(excluded)
        if not self.complete:
            head = next((s.head for s in self.splits if s.head is not None), None)
            why = f"shard {head[0].relpath} is unfinished" if head else "parts handed out to copy were never placed"
            raise RuntimeError(f"cannot finalize: {why}")

    def place_ready(self, excluded: frozenset[str] = frozenset()) -> None:
        """Place, in this process, the parts whose place is known now."""
        parts = self.ready(excluded)
        batch, size = [], 0
        for part in parts + [None]:
            if batch and (part is None or part.stem != batch[0].stem or size >= COPY_BATCH_BYTES):
                records = place(self.out.root, batch, self.itemsize) if self.concat else [p.record for p in batch]
                self.placed(batch, records)
                batch, size = [], 0
            if part is not None:
                batch.append(part)
                size += part.record["tokens"] * self.itemsize

    def finish(self, excluded: frozenset[str]) -> dict[str, SplitEntry]:
        """Cut, fsync and rename every split's files; returns meta's `splits` (in manifest order of splits)."""
        return self.listing.finish(self.splits, excluded)

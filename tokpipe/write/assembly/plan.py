"""The plan of what goes where: which part of which done shard is written at which offset of its split file
(or its group's), handed out as soon as every part before it in its file is known."""

from __future__ import annotations

from tokpipe.inputs.manifest import Shard
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
from tokpipe.layout.files import LayoutWriter, PartKey
from tokpipe.layout.records import Part, part_record
from tokpipe.layout.run import WriteSpec
from tokpipe.write.assembly.split import Groups, SplitAssembly


class Plan:
    """Feed it finished shards (`done`); `ready` hands out the parts whose offsets are now known, each split's
    in order (with --group-by a shard has a part per group, each at its group's file's offset)."""

    def __init__(self, out: LayoutWriter, spec: WriteSpec, groups: Groups, checkpoints: Checkpoints):
        self.out, self.groups = out, groups
        self.val_fraction, self.concat = spec.val_fraction, spec.concat
        # Done shards not yet scheduled (those that finished out of order), with how many parts still need them
        # and the parts they kept in memory.
        self.finished: dict[str, tuple[Shard, Checkpoint, int, object]] = {}
        # Those done before this run: a shard done in it comes to `done`, and one done before is listed at the start.
        self.before = checkpoints

    def done(self, shard: Shard, ckpt: Checkpoint, buffered: object = None) -> None:
        """A shard finished in this run (its checkpoint as its task returned it); `buffered`: the parts it kept
        in memory (ShardResult.buffered, or on Ray the reference to them), to be written into place."""
        self.groups.meet_shard(shard, ckpt)
        self.finished[shard.relpath] = (shard, ckpt, 2 if self.val_fraction and shard.split == "train" else 1, buffered)

    def unplaced(self) -> list[tuple[Shard, Checkpoint, object]]:
        """The done shards whose parts, kept in memory, wait for their place (not all scheduled yet)."""
        return [(shard, ckpt, buffered) for shard, ckpt, _, buffered in self.finished.values() if buffered is not None]

    def _checkpoint(self, shard: Shard) -> tuple[Checkpoint | None, object]:
        """The shard's checkpoint, and its buffered parts if it kept them in memory (None: in its own files)."""
        if shard.relpath not in self.finished:
            return self.before.of(shard), None
        _, ckpt, uses, buffered = self.finished.pop(shard.relpath)
        if uses > 1:  # its other part has yet to be scheduled
            self.finished[shard.relpath] = (shard, ckpt, uses - 1, buffered)
        return ckpt, buffered

    def ready(self, splits: list[SplitAssembly], excluded: frozenset[str] = frozenset()) -> list[Part]:
        """Parts whose offsets are now known: each split's next shards, while they are done (or excluded)."""
        parts = []
        for s in splits:
            while s.head is not None:
                shard, held = s.head
                if s.head_parts is None and shard.relpath in excluded:
                    s.advance()
                    continue
                if s.head_ckpt is None:
                    ckpt, s.head_buffered = self._checkpoint(shard)
                    if ckpt is None or not ckpt.done:
                        break
                    s.head_ckpt = ckpt
                    if s.head_parts is None:
                        s.head_parts = self.groups.head_parts(s, ckpt)
                parts += [self._part(s, shard, (held, group)) for group in s.head_parts]
                s.advance()
        return parts

    def _part(self, s: SplitAssembly, shard: Shard, key: PartKey) -> Part:
        """The head's part of `key`, next in its file; or with --group-by, the shard's accounting line (no part)."""
        group, exists = key[1], s.head_ckpt.part(key) is not None
        # A part in memory, concatenated, needs no paths: building them was half of this function's CPU (20,000
        # two-document shards: 0.56 -> 0.29 s, py-spy).
        named = exists and (s.head_buffered is None or not self.concat)
        bin_path, idx_path = self.out.shard(shard).part(key) if named else (None, None)
        record = part_record(shard, s.head_ckpt, key)
        if not self.concat and exists:  # the part's files are the split's: meta lists them
            record.update(bin=str(bin_path.relative_to(self.out.root)), idx=str(idx_path.relative_to(self.out.root)))
        if self.concat and group is not None and group not in s.offsets:  # a group's first part
            self.out.new_assembly_files(s.stem, group)
        seq, (tokens, documents) = s.scheduled, s.add(group, record)
        s.scheduled += 1
        source = s.moving.take(shard.relpath, key) if s.moving is not None else None
        if s.head_buffered is not None:
            buffered = (s.head_buffered, key) if exists else None
            checkpoint = (shard.split, shard.key, s.head_ckpt)
            return Part(s.stem, seq, tokens, documents, record, buffered=buffered, checkpoint=checkpoint)
        if source is not None and bin_path is not None:  # in the split file as it was: moved from there
            s.moved_until = seq
            return Part(s.stem, seq, tokens, documents, record, source[0], source[1], moved_from=source[2:])
        where = (str(bin_path), str(idx_path)) if bin_path is not None else ("", "")
        return Part(s.stem, seq, tokens, documents, record, *where)

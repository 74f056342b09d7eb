"""One split file's assembly (with --group-by, its groups' files): what is scheduled, what is on disk and
listed in .parts.tmp; and which parts a done shard has in it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokpipe.errors import too_many_groups
from tokpipe.inputs.manifest import Shard
from tokpipe.layout.checkpoints import Checkpoint
from tokpipe.layout.files import Layout, split_file_stem
from tokpipe.layout.records import MAX_GROUPS, Part
from tokpipe.write.assembly.moving import Moving


@dataclass
class SplitAssembly:
    """The assembly of one split file: what is scheduled, and what is on disk and listed in .parts.tmp."""

    stem: str
    shards: Iterator[tuple[Shard, bool]]  # sources() of the split file, after the head
    head: tuple[Shard, bool] | None = None  # the next shard (and part) to schedule
    # With --group-by, once the head is done: its parts still to schedule (None: its accounting line, then
    # its groups in value order), and its checkpoint.
    head_parts: list[str | None] | None = None
    head_ckpt: Checkpoint | None = None
    head_buffered: object = None  # the parts the head kept in memory (Plan.done), if it did
    scheduled: int = 0  # parts handed out
    # The split's files being assembled, each with the tokens and documents in it: its own (None), from its start
    # where it has one (`start`); a group's (--group-by), once met.
    offsets: dict[str | None, tuple[int, int]] = field(default_factory=dict)
    listed: int = 0  # parts in .parts.tmp (fsynced, in order)
    waiting: dict[int, tuple[Part, dict]] = field(default_factory=dict)  # seq -> parts placed before an earlier one
    # Where shards were added before listed parts: the files those parts are moved from (moving.py), until every
    # part taken from them is listed; and the last such part (its seq).
    moving: Moving | None = None
    moved_until: int = -1

    @classmethod
    def start(cls, stem: str, shards: Iterator[tuple[Shard, bool]], own_file: bool) -> SplitAssembly:
        """The split's assembly from its first source; `own_file`: its tokens in one file (without --group-by),
        not in its groups'."""
        return cls(stem, shards, next(shards, None), offsets={None: (0, 0)} if own_file else {})

    def advance(self) -> None:
        self.head, self.head_parts, self.head_ckpt, self.head_buffered = next(self.shards, None), None, None, None

    def add(self, group: str | None, record: dict) -> tuple[int, int]:
        """A line goes next in the parts list, its part next in its file: returns its offsets there. A grouped
        split's accounting line (group None) is in no file."""
        tokens, documents = self.offsets.get(group, (0, 0))
        if group is not None or None in self.offsets:
            self.offsets[group] = (tokens + record["tokens"], documents + record["documents"])
        return tokens, documents

    def files(self, out: Layout) -> dict[str | None, tuple[Path, Path]]:
        """The split's files being assembled: its one file, or (--group-by) those of the groups it has met."""
        return {group: out.assembly(self.stem, group)[:2] for group in self.offsets}


@dataclass
class Groups:
    """--group-by's groups: the values each split has met, refused past MAX_GROUPS as soon as done shards show
    them; and the lines of a done source."""

    group_by: str | None
    values: dict[str, set[str]] = field(default_factory=dict)  # split stem -> the groups met

    def head_parts(self, state: SplitAssembly, ckpt: Checkpoint) -> list[str | None]:
        """The lines of the head source, done (Checkpoint.line_groups); its groups met."""
        groups = ckpt.line_groups(state.head[1])
        self.meet(state.stem, [group for group in groups if group is not None])
        return groups

    def meet_shard(self, shard: Shard, ckpt: Checkpoint) -> None:
        """The groups of a done shard's parts, met by the split each goes to."""
        for split, part in ckpt.group_parts(shard.split):
            self.meet(split_file_stem(split), [part.group])

    def meet(self, stem: str, groups) -> None:
        """Refuse a split that has more groups than MAX_GROUPS, as soon as its done shards show it."""
        values = self.values.setdefault(stem, set())
        values.update(groups)
        if len(values) > MAX_GROUPS:
            raise too_many_groups(self.group_by, f"split {stem}", values, MAX_GROUPS)

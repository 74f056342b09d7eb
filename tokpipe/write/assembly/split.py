"""One split file's assembly (with --group-by, its groups' files): what is scheduled, what is on disk and
listed in .parts.tmp; and which parts a done shard has in it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokpipe.errors import too_many_groups
from tokpipe.inputs.manifest import Shard
from tokpipe.out.files import Out
from tokpipe.out.records import MAX_GROUPS, Checkpoint, Part
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
    offsets: dict[str | None, tuple[int, int]] = field(default_factory=dict)  # file (group) -> tokens, documents
    listed: int = 0  # parts in .parts.tmp (fsynced, in order)
    waiting: dict[int, tuple[Part, dict]] = field(default_factory=dict)  # seq -> parts placed before an earlier one
    # Where shards were added before listed parts: the files those parts are moved from (moving.py), until every
    # part taken from them is listed; and the last such part (its seq).
    moving: Moving | None = None
    moved_until: int = -1

    @classmethod
    def start(cls, stem: str, shards: Iterator[tuple[Shard, bool]]) -> SplitAssembly:
        return cls(stem, shards, next(shards, None))

    def advance(self) -> None:
        self.head, self.head_parts, self.head_ckpt, self.head_buffered = next(self.shards, None), None, None, None

    def add(self, group: str | None, record: dict) -> tuple[int, int]:
        """A part goes next in its file: returns its offsets there."""
        tokens, documents = self.offsets.get(group, (0, 0))
        self.offsets[group] = (tokens + record["tokens"], documents + record["documents"])
        return tokens, documents

    def files(self, out: Out, grouped: bool) -> dict[str | None, tuple[Path, Path]]:
        """The split's files being assembled: its one file, or (--group-by) those of the groups it has met."""
        groups = [g for g in self.offsets if g is not None] if grouped else [None]
        return {g: out.assembly(self.stem, g)[:2] for g in groups}


@dataclass
class Groups:
    """--group-by's groups: which parts a done shard has, and the values each split has met, refused past
    MAX_GROUPS as soon as done shards show them."""

    group_by: str | None
    values: dict[str, set[str]] = field(default_factory=dict)  # split stem -> the groups met

    def head_parts(self, state: SplitAssembly, ckpt: Checkpoint) -> list[str | None]:
        """The parts of the head source, done: its one part; with --group-by its accounting line and groups."""
        if self.group_by is None:
            return [None]
        held = state.head[1]
        groups = list(ckpt.parts(held, grouped=True))
        self.meet(state.stem, groups)
        return groups if held else [None, *groups]

    def meet(self, stem: str, groups) -> None:
        """Refuse a split that has more groups than MAX_GROUPS, as soon as its done shards show it."""
        values = self.values.setdefault(stem, set())
        values.update(groups)
        if len(values) > MAX_GROUPS:
            raise too_many_groups(self.group_by, f"split {stem}", values, MAX_GROUPS)

"""Finished parts moved to new offsets, copied from the split file they were in, never tokenized again.

Shards added before finished ones in a split (an append whose new shards sort among the old, a shard left out
by --skip-failed and back) change the offsets of every part after them. The split's files as they are become
the source of its listed parts, and a new split file is assembled, each part copied into it from the source
(in the kernel, place.py) when the plan reaches it, its document ends rebased; its checksums still hold (of
its own bytes, its ends counted from its first token).

Crash safety. A move starts by linking the split's files (each group's) into OUT/moving/<stem>/<n>/, then its
parts list: that list's name is the commit, and a source folder without it is a start that never finished, which
goes (its files are links: the split's names still hold them). Then new, empty files take the split's names,
then a new parts list: until it has, the split's parts list is the source's, and a rerun makes them anew. The
sources are only read, never written: an export's hard link to the old split file keeps its bytes. Once every
part taken from them is listed in the new split file they go, their parts lists first. Shards added again
before the move is done (a second append) make a second source of the new split file as it is then; a part is
taken from whichever holds it.

Each source's parts list is read once, in order, as the plan walks the split (`take`): the manifest lists
shards in path order, a shard's groups come in value order, so a source's parts are in the split's order,
and the driver holds no list of them (docs/design.md, "At scale").
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokpipe.durability import copy_file, fsync_path
from tokpipe.layout.files import Layout, PartKey
from tokpipe.layout.records import Part, parts_of, read_parts, record_key


def _order(relpath: str, group: str | None) -> tuple:
    """Where a part falls in its split: by its shard's path, then its accounting line before its groups."""
    return relpath, group is not None, group or ""


@dataclass
class _Source:
    """One source's parts (records.parts_of: at their offsets in its files), read as far as `part`, the next one."""

    n: int
    parts: Iterator[Part]
    part: Part | None = None

    def advance(self) -> None:
        self.part = next(self.parts, None)


class Moving:
    """The sources of a split's moved parts: `take` says where a part is in one of them, `end` removes them."""

    def __init__(self, out: Layout, stem: str):
        self.out, self.stem = out, stem
        self.numbers = _committed(out, stem)
        self.sources = [self._open(n) for n in self.numbers]

    def _open(self, n: int) -> _Source:
        source = _Source(n, parts_of(self.stem, read_parts(self.out.moving_source(self.stem, n)[2], torn="stop")))
        source.advance()
        return source

    def __bool__(self) -> bool:
        return bool(self.numbers)

    def unstarted(self) -> bool:
        """Whether the last move committed but its new split file was not begun (the split's parts list is
        still the source's): a rerun makes it anew, keeping none of the split's .tmp files."""
        if not self:
            return False
        parts_tmp, source = self.out.assembly(self.stem)[2], self.out.moving_source(self.stem, self.numbers[-1])[2]
        return parts_tmp.exists() and os.path.samefile(parts_tmp, source)

    def start(self, files: dict[str | None, tuple[Path, Path]]) -> None:
        """The split's files (its groups', `files`) and its parts list become source n: linked, the list last."""
        n = self.numbers[-1] + 1 if self else 0
        parts = self.out.moving_source(self.stem, n)[2]
        parts.parent.mkdir(parents=True)
        for group, pair in files.items():
            for path, source in zip(pair, self.out.moving_source(self.stem, n, group)[:2]):
                link(path, source)
        for folder in (parts.parent, parts.parent.parent, parts.parent.parent.parent, self.out.root):
            fsync_path(folder)
        link(self.out.assembly(self.stem)[2], parts)  # the commit
        fsync_path(parts.parent)
        self.numbers.append(n)
        self.sources.append(self._open(n))

    def take(self, relpath: str, key: PartKey) -> tuple[str, str, int, int] | None:
        """Where a shard's part is in a source, if one holds it: (bin, idx, token offset, document offset). Called
        in the split's order; each source reads past the parts before this one."""
        found, group = None, key[1]
        at = _order(relpath, group)
        for source in self.sources:
            while source.part is not None and _order(source.part.name, source.part.group) < at:
                source.advance()
            part = source.part
            if part is not None and (part.name, record_key(part.record)) == (relpath, key):
                bin_path, idx_path, _ = self.out.moving_source(self.stem, source.n, group)
                found = (str(bin_path), str(idx_path), part.token_offset, part.doc_offset)
                source.advance()
        return found

    @property
    def exhausted(self) -> bool:
        """Whether every source's parts were passed: none is taken from them any more."""
        return all(source.part is None for source in self.sources)

    def end(self) -> None:
        """Remove the sources: every part taken from them is listed in the split file. Each parts list first."""
        for n in self.numbers:
            self.out.moving_source(self.stem, n)[2].unlink()
            fsync_path(self.out.moving_source(self.stem, n)[2].parent)
        _remove(self.out, self.stem)
        self.numbers, self.sources = [], []


def link(path: Path, name: Path) -> None:
    """`name` for the file `path`; a copy where the file system has no hard links."""
    try:
        os.link(path, name)
    except OSError:
        copy_file(path, name)


def _committed(out: Layout, stem: str) -> list[int]:
    """The numbers of the split's sources, in order; a start that never committed (no parts list) goes."""
    folder, numbers = out.moving(stem), []
    if not folder.is_dir():
        return numbers
    for source in sorted(folder.iterdir(), key=lambda p: int(p.name)):
        if out.moving_source(stem, int(source.name))[2].exists():
            numbers.append(int(source.name))
        else:
            shutil.rmtree(source)
    if not numbers:
        _remove(out, stem)
    return numbers


def _remove(out: Layout, stem: str) -> None:
    """OUT/moving/<stem>, and OUT/moving once no split has sources."""
    shutil.rmtree(out.moving(stem), ignore_errors=True)
    if out.moving(stem).parent.is_dir() and not any(out.moving(stem).parent.iterdir()):
        out.moving(stem).parent.rmdir()

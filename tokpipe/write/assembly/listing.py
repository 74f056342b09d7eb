"""The bookkeeping of what is in place: each split's parts list (.parts.tmp), appended in split order once
parts are fsynced; and the end, when the split files are cut to what is listed and renamed."""

from __future__ import annotations

import os
from pathlib import Path

from tokpipe.durability import fsync_path
from tokpipe.layout.files import LayoutWriter
from tokpipe.layout.meta import SplitEntry
from tokpipe.layout.records import IDX_DTYPE, Part, parts_line, split_entry
from tokpipe.layout.run import WriteSpec
from tokpipe.write.assembly.split import SplitAssembly


class Listing:
    """Tokens are kept once: a part's own files are removed as soon as its line in .parts.tmp is fsynced (its
    bytes were fsynced in the split file before). Its checkpoint stays, with the checksums and accounting that
    resume, status and verify read. With --no-concat nothing is copied: a split is its parts' own files,
    listed in order, and they stay."""

    def __init__(self, out: LayoutWriter, itemsize: int, spec: WriteSpec):
        self.out, self.itemsize, self.spec = out, itemsize, spec
        self.placed_tokens = 0  # copied into the split files by this process's placements, and listed

    def placed(self, splits: list[SplitAssembly], parts: list[Part], records: list[dict]) -> None:
        """Parts are on disk (fsynced): list them in .parts.tmp, in split order, as far as no part is
        missing; then the listed parts' own files go (with --no-concat they are the split: they stay)."""
        for part, record in zip(parts, records):
            s = next(s for s in splits if s.stem == part.stem)
            s.waiting[part.seq] = (part, record)
        for s in splits:
            listed = []
            while s.listed in s.waiting:
                listed.append(s.waiting.pop(s.listed))
                s.listed += 1
            if listed:
                self.out.list_parts(s.stem, b"".join(parts_line(record) for _, record in listed))
                if self.spec.concat:
                    self.placed_tokens += sum(record["tokens"] for _, record in listed)
                    for part, _ in listed:
                        if part.bin and part.moved_from is None:
                            Path(part.bin).unlink(missing_ok=True)
                            Path(part.idx).unlink(missing_ok=True)
            if s.moving is not None and s.moving.exhausted and s.listed > s.moved_until:
                s.moving.end()  # every part moved from them is listed
                s.moving = None

    def finish(self, splits: list[SplitAssembly], excluded: frozenset[str]) -> dict[str, SplitEntry]:
        """Cut, fsync and rename every split's files; returns meta's `splits` (in manifest order of splits).
        Shard token files that a crash left behind after their part was listed go too (not those of
        `excluded` shards: a rerun resumes them)."""
        entries = {}
        for s in splits:
            assembled = []
            if self.spec.concat:
                for group, (bin_tmp, idx_tmp) in s.files(self.out).items():
                    tokens, documents = s.offsets.get(group, (0, 0))
                    for path, length in ((bin_tmp, tokens * self.itemsize), (idx_tmp, documents * IDX_DTYPE.itemsize)):
                        with open(path, "r+b") as f:
                            f.truncate(length)  # bytes beyond: copies of a layout that changed since
                            os.fsync(f.fileno())
                    assembled += [bin_tmp, idx_tmp]
            if s.moving is not None:
                s.moving.end()
                s.moving = None
            entries[s.stem] = split_entry(s.stem, self.out.assembly(s.stem)[2].read_bytes(), self.spec)
            self.out.finish_split(s.stem, assembled)
        fsync_path(self.out.root)
        if self.spec.concat:
            self.out.remove_placed_leftovers(excluded)
        return entries

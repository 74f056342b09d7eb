"""Read a finished OUT as a trainer does: its meta, and each split's tokens and document ends, through the one
reader of a split's files (files.py, TokenFiles).

Opening checks only what is cheap and would otherwise mislead silently (OUT finished, files present, sizes
agreeing with meta); `tokpipe verify` proves the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokpipe.layout.files import Layout
from tokpipe.layout.meta import Meta, SplitEntry, finished_meta
from tokpipe.layout.stored import reader_out, stored_of
from tokpipe.read.files import TokenFile, TokenFiles
from tokpipe.read.maps import each_file


class Joined:
    """A split's tokens, or its document ends counted from its start, across its files as one array (or, given `f`,
    one file's alone, counted from its start): len(), [i], [a:b] (a copy, where it crosses files or is read from a
    store) and np.asarray (all of it, read at once)."""

    def __init__(self, files: TokenFiles, ends: bool, f: int | None = None):
        self.files, self.is_ends, self.f = files, ends, f
        self.dtype = np.dtype("<i8") if ends else files.dtype

    def __len__(self) -> int:
        if self.f is not None:
            entry = self.files.entries[self.f]
            return entry.documents if self.is_ends else entry.tokens
        return self.files.documents if self.is_ends else self.files.tokens

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            if self.f is not None:
                return self.files.file_range(self.f, start, max(start, stop), self.is_ends)
            return self.files.read(start, max(start, stop), self.is_ends)
        index = key + len(self) if key < 0 else key
        if not 0 <= index < len(self):
            raise IndexError(f"index {key} is out of bounds for {len(self):,}")
        return self[index : index + 1][0]  # (a range: a file on a store is never fetched whole)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[:], dtype)


@dataclass(frozen=True)
class Split:
    """A split's tokens and document ends. With --group-by, the split is its groups one after the other,
    in meta's order (by value, as Python sorts strings), and `groups` has each group alone."""

    name: str  # as in meta: train | validation | test
    reader: TokenFiles  # one file; with --no-concat, its shards' parts in order; with --group-by, its groups'
    groups: dict[str, Split] = field(default_factory=dict)  # --group-by: value -> the group's documents alone

    @property
    def stored(self) -> bool:
        """Whether its files are on a store (read by ranged GETs: never mapped, never held whole)."""
        return stored_of(self.reader.out) is not None

    @property
    def files(self) -> list[TokenFile]:
        """Each of its files, read (every one mapped; on a store its tokens a Joined of the file, its ends read)."""
        if self.stored:  # each file's ends read (maps.each_file: many at once)
            reader = self.reader
            ends = each_file(
                reader.out, lambda f: reader.file_range(f, 0, reader.entries[f].documents, True), range(len(reader))
            )
            return [
                TokenFile(e.name, Joined(self.reader, False, f), ends[f]) for f, e in enumerate(self.reader.entries)
            ]
        return [self.reader.file(f) for f in range(len(self.reader))]

    @property
    def tokens(self) -> np.memmap | Joined:
        """The split's tokens: its one file's, a read-only np.memmap (a view of the reader's map: np.memmap's own
        keeps a descriptor open); a Joined over a --no-concat split's files, or of an OUT on a store."""
        if len(self.reader) == 1 and not self.stored:
            return self.reader.file_tokens(0).view(np.memmap)
        return Joined(self.reader, ends=False)

    @property
    def ends(self) -> np.ndarray | Joined:
        """Document ends counted from the split's start: document i is tokens[ends[i-1]:ends[i]]."""
        return self.reader.file_ends(0) if len(self.reader) == 1 and not self.stored else Joined(self.reader, True)

    def document(self, i: int) -> np.ndarray:
        ends = self.ends
        return np.asarray(self.tokens[ends[i - 1] if i else 0 : ends[i]])


@dataclass(frozen=True)
class Output:
    path: Path
    record: Meta  # meta.pkl as a record (tokpipe/layout/meta.py)
    splits: dict[str, Split]

    @property
    def meta(self) -> dict:
        """meta.pkl's dict, read with the restricted unpickler."""
        return self.record.as_dict()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.record.dtype)

    @property
    def vocab_size(self) -> int:
        return self.record.vocab_size

    @property
    def eos_id(self) -> int:
        return self.record.eos_token_id


def open_output(out: str | os.PathLike) -> Output:
    """A finished OUT, ready to train from. UserError when OUT is not finished or does not match its meta."""
    out = reader_out(out)
    meta = finished_meta(Layout(out))
    return Output(out, meta, {name: open_split(out, name, entry, meta.dtype) for name, entry in meta.splits.items()})


def open_split(out: Path, name: str, entry: SplitEntry, dtype: str) -> Split:
    """A split of a finished OUT, its files as its entry lists them; a grouped split's reader is its groups' files
    one after another (looked up at once: maps.seen_all), and each group's reader its own of them."""
    reader = TokenFiles(out, entry.token_files(), dtype)
    groups, first = {}, 0
    for value, group in (entry.groups or {}).items():
        files = len(group.token_files())
        groups[value], first = Split(name, reader.files_of(first, first + files)), first + files
    return Split(name, reader, groups)

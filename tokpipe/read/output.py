"""Read a finished OUT as a trainer does: its meta, and each split as read-only memmaps with document ends.

Opening checks only what is cheap and would otherwise mislead silently (files present, sizes agreeing
with meta); `tokpipe verify` proves the rest.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokpipe.errors import UserError
from tokpipe.out.files import Out, load_meta_pkl, out_folder
from tokpipe.out.records import IDX_DTYPE, split_files


@dataclass(frozen=True)
class TokenFile:
    """One file of a split: the whole split, or (--no-concat, or an unfinished run) one shard's part."""

    name: str  # its path relative to OUT
    tokens: np.ndarray  # read-only memmap
    ends: np.ndarray  # document ends, counted from the file's first token


class Chain:
    """Several arrays read as one: len() and [i] / [a:b] (a copy, for a slice across files). `shifts`
    are added to each array's values (document ends of a file, to count from the split's start)."""

    def __init__(self, arrays: list[np.ndarray], shifts: list[int] | None = None):
        self.arrays, self.shifts = arrays, shifts or [0] * len(arrays)
        self.starts = np.cumsum([0] + [len(a) for a in arrays])
        self.dtype = arrays[0].dtype if arrays else np.dtype("<i8")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            first = int(np.searchsorted(self.starts, start, side="right")) - 1
            pieces = []
            for i in range(max(first, 0), len(self.arrays)):
                if self.starts[i] >= stop:
                    break
                a = self.arrays[i][max(start - self.starts[i], 0) : stop - self.starts[i]]
                pieces.append(np.asarray(a) + self.shifts[i] if self.shifts[i] else np.asarray(a))
            return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
        index = key + len(self) if key < 0 else key
        i = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.arrays[i][index - self.starts[i]] + self.shifts[i]


@dataclass(frozen=True)
class Split:
    """A split's tokens and document ends. With --group-by, the split is its groups one after the other,
    in meta's order (by value, as Python sorts strings), and `groups` has each group alone."""

    name: str  # as in meta: train | validation | test
    files: list[TokenFile]  # one; with --no-concat, its shards' parts in order; with --group-by, its groups'
    groups: dict[str, Split] = field(default_factory=dict)  # --group-by: value -> the group's documents alone

    @property
    def tokens(self) -> np.ndarray | Chain:
        """The split's tokens: the file's read-only memmap, or a Chain over a --no-concat split's files."""
        return self.files[0].tokens if len(self.files) == 1 else Chain([f.tokens for f in self.files])

    @property
    def ends(self) -> np.ndarray | Chain:
        """Document ends counted from the split's start: document i is tokens[ends[i-1]:ends[i]]."""
        if len(self.files) == 1:
            return self.files[0].ends
        shifts = np.cumsum([0] + [len(f.tokens) for f in self.files[:-1]])
        return Chain([f.ends for f in self.files], [int(x) for x in shifts])

    def document(self, i: int) -> np.ndarray:
        ends = self.ends
        return np.asarray(self.tokens[ends[i - 1] if i else 0 : ends[i]])


@dataclass(frozen=True)
class Output:
    path: Path
    meta: dict  # meta.pkl, read with the restricted unpickler
    splits: dict[str, Split]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_token_id"])


def _memmap(out: Path, path: Path, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    """A file of OUT's split, as meta describes it (OUT: for the command that checks it)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing though meta lists it: the output is damaged (tokpipe verify {shlex.quote(str(out))})"
        ) from None
    if size != count * dtype.itemsize:
        raise UserError(
            f"{path} holds {size:,} bytes, meta says {count:,} {what} of {dtype.itemsize} bytes: "
            f"the file is not the one meta describes (tokpipe verify {shlex.quote(str(out))})"
        )
    if count == 0:  # mmap cannot map an empty file
        empty = np.zeros(0, dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r")


def open_output(out: str | os.PathLike) -> Output:
    """A finished OUT, ready to train from. UserError when OUT is not finished or does not match its meta."""
    out = out_folder(out)
    try:
        meta = load_meta_pkl(Out(out).meta_pkl)  # a damaged or hostile one: its UserError
    except FileNotFoundError:
        raise UserError(
            f"{out} is not a finished tokpipe output (no meta.pkl): see where it stands with tokpipe status "
            f"{shlex.quote(str(out))}"
        ) from None
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for name, info in meta["splits"].items():
        groups = {value: Split(name, _files(out, group, dtype)) for value, group in info.get("groups", {}).items()}
        files = [f for group in groups.values() for f in group.files] if "groups" in info else _files(out, info, dtype)
        splits[name] = Split(name, files, groups)
    return Output(out, meta, splits)


def _files(out: Path, entry: dict, dtype: np.dtype) -> list[TokenFile]:
    """The files of a split (or of a group) as meta lists them, memory-mapped."""
    return [
        TokenFile(
            str(bin_path.relative_to(out)),
            _memmap(out, bin_path, dtype, tokens, "tokens"),
            _memmap(out, idx_path, IDX_DTYPE, documents, "document ends"),
        )
        for bin_path, idx_path, tokens, documents in split_files(out, entry)
    ]

"""Read a finished OUT as a trainer does: its meta, and each split as a read-only memmap with its document ends.

Opening checks only what is cheap and would otherwise mislead silently (files present, sizes agreeing
with meta); `tokpipe verify` proves the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.errors import UserError
from tokpipe.layout import IDX_DTYPE, load_meta_pkl


@dataclass(frozen=True)
class Split:
    name: str  # as in meta: train | validation | test
    path: Path  # the .bin
    tokens: np.ndarray  # read-only np.memmap of meta['dtype']
    ends: np.ndarray  # read-only int64 memmap: document i is tokens[ends[i-1]:ends[i]] (ends[-1] == len(tokens))

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.ends[i - 1] if i else 0 : self.ends[i]]


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


def _memmap(path: Path, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing though meta lists it: the output is damaged (tokpipe verify {path.parent})"
        ) from None
    if size != count * dtype.itemsize:
        raise UserError(
            f"{path} holds {size:,} bytes, meta says {count:,} {what} of {dtype.itemsize} bytes: "
            f"the file is not the one meta describes (tokpipe verify {path.parent})"
        )
    if count == 0:  # mmap cannot map an empty file
        empty = np.zeros(0, dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r")


def open_output(out: str | os.PathLike) -> Output:
    """A finished OUT, ready to train from. UserError when OUT is not finished or does not match its meta."""
    out = Path(out)
    try:
        meta = load_meta_pkl(out / "meta.pkl")
    except FileNotFoundError:
        raise UserError(
            f"{out} is not a finished tokpipe output (no meta.pkl): see where it stands with tokpipe status {out}"
        ) from None
    except Exception as e:  # a hostile or damaged pickle: the restricted unpickler refused it
        raise UserError(
            f"{out / 'meta.pkl'} cannot be read safely ({type(e).__name__}: {e}): tokpipe verify {out}"
        ) from None
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for name, info in meta["splits"].items():
        bin_path = out / info["file"]
        splits[name] = Split(
            name=name,
            path=bin_path,
            tokens=_memmap(bin_path, dtype, int(info["tokens"]), "tokens"),
            ends=_memmap(out / info["idx"], IDX_DTYPE, int(info["documents"]), "document ends"),
        )
    return Output(out, meta, splits)

"""A finished OUT -> the files other trainers read: Megatron-LM's indexed dataset, or llm.c's shards.

Token data goes through numpy a chunk at a time (memory stays flat on a multi-TB split), and every id
is checked to fit the target type on the way: an id that does not fit is an error, never a wrap.
Files are written under a temporary name and renamed into place once all are complete, so a killed
export leaves no file a trainer would take for a whole one.

Formats, as their writers define them:

- megatron: NVIDIA/Megatron-LM megatron/core/datasets/indexed_dataset.py (`_IndexWriter.__enter__`
  and `.write`, `DType`, `IndexedDatasetBuilder`). PREFIX.bin holds the tokens; PREFIX.idx is the
  header b"MMIDIDX\\x00\\x00", version 1 as "<Q", the dtype code as "<B" (DType: 1 uint8, 2 int8,
  3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence count "<Q", the document
  count "<Q" (= len(document_indices)), then int32 sequence lengths, int64 byte pointers of the
  sequences, and int64 document_indices (the builder starts them at [0] and appends the sequence
  count after each document). dtype: `DType.optimal_dtype(vocab_size)`, uint16 below 65,500 ids,
  else int32. We write one sequence per document (preprocess_data.py's layout without sentence
  splitting), its delimiters included (EOS as with --append-eod; BOS where the run placed it).
- llmc: karpathy/llm.c dev/data/data_common.py `write_datafile`: a header of 256 int32, header[0]
  the magic, header[1] the version, header[2] the token count (< 2**31), then the tokens: magic
  20240520 version 1 with uint16 tokens ("gpt-2"), or 20240801 version 7 with uint32 ("llama-3").
  Files are named like modded-nanogpt's and llm.c's fineweb shards: <split>_NNNNNN.bin.

An OUT made with --group-by is exported to Megatron as a prefix per group (DEST/<split>/<group>, named
as in OUT), and `megatron_flags` gives the blend, each group weighted by its share of the split's tokens;
llm.c has no blend, so its shards hold the split's groups one after the other (open_output's order).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.durability import fsync_dir
from tokpipe.errors import UserError
from tokpipe.layout import group_file, split_file_stem
from tokpipe.output import Output, Split, open_output
from tokpipe.shard import to_dtype

FORMATS = ("megatron", "llmc")
CHUNK = 1 << 24  # tokens (or index entries) per numpy step

MEGATRON_INDEX_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPE_CODES = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}

LLMC_HEADER_INTS = 256
LLMC_SHARD_TOKENS = 100_000_000  # the size of llm.c's and modded-nanogpt's fineweb shards
LLMC_MAX_TOKENS = 2**31 - 1  # header[2] is an int32
LLMC_VERSIONS = {"uint16": (20240520, 1), "uint32": (20240801, 7)}
LLMC_NAME = re.compile(r"(train|val|test)_\d{6}\.bin")


@dataclass(frozen=True)
class Exported:
    path: Path
    tokens: int
    documents: int  # whole documents in the file; llmc: a document cut at the end counts where it ends
    stem: str = ""  # of the split: train, val, test
    group: str | None = None  # megatron, --group-by: the group the file holds


def megatron_dtype(vocab_size: int) -> str:
    """Megatron's DType.optimal_dtype."""
    return "uint16" if vocab_size < 65500 else "int32"


def llmc_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _write_tokens(f, tokens: np.ndarray, start: int, stop: int, dtype: str) -> None:
    for begin in range(start, stop, CHUNK):
        f.write(memoryview(to_dtype(np.asarray(tokens[begin : min(begin + CHUNK, stop)]), dtype)))


def _finish(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _megatron_split(split: Split, prefix: Path, dtype: str) -> list[tuple[Path, Path]]:
    """Write PREFIX.bin/.idx under temporary names; returns (temporary, final) pairs, .bin first."""
    itemsize = np.dtype(dtype).itemsize
    n = len(split.ends)
    pairs = [
        (prefix.with_name(prefix.name + ext + ".tmp"), prefix.with_name(prefix.name + ext)) for ext in (".bin", ".idx")
    ]
    with open(pairs[0][0], "wb") as f:
        _write_tokens(f, split.tokens, 0, len(split.tokens), dtype)
        _finish(f)
    with open(pairs[1][0], "wb") as f:
        f.write(MEGATRON_INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", n))  # sequences: one per document
        f.write(struct.pack("<Q", n + 1))  # entries of document_indices
        # The three arrays one after the other, each built a chunk at a time from the document ends.
        for section in ("lengths", "pointers", "documents"):
            for begin in range(0, n, CHUNK):
                ends = np.asarray(split.ends[begin : begin + CHUNK], dtype=np.int64)
                starts = np.concatenate(([split.ends[begin - 1] if begin else 0], ends[:-1]))
                if section == "lengths":
                    f.write((ends - starts).astype("<i4").tobytes())
                elif section == "pointers":
                    f.write((starts * itemsize).astype("<i8").tobytes())
                else:
                    f.write(np.arange(begin, begin + len(ends), dtype="<i8").tobytes())
        f.write(struct.pack("<q", n))  # document_indices ends with the sequence count
        _finish(f)
    return pairs


def llmc_cuts(ends: np.ndarray, total: int, shard_tokens: int) -> list[int]:
    """Shard ends: the last document end that fits each shard, so documents stay whole; a document
    longer than a shard continues in the next one (as llm.c's fineweb.py splits every document)."""
    cuts, start = [], 0
    while start < total:
        limit = start + shard_tokens
        if limit >= total:
            cut = total
        else:
            i = int(np.searchsorted(ends, limit, side="right")) - 1
            cut = int(ends[i]) if i >= 0 and ends[i] > start else limit
        cuts.append(cut)
        start = cut
    return cuts


def _llmc_split(
    split: Split, dest: Path, stem: str, dtype: str, shard_tokens: int
) -> list[tuple[Path, Path, int, int]]:
    magic, version = LLMC_VERSIONS[dtype]
    written, start = [], 0
    ends = split.ends[:]  # searchsorted needs one array: a view of a memmap; of --no-concat files, a copy
    for k, cut in enumerate(llmc_cuts(ends, len(split.tokens), shard_tokens)):
        final = dest / f"{stem}_{k:06d}.bin"
        tmp = final.with_name(final.name + ".tmp")
        header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
        header[:3] = magic, version, cut - start
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            _write_tokens(f, split.tokens, start, cut, dtype)
            _finish(f)
        documents = int(np.searchsorted(ends, cut, side="right") - np.searchsorted(ends, start, side="right"))
        written.append((tmp, final, cut - start, documents))
        start = cut
    return written


def _prepare(dest: Path, force: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--dest {dest} is a file, not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise UserError(
            f"--dest {dest} is not empty: choose an empty folder, or pass --force to overwrite what is there"
        )
    dest.mkdir(parents=True, exist_ok=True)


def export(
    out: str | os.PathLike,
    fmt: str,
    dest: str | os.PathLike,
    force: bool = False,
    shard_tokens: int = LLMC_SHARD_TOKENS,
) -> list[Exported]:
    """Write every split of a finished OUT into DEST in `fmt`; returns what was written."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if not 0 < shard_tokens <= LLMC_MAX_TOKENS:
        raise UserError(f"shard size {shard_tokens:,} tokens: llm.c's header holds 1 to {LLMC_MAX_TOKENS:,}")
    data: Output = open_output(out)
    dest = Path(dest)
    _prepare(dest, force)
    renames, exported = [], []
    for name, split in data.splits.items():
        stem = split_file_stem(name)
        if fmt == "megatron":
            for group, part in split.groups.items() if split.groups else [(None, split)]:
                prefix = group_file(dest, stem, group)
                prefix.parent.mkdir(exist_ok=True)
                pairs = _megatron_split(part, prefix, megatron_dtype(data.vocab_size))
                renames += pairs
                exported.append(Exported(pairs[0][1], len(part.tokens), len(part.ends), stem, group))
        else:
            shards = _llmc_split(split, dest, stem, llmc_dtype(data.vocab_size), shard_tokens)
            renames += [(tmp, final) for tmp, final, _, _ in shards]
            exported += [Exported(final, tokens, documents) for _, final, tokens, documents in shards]
    for tmp, final in renames:
        os.replace(tmp, final)
    if fmt == "llmc":
        # A trainer reads every <split>_*.bin: shards of an earlier, longer export (--force) must not stay among them.
        mine = {e.path.name for e in exported}
        for old in dest.iterdir():
            if LLMC_NAME.fullmatch(old.name) and old.name not in mine:
                old.unlink()
    fsync_dir(dest)
    return exported


def megatron_flags(exported: list[Exported]) -> str:
    """Megatron-LM's data flags for what `export` wrote: a prefix per split, or with --group-by each split's
    blend, `--train-data-path W1 PREFIX1 W2 PREFIX2 ...`, the weights the groups' shares of the split's tokens."""
    flags = {"train": "--train-data-path", "val": "--valid-data-path", "test": "--test-data-path"}
    words = []
    for stem in dict.fromkeys(e.stem for e in exported):
        mine = [e for e in exported if e.stem == stem]
        words.append(flags[stem])
        if mine[0].group is None:
            words.append(str(mine[0].path.with_suffix("")))
            continue
        total = max(sum(e.tokens for e in mine), 1)
        words += [f"{e.tokens / total:.6f} {e.path.with_suffix('')}" for e in mine]
    return " ".join(words)

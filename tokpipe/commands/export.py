"""A finished OUT -> the files other trainers read: Megatron-LM's indexed dataset, or llm.c's shards.

Megatron's .bin holds the split file's bytes whenever the widths agree (uint16 with uint16; tokpipe's
uint32 with Megatron's int32, since ids are below 2**31): it is a hard link to the split file (no byte
copied, no block used; measured 0.05-0.10 s for 1.5 GB, the .idx all of it), else a reflink, else a
copy in the kernel (copy_file_range), and through a buffer only where the file systems allow nothing
else. tokpipe never writes into a finished split file in place without first giving it an inode of
its own (durability.own_inode: an append rewrites the split), so the link cannot change under Megatron.
Everything else goes through numpy a chunk at a time (memory stays flat on a multi-TB split), and
every id is checked to fit the target type on the way: an id that does not fit is an error, never a
wrap. Files are written under a temporary name and renamed into place once all are complete, so a
killed export leaves no file a trainer would take for a whole one.

llmc --shuffle SEED writes the documents in a seeded order (Permutation: a keyed bijection of the
document numbers, nothing held per document), gathered a chunk of documents at a time through the
memmaps: for trainers that read shards in sequence (llm.c, modded-nanogpt), where a split in file
order is a walk through its sources in their order (FineWeb: Common Crawl dumps by date).

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
as in OUT), and `megatron_line` gives the blend, each group weighted by its share of the split's tokens;
llm.c has no blend, so its shards hold the split's groups one after the other (open_output's order).
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.data import Permutation
from tokpipe.durability import copy_file, copy_range, fsync_path
from tokpipe.errors import UserError
from tokpipe.layout.files import Layout, split_file_stem
from tokpipe.layout.stored import stored_of
from tokpipe.layout.tokens import to_dtype
from tokpipe.read.output import Output, Split, open_output

FORMATS = ("megatron", "llmc")
CHUNK = 1 << 24  # tokens (or index entries) per numpy step
SHUFFLE_DOCUMENTS = 1 << 16  # documents per step of a shuffled export
SHUFFLE_TOKENS = 1 << 22  # tokens gathered per step: ~50 MB of index and tokens

MEGATRON_INDEX_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPE_CODES = dict(uint8=1, int8=2, int16=3, int32=4, int64=5, float64=6, float32=7, uint16=8)  # DType

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
    how: str = ""  # how a Megatron .bin got its bytes: "hard link (no copy)", "reflink ...", "copied ..."
    stem: str = ""  # of the split: train, val, test
    group: str | None = None  # megatron, --group-by: the group the file holds


def megatron_dtype(vocab_size: int) -> str:
    """Megatron's DType.optimal_dtype."""
    return "uint16" if vocab_size < 65500 else "int32"


def llmc_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every token's position in the split, documents one after another: ones, with the jump to its
    start at each document's first token, summed up (measured: 9 ns a token; np.repeat of the offsets
    plus an arange took 28)."""
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    steps = np.ones(int(lengths.sum()), dtype=np.int64)
    if len(steps):
        steps[0] = starts[0]
        steps[np.cumsum(lengths[:-1])] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.cumsum(steps, out=steps)


def _shuffled(split: Split, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The split's documents in the order of Permutation(documents, seed): (tokens, lengths) a chunk of
    documents at a time, each chunk at most SHUFFLE_TOKENS tokens, or one longer document."""
    reader, n = split.reader, split.reader.documents
    order = Permutation(n, seed)
    for begin in range(0, n, SHUFFLE_DOCUMENTS):
        docs = order[np.arange(begin, min(begin + SHUFFLE_DOCUMENTS, n), dtype=np.int64)]
        stops = reader.gather(docs, ends=True)
        starts = np.zeros_like(stops)
        later = docs > 0  # a document's start is the end of the one before it, in its file or the last file's
        starts[later] = reader.gather(docs[later] - 1, ends=True)
        lengths = stops - starts
        through = np.cumsum(lengths)
        a = 0
        while a < len(docs):
            b = max(int(np.searchsorted(through, through[a] - lengths[a] + SHUFFLE_TOKENS, side="right")), a + 1)
            if lengths[a] > SHUFFLE_TOKENS:  # a long document alone: a slice, no index per token
                yield reader.read(int(starts[a]), int(stops[a])), lengths[a:b]
            else:
                yield reader.gather(_positions(starts[a:b], lengths[a:b])), lengths[a:b]
            a = b


def _in_order(split: Split) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The split's documents in file order, as _shuffled gives them: slices of at most CHUNK tokens
    (unless one document alone is longer)."""
    start = 0
    for begin in range(0, len(split.ends), CHUNK):
        chunk = np.asarray(split.ends[begin : begin + CHUNK], dtype=np.int64)
        a = 0
        while a < len(chunk):
            b = max(int(np.searchsorted(chunk, start + CHUNK, side="right")), a + 1)
            stop = int(chunk[b - 1])
            yield split.tokens[start:stop], np.diff(chunk[a:b], prepend=start)
            start, a = stop, b


class LlmcShards:
    """llm.c shards written one after another. Documents come whole (`add`); a shard closes at the last
    document end that fits shard_tokens, and a document longer than a whole shard continues in the next
    one (as llm.c's fineweb.py splits every document)."""

    def __init__(self, dest: Path, stem: str, dtype: str, shard_tokens: int):
        self.dest, self.stem, self.dtype, self.shard_tokens = dest, stem, dtype, shard_tokens
        self.written: list[tuple[Path, Path, int, int]] = []  # (temporary, final, tokens, documents)
        self.f, self.filled, self.documents = None, 0, 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths)
        at, first = 0, 0  # tokens written, documents not yet written whole
        while at < len(tokens):
            room = self.shard_tokens - self.filled
            fit = int(np.searchsorted(ends, at + room, side="right"))  # documents that end within the room
            if fit == len(ends) or fit > first:
                stop = int(ends[fit - 1])
                self._write(tokens[at:stop], fit - first)
                at, first = stop, fit
                if fit < len(ends):
                    self.close()
            elif self.filled:  # the next document does not fit: the shard ends before it
                self.close()
            else:  # a document (or the rest of one) longer than a shard: cut at the shard's end
                self._write(tokens[at : at + room], 0)
                at += room
                self.close()

    def _write(self, tokens: np.ndarray, documents: int) -> None:
        if self.f is None:
            final = self.dest / f"{self.stem}_{len(self.written):06d}.bin"
            tmp = final.with_name(final.name + ".tmp")
            tmp.unlink(missing_ok=True)
            self.f = open(tmp, "xb")
            self.f.write(bytes(LLMC_HEADER_INTS * 4))  # the header, once the token count is known
            self.written.append((tmp, final, 0, 0))
        _write_tokens(self.f, tokens, self.dtype)
        self.filled += len(tokens)
        self.documents += documents

    def close(self) -> None:
        if self.f is None:
            return
        header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
        header[:3] = *LLMC_VERSIONS[self.dtype], self.filled
        self.f.flush()  # the placeholder out of the buffer first: flushed after, it wrote zeros over the header
        os.pwrite(self.f.fileno(), header.tobytes(), 0)
        _finish(self.f)
        self.f.close()
        tmp, final, _, _ = self.written[-1]
        self.written[-1] = (tmp, final, self.filled, self.documents)
        self.f, self.filled, self.documents = None, 0, 0


def _write_tokens(f, tokens: np.ndarray, dtype: str) -> None:
    for begin in range(0, len(tokens), CHUNK):
        f.write(memoryview(to_dtype(np.asarray(tokens[begin : begin + CHUNK]), dtype)))


def _finish(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _megatron_bin(data: Output, split: Split, tmp: Path, dtype: str) -> str:
    """Give tmp the split's tokens as Megatron's .bin; returns how, in words."""
    tmp.unlink(missing_ok=True)  # a killed export's link to the split file: never write through it
    stored = stored_of(data.path) is not None  # OUT on a store: its tokens read by ranged GETs, written here
    # The .bin is the split file's bytes where the widths agree and (uint32 read as int32) every id is below
    # 2**31, which a vocabulary of at most 2**31 ids guarantees.
    if np.dtype(dtype).itemsize != data.dtype.itemsize or data.vocab_size > 2**31 or stored:
        with open(tmp, "xb") as f:
            _write_tokens(f, split.tokens, dtype)
            _finish(f)
        if stored:
            return "downloaded from the store (a copy)"
        return f"converted {data.dtype} to {dtype} (a copy: Megatron stores {data.vocab_size:,} ids as {dtype})"
    sources = [tokens for tokens, _ in split.reader.paths]
    if len(sources) > 1:
        # Several files into one: a copy in the kernel. A clone needs block-aligned offsets (FICLONERANGE),
        # which the second file's start almost never is; copy_file_range clones wherever it can.
        with open(tmp, "xb") as f:
            hows = {
                copy_range(src, f.fileno(), src.stat().st_size, offset)
                for src, offset in zip(sources, np.cumsum([0] + [s.stat().st_size for s in sources[:-1]]))
            }
            _finish(f)
        return f"{len(sources):,} --no-concat files joined by {' and '.join(sorted(hows))} (a copy)"
    try:
        os.link(sources[0], tmp)
        return "hard link to the split file (no copy)"
    except OSError as e:
        why = (
            "OUT and --dest are on different file systems" if e.errno == errno.EXDEV else f"no hard link: {e.strerror}"
        )
    how = copy_file(sources[0], tmp)
    if how == "reflink":
        return f"reflink (no copy: shares the split file's blocks; {why})"
    return f"copied{' in the kernel (copy_file_range)' if how == 'copy_file_range' else ''} ({why})"


def _megatron_split(data: Output, split: Split, prefix: Path, dtype: str) -> tuple[list[tuple[Path, Path]], str]:
    """Write PREFIX.bin/.idx under temporary names; returns (temporary, final) pairs, .bin first, and
    how the .bin got its bytes."""
    itemsize = np.dtype(dtype).itemsize
    n = len(split.ends)
    pairs = [
        (prefix.with_name(prefix.name + ext + ".tmp"), prefix.with_name(prefix.name + ext)) for ext in (".bin", ".idx")
    ]
    how = _megatron_bin(data, split, pairs[0][0], dtype)
    pairs[1][0].unlink(missing_ok=True)
    with open(pairs[1][0], "xb") as f:
        # version 1, the dtype's code, the sequences (one per document), the entries of document_indices
        f.write(MEGATRON_INDEX_HEADER + struct.pack("<QBQQ", 1, MEGATRON_DTYPE_CODES[dtype], n, n + 1))
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
    return pairs, how


def _megatron_prefixes(data: Output, dest: Path) -> Iterator[tuple[str, str | None, Split, Path]]:
    """Each Megatron prefix of the export: (split stem, group, its documents, DEST/<stem> or DEST/<stem>/<group>)."""
    for name, split in data.splits.items():
        stem = split_file_stem(name)
        for group, part in split.groups.items() if split.groups else [(None, split)]:
            yield stem, group, part, Layout(dest).split(stem, group)


def _touched(data: Output, fmt: str, dest: Path) -> list[Path]:
    """Every path the export may replace or remove: each Megatron prefix's files and their temporary names; the
    llm.c shards in DEST, this export's or an earlier one's (the new ones that are not there yet replace nothing)."""
    if fmt == "megatron":
        prefixes = [prefix for *_, prefix in _megatron_prefixes(data, dest)]
        return [p.with_name(p.name + ext + tmp) for p in prefixes for ext in (".bin", ".idx") for tmp in ("", ".tmp")]
    found = dest.iterdir() if dest.is_dir() else ()
    return [path for path in found if LLMC_NAME.fullmatch(path.name.removesuffix(".tmp"))]


def _refuse_out_files(data: Output, dest: Path, touched: list[Path]) -> None:
    """Refuse a DEST that is OUT, or through which the export would replace or remove a file of OUT: by identity
    (a folder's st_dev and st_ino, and the name), not by path, since a bind mount or a symlink gives OUT's
    folders other paths. An entry, not a file: the hard link an earlier export made to a split file is the
    export's name for it, which a rename replaces without touching OUT's."""
    if dest.is_dir() and os.path.samefile(dest, data.path):
        raise UserError(
            f"--dest {dest} is OUT itself: the export's files would mix with OUT's (Megatron's .idx would replace"
            " OUT's); choose another folder"
        )
    parents, device = {}, data.path.stat().st_dev
    for path in touched:
        try:
            st = path.parent.stat()
        except FileNotFoundError:  # a folder the export makes: no file of OUT is in it
            continue
        if st.st_dev == device:  # (a bind mount keeps the file system's)
            parents.setdefault((st.st_dev, st.st_ino), []).append(path)
    if not parents:  # a new DEST, or on another file system: OUT's folders need no walk (0.3-0.5 s for 60k shards)
        return
    for folder, files in Layout(data.path).folders([split_file_stem(name) for name in data.splits]):
        st = folder.stat()
        for path in parents.get((st.st_dev, st.st_ino), ()):
            if path.name in files:
                raise UserError(
                    f"--dest {dest}: the export would replace or remove {path}, which is {folder / path.name} of OUT"
                    " reached through another path (a bind mount, a symlink); choose a folder outside OUT"
                )


def _prepare(dest: Path, force: bool, touched: list[Path]) -> None:
    """DEST made, or refused where it holds files of its own (but with --force); an export's temporary files, which a
    killed or interrupted one left, are no one's: removed, so that the same command runs again."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--dest {dest} is a file, not a folder")
    left = [path for path in touched if path.name.endswith(".tmp") and path.exists()]
    if dest.is_dir() and any(path not in left for path in dest.iterdir()) and not force:
        raise UserError(
            f"--dest {dest} is not empty: choose an empty folder, or pass --force to overwrite what is there"
        )
    for path in left:
        path.unlink()
    dest.mkdir(parents=True, exist_ok=True)


def export(
    out: str | os.PathLike,
    fmt: str,
    dest: str | os.PathLike,
    force: bool = False,
    shard_tokens: int = LLMC_SHARD_TOKENS,
    shuffle: int | None = None,
) -> list[Exported]:
    """Write every split of a finished OUT into DEST in `fmt`; returns what was written. `shuffle`
    (llmc): the seed of the documents' order, instead of the split's."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if not 0 < shard_tokens <= LLMC_MAX_TOKENS:
        raise UserError(f"shard size {shard_tokens:,} tokens: llm.c's header holds 1 to {LLMC_MAX_TOKENS:,}")
    if shuffle is not None and fmt != "llmc":
        raise UserError("--shuffle is for --format llmc: Megatron-LM shuffles its samples itself (its shuffle index)")
    data: Output = open_output(out)
    if shuffle is not None and stored_of(data.path) is not None:
        raise UserError(
            f"--shuffle reads the documents at random places, on a store a request each: copy {out} first (aws s3"
            " sync, rclone) and export from the copy"
        )
    dest, touched = Path(dest), _touched(data, fmt, Path(dest))
    _refuse_out_files(data, dest, touched)
    _prepare(dest, force, touched)
    renames, exported = [], []
    if fmt == "megatron":
        for stem, group, part, prefix in _megatron_prefixes(data, dest):
            prefix.parent.mkdir(exist_ok=True)
            pairs, how = _megatron_split(data, part, prefix, megatron_dtype(data.vocab_size))
            renames += pairs
            exported.append(Exported(pairs[0][1], len(part.tokens), len(part.ends), how, stem, group))
    else:
        for name, split in data.splits.items():
            stem = split_file_stem(name)
            shards = LlmcShards(dest, stem, llmc_dtype(data.vocab_size), shard_tokens)
            for tokens, lengths in _in_order(split) if shuffle is None else _shuffled(split, shuffle):
                shards.add(tokens, lengths)
            shards.close()
            renames += [(tmp, final) for tmp, final, _, _ in shards.written]
            exported += [Exported(final, tokens, docs, stem=stem) for _, final, tokens, docs in shards.written]
    for tmp, final in renames:
        os.replace(tmp, final)
        tmp.unlink(missing_ok=True)  # rename keeps both names when they are links to one file (a re-export)
    if fmt == "llmc":
        # A trainer reads every <split>_*.bin: shards of an earlier, longer export (--force) must not stay among them.
        mine = {e.path.name for e in exported}
        for old in dest.iterdir():
            if LLMC_NAME.fullmatch(old.name) and old.name not in mine:
                old.unlink()
    fsync_path(dest)
    return exported


def megatron_line(exported: list[Exported]) -> str:
    """Megatron-LM's flags for what `export` wrote: a prefix per split, or with --group-by each split's blend,
    `--train-data-path W1 PREFIX1 W2 PREFIX2 ...`, the weights the groups' shares of the split's tokens. A split of
    no tokens is left out, and said: Megatron-Core's GPTDataset adds epochs until they hold the samples asked for
    (_get_num_epochs), of an empty dataset forever."""
    flags = {"train": "--train-data-path", "val": "--valid-data-path", "test": "--test-data-path"}
    words, empty = [], []
    for stem in dict.fromkeys(e.stem for e in exported):
        mine = [e for e in exported if e.stem == stem]
        total = sum(e.tokens for e in mine)
        if not total:
            empty.append(stem)
        elif mine[0].group is None:
            words += [flags[stem], shlex.quote(str(mine[0].path.with_suffix("")))]
        else:
            words.append(flags[stem])
            words += [f"{e.tokens / total:.6f} {shlex.quote(str(e.path.with_suffix('')))}" for e in mine]
    line = f"Megatron-LM: {' '.join(words)} --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR"
    left = f"; {', '.join(empty)} left out: no documents (Megatron-LM's index of an empty one never ends)"
    return f"{line} (the tokenizer folder of the run){left if empty else ''}"


def llmc_line(exported: list[Exported], dest: str | os.PathLike, shuffle: int | None) -> str:
    """What llm.c and modded-nanogpt read of `export`'s shards: the globs of the splits written (a split of no
    documents, none held out or none in the dataset, has no file)."""
    stems = {e.stem for e in exported}
    uses = [f"{use} on {shlex.quote(str(Path(dest) / f'{stem}_*.bin'))}"
            for use, stem in (("train", "train"), ("evaluate", "val")) if stem in stems]  # fmt: skip
    return (
        f"llm.c / modded-nanogpt: {', '.join(uses) or 'no split has documents'}"
        + ("" if "val" in stems else "; no val split has documents to evaluate on")
        + (f" (documents in the order of --shuffle {shuffle})" if shuffle is not None else "")
    )

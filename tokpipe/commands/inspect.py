"""`tokpipe inspect OUT`: the eye test. Random windows of a split decoded with the run's tokenizer,
document boundaries marked, then the token ids scanned for the red flags of a broken token file.

The seeds' worst incidents were visible to the eye and to a histogram, and to nothing else before the
loss curve: a uint16 file of a 151,669-id vocabulary ("Phantom Zero": ids wrapped, EOS gone, loss
collapsing to 0), a uint32 file read as uint16 (every other id 0), samples that did not look like
text. Works on a finished OUT (the split files) and on an unfinished one (what the shard checkpoints and parts
lists cover), both read through the one reader of a split's files, so a week-long run can be looked at on its
first day.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.errors import UserError
from tokpipe.fmt import plural
from tokpipe.inputs.encoders import encoder
from tokpipe.inputs.manifest import load_manifest
from tokpipe.inputs.tokenizer import load_tokenizer_info
from tokpipe.layout.files import Layout, split_file_stem, split_named
from tokpipe.layout.records import unfinished_files
from tokpipe.layout.run import load_run, output_splits
from tokpipe.layout.stored import reader_out
from tokpipe.read.files import TokenFile, TokenFiles
from tokpipe.read.maps import each_file
from tokpipe.read.output import open_output
from tokpipe.read.verify import Check
from tokpipe.read.verify import report as verify_report

EOS_MARK = "⟨EOS⟩"
BOS_MARK = "⟨BOS⟩"
SCAN_TOKENS = 1 << 22  # ids scanned for red flags: the whole split when it is smaller, else evenly spread blocks
SCAN_BLOCKS = 64
# Thresholds of the red flags. Natural text puts well under 0.1% of its tokens on id 0 (Qwen3: 0.02%);
# a uint32 file read as uint16 puts ~40% there, zero-filled bytes 100%.
ZERO_SHARE_MAX = 0.01
TOP_VALUES = 256  # "near the dtype limit": the top 256 values of the dtype, where saturation and padding land
TOP_SHARE_MAX = 0.01
EOS_RATIO_MAX = 10.0  # EOS share off by more than this factor from documents/tokens
EOS_MIN_EXPECTED = 10  # ... judged only when at least this many EOS are expected in what was scanned
# Text in a >65,536-id vocabulary uses ids above 65,535 (Qwen3 on SlimPajama: 18% of tokens); none in
# this many tokens is what a 16-bit wrap leaves.
HIGH_IDS_MIN_SCANNED = 100_000
COMMON_IDS = 8
# All but \t and \n: a web page's ESC must not drive the terminal.
CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Source:
    """One split of OUT, as far as it is written, with what is needed to read it."""

    split: str
    finished: bool
    dtype: np.dtype
    vocab_size: int
    eos_id: int
    eos_token: str
    tokenizer: str  # the run's tokenizer id and sha256
    tokenizer_sha256: str
    tokenizer_path: str | None  # where the run found it (run.json)
    documents: int
    files: list[TokenFile]
    bos_id: int | None = None  # when the run placed BOS before documents
    eos_written: bool = True  # False: --no-eos
    shards: int | None = None  # of an unfinished OUT: the shards its files hold committed tokens of
    out: Path | None = None  # OUT as read (reader_out): a store's files are read many at once (maps.each_file)

    @property
    def boundary(self) -> tuple[str, int]:
        """The delimiter every document has: EOS, or BOS for a run without EOS."""
        return ("EOS", self.eos_id) if self.eos_written or self.bos_id is None else ("BOS", self.bos_id)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.files)

    def locate(self, pos: int, documents: bool = False) -> tuple[TokenFile, int]:
        """The file holding token `pos` of the split (`documents`: document `pos`), and its offset in it."""
        sizes = [len(s.ends if documents else s.tokens) for s in self.files]
        ends = np.cumsum(sizes)
        i = int(np.searchsorted(ends, pos, side="right"))
        return self.files[i], int(pos - ends[i] + sizes[i])


def _split_name(wanted: str, available: list[str]) -> str:
    name = split_named(wanted)
    if name not in available:
        raise UserError(f"no split {wanted!r} here; there are: {', '.join(available) or 'none'}")
    return name


def open_source(out: str | os.PathLike, split: str) -> Source:
    """A split of OUT as far as it is written: a finished OUT's split files, or what an unfinished one's checkpoints
    and parts lists cover (records.unfinished_files), each read through the one reader of a split's files.
    What is known of the run comes from meta, or while OUT is unfinished, run.json."""
    out = reader_out(out)
    layout = Layout(out)
    run = load_run(layout)
    finished = layout.is_finished()
    if finished:
        data = open_output(out)
        name = _split_name(split, list(data.splits))
        record, files = data.record, data.splits[name].files
        documents, shards = sum(len(f.ends) for f in files), None
    else:
        if run is None or not layout.manifest.is_file():
            raise UserError(f"{layout.where} holds no tokpipe run (no meta.json, run.json or manifest.json)")
        manifest = load_manifest(layout.manifest)
        name = _split_name(split, output_splits(manifest, run.val_fraction))
        written, shards = unfinished_files(out, manifest, split_file_stem(name), run.val_fraction)
        reader = TokenFiles(out, written, run.dtype)
        record, files, documents = run, [reader.file(f) for f in range(len(reader))], reader.documents
    return Source(
        split=name,
        finished=finished,
        dtype=np.dtype(record.dtype),
        vocab_size=record.vocab_size,
        eos_id=record.eos_token_id,
        eos_token=record.eos_token,
        tokenizer=record.tokenizer,
        tokenizer_sha256=record.tokenizer_sha256,
        tokenizer_path=run.tokenizer_path if run is not None else None,
        documents=documents,
        files=files,
        bos_id=record.bos_placed,
        eos_written=record.delimiters.eos,
        shards=shards,
        out=out,
    )


def load_decoder(source: Source, tokenizer: str | None) -> tuple[Callable[[np.ndarray], str], str]:
    """(decode, where the tokenizer is). Only the run's own tokenizer: another one decodes to plausible nonsense."""
    path = tokenizer or source.tokenizer_path
    if path is None:
        raise UserError(
            "this OUT's run.json does not record where its tokenizer is: pass it with --tokenizer (the run "
            f"used {source.tokenizer})"
        )
    info = load_tokenizer_info(path, source.eos_token)
    if info.sha256 != source.tokenizer_sha256:
        raise UserError(
            f"{path} is tokenizer {info.id}, but OUT was made with {source.tokenizer}: pass the run's tokenizer "
            "with --tokenizer"
        )
    return encoder("hf", info.path).decode, info.path


@dataclass(frozen=True)
class Window:
    file: TokenFile
    start: int
    ids: np.ndarray

    @property
    def document(self) -> int:
        """Index of the document the window starts in."""
        return int(np.searchsorted(self.file.ends, self.start, side="right"))


def _printable(text: str) -> str:
    return CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def render(
    ids: np.ndarray, decode: Callable[[np.ndarray], str], eos_id: int, vocab_size: int, bos_id: int | None = None
) -> str:
    """Decoded text with EOS shown as ⟨EOS⟩ and a line break, BOS (when placed) as a line break and ⟨BOS⟩,
    and ids outside the vocabulary shown (a decoder drops them)."""
    pieces, start = [], 0
    for i in np.flatnonzero((ids == eos_id) | (ids == bos_id) | (ids >= vocab_size)):
        pieces.append(_printable(decode(ids[start:i])))
        if ids[i] == eos_id:
            pieces.append(f"{EOS_MARK}\n")
        elif ids[i] == bos_id:
            pieces.append(BOS_MARK if not "".join(pieces) or pieces[-1].endswith("\n") else f"\n{BOS_MARK}")
        else:
            pieces.append(f"⟨id {int(ids[i])} ≥ vocab_size⟩")
        start = i + 1
    pieces.append(_printable(decode(ids[start:])))
    return "".join(pieces)


@dataclass(frozen=True)
class IdScan:
    scanned: int
    whole: bool  # the whole split, not a sample of it
    zeros: int
    boundaries: int  # ids of the delimiter every document has (Source.boundary)
    max_id: int
    high: int  # ids >= 65,536
    top: int  # ids in the dtype's top TOP_VALUES values
    common: list[tuple[int, int]]  # the most frequent (id, count)


def scan_ids(source: Source) -> IdScan:
    """The id statistics of a split with tokens."""
    total = source.tokens
    if total <= SCAN_TOKENS:
        ids = np.concatenate(each_file(source.out, lambda file: np.asarray(file.tokens), source.files))
    else:  # evenly spread blocks, from the first bytes on (where the seeds' eye test looked) to the end
        block = SCAN_TOKENS // SCAN_BLOCKS
        located = [source.locate(int(pos)) for pos in np.linspace(0, total - block, SCAN_BLOCKS).astype(np.int64)]
        ids = np.concatenate(each_file(source.out, lambda at: np.asarray(at[0].tokens[at[1] : at[1] + block]), located))
    values, counts = np.unique(ids, return_counts=True)
    order = np.argsort(counts, kind="stable")[::-1][:COMMON_IDS]
    limit = int(np.iinfo(source.dtype).max)
    return IdScan(
        scanned=len(ids),
        whole=total <= SCAN_TOKENS,
        zeros=int(np.count_nonzero(ids == 0)),
        boundaries=int(np.count_nonzero(ids == source.boundary[1])),
        max_id=int(values[-1]),
        high=int(np.count_nonzero(ids >= 1 << 16)),
        top=int(np.count_nonzero(ids > limit - TOP_VALUES)),
        common=[(int(values[j]), int(counts[j])) for j in order],
    )


def red_flags(source: Source, scan: IdScan) -> list[Check]:
    """The histogram's checks; `ok` False is a red flag."""
    n = max(scan.scanned, 1)
    limit = int(np.iinfo(source.dtype).max) + 1
    checks = []

    def check(name: str, ok: bool, detail: str, why: str) -> None:
        """A check, its detail followed by what a red flag means."""
        checks.append(Check(name, ok, detail + ("" if ok else why)))

    check(
        "dtype holds vocab",
        source.vocab_size <= limit,
        f"{source.dtype.name} holds ids < {limit:,}; vocab_size {source.vocab_size:,}",
        f": every id ≥ {limit:,} was wrapped (Phantom Zero)",
    )
    check(
        "max id < vocab_size",
        scan.max_id < source.vocab_size,
        f"max id {scan.max_id:,}, vocab_size {source.vocab_size:,}",
        f": the file is not {source.dtype.name}, or not this tokenizer's",
    )
    zero_share = scan.zeros / n
    zeros_ok = source.boundary[1] == 0 or zero_share <= ZERO_SHARE_MAX
    why = f" (> {ZERO_SHARE_MAX:.0%}): a uint32 file read as uint16, or zero-filled bytes"
    check("share of id 0", zeros_ok, f"{zero_share:.3%}", why)
    expected_share = source.documents / source.tokens if source.tokens else 0.0
    expected = expected_share * scan.scanned
    name, boundary_id = source.boundary
    eos_ok = expected < EOS_MIN_EXPECTED or 1 / EOS_RATIO_MAX <= scan.boundaries / expected <= EOS_RATIO_MAX
    check(
        f"share of {name} (id {boundary_id})",
        eos_ok,
        f"{scan.boundaries / n:.3%}, expected {expected_share:.3%} from {source.documents:,} documents in "
        f"{source.tokens:,} tokens",
        f": document boundaries are lost (ids wrapped? another {name}?)",
    )
    top = f"{scan.top / n:.3%} in its top {TOP_VALUES} values"
    check(f"ids near the {source.dtype.name} limit", scan.top / n <= TOP_SHARE_MAX, top, ": saturated or padded ids")
    if source.vocab_size > 1 << 16:
        check(
            "ids ≥ 65,536 present",
            scan.high > 0 or scan.scanned < HIGH_IDS_MIN_SCANNED,
            f"{scan.high / n:.2%}",
            f" of {scan.scanned:,} tokens with a {source.vocab_size:,}-id vocabulary: looks wrapped to 16 bits"
            " (Phantom Zero)",
        )
    return checks


@dataclass(frozen=True)
class Inspection:
    source: Source
    tokenizer_path: str
    seed: int
    windows: list[Window]
    texts: list[str]  # the windows decoded
    scan: IdScan
    flags: list[Check]
    common: list[tuple[int, str, float]]  # the most frequent ids: (id, text, share)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.flags)


def inspect(
    out: str | os.PathLike,
    split: str = "train",
    n: int = 5,
    window: int = 64,
    seed: int | None = None,
    tokenizer: str | None = None,
) -> Inspection:
    source = open_source(out, split)
    if not source.tokens and source.finished:  # --val-fraction that held out no document of a small train split
        raise UserError(f"split {source.split} of {out} is empty (0 tokens): the finished run wrote no document to it")
    if not source.tokens:
        raise UserError(
            f"no tokens of split {source.split} are written yet: see where the run stands with tokpipe status "
            f"{shlex.quote(str(out))}"
        )
    decode, tokenizer_path = load_decoder(source, tokenizer)
    # A short seed, printed, so the same windows can be looked at again (or by a colleague).
    seed = secrets.randbelow(1_000_000) if seed is None else seed
    windows = []  # at uniformly random token positions, each moved back as far as it must to lie in one file
    for pos in np.random.default_rng(seed).integers(0, source.tokens, size=n):
        file, offset = source.locate(int(pos))
        start = max(0, min(offset, len(file.tokens) - window))
        windows.append(Window(file, start, np.asarray(file.tokens[start : start + window])))
    scan = scan_ids(source)
    n_scanned = max(scan.scanned, 1)
    common = [(i, decode(np.array([i])) if i < source.vocab_size else "?", c / n_scanned) for i, c in scan.common]
    texts = [
        render(w.ids, decode, source.eos_id if source.eos_written else None, source.vocab_size, source.bos_id)
        for w in windows
    ]
    return Inspection(source, tokenizer_path, seed, windows, texts, scan, red_flags(source, scan), common)


def report(ins: Inspection) -> str:
    src = ins.source
    where = "a finished run"
    if not src.finished:
        where = f"an unfinished run ({plural(src.shards, 'shard')} with committed tokens)"
    lines = [
        f"{src.split}: {src.tokens:,} tokens, {src.documents:,} documents of {where}; "
        f"{src.dtype.name}, vocab_size {src.vocab_size:,}, EOS {src.eos_token!r} = {src.eos_id}",
        f"tokenizer: {ins.tokenizer_path} ({src.tokenizer}, the run's own)",
    ]
    if ins.windows:
        lines.append(
            f"{plural(len(ins.windows), 'window')} of up to {max(len(w.ids) for w in ins.windows)} tokens, seed "
            f"{ins.seed} (--seed {ins.seed} shows them again)"
        )
    for k, (w, text) in enumerate(zip(ins.windows, ins.texts), 1):
        end = w.start + len(w.ids)
        lines += [
            "",
            f"── {k}/{len(ins.windows)}  {w.file.name}[{w.start:,}:{end:,}], in document {w.document + 1:,} of "
            f"{len(w.file.ends):,} ──",
            text,
        ]
    scanned = (
        f"the whole split, {ins.scan.scanned:,} tokens"
        if ins.scan.whole
        else f"{ins.scan.scanned:,} tokens in {SCAN_BLOCKS} blocks spread over the split"
    )
    *checks, verdict = verify_report(ins.flags).splitlines()
    common = ", ".join(f"{i} {text!r} {share:.1%}" for i, text, share in ins.common)
    lines += ["", f"── token ids: {scanned} ──", *checks, f"most common: {common}", verdict]
    if not ins.ok:
        lines.append("RED FLAGS: do not train on this before you know why (README, Troubleshooting)")
    return "\n".join(lines)

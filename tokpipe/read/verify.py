"""Checks on a finished OUT. Every check is named; `verify` passes only when all hold.

meta.pkl is read with a restricted unpickler (plain containers and scalars only): a hostile
meta.pkl executes nothing, it is reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokpipe.durability import HASH_CHUNK, ShortRead
from tokpipe.errors import UserError
from tokpipe.fmt import plural
from tokpipe.layout.files import Layout, load_meta_pkl
from tokpipe.layout.meta import Meta, SplitEntry, SplitFile
from tokpipe.layout.records import IDX_DTYPE, Part, parts_of, read_parts
from tokpipe.layout.stored import StoredOut, no_object, on_store, reader_out, shown, stored_of
from tokpipe.read.files import TokenFiles
from tokpipe.read.maps import REQUESTS_AT_ONCE, seen_all  # a store's, as maps reads it


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class PartScan:
    """What one pass over some parts found."""

    top: int = 0  # largest id
    eos: int = 0  # EOS ids
    bos: int = 0  # BOS ids (when the run placed BOS)
    bad_bin: list[str] = field(default_factory=list)  # parts whose token sha256 differs
    bad_idx: list[str] = field(default_factory=list)
    increasing: bool = True  # every end > the one before (the part's first token before the first)
    not_eos_ended: int = 0  # documents whose last token is not EOS
    not_bos_started: int = 0  # documents whose first token is not BOS
    end: tuple[int, int] = (0, 0)  # the file's last document end, and its token count


_buffers = threading.local()
ENDS_AT_ONCE = HASH_CHUNK // IDX_DTYPE.itemsize  # document ends read in one call, a span of parts' (1 Mi: 8 MiB)


def _scan_file(reader: TokenFiles, f: int, parts: list[Part], eos_id: int, bos_id: int | None) -> PartScan:
    """Parts of file f of the split, hashed and scanned reading each byte once, a span of back-to-back parts at a time
    (_spans: its document ends in one read, its tokens a buffer at a time whatever parts a buffer spans): the ids, and
    each document's last (EOS) and first (BOS) token in the buffer that holds it; then the file's last document end
    and its tokens. On a store each read is a ranged GET and no split file is held whole: read a part at a time (two
    GETs a part), 2,000 groups' files of 8 parts each took 130 s to verify on SeaweedFS here, 664 s with its answers
    20 ms late; 25 s and 24 s now. A thread per chunk of parts: hashlib and numpy drop the GIL."""
    scan, documents = PartScan(), reader.entries[f].documents
    buffer = getattr(_buffers, "buffer", None) or bytearray(HASH_CHUNK)
    _buffers.buffer = buffer
    last = None
    for span in _spans(parts):
        last = _scan_span(reader, f, span, eos_id, bos_id, buffer, scan)
    if last is None or not len(last) or parts[-1].doc_end != documents:  # the file's last end: no span here had it
        last = reader.file_range(f, documents - 1, documents, ends=True) if documents else np.zeros(0, np.int64)
    scan.end = (int(last[-1]) if len(last) else 0, int(reader.ends[f] - reader.starts[f]))
    reader.release(f)
    return scan


def _spans(parts: list[Part]) -> list[list[Part]]:
    """Consecutive parts in spans read at once: each starts where the one before ends, and their document ends number
    ENDS_AT_ONCE at most (a part of more is a span of its own)."""
    spans: list[list[Part]] = []
    for r in parts:
        follows = spans and (r.token_offset, r.doc_offset) == (spans[-1][-1].token_end, spans[-1][-1].doc_end)
        if follows and r.doc_end - spans[-1][0].doc_offset <= ENDS_AT_ONCE:
            spans[-1].append(r)
        else:
            spans.append([r])
    return spans


def _scan_span(
    reader: TokenFiles, f: int, span: list[Part], eos_id: int, bos_id: int | None, buffer: bytearray, scan: PartScan
) -> np.ndarray:
    """One span of parts scanned into `scan` (_scan_file); returns its document ends. Ends are hashed relative to
    their part's first token."""
    dtype, first = reader.dtype, span[0]
    all_ends = reader.file_range(f, first.doc_offset, span[-1].doc_end, ends=True)
    in_order, starts = [], []  # the ends of the parts whose ends lie in order within them; their documents' starts
    for r in span:
        range_ends = all_ends[r.doc_offset - first.doc_offset : r.doc_end - first.doc_offset]
        relative = range_ends - r.token_offset
        if (
            r.record["idx_sha256"] is not None
            and hashlib.sha256(memoryview(relative)).hexdigest() != r.record["idx_sha256"]
        ):
            scan.bad_idx.append(r.name)
        # Each end within the part, after the one before it: then every document lies in the part's tokens.
        ordered = not len(range_ends) or bool(
            relative[0] > 0 and np.all(np.diff(range_ends) > 0) and range_ends[-1] <= r.token_end
        )
        scan.increasing &= ordered
        if ordered:
            in_order.append(range_ends)
            if bos_id is not None:
                starts.append(np.concatenate([[r.token_offset], range_ends[:-1]]))
    ends = np.concatenate(in_order) if in_order else np.zeros(0, IDX_DTYPE)  # in order: each part's lie within it
    starts = np.concatenate(starts) if starts else ends
    hashers, p, at = [hashlib.sha256() for _ in span], 0, first.token_offset  # `at`: the buffer's first token
    start, end = first.token_offset * dtype.itemsize, span[-1].token_end * dtype.itemsize
    try:
        for view in reader.token_bytes(f, start, end, buffer):
            chunk = np.frombuffer(view, dtype=dtype, count=len(view) // dtype.itemsize)
            stop = at + chunk.size
            while p < len(span):  # the view's bytes to the parts they belong to
                low, high = max(span[p].token_offset, at) - at, min(span[p].token_end, stop) - at
                hashers[p].update(view[low * dtype.itemsize : high * dtype.itemsize])
                if span[p].token_end > stop:
                    break
                p += 1
            if not chunk.size:
                continue
            scan.top = max(scan.top, int(chunk.max()))
            scan.eos += int(np.count_nonzero(chunk == eos_id))
            scan.bos += int(np.count_nonzero(chunk == bos_id)) if bos_id is not None else 0
            if len(ends):
                here = np.searchsorted(ends, [at, stop], "right")  # the ends whose last token is here
                last = ends[here[0] : here[1]]
                scan.not_eos_ended += int(np.count_nonzero(chunk[last - 1 - at] != eos_id))
                if bos_id is not None:
                    here = np.searchsorted(starts, [at, stop])  # the starts here
                    begun = starts[here[0] : here[1]]
                    scan.not_bos_started += int(np.count_nonzero(chunk[begun - at] != bos_id))
            at = stop
    except ShortRead as short:
        raise RuntimeError(f"the file ended at byte {short.at} while its size said {end}") from None
    scan.bad_bin += [r.name for r, h in zip(span, hashers) if r.record["sha256"] not in (None, h.hexdigest())]
    return all_ends


def _parts(out: Path, split: str, entry: SplitEntry, check) -> list[Part] | None:
    """The split's checksummed parts: its .parts list (checked against meta), or the whole file as one
    part for an OUT of tokpipe 0.1; None when the parts list cannot be trusted."""
    tokens, documents = entry.tokens, entry.documents
    if entry.parts is None:
        whole = {"shard": entry.file, "tokens": tokens, "documents": documents}
        return [Part(split, 0, 0, 0, whole | {"sha256": entry.sha256, "idx_sha256": entry.idx_sha256})]
    path = out / entry.parts
    if not check(f"{split}: parts list present", path.is_file(), shown(out, entry.parts)):
        return None
    raw = path.read_bytes()
    same = hashlib.sha256(raw).hexdigest() == entry.parts_sha256
    if not check(f"{split}: parts list sha256 matches meta", same, "" if same else f"{path} changed since finalize"):
        return None
    parts = list(parts_of(split, read_parts(raw)))
    t, d = sum(p.tokens for p in parts), sum(p.documents for p in parts)
    check(
        f"{split}: parts add up to meta",
        (t, d) == (tokens, documents),
        f"parts: {t:,} tokens, {d:,} documents; meta: {tokens:,}, {documents:,}",
    )
    if entry.groups is not None:  # --group-by: each group's parts (where its last one ends) add up to its entry
        counts = {p.group: (p.token_end, p.doc_end) for p in parts if p.group is not None}
        wanted = {g: (e.tokens, e.documents) for g, e in entry.groups.items()}
        wrong = sorted(g for g in set(counts) | set(wanted) if counts.get(g) != wanted.get(g))
        first = wrong[0] if wrong else None
        detail = f"{len(wrong)} differ, e.g. {first!r}: parts {counts.get(first)}, meta {wanted.get(first)}"
        if not check(f"{split}: groups add up to meta", not wrong, detail if wrong else f"{len(counts):,} groups"):
            return None
    return parts if (t, d) == (tokens, documents) else None


def _size_chunks(parts: list[Part], itemsize: int, jobs: int) -> list[list[Part]]:
    """Consecutive parts in chunks of similar size, several per job: small shards share a task."""
    target = max(sum(r.tokens for r in parts) * itemsize // (4 * jobs), HASH_CHUNK)
    chunks, size = [[]], 0
    for r in parts:
        if size >= target:
            chunks.append([])
            size = 0
        chunks[-1].append(r)
        size += r.tokens * itemsize
    return chunks


def _finished_or_a_folder(out: str | os.PathLike) -> bool:
    """Whether OUT is a folder or holds a meta.pkl (a HEAD): of an unfinished OUT on a store, its manifest alone says
    what is missing, not a copy of every live segment's record (1,000 segments: 4.1 s; 60,000, minutes)."""
    if not on_store(out) or getattr(out, "stored", None) is not None:  # a folder, or a reader's copy already
        return True
    stored = StoredOut.of(os.fspath(out))
    stored.check()
    return stored.bucket.head(stored.key(Layout("").meta_pkl.name)) is not None


def verify(out: str | os.PathLike, jobs: int | None = None) -> list[Check]:
    """Every check on a finished OUT. Checksums and id scans run on `jobs` threads (default: all cores; on a store,
    whose reads wait on the network, REQUESTS_AT_ONCE)."""
    out = reader_out(out) if _finished_or_a_folder(out) else reader_out(out, [Layout("").manifest.name])
    jobs = jobs or (os.cpu_count() or 1 if stored_of(out) is None else REQUESTS_AT_ONCE)
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str = "") -> bool:
        checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    unfinished = f"the run has not finished (tokpipe status {shlex.quote(Layout(out).where)})"
    try:
        raw = load_meta_pkl(Layout(out).meta_pkl)
    except FileNotFoundError:
        if not Layout(out).manifest.is_file():  # no run's at all: a dataset's folder, a typo, an OUT's subfolder
            if (stored := stored_of(out)) is not None and next(stored.bucket.list(stored.prefix), None) is None:
                raise no_object(stored) from None
            raise UserError(f"{Layout(out).where} holds no tokpipe run (no meta.pkl, no manifest.json)") from None
        check("meta.pkl present", False, f"{shown(out, Layout(out).meta_pkl.name)} is missing: {unfinished}")
        return checks
    except UserError as e:  # damaged, or hostile: the restricted unpickler refused it
        check("meta.pkl readable", False, str(e))
        return checks
    try:
        raw_json = Layout(out).load_meta_json()
    except UserError as e:
        check("meta.json readable", False, str(e))
        return checks
    if raw_json is None:  # written last: a run killed between the two metas
        check("meta.json present", False, f"{shown(out, Layout(out).meta_json.name)} is missing: {unfinished}")
        return checks
    if not check("meta.pkl == meta.json", raw == raw_json, "" if raw == raw_json else "the two metas differ"):
        return checks

    try:
        meta = Meta.of(raw)
        dtype = np.dtype(meta.dtype)
    except (KeyError, TypeError, ValueError) as e:
        check("meta well-formed", False, f"{type(e).__name__}: {e}")
        return checks
    vocab_size, eos_id = meta.vocab_size, meta.eos_token_id
    limit = np.iinfo(dtype).max + 1 if dtype.kind == "u" else 0
    check("dtype holds vocab", vocab_size <= limit, f"{meta.dtype} holds ids < {limit}; vocab_size {vocab_size}")
    check("eos id in vocab", 0 <= eos_id < vocab_size, f"eos {eos_id}, vocab {vocab_size}")

    for split, entry in meta.splits.items():
        _verify_split(out, split, entry, meta, dtype, check, jobs)
    if meta.excluded:
        # Not a failure: the user chose --skip-failed. But nobody should mistake the output for the whole corpus.
        check(f"note: {plural(len(meta.excluded), 'shard')} excluded by --skip-failed", True, ", ".join(meta.excluded))
    return checks


def _verify_split(out: Path, split: str, entry: SplitEntry, meta: Meta, dtype: np.dtype, check, jobs: int) -> None:
    vocab_size, eos_id, bos_id, eos_written = meta.vocab_size, meta.eos_token_id, meta.bos_placed, meta.delimiters.eos
    docs_expected = entry.documents
    if entry.lines is not None:  # every line of the split's sources is a document or a skipped line
        skipped = sum(entry.skipped.values())
        # --val-fraction moves documents from train (held_out) to validation (held_in).
        read = entry.documents - entry.held_in + entry.held_out
        moved = f" (held out {entry.held_out:,}, held in {entry.held_in:,})" if entry.held_out or entry.held_in else ""
        check(
            f"{split}: documents + skipped == lines",
            read + skipped == entry.lines,
            f"{read:,} + {skipped:,} vs {entry.lines:,}{moved}",
        )
    if (found := _check_files(out, split, entry, entry.token_files(), dtype, check)) is None:
        return
    parts = _parts(out, split, entry, check)
    if parts is None:
        return
    held = entry.holding(parts)  # each file with the parts (with tokens: not a shard's accounting line) it holds
    parts = [part for _, in_file in held for part in in_file]
    reader = TokenFiles(out, [file for file, _ in held], dtype, found=found)  # as checked: not looked up again
    scans_of = [
        (f, chunk) for f, (_, in_file) in enumerate(held) for chunk in _size_chunks(in_file, dtype.itemsize, jobs)
    ]
    with ThreadPoolExecutor(jobs) as pool:
        scans = list(pool.map(lambda job: _scan_file(reader, *job, eos_id, bos_id), scans_of))
    bad_bin = [name for s in scans for name in s.bad_bin]
    bad_idx = [name for s in scans for name in s.bad_idx]
    if any(r.record["sha256"] for r in parts):
        check(
            f"{split}: sha256 matches meta",
            not bad_bin,
            f"the token bytes changed since finalize{_where(bad_bin, parts)}" if bad_bin else "",
        )
    top, eos = max((s.top for s in scans), default=0), sum(s.eos for s in scans)
    check(f"{split}: ids < vocab_size", top < vocab_size, f"max id {top:,}, vocab_size {vocab_size:,}")
    if eos_written:
        check(f"{split}: EOS count == documents", eos == docs_expected, f"EOS {eos:,}, documents {docs_expected:,}")
    else:  # a literal "<|endoftext|>" in a text is encoded as text: the id appears only where placed
        check(f"{split}: no EOS anywhere (--no-eos)", eos == 0, f"EOS {eos:,}")
    if bos_id is not None:
        bos = sum(s.bos for s in scans)
        check(f"{split}: BOS count == documents", bos == docs_expected, f"BOS {bos:,}, documents {docs_expected:,}")
    if any(r.record["idx_sha256"] for r in parts):
        check(
            f"{split}: idx sha256 matches meta",
            not bad_idx,
            f"the index changed since finalize{_where(bad_idx, parts)}" if bad_idx else "",
        )
    increasing = all(s.increasing for s in scans)
    check(f"{split}: idx strictly increasing", increasing)
    short = [s.end for s in scans if s.end[0] != s.end[1]]
    last, n = short[0] if short else (scans[-1].end if scans else (0, 0))
    check(f"{split}: idx ends at token count", not short, f"last end {last:,}, tokens {n:,}")
    if increasing and not short and docs_expected:
        if eos_written:
            not_ended = sum(s.not_eos_ended for s in scans)
            check(f"{split}: every document ends with EOS", not not_ended, f"{not_ended} do not")
        if bos_id is not None:
            not_started = sum(s.not_bos_started for s in scans)
            check(f"{split}: every document starts with BOS", not not_started, f"{not_started} do not")


def _check_files(out: Path, split: str, entry: SplitEntry, files: list[SplitFile], dtype: np.dtype, check):
    """The split's files are there, of meta's sizes; returns them as found (maps.seen_all, by name), which the scan
    reads next, or None where they are not."""
    found = seen_all(out, [name for f in files for name in (f.bin, f.idx)])
    problems = [_file_problems(f, found[f.bin], found[f.idx], dtype) for f in files]
    if len(files) == 1:  # the whole split in one file: each check on its own line, as ever
        names = ("file present", f"size matches meta ({entry.tokens:,} {dtype.name})", "idx present")
        names += ("idx entries == documents",)
        for name, problem in zip(names, problems[0]):
            if not check(f"{split}: {name}", problem is None, problem or ""):
                return None
        return found
    # --no-concat: one line per check over all the split's files
    names = ("files present", "sizes match meta", "idx files present", "idx entries == documents")
    for k, name in enumerate(names):
        bad = [(f.bin, p[k]) for f, p in zip(files, problems) if p[k] is not None]
        where = f"{len(bad)} of {len(files):,} files, e.g. {bad[0][0]}: {bad[0][1]}" if bad else f"{len(files):,} files"
        if not check(f"{split}: {name}", not bad, where):
            return None
    return found


def _file_problems(file: SplitFile, tokens_file: tuple, ends_file: tuple, dtype: np.dtype) -> list[str | None]:
    """What is wrong with one file of a split and its index (each as maps.seen found it), check by check (None:
    holds); after the first problem the rest are not looked at."""
    (path, found), (idx_path, idx_found) = tokens_file, ends_file
    size, idx_size = found and found.size, idx_found and idx_found.size
    tokens, documents = file.tokens, file.documents
    if size is None:
        return [path, None, None, None]
    if size != tokens * dtype.itemsize:
        widths = ("uint16", "uint32", "int32", "int64")
        other = next((d for d in widths if d != dtype.name and size == tokens * np.dtype(d).itemsize), None)
        if size == 0:
            detail = f"the file is empty; meta says {tokens:,} tokens"
        elif other:
            detail = f"{size:,} bytes hold {tokens:,} tokens of {other}, but meta says dtype {dtype.name}"
        elif size % dtype.itemsize:
            detail = f"{size:,} bytes is not a whole number of {dtype.name} tokens: the file was cut"
        else:
            detail = f"file {size // dtype.itemsize:,} tokens, meta {tokens:,}"
        return [None, detail, None, None]
    if idx_size is None:
        return [None, None, idx_path, None]
    entries = None if idx_size == 8 * documents else f"{idx_size / 8:,.0f} entries, {documents:,} documents"
    return [None, None, None, entries]


def _where(names: list[str], parts: list[Part]) -> str:
    if len(parts) == 1:  # the whole file: no shard to name
        return ""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f", in the range of {shown}" if len(names) == 1 else f", in the ranges of {len(names)} shards: {shown}"


def report(checks: list[Check]) -> str:
    lines = [f"{'ok  ' if c.ok else 'FAIL'}  {c.name}" + (f"  ({c.detail})" if c.detail else "") for c in checks]
    failed = sum(not c.ok for c in checks)
    lines.append(f"{failed} of {len(checks)} checks FAILED" if failed else f"all {len(checks)} checks hold")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> str:
    return json.dumps({"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}, indent=1)

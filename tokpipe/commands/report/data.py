"""What `tokpipe report` shows, computed from OUT's files alone (no Ray), as small dataclasses.

Sources, each the one the other readers of OUT use: meta.json (a finished run's totals, the same as
`status` and `verify`), run.json (an unfinished run's tokenizer and options), `tokpipe.commands.status.status()`
(shard states, the live progress, the resume command), each split's `.parts` lines (a finished
split's per-shard accounting), the shard checkpoints (an unfinished run's accounting; text bytes and
seconds of every shard), the `.idx` files (document lengths), `tokpipe.commands.inspect` (token-id health)
and OUT/logs/series.jsonl (throughput over time, `tokpipe.layout.series`).
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from tokpipe.commands.inspect import Source, load_decoder, open_source, red_flags, scan_ids
from tokpipe.commands.status import STATES, RunStatus, ShardStatus, status
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import load_manifest
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
from tokpipe.layout.files import Layout, split_bin_name, split_file_stem
from tokpipe.layout.meta import Meta, load_meta
from tokpipe.layout.records import read_parts
from tokpipe.layout.run import RunRecord, load_run, output_splits, sources
from tokpipe.layout.series import read_series
from tokpipe.layout.stored import reader_out, records_of

LENGTH_SAMPLE = 1 << 20  # documents whose lengths are read per split: all of a smaller split, else evenly spread blocks
LENGTH_BLOCKS = 64
LENGTH_BINS = 40
SHARDS_LISTED = 500  # per-shard rows in the page's data: all of a smaller run, else the notable ones
OUTLIER_FACTOR = 1.5  # a shard's bytes per token off the run's median by more than this factor is named


@dataclass(frozen=True)
class SplitStats:
    name: str  # as in meta: train | validation | test
    file: str  # train.bin, val.bin
    tokens: int
    documents: int
    lines: int
    skipped: dict[str, int]
    repaired: dict[str, int]
    held_out: int
    held_in: int
    shards: int


@dataclass(frozen=True)
class GroupStats:
    """One group of a split (--group-by)."""

    split: str
    group: str
    tokens: int
    documents: int
    text_bytes: int  # UTF-8 bytes of its documents' texts

    @property
    def bytes_per_token(self) -> float | None:
        return self.text_bytes / self.tokens if self.tokens else None


def _group_stats(out: Path, meta: Meta | None, manifest) -> list[GroupStats]:
    """Each split's groups: meta's (exact), or what the checkpoints have committed (held-out ones in validation)."""
    if meta is not None:
        return [
            GroupStats(split, group, g.tokens, g.documents, g.text_bytes)
            for split, s in meta.splits.items()
            for group, g in (s.groups or {}).items()
        ]
    found: dict[tuple[str, str], Counter] = defaultdict(Counter)
    checkpoints = Checkpoints(out)
    for shard in manifest.shards():
        ckpt = checkpoints.of(shard) or Checkpoint()
        for split, part in ckpt.group_parts(shard.split):
            found[split, part.group].update(tokens=part.tokens, documents=part.documents, text_bytes=part.text_bytes)
    return [GroupStats(*key, n["tokens"], n["documents"], n["text_bytes"]) for key, n in sorted(found.items())]


@dataclass(frozen=True)
class Lengths:
    split: str
    documents: int  # in the split
    sampled: int  # whose lengths were read (== documents unless the split is large)
    median: float
    p99: float
    max: int
    mean: float
    edges: list[float]  # log-spaced bin edges, in tokens
    counts: list[int]


@dataclass
class Shards:
    count: int
    listed: list[ShardStatus]  # every shard, or (count > SHARDS_LISTED) the outliers, failed and partial ones
    all_listed: bool
    median_bytes_per_token: float | None
    outliers: list[str]  # relpaths whose bytes per token is off the median by more than OUTLIER_FACTOR
    skipped: dict[str, int]  # lines skipped by reason, all shards
    rows: list[ShardStatus] = field(default_factory=list, repr=False)  # every shard, in manifest order: the charts'


@dataclass(frozen=True)
class Health:
    split: str
    scanned: int
    whole: bool
    max_id: int
    vocab_size: int
    dtype: str
    dtype_limit: int  # the largest id the dtype holds, + 1
    zero_share: float
    boundary: str  # EOS, or BOS for a run without EOS
    boundary_id: int
    boundary_share: float
    expected_boundary_share: float
    flags: list[dict]  # {name, ok, detail}: inspect's red flags
    common: list[dict]  # {id, text, share}: the most frequent ids, decoded with the run's tokenizer
    decoded: str | None  # why the ids are not decoded, when they are not


@dataclass(frozen=True)
class ProgressStats:
    state: str  # finished | running | stopped (status's words)
    counts: dict[str, int]  # shards per state, all splits
    by_split: dict[str, dict[str, int]]
    bytes_total: int
    bytes_read: int
    rate_mb_s: float | None  # input MB/s: the live run's, else the last attempt's average
    eta_s: float | None  # the live run's ETA, else what is left at that rate
    projected_finish: float | None  # Unix time, for a running run
    next: str  # the command to run next (status's)
    holder: str | None


@dataclass
class Report:
    out: str
    generated_at: float
    finished: bool
    summary: dict  # what a trainer needs: meta's (run.json's while unfinished) keys, exactly
    splits: list[SplitStats]
    groups: list[GroupStats]  # --group-by: each split's groups, in order of their values
    lengths: list[Lengths]
    shards: Shards
    health: list[Health]
    series: list[dict]  # OUT/logs/series.jsonl, whole lines only
    progress: ProgressStats
    notes: list[str]

    def as_json(self) -> dict:
        """The page's data block: everything but the per-shard arrays only the charts use."""
        data = asdict(replace(self, shards=replace(self.shards, rows=[])))
        data["shards"].pop("rows")
        return data


SUMMARY_KEYS = (
    "dtype", "vocab_size", "eos_token", "eos_token_id", "bos_token", "bos_token_id", "delimiters", "val_fraction",
    "tokenizer", "tokenizer_sha256", "tokenizer_path", "text_field", "group_by", "excluded",
)  # fmt: skip


def _summary(meta: Meta | None, run: RunRecord) -> dict:
    source = meta if meta is not None else run
    summary = {k: getattr(source, k, None) for k in SUMMARY_KEYS} | {"delimiters": source.delimiters.as_dict()}
    summary["excluded"] = summary["excluded"] or {}
    if meta is None and summary["bos_token_id"] is not None:
        summary.pop("bos_token")  # run.json records BOS by id only
    return summary


def _split_stats(out: Path, meta: Meta | None, manifest, val_fraction: float) -> list[SplitStats]:
    keys = ("tokens", "documents", "lines", "skipped", "repaired", "held_out", "held_in", "shards")
    if meta is not None:
        return [
            SplitStats(name, s.file or f"{split_file_stem(name)}/", *(getattr(s, k) for k in keys))
            for name, s in meta.splits.items()
        ]
    stats, checkpoints = [], Checkpoints(out)
    for name in output_splits(manifest, val_fraction):
        stem = split_file_stem(name)
        n, skipped, repaired = Counter(), Counter(), Counter()
        for shard, held in sources(manifest, stem, val_fraction):
            ckpt = checkpoints.of(shard) or Checkpoint()
            tokens, documents = ckpt.counts(held)
            n.update(tokens=tokens, documents=documents)
            if held:
                n.update(held_in=documents)
            else:
                n.update(lines=ckpt.lines, held_out=ckpt.counts(True)[1], shards=1)
                skipped.update(ckpt.skipped)
                repaired.update(ckpt.repaired)
        by_reason = {"skipped": dict(sorted(skipped.items())), "repaired": dict(sorted(repaired.items()))}
        stats.append(SplitStats(name, split_bin_name(stem), *(by_reason.get(k, n[k]) for k in keys)))
    return stats


def _lengths(source: Source) -> Lengths | None:
    total = source.documents
    if total == 0:
        return None
    if total <= LENGTH_SAMPLE:
        pieces = [np.diff(np.asarray(s.ends), prepend=0) for s in source.files if len(s.ends)]
    else:  # evenly spread blocks of consecutive documents, across segments
        block, pieces = LENGTH_SAMPLE // LENGTH_BLOCKS, []
        for pos in np.linspace(0, total - block, LENGTH_BLOCKS).astype(np.int64):
            seg, first = source.locate(int(pos), documents=True)
            ends = np.asarray(seg.ends[max(first - 1, 0) : first + block])
            pieces.append(np.diff(ends, prepend=0) if first == 0 else np.diff(ends))
    lengths = np.concatenate(pieces)
    top = int(lengths.max())
    edges = np.unique(np.geomspace(1, max(top, 2) + 1, LENGTH_BINS + 1).round().astype(np.int64))
    counts, _ = np.histogram(lengths, bins=edges)
    return Lengths(
        source.split, total, len(lengths), float(np.median(lengths)), float(np.percentile(lengths, 99)), top,
        float(lengths.mean()), edges.tolist(), counts.tolist(),
    )  # fmt: skip


def _shards(out: Path, st: RunStatus, meta: Meta | None) -> Shards:
    parts = {}
    if meta is not None:
        for s in meta.splits.values():
            for r in read_parts(out / s.parts, s.parts_sha256):
                mine = parts.setdefault(r["shard"], {"tokens": 0, "documents": 0, "lines": 0, "skipped": {}})
                mine["tokens"] += r["tokens"]
                mine["documents"] += r["documents"]
                if "lines" in r:  # a shard's own part (with --group-by, its accounting line)
                    mine.update(lines=r["lines"], skipped=r.get("skipped", {}))
    # A finished split's accounting is its .parts lines; an unfinished run's, or an excluded shard's, its checkpoint.
    rows = [replace(s, **parts[s.relpath]) if s.relpath in parts else s for s in st.shards]
    bpt = np.array([r.bytes_per_token for r in rows if r.bytes_per_token is not None])
    median = float(np.median(bpt)) if len(bpt) else None
    outliers = [
        r.relpath
        for r in rows
        if median and r.bytes_per_token and not median / OUTLIER_FACTOR <= r.bytes_per_token <= median * OUTLIER_FACTOR
    ]
    skipped = Counter()
    for r in rows:
        skipped.update(r.skipped)
    all_listed = len(rows) <= SHARDS_LISTED
    if all_listed:
        listed = rows
    else:
        notable = set(outliers[: SHARDS_LISTED // 2]) | {r.relpath for r in rows if r.state in ("failed", "partial")}
        listed = [r for r in rows if r.relpath in notable][:SHARDS_LISTED]
    return Shards(len(rows), listed, all_listed, median, outliers, dict(sorted(skipped.items())), rows)


def _health(source: Source, tokenizer: str | None) -> Health | None:
    if not source.tokens:
        return None
    scan = scan_ids(source)
    n = max(scan.scanned, 1)
    why, decode = None, None
    try:
        decode, _ = load_decoder(source, tokenizer)
    except (UserError, OSError, ValueError) as e:
        why = str(e)
    common = [
        {"id": i, "text": decode(np.array([i])) if decode and i < source.vocab_size else None, "share": c / n}
        for i, c in scan.common
    ]
    name, boundary_id = source.boundary
    return Health(
        source.split, scan.scanned, scan.whole, scan.max_id, source.vocab_size, source.dtype.name,
        int(np.iinfo(source.dtype).max) + 1, scan.zeros / n, name, boundary_id, scan.boundaries / n,
        source.documents / source.tokens, [asdict(c) for c in red_flags(source, scan)], common, why,
    )  # fmt: skip


def _progress(st: RunStatus, series: list[dict]) -> ProgressStats:
    counts = {s: st.count(s) for s in STATES}
    by_split = {split: {s: st.count(s, split) for s in STATES} for split in dict.fromkeys(x.split for x in st.shards)}
    total, read = sum(s.size for s in st.shards), sum(s.read for s in st.shards)
    rate = eta = finish = None
    points = [r for r in series if "b" in r]
    last = [r for r in points if r["a"] == points[-1]["a"]] if points else []
    if len(last) >= 2 and last[-1]["t"] > last[0]["t"]:  # the last attempt's average input rate
        rate = (last[-1]["b"] - last[0]["b"]) / (last[-1]["t"] - last[0]["t"]) / 1e6
    if st.progress and st.progress.get("eta_s") is not None:  # a live run: its own ETA
        eta = st.progress["eta_s"]
        finish = st.progress["updated_at"] + eta
    elif st.state != "finished" and rate:  # stopped: what is left, at the last attempt's rate
        eta = (total - read) / (rate * 1e6)
    return ProgressStats(st.state, counts, by_split, total, read, rate, eta, finish, st.next, st.holder)


def build(out: str | os.PathLike, tokenizer: str | None = None) -> Report:
    """Everything the page shows. UserError when OUT holds no tokpipe run."""
    out = reader_out(out)
    st = status(out)  # UserError for a folder without a run
    meta = load_meta(Layout(out)) if st.state == "finished" else None
    run = load_run(Layout(out))
    if run is None:
        raise UserError(f"{st.out} has a manifest but no run.json: tokpipe run has not started there yet")
    manifest = load_manifest(Layout(out).manifest)
    summary = _summary(meta, run)
    splits = _split_stats(out, meta, manifest, (meta or run).val_fraction)
    notes = list(st.warnings)  # the logs status found damaged
    sources = [open_source(out, s.name) for s in splits]  # once a split: unfinished, each reads every checkpoint
    lengths = [found for source in sources if (found := _lengths(source)) is not None]
    notes += [
        f"{x.split}: document lengths from {x.sampled:,} of {x.documents:,} documents"
        f" ({LENGTH_BLOCKS} evenly spread blocks)"
        for x in lengths
        if x.sampled < x.documents
    ]
    health = [h for source in sources if (h := _health(source, tokenizer)) is not None]
    shards = _shards(out, st, meta)
    if not shards.all_listed:
        notes.append(
            f"{shards.count:,} shards: the page's data lists {len(shards.listed):,} of them"
            " (outliers, failed and partial); the charts draw all"
        )
    series = read_series(records_of(st.out) if st.holder else out)  # a live run's: in its records, as status reads
    return Report(
        st.out, time.time(), meta is not None, summary, splits, _group_stats(out, meta, manifest), lengths, shards,
        health, series, _progress(st, series), notes,
    )  # fmt: skip

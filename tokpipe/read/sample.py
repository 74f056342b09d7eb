"""`tokpipe verify --sample K`: K random documents of OUT re-tokenized from the source with `tokenizers` (the
reference: docs/design.md) and compared with their span in the split files: an independent check of the encoder that
wrote them and of the offsets where they went. `tokpipe verify`'s other checks are verify.py's. (The one reader
of OUT that reads its sources: tokpipe/inputs.)
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np

from tokpipe.errors import UserError
from tokpipe.fmt import plural
from tokpipe.inputs.encoders import HFEncoder
from tokpipe.inputs.manifest import Shard, load_manifest
from tokpipe.inputs.objects import check_reachable
from tokpipe.inputs.pieces import PIECE_CHARS
from tokpipe.inputs.source import read_batches
from tokpipe.inputs.tokenizer import tokenizer_json_path
from tokpipe.layout.checkpoints import Checkpoints
from tokpipe.layout.files import Layout, split_file_stem
from tokpipe.layout.meta import Meta
from tokpipe.layout.run import sources
from tokpipe.layout.tokens import held_out
from tokpipe.read.output import open_output
from tokpipe.read.verify import Check


def verify_sample(out: str | os.PathLike, k: int, seed: int = 0, tokenizer: str | None = None) -> list[Check]:
    """Re-tokenize k random documents from the source with `tokenizers` (the reference: docs/design.md) and
    compare them with their span in the bins: an independent check of the backend and of the offsets.
    A document over PIECE_CHARS is re-encoded a piece at a time, exactly as whole (encoders.Encoder),
    so the check's memory is a piece's, not the document's: `tokenizers` needs 150-350 bytes a character."""
    data = open_output(out)
    out = data.path  # a folder, or a local copy of the records of an OUT on a store (layout/stored.py reader_out)
    meta = data.record
    json_path = tokenizer_json_path(tokenizer or meta.tokenizer_path)
    if hashlib.sha256(json_path.read_bytes()).hexdigest() != meta.tokenizer_sha256:
        why = f"{json_path} is not the tokenizer this run used (sha256 differs); pass --tokenizer"
        return [Check("sample: tokenizer is the run's", False, why)]
    reference = HFEncoder(str(json_path))
    manifest = load_manifest(Layout(out).manifest)
    check_reachable(manifest)  # its sources on a store: a wrong key or no store there said in one line, now
    before = [meta.bos_token_id] if meta.delimiters.bos else []
    after = [meta.eos_token_id] if meta.delimiters.eos else []
    val_fraction, group_by = meta.val_fraction, meta.group_by
    population = _population(out, meta, manifest)
    picks = _picks(population, k, seed)
    for shard in {population[i][1] for i in picks}:
        _check_source(shard)

    results: dict[str, list[int]] = {}
    mismatches: dict[str, list[str]] = {}
    in_pieces: dict[str, int] = {}  # split -> sampled documents re-encoded a piece at a time
    passed_over: dict[str, int] = {}  # split -> sampled documents too long to re-encode whole, not checked
    for i, docs in picks.items():
        split, shard, held, group, _, _ = population[i]
        tokens, ends = data.splits[split].tokens, data.splits[split].ends
        needed = dict(docs)
        last = max(needed)
        seen = 0  # documents of this part read so far
        for batch in read_batches(shard.path, meta.text_field, group_by=group_by, etag=shard.etag):
            texts = batch.texts
            if group_by is not None:  # the part's documents only: of its group
                texts = [t for t, g in zip(texts, batch.groups) if g == group]
            if val_fraction and shard.split == "train":  # the part's documents only: held out, or kept
                texts = [t for t, h in zip(texts, held_out(texts, val_fraction)) if h == held]
            picked = [(number, text) for number, text in enumerate(texts, start=seen) if number in needed]
            seen += len(texts)
            if reference.piece_tokens is None:  # a tokenizer tokpipe cannot cut: a long document is passed over
                passed_over[split] = passed_over.get(split, 0) + sum(len(text) > PIECE_CHARS for _, text in picked)
                picked = [(number, text) for number, text in picked if len(text) <= PIECE_CHARS]
            # A batch's picks in one call: tokenizers encodes them on all cores.
            flat, lengths = reference.encode([text for _, text in picked])
            for (number, text), length, end in zip(picked, lengths, np.cumsum(lengths)):
                d = needed[number]
                start = int(ends[d - 1]) if d else 0
                got = tokens[start : int(ends[d])]
                results.setdefault(split, []).append(d)
                in_pieces[split] = in_pieces.get(split, 0) + (len(text) > PIECE_CHARS)  # (none where passed over)
                if not _matches(got, before, flat[end - length : end], after):
                    mismatches.setdefault(split, []).append(
                        f"document {d} ({shard.relpath}{', held out' if held else ''}, its document {number})"
                    )
            if seen > last:
                break
    return _checks(results, mismatches, in_pieces, passed_over)


def _check_source(shard: Shard) -> None:
    """A sampled file of the run's dataset is where the manifest says, as the run read it (its size): else its
    documents would be said not to match their tokens. (An object on a store is read by its ETag: one replaced
    fails its read.)"""
    if shard.on_store:
        return
    try:
        size = os.stat(shard.path).st_size
    except FileNotFoundError:
        size = None
    if size != shard.size:
        now = "is not there" if size is None else f"is {size:,} bytes, where the run read {shard.size:,}"
        raise UserError(
            f"--sample re-reads documents from the run's dataset, and {shard.path} ({shard.relpath} in OUT's "
            f"manifest.json) {now}: put the dataset back as the run read it, or verify without --sample"
        )


def _population(out: Path, meta: Meta, manifest) -> list[tuple]:
    """Every document of the output as (split, shard, held-out part or not, group, number within split), a part
    at a time. With --group-by a split is its groups one after the other, in meta's order."""
    population, checkpoints = [], Checkpoints(out)
    for split, entry in meta.splits.items():
        groups = entry.groups if entry.groups is not None else {None: entry}
        base = dict(zip(groups, np.cumsum([0] + [g.documents for g in groups.values()]).tolist()))
        for shard, held in sources(manifest, split_file_stem(split), meta.val_fraction):
            if shard.relpath in meta.excluded:
                continue
            for part in checkpoints.of(shard).source_parts(held):
                population.append((split, shard, held, part.group, base[part.group], part.documents))
                base[part.group] += part.documents
    return population


def _picks(population: list[tuple], k: int, seed: int) -> dict[int, list[tuple[int, int]]]:
    """k documents drawn at random: population index -> [(doc in part, doc in split)]."""
    total = sum(p[5] for p in population)
    wanted = sorted(random.Random(seed).sample(range(total), min(k, total)))
    starts = np.cumsum([0] + [p[5] for p in population])  # first document of each part, over all splits
    picks: dict[int, list[tuple[int, int]]] = {}
    for doc in wanted:
        i = int(np.searchsorted(starts, doc, side="right")) - 1
        picks.setdefault(i, []).append((doc - int(starts[i]), population[i][4] + doc - int(starts[i])))
    return picks


def _matches(got: np.ndarray, before: list[int], encoded: np.ndarray, after: list[int]) -> bool:
    """A document's span in the split file is the reference's tokens between the delimiters written."""
    return (
        len(got) == len(before) + len(encoded) + len(after)
        and list(got[: len(before)]) == before
        and list(got[len(got) - len(after) :]) == after
        and np.array_equal(got[len(before) : len(got) - len(after)], encoded)
    )


def _checks(
    results: dict[str, list[int]],
    mismatches: dict[str, list[str]],
    in_pieces: dict[str, int],
    passed_over: dict[str, int],
) -> list[Check]:
    """One check per split sampled."""
    checks = []
    for split in {**results, **passed_over}:
        notes = mismatches.get(split, [])[:5]
        if in_pieces.get(split) and not notes:
            notes.append(f"{in_pieces[split]} of them over {PIECE_CHARS:,} characters, re-encoded in pieces")
        if passed_over.get(split):
            notes.append(
                f"{passed_over[split]} more passed over, not checked: over {PIECE_CHARS:,} characters, and this"
                " tokenizer's pre-tokenizer is not one tokpipe can cut exactly (tokpipe/inputs/pieces.py)"
            )
        sampled = len(results.get(split, []))
        name = f"{split}: {plural(sampled, 'sampled document')} re-tokenized by tokenizers match{'es' * (sampled == 1)}"
        checks.append(Check(name, not mismatches.get(split), "; ".join(notes)))
    return checks

"""What a run is: the inputs its bytes depend on, recorded in run.json; a rerun with other inputs is refused.

A manifest that only gained shards is an append: the finished shards are kept and the new ones run; so is one that
changed or left out shards OUT holds nothing finished of (a cut download that failed, fetched again or taken out).
An OUT that holds no token yet is no run to protect: a rerun with other inputs (the command corrected
after a refusal) starts it over.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from tokpipe.durability import write_json_atomic
from tokpipe.errors import UserError
from tokpipe.fmt import plural
from tokpipe.inputs.manifest import Manifest, Shard, load_manifest
from tokpipe.inputs.tokenizer import TokenizerInfo
from tokpipe.layout.checkpoints import Checkpoints
from tokpipe.layout.files import RECORD, REFUSED, Layout, LayoutWriter
from tokpipe.layout.meta import Meta, load_meta
from tokpipe.layout.run import RUN_FORMAT, finished_with, load_run
from tokpipe.options import RunOptions
from tokpipe.runner.events import Listener, Said, silent
from tokpipe.write.shard import EncodeSpec


def run_identity(manifest: Manifest, info: TokenizerInfo, opts: RunOptions) -> dict:
    """What the bytes of OUT depend on. Workers, backend and intervals are not in it: they never change bytes."""
    return {
        "format": RUN_FORMAT,
        "manifest_sha256": manifest.fingerprint,
        "tokenizer": info.id,
        "tokenizer_sha256": info.sha256,
        "vocab_size": info.vocab_size,
        "dtype": info.dtype,
        "eos_token": info.eos_token,
        "eos_token_id": info.eos_id,
        "bos_token_id": info.bos_id,
        "text_field": opts.text_field,
        "delimiters": opts.delimiters,
        "val_fraction": opts.val_fraction,
        "concat": not opts.no_concat,
    } | ({"group_by": opts.group_by} if opts.group_by is not None else {})


def encode_spec(
    opts: RunOptions, info: TokenizerInfo, backend: str, read_ahead: bool = False, spill: str = ""
) -> EncodeSpec:
    """What every worker of this run needs to write its shards' bytes; `spill`: an OUT on a store's folder for
    large parts (layout/stored.py spill_name)."""
    return EncodeSpec(
        info.path,
        backend,
        eos_id=None if opts.no_eos else info.eos_id,
        bos_id=info.bos_id if opts.bos else None,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        text_field=opts.text_field,
        checkpoint_interval=opts.checkpoint_interval,
        memory_limit=opts.worker_memory << 20,
        val_fraction=opts.val_fraction,
        buffer_bytes=0 if opts.no_concat else opts.buffer_mib << 20,
        read_ahead=read_ahead,
        group_by=opts.group_by,
        spill=spill,
    )


def check_options(opts: RunOptions, info: TokenizerInfo, tokenizer) -> None:
    """Refuse documents no trainer could tell apart, a BOS the tokenizer does not have, a --group-by with no field,
    and, unasked, delimiters other than the model's (a chat turn's end, no BOS where the tokenizer places one).
    (A number an option cannot take is refused where the options are made: options.Number.)"""
    if opts.no_eos and not opts.bos:
        raise UserError(
            "--no-eos without --bos would write documents back to back with nothing between them: add --bos, or "
            "drop --no-eos"
        )
    if opts.bos_token and not opts.bos:
        raise UserError("--bos-token names the BOS that --bos places: add --bos")
    if opts.bos and opts.no_bos:
        raise UserError("--bos places a BOS before every document and --no-bos none: pass one of them")
    if info.text_start and not (opts.bos or opts.no_bos):  # a model will read every text after it, unlike its training
        raise UserError(
            f"{tokenizer} places {info.text_start!r} before every text it encodes, as its model will read text: pass"
            f" --bos to place it before each document, or --no-bos to leave it out",
            fix={"bos": True},
        )
    if opts.bos and info.bos_id is None:
        raise UserError(
            f"{tokenizer} names no bos_token (tokenizer_config.json): pass --bos-token TOKEN (e.g. --bos-token "
            "'<|endoftext|>')"
        )
    if opts.group_by is not None and not opts.group_by.strip("."):
        raise UserError("--group-by needs a field name (e.g. --group-by meta.redpajama_set_name)")
    if info.text_end and not opts.no_eos:  # documents ended with a turn's end, unasked: pretraining data a chat format
        raise UserError(
            f"{tokenizer} is a chat model's tokenizer: its eos {info.eos_token!r} ends a chat turn, and its base"
            f" model's texts end with {info.text_end!r}: pass --eos {shlex.quote(info.text_end)} to end documents"
            f" so, or --eos {shlex.quote(info.eos_token)} to end them with the turn's end",
            fix={"eos": info.text_end},
        )


@contextmanager
def refusals_noted(out: Path, holds_no_token: Callable[[], bool]):
    """Note a refusal of this run in `out`'s logs (refused.json) when OUT holds no token (and is still this run's):
    the command that works there is then the corrected one (`tokpipe status` prints it), not the one run.json
    records."""
    try:
        yield
    except UserError as e:
        if Layout(out).run_json.exists() and holds_no_token():
            LayoutWriter(out).write_log(REFUSED, {"error": str(e), "fix": e.fix})
        raise


def record_run(out: Path, manifest: Manifest, info: TokenizerInfo, opts: RunOptions, tell: Listener = silent) -> None:
    """Refuse an OUT that holds a run with other inputs (a manifest that only gained shards is an
    append; an OUT with no token yet is started over); then (re)write run.json for this run."""
    identity = run_identity(manifest, info, opts)
    changed = identity_changes(out, identity)
    if changed:
        what = describe_changes(changed)
        if not LayoutWriter(out).holds_tokens():
            LayoutWriter(out).start_over()
            tell(Said(f"{out} holds no token yet: starting it over with these inputs ({what})"))
        elif list(changed) == ["manifest_sha256"] and Layout(out).manifest.exists():
            checkpoints, recorded = Checkpoints(out), load_manifest(Layout(out).manifest)
            checkpoints.forget(check_append(str(out), recorded, manifest, tell, checkpoints.done))  # begun again
            LayoutWriter(out).unfinish()  # until the new finalize
        else:
            raise UserError(
                f"{out} holds a run with other inputs ({what}); use a new --out, or the original inputs to resume"
            )
    Layout(out).log(REFUSED).unlink(missing_ok=True)
    defaults = asdict(RunOptions())
    options = {k: v for k, v in asdict(opts).items() if v != defaults[k]}
    write_json_atomic(Layout(out).run_json, {**identity, "tokenizer_path": info.path, "options": options})


def refuse_foreign(out: str | Path, names: Iterable[str]) -> None:
    """Refuse to begin a run where something no tokpipe run wrote is: OUT is a new or empty folder (or prefix), or a
    tokpipe run's. A run's files would lie among another's and replace those of the same names (a nanoGPT data
    folder's train.bin). `names`: OUT's entries (a prefix's: its objects' first names); those a refused run leaves
    (files.RECORD) are tokpipe's."""
    foreign = sorted(set(names) - RECORD)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3:,} more" if len(foreign) > 3 else "")
        raise UserError(
            f"{out} holds what no tokpipe run wrote ({shown}) and no run.json: --out takes a new or empty folder, or"
            " a tokpipe run's OUT"
        )


def refuse_inside(out: str | Path, inside: str | None) -> None:
    """Refuse a new OUT inside another's (`inside`): a rerun of that one that resumed removed the split files it
    found among its own (a nested OUT's train.bin, on a store; in its shards/ folder, on disk)."""
    if inside is not None:
        raise UserError(f"{out} is inside the tokpipe OUT {inside}, whose runs would take its files for their own:"
                        " --out takes a folder outside every OUT")  # fmt: skip


def identity_changes(out: Path, identity: dict) -> dict[str, tuple] | None:
    """What differs between a run's identity and the one OUT's run.json records: key -> (was, now), in key
    order; None where OUT records none."""
    recorded = load_run(Layout(out))
    if recorded is None:
        return None
    previous = recorded.identity()
    keys = sorted(set(identity) | set(previous))
    return {k: (previous.get(k), identity.get(k)) for k in keys if identity.get(k) != previous.get(k)}


def describe_changes(changed: dict[str, tuple]) -> str:
    return "; ".join(f"{k}: was {was!r}, now {now!r}" for k, (was, now) in changed.items())


def finished_read_only(out: Path, manifest: Manifest, info: TokenizerInfo, opts: RunOptions) -> Meta:
    """The meta of an OUT this process may not write (a read-only mount) that holds this run finished: a rerun
    there is nothing to do, as anywhere. Anything else would write to it: refused, before any work."""
    meta = load_meta(Layout(out))
    changed = identity_changes(out, run_identity(manifest, info, opts))
    where = f"{out} is not writable here (a read-only mount, or another user's)"
    if changed:
        raise UserError(f"{where}, and holds a run with other inputs ({describe_changes(changed)}): use a new --out")
    if changed is None or not finished_with(meta, manifest):
        raise UserError(f"{where}, and its run is not finished: rerun where it can be written")
    return meta


def check_append(
    out: str,
    old_manifest: Manifest,
    manifest: Manifest,
    tell: Listener,
    done: Callable[[Shard], bool],
    no_gain: str = "",
) -> list[Shard]:
    """Every shard of the old manifest that is `done` in OUT must be in the new one, the same size (on a store, the
    same ETag); one that is not (it failed: a cut download fetched again, or left out) may change or go, nothing of it
    being kept. Returns those (the old manifest's), whose partial work is forgotten. `no_gain`: the refusal of a
    manifest that gained shards. Both list a split's shards in path order (docs/design.md), so one merged pass per
    split compares them, holding neither manifest."""
    refused, changed, left = [], [], []
    for split in old_manifest.counts:
        new = manifest.shards(split)
        candidate = next(new, None)
        for shard in old_manifest.shards(split):
            while candidate is not None and candidate.relpath < shard.relpath:
                candidate = next(new, None)
            if candidate is None or candidate.relpath != shard.relpath:
                (refused if done(shard) else left).append(shard)
            elif (candidate.size, candidate.etag) != (shard.size, shard.etag):
                (refused if done(shard) else changed).append(shard)
    if refused:
        are = "is" if len(refused) == 1 else "are"
        raise UserError(
            f"{out} was started from another manifest: {len(refused)} of the shards it finished {are} changed or gone"
            f" in this one (e.g. {refused[0].relpath}); use a new --out, or the original manifest to resume"
        )
    gained = sum(manifest.counts.values()) - sum(old_manifest.counts.values()) + len(left)
    if gained > 0 and no_gain:
        raise UserError(no_gain)
    said = ((changed, "changed", "tokenized anew as it lists them now"), (left, "left out", "not in OUT"))
    for shards, what, then in said:
        if shards:
            some = f"{plural(len(shards), 'shard')} that {out} holds no finished work of (e.g. {shards[0].relpath})"
            tell(Said(f"the manifest {what} {some}: {then}"))
    if gained > 0:
        gained = plural(gained, "shard")
        tell(Said(f"the manifest gained {gained} since {out} was started: appending them (finished shards are kept)"))
    return changed + left

"""`tokpipe run`: the driver. Plan (inputs, identity, checkpoints), tokenize every unfinished shard on
Ray while finished ones are copied into their split files, report failures, finalize, summarize.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import ray

from tokpipe.durability import write_json_atomic
from tokpipe.errors import SourceError, hold_sigterm, terminate_on_sigterm
from tokpipe.finalize import Assembler, finalize
from tokpipe.layout import FAILED, Checkpoint, load_meta_json, lock_out, log_file
from tokpipe.manifest import Manifest, load_manifest, write_manifest
from tokpipe.options import RunOptions
from tokpipe.runner.identity import check_options, record_run
from tokpipe.runner.progress import Progress, RunLog, Timeline
from tokpipe.runner.schedule import Copies, Scheduler
from tokpipe.shard import ShardResult
from tokpipe.source import read_batches
from tokpipe.tokenizer import TokenizerInfo, choose_backend, load_tokenizer_info

SAMPLE_BYTES = 256 << 10  # of input per split, to prove the fast backend exact on this data (with HARD_CASES)


@dataclass
class RunSummary:
    finished: bool
    failed: dict[str, str]  # shard relpath -> last error
    meta: dict | None
    redone_tokens: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """Where the shards stand before this run starts."""

    shards: int
    done: int
    partial: int
    done_bytes: int  # of input already covered by checkpoints


def _plan(out: Path, manifest: Manifest, info: TokenizerInfo, log: RunLog, manifest_path) -> Plan:
    shards, done, partial, done_bytes = sum(manifest.counts.values()), 0, 0, 0
    for shard in manifest.shards():  # one checkpoint in memory at a time: manifests may hold 100,000s of shards
        ckpt = Checkpoint.of(out, shard)
        done += ckpt is not None and ckpt.done
        partial += ckpt is not None and not ckpt.done
        done_bytes += shard.size if ckpt and ckpt.done else (ckpt.source_pos if ckpt else 0)
    print(
        f"tokenizer {info.id}: vocab_size {info.vocab_size:,} (len(tokenizer), added tokens included), "
        f"eos {info.eos_token!r} = {info.eos_id}, dtype {info.dtype}"
    )
    print(
        f"manifest {manifest.repo_id or manifest.root}: {shards} shards, {manifest.size / 2**20:,.1f} MiB; "
        f"{done} done, {partial} partial, {shards - done - partial} to start"
    )
    log(
        f"run: manifest {manifest_path} ({manifest.fingerprint[:16]}), tokenizer {info.id}, {shards} shards: "
        f"{done} done, {partial} partial"
    )
    return Plan(shards, done, partial, done_bytes)


def _start_ray(opts: RunOptions) -> tuple[int, bool]:
    """Join the cluster, or start an embedded local Ray; returns (shard tasks to run at once, read ahead).

    With at least twice as many CPUs as tasks, a task takes 2 and reads its next batch on the second
    while it encodes (EncodeSpec.read_ahead); Ray keeps that core free for it.
    """
    # ray.init would install SIGTERM handlers that exit halfway through its start, leaving its agents
    # running: a SIGTERM then is held, and raised once Ray is up (tokpipe's stop shuts Ray down, exit 143).
    ray._private.utils.set_sigterm_handler = hold_sigterm
    address = opts.address or os.environ.get("RAY_ADDRESS")
    common = dict(logging_level=logging.ERROR, log_to_driver=False)
    if address:
        ray.init(address=address, **common)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        widest = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
    else:
        cpus = widest = os.cpu_count() or 1
    workers = opts.workers or cpus
    read_ahead = 2 * workers <= cpus and widest >= 2
    if not address:
        # address="local": never attach to some other Ray instance that happens to run on this machine.
        ray.init(
            address="local",
            num_cpus=workers * (2 if read_ahead else 1),
            include_dashboard=False,
            object_store_memory=128 << 20,
            **common,
        )
    terminate_on_sigterm()  # over the C++ handler Ray's core worker installed (it prints a stack, exits 1)
    return workers, read_ahead


def _sample_texts(manifest: Manifest, text_field: str) -> list[str]:
    texts = []
    for split in manifest.counts:
        path = next(manifest.shards(split)).path
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe or device: reading could block the driver
            continue
        try:
            first = next(read_batches(path, text_field, batch_bytes=SAMPLE_BYTES), None)
        except SourceError:  # an unreadable first shard: its own task reports it
            continue
        if first is not None:  # None: an empty shard
            texts += first.texts
    return texts


def _tokenize(
    manifest: Manifest,
    out: Path,
    info: TokenizerInfo,
    opts: RunOptions,
    assembler: Assembler,
    log: RunLog,
    plan: Plan,
    clock: Timeline,
) -> tuple[dict[str, str], list[ShardResult]]:
    """Tokenize every unfinished shard on Ray, assembling the split files as shards finish; returns
    (failures, shards that resumed). Ray is up when it returns: what finalize has left is the last copies."""
    with ThreadPoolExecutor(1) as pool:
        # The backend's self-check and Ray's start-up take seconds each: do them at the same time.
        choice = pool.submit(choose_backend, opts.backend, info.path, _sample_texts(manifest, opts.text_field))
        workers, read_ahead = _start_ray(opts)
        backend, why = choice.result()
    print(f"backend {backend}: {why}")
    log(f"backend {backend}: {why}")
    where = (
        f"cluster {ray.get_runtime_context().gcs_address}"
        if opts.address or os.environ.get("RAY_ADDRESS")
        else "embedded local instance"
    )
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    print(
        f"ray: {where}, {workers} workers"
        + (" (2 CPUs each: reading overlaps encoding)" if read_ahead else "")
        + (f" on {nodes} nodes" if nodes > 1 else "")
    )
    spec = opts.encode_spec(info, backend, read_ahead)
    progress = Progress(out, manifest.size, plan, np.dtype(info.dtype).itemsize)
    copies = Copies(assembler, out, np.dtype(info.dtype).itemsize, nodes)
    scheduler = Scheduler(manifest, out, spec, opts, workers, log)
    clock.planned = time.monotonic()
    try:
        scheduler.run(progress, copies, plan.done)
    finally:
        progress.close()
    clock.tokenized = time.monotonic()
    clock.read_bytes = progress.read_this_run
    clock.assembled_bytes = sum(copies.bytes_by_node.values())
    # Failed shards block their split's assembly; with --skip-failed it goes on without them.
    copies.drain(frozenset(scheduler.failed) if opts.skip_failed else frozenset())
    if nodes > 1:
        log(
            "assembled by node: "
            + ", ".join(f"{node[:8]} {size / 1e6:,.1f} MB" for node, size in copies.bytes_by_node.most_common())
        )
    return scheduler.failed, scheduler.resumed


def _report_failures(
    out: Path, failed: dict[str, str], resumed: list[ShardResult], opts: RunOptions, log: RunLog
) -> bool:
    """Say what resumed and what failed; returns whether to finalize."""
    if resumed:
        kept, redone = sum(r.resumed_tokens for r in resumed), sum(r.redone_tokens for r in resumed)
        print(
            f"resumed {len(resumed)} shards from their checkpoints: {kept:,} tokens kept, {redone:,} tokens "
            "written after the last checkpoints redone"
        )
    failures_file = log_file(out, FAILED)
    if not failed:
        failures_file.unlink(missing_ok=True)
        return True
    write_json_atomic(failures_file, failed)
    for relpath, error in failed.items():
        print(f"FAILED {relpath}: {error}", file=sys.stderr)
    if not opts.skip_failed:
        log(f"{len(failed)} shards failed; not finalized")
        return False
    print(
        f"--skip-failed: finalizing without these {len(failed)} shards; meta records them as excluded", file=sys.stderr
    )
    log(f"{len(failed)} shards failed; finalizing without them (--skip-failed)")
    return True


def _where(out: Path, split: dict) -> str:
    if "files" in split:  # --no-concat
        n = len(split["files"])
        return f"{n:,} file{'s' if n != 1 else ''} listed in {out / 'meta.json'}"
    return str(out / split["file"])


def _print_summary(meta: dict, out: Path, seconds: float, phases: str) -> None:
    for split, s in meta["splits"].items():
        skipped = sum(s["skipped"].values())
        why = ", ".join(f"{k} {v}" for k, v in s["skipped"].items())
        print(
            f"{split}: {s['tokens']:,} tokens, {s['documents']:,} documents, {skipped:,} lines "
            f"skipped{' (' + why + ')' if why else ''} -> {_where(out, s)}"
        )
    if meta["excluded"]:
        print(
            f"EXCLUDED {len(meta['excluded'])} failed shards (recorded in meta['excluded']): "
            f"{', '.join(meta['excluded'])}"
        )
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    print(phases)
    print(
        f"done in {seconds:.1f}s ({tokens / seconds / 1e6:.2f}M tokens/s overall); meta: {out / 'meta.pkl'}. "
        f"Next: tokpipe verify {out}"
    )


def run(
    manifest_path: str | os.PathLike,
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    opts: RunOptions = RunOptions(),
) -> RunSummary:
    clock = Timeline(time.monotonic())
    manifest = load_manifest(manifest_path)
    info = load_tokenizer_info(tokenizer, opts.eos, opts.bos_token, opts.tokenizer_revision)
    check_options(opts, info, tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_out(out)
    try:
        record_run(out, manifest, info, opts)
        write_manifest(manifest, out / "manifest.json")  # what `verify --sample` and `status` read
        manifest = replace(manifest, source=out / "manifest.json")  # from here on, its shards stream from OUT's copy
        log = RunLog(out)
        meta = load_meta_json(out)
        if meta is not None and meta.get("manifest_sha256") == manifest.fingerprint and not meta.get("excluded"):
            print(
                f"{out} is already finished ({out / 'meta.json'}); nothing to do. Check it with: tokpipe verify {out}"
            )
            return RunSummary(True, {}, meta, 0, time.monotonic() - clock.start)
        # Before the plan: it may find placed shards whose place is not kept, to tokenize again.
        assembler = Assembler(out, manifest, np.dtype(info.dtype).itemsize, opts)
        if assembler.lost:
            what = f"{len(assembler.lost)} shards (e.g. {assembler.lost[0]})"
            print(f"the split files changed before {what} whose own files were already removed: tokenizing them again")
            log(f"tokenizing again: {', '.join(assembler.lost)}")
        plan = _plan(out, manifest, info, log, manifest_path)
        failed, resumed = {}, []
        try:
            if plan.done < plan.shards:
                failed, resumed = _tokenize(manifest, out, info, opts, assembler, log, plan, clock)
            redone = sum(r.redone_tokens for r in resumed)
            if not _report_failures(out, failed, resumed, opts, log):
                return RunSummary(False, failed, None, redone, time.monotonic() - clock.start)
            meta = finalize(out, manifest, info, opts, failed, assembler)
            seconds = time.monotonic() - clock.start
            phases = clock.report(time.monotonic(), meta)
            _print_summary(meta, out, seconds, phases)
            log(phases)
            log(f"finished: {sum(s['tokens'] for s in meta['splits'].values()):,} tokens in {seconds:.1f}s")
            return RunSummary(True, failed, meta, redone, seconds)
        finally:
            ray.shutdown()  # after the summary: the run is done before Ray's stop (~1.3 s here) is paid
    finally:
        lock.close()

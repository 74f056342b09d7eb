"""Run a manifest on Ray: one task per unfinished shard, retries, stall detection, progress, then finalize.

Ray does the scheduling and the retrying of tasks whose worker or node died (`max_retries`); a retry
resumes the shard from its checkpoint. What Ray cannot see is a task that is alive but stuck: each
worker reports progress to a small actor, and the driver cancels a task that reported nothing for
`stall_timeout` seconds (the worker dumps its stacks to OUT/logs first) and submits it again.
"""

from __future__ import annotations

import faulthandler
import fcntl
import json
import logging
import os
import stat
import sys
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from tokpipe.errors import SourceError, UserError
from tokpipe.finalize import COPY_BATCH_BYTES, Assembler, Part, finalize, load_meta_json, place
from tokpipe.manifest import Manifest, Shard, load_manifest, write_manifest
from tokpipe.durability import write_json_atomic
from tokpipe.shard import WORKER_MEMORY, Checkpoint, EncodeSpec, ShardFiles, ShardResult, tokenize_shard
from tokpipe.source import read_batches
from tokpipe.status import duration
from tokpipe.tokenizer import TokenizerInfo, choose_backend, load_tokenizer_info

RUN_FORMAT = 1
SAMPLE_BYTES = 256 << 10  # of input per split, to prove the fast backend exact on this data (with HARD_CASES)
REPORT_EVERY = 1.0  # seconds between a worker's progress reports
POLL_EVERY = 0.5
# Kept in run.json beside the identity but never compared: where this run found its tokenizer (a
# folder that moved holds the same tokenizer; its sha256 is in the identity) and the options it was
# given. `tokpipe status` prints the resume command from them, `tokpipe inspect` decodes with that tokenizer.
LAST_RUN_KEYS = ("tokenizer_path", "options")


@dataclass(frozen=True)
class RunOptions:
    workers: int | None = None  # concurrent shard tasks; default: the CPUs Ray sees
    address: str | None = None  # Ray cluster to join; None: RAY_ADDRESS, else an embedded local Ray
    backend: str = "auto"
    text_field: str = "text"
    eos: str | None = None
    checkpoint_interval: float = 30.0
    stall_timeout: float = 600.0
    max_retries: int = 3
    skip_failed: bool = False  # finalize without shards that failed, recording them in meta as excluded
    worker_memory: int = WORKER_MEMORY >> 20  # MiB of RSS a worker keeps under (shard.MemoryGuard)
    bos: bool = False  # BOS before every document
    bos_token: str | None = None  # default: the tokenizer's bos_token
    no_eos: bool = False  # no EOS after documents (with bos: documents start with BOS instead)
    val_fraction: float = 0.0  # share of train documents held out for val.bin, by a hash of their text

    def encode_spec(self, info: TokenizerInfo, backend: str, read_ahead: bool = False) -> EncodeSpec:
        """What every worker of this run needs to write its shards' bytes."""
        return EncodeSpec(
            info.path, backend, None if self.no_eos else info.eos_id, info.vocab_size, info.dtype, self.text_field,
            checkpoint_interval=self.checkpoint_interval, read_ahead=read_ahead, memory_limit=self.worker_memory << 20,
            bos_id=info.bos_id if self.bos else None, val_fraction=self.val_fraction,
        )

    @property
    def layout(self) -> dict:
        """How documents are written, as finalize records it in meta."""
        return {"bos": self.bos, "eos": not self.no_eos, "val_fraction": self.val_fraction}


@dataclass
class RunSummary:
    finished: bool
    failed: dict[str, str]  # shard relpath -> last error
    meta: dict | None
    redone_tokens: int
    seconds: float


# What a run.json written before these entries existed meant by their absence.
IDENTITY_DEFAULTS = {"delimiters": {"bos": False, "eos": True}, "val_fraction": 0.0}


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
        "delimiters": {"bos": opts.bos, "eos": not opts.no_eos},
        "val_fraction": opts.val_fraction,
    }


def check_layout(opts: RunOptions, info: TokenizerInfo, tokenizer) -> None:
    """Refuse documents no trainer could tell apart, a BOS the tokenizer does not have, a share that is no share."""
    if opts.no_eos and not opts.bos:
        raise UserError("--no-eos without --bos would write documents back to back with nothing between them: add --bos, or drop --no-eos")
    if opts.bos_token and not opts.bos:
        raise UserError("--bos-token names the BOS that --bos places: add --bos")
    if opts.bos and info.bos_id is None:
        raise UserError(f"{tokenizer} names no bos_token (tokenizer_config.json): pass --bos-token TOKEN (e.g. --bos-token '<|endoftext|>')")
    if not 0 <= opts.val_fraction < 1:
        raise UserError(f"--val-fraction must be at least 0 and below 1, got {opts.val_fraction}")


class RunLog:
    """OUT/logs/run.log: the effective configuration, shard failures, stalls, the outcome."""

    def __init__(self, out: Path):
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self._f = open(out / "logs" / "run.log", "a")

    def __call__(self, message: str) -> None:
        self._f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
        self._f.flush()


def _lock_out(out: Path):
    """Hold OUT for this run. The kernel drops the lock when the process dies, so a killed run never blocks."""
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        raise UserError(f"{out} is in use by another tokpipe run ({holder}); wait for it to finish or stop it") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {os.uname().nodename}")
    f.flush()
    return f


def record_run(out: Path, manifest: Manifest, info: TokenizerInfo, opts: RunOptions) -> None:
    """Refuse an OUT that holds a run with other inputs (a manifest that only gained shards is an
    append); then (re)write run.json for this run."""
    path = out / "run.json"
    identity = run_identity(manifest, info, opts)
    if path.exists():
        previous = {**IDENTITY_DEFAULTS, **{k: v for k, v in json.loads(path.read_text()).items() if k not in LAST_RUN_KEYS}}
        differs = [k for k in sorted(set(identity) | set(previous)) if identity.get(k) != previous.get(k)]
        if differs == ["manifest_sha256"] and (out / "manifest.json").exists():
            _check_append(out, load_manifest(out / "manifest.json"), manifest)
        elif differs:
            what = "; ".join(f"{k}: was {previous.get(k)!r}, now {identity.get(k)!r}" for k in differs)
            raise UserError(f"{out} holds a run with other inputs ({what}); use a new --out, or the original inputs to resume")
    defaults = asdict(RunOptions())
    options = {k: v for k, v in asdict(opts).items() if v != defaults[k]}
    write_json_atomic(path, {**identity, "tokenizer_path": info.path, "options": options})


def _check_append(out: Path, old_manifest: Manifest, manifest: Manifest) -> None:
    """Every shard of the old manifest must be in the new one, the same size. Both list a split's shards
    in path order (DESIGN), so one merged pass per split compares them, holding neither manifest."""
    changed = []
    for split in old_manifest.counts:
        new = manifest.shards(split)
        candidate = next(new, None)
        for shard in old_manifest.shards(split):
            while candidate is not None and candidate.relpath < shard.relpath:
                candidate = next(new, None)
            if candidate is None or candidate.relpath != shard.relpath or candidate.size != shard.size:
                changed.append(f"{split}/{shard.relpath}")
    if changed:
        raise UserError(
            f"{out} was started from another manifest: {len(changed)} of its shards are changed or gone in this one "
            f"(e.g. {changed[0]}); use a new --out, or the original manifest to resume"
        )
    gained = sum(manifest.counts.values()) - sum(old_manifest.counts.values())
    print(f"the manifest gained {gained} shards since {out} was started: appending them (finished shards are kept)")
    (out / "meta.json").unlink(missing_ok=True)  # OUT is unfinished again until the new finalize


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


@ray.remote(num_cpus=0, max_restarts=-1)
class ProgressBoard:
    """Where workers leave progress; the driver reads it twice a second. No per-batch round trips.

    It lives on the driver's node, so losing a worker node loses no progress; should it die anyway,
    Ray restarts it, and only the progress display and stall clocks start over.
    """

    def __init__(self):
        self.totals = [0, 0, 0]  # file bytes, documents, tokens
        self.beats: dict[str, float] = {}

    def report(self, key: str, file_bytes: int, documents: int, tokens: int, finished: bool = False) -> None:
        self.totals[0] += file_bytes
        self.totals[1] += documents
        self.totals[2] += tokens
        if finished:  # only running shards need a heartbeat: beats, and every snapshot, stay O(workers)
            self.beats.pop(key, None)
        else:
            self.beats[key] = time.time()

    def snapshot(self) -> tuple[list[int], dict[str, float]]:
        return self.totals, self.beats


def shard_task(shard: Shard, out: str, spec: EncodeSpec, board, stall_timeout: float) -> ShardResult:
    """The Ray task around tokenize_shard: progress reports, and a stack dump if it stops moving."""
    tag = f"{shard.split}/{shard.key}"
    # `ps` shows which shard each worker is on (Ray sets the title back to ray::IDLE after the task).
    # Ray's own setter, as it uses for task names; the task name itself is the same for every shard.
    getattr(ray._raylet, "setproctitle", lambda title: None)(f"ray::tokpipe {tag}")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker per core: no thread pool inside each
    dump_path = Path(out) / "logs" / f"stall-{shard.split}-{shard.key}.txt"
    pending = [0, 0, 0]
    last_report = time.monotonic()

    with open(dump_path, "a") as dump:

        def arm_dump() -> None:
            # Fires in a C watchdog thread, so it works even when Python is stuck holding the GIL.
            faulthandler.dump_traceback_later(max(stall_timeout * 0.8, 0.5), file=dump)

        def on_batch(file_bytes: int, documents: int, tokens: int) -> None:
            nonlocal last_report
            arm_dump()
            pending[0] += file_bytes
            pending[1] += documents
            pending[2] += tokens
            if time.monotonic() - last_report >= REPORT_EVERY:
                board.report.remote(tag, *pending)
                pending[:] = [0, 0, 0]
                last_report = time.monotonic()

        board.report.remote(tag, 0, 0, 0)
        arm_dump()
        try:
            result = tokenize_shard(shard, out, spec, on_batch)
        finally:
            faulthandler.cancel_dump_traceback_later()
            board.report.remote(tag, *pending, finished=True)
    if dump_path.stat().st_size == 0:
        dump_path.unlink()
    return result


class Progress:
    """A tqdm bar on a terminal; a plain line every `every` seconds otherwise (CI, nohup, Slurm logs).

    Also keeps OUT/logs/progress.json current, so `tokpipe status` can tell rate and ETA from files alone.
    """

    def __init__(self, out: Path, total_bytes: int, done_bytes: int, shards: int, every: float = 30.0):
        self.out, self.total, self.shards = out, total_bytes, shards
        self.start_bytes, self.t0, self.started_at, self.every = done_bytes, time.monotonic(), time.time(), every
        self.last_line = self.last_file = 0.0
        self.read_this_run = 0
        self.bar = None
        if sys.stderr.isatty():
            # Shard counts (and failures) before the rates, and no label: in 80 columns tqdm cuts the
            # line's end, and that must be the least important part.
            self.bar = tqdm(
                total=total_bytes,
                initial=done_bytes,
                unit="iB",
                unit_scale=True,
                unit_divisor=1024,
                dynamic_ncols=True,
                bar_format="{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}iB, ETA {remaining}{postfix}",
            )

    def update(self, file_bytes: int, documents: int, tokens: int, done: int, running: int, failed: int, final: bool = False) -> None:
        now = time.monotonic()
        elapsed = max(now - self.t0, 1e-9)
        # Workers report the compressed bytes they have read, and a shard's last report may miss the
        # file's tail (zstd's frame end, the reports still in flight): a finished run has read it all.
        read = self.total if final and done == self.shards else self.start_bytes + file_bytes
        self.read_this_run = read - self.start_bytes
        rate = file_bytes / elapsed
        eta = (self.total - read) / rate if rate > 0 else None
        failures = f" ({failed} FAILED)" if failed else ""
        rates = f"{documents:,} docs, {tokens / elapsed / 1e6:.2f}M tok/s"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{done}/{self.shards} shards{failures}, {rates}", refresh=False)
            self.bar.update(read - self.bar.n)
        elif final or now - self.last_line >= self.every:
            self.last_line = now
            pct = 100 * read / self.total if self.total else 100.0
            when = f" in {duration(elapsed)}" if final else f", ETA {duration(eta)}" if eta is not None else ", ETA unknown"
            print(
                f"[tokpipe] {pct:5.1f}% of {self.total / 2**20:,.1f} MiB read{when} | {done}/{self.shards} shards done{failures}, {running} running, {rates}",
                file=sys.stderr,
                flush=True,
            )
        if final or now - self.last_file >= 2.0:
            self.last_file = now
            write_json_atomic(
                self.out / "logs" / "progress.json",
                {
                    "pid": os.getpid(),
                    "started_at": self.started_at,
                    "updated_at": time.time(),
                    "bytes_read": read,
                    "bytes_total": self.total,
                    "documents": documents,
                    "tokens": tokens,
                    "tokens_per_s": tokens / elapsed,
                    "eta_s": eta,
                    "shards": {"total": self.shards, "done": done, "running": running, "failed": failed},
                },
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _start_ray(opts: RunOptions) -> tuple[int, bool]:
    """Join the cluster, or start an embedded local Ray; returns (shard tasks to run at once, read ahead).

    With at least twice as many CPUs as tasks, a task takes 2 and reads its next batch on the second
    while it encodes (EncodeSpec.read_ahead); Ray keeps that core free for it.
    """
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
        ray.init(address="local", num_cpus=workers * (2 if read_ahead else 1), include_dashboard=False, object_store_memory=128 << 20, **common)
    return workers, read_ahead


def _read_board(board, totals: list[int], beats: dict[str, float]) -> tuple[list[int], dict[str, float]]:
    try:
        return ray.get(board.snapshot.remote(), timeout=30)
    except ray.exceptions.RayError:  # board restarting: keep the last view; stall clocks run from submission
        return totals, beats


def _describe_failure(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def _finished(out: Path, shard: Shard) -> bool:
    ckpt = Checkpoint.load(ShardFiles.of(out, shard).checkpoint)
    return ckpt is not None and ckpt.done


def copy_task(out: str, parts: list[Part], itemsize: int) -> tuple[str, list[dict]]:
    """The Ray task around finalize.place; says which node it ran on (on a cluster, every node copies)."""
    return ray.get_runtime_context().get_node_id(), place(out, parts, itemsize)


class Copies:
    """Copies that assemble the split files while shards still tokenize; what goes where is the Assembler's.

    On a cluster they are Ray tasks spread over the nodes, so every node copies (OUT is on storage all
    of them see). On one machine they are threads of the driver: the copy and the fsync run in the
    kernel without the GIL, and no worker process has to start for them (two extra workers cost
    ~1 s of tokenizing on 2 cores, measured). Parts wait in a queue while every slot is busy, so the
    next copy takes all of them: with thousands of tiny shards, one copy and one fsync cover many.
    """

    def __init__(self, assembler: Assembler, out: Path, itemsize: int, nodes: int):
        self.assembler, self.out, self.itemsize = assembler, out, itemsize
        self.remote = nodes > 1
        self.slots = 2 * nodes
        if self.remote:
            self.task = ray.remote(num_cpus=0, max_retries=3, scheduling_strategy="SPREAD", name="tokpipe copy")(copy_task)
        else:
            self.threads = ThreadPoolExecutor(self.slots)
        self.queue: deque[Part] = deque()
        self.running: dict = {}  # ObjectRef or Future -> its parts
        self.bytes_by_node: Counter = Counter()

    def feed(self, excluded: frozenset[str] = frozenset()) -> None:
        self.queue.extend(self.assembler.ready(excluded))
        while self.queue and len(self.running) < self.slots:
            batch, size, stem = [], 0, self.queue[0].stem
            while self.queue and self.queue[0].stem == stem and size < COPY_BATCH_BYTES:
                batch.append(self.queue.popleft())
                size += batch[-1].record["tokens"] * self.itemsize
            args = (str(self.out), batch, self.itemsize)
            self.running[self.task.remote(*args) if self.remote else self.threads.submit(copy_task, *args)] = batch

    def collect(self, block: bool = False) -> None:
        """List the copies that are done (with `block`, after waiting for one), then start the next."""
        if not self.running:
            return
        if self.remote:
            done, _ = ray.wait(list(self.running), num_returns=1 if block else len(self.running), timeout=None if block else 0)
        else:
            done = wait(self.running, return_when=FIRST_COMPLETED)[0] if block else [f for f in self.running if f.done()]
        for handle in done:
            parts = self.running.pop(handle)
            node, records = ray.get(handle) if self.remote else handle.result()
            self.assembler.placed(parts, records)
            self.bytes_by_node[node] += sum(r["tokens"] for r in records) * self.itemsize
        self.feed()

    def drain(self, excluded: frozenset[str] = frozenset()) -> None:
        """Copy everything whose place is known (with `excluded` left out) and wait for it."""
        self.feed(excluded)
        while self.running:
            self.collect(block=True)
        if not self.remote:
            self.threads.shutdown()


def _schedule(manifest: Manifest, out: Path, spec: EncodeSpec, opts: RunOptions, workers: int, progress: Progress, copies: Copies, log: RunLog, done_before: int) -> tuple[dict[str, str], list[ShardResult]]:
    """Run every unfinished shard to completion or failure, copying finished ones into place as their
    offsets become known; returns (failures, results of shards that resumed).

    Shards are taken from the manifest as workers free up (the driver holds the running ones, never the
    list), checkpoints read again at that moment: a shard a leftover worker finished meanwhile is skipped.
    """
    # One task name for all: the driver keeps state per distinct name (~1.8 MiB per 1k names, measured).
    task = ray.remote(num_cpus=2 if spec.read_ahead else 1, max_retries=opts.max_retries, retry_exceptions=False, name="tokpipe shard")(shard_task)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    board = ProgressBoard.options(scheduling_strategy=here).remote()
    totals, beats = [0, 0, 0], {}
    unfinished = (shard for shard in manifest.shards() if not _finished(out, shard))
    stalled: deque = deque()  # (shard, stall retries) cancelled for a stall, to submit again
    running: dict = {}  # ObjectRef -> (shard, stall retries, submitted at)
    failed: dict[str, str] = {}
    done, resumed = done_before, []
    last_look = 0.0  # when progress and stalls were last looked at
    copies.feed()  # what earlier runs finished and did not place
    while True:
        while len(running) < workers:
            if stalled:
                shard, stalls = stalled.popleft()
            elif (shard := next(unfinished, None)) is not None:
                stalls = 0
            else:
                break
            ref = task.remote(shard, str(out), spec, board, opts.stall_timeout)
            running[ref] = (shard, stalls, time.time())
        if not running:
            break
        # Wake on the first finished task (small shards finish in milliseconds), then take all that are done.
        ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_EVERY)
        if ready:
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
        copies.collect()
        for ref in ready:
            shard, _, _ = running.pop(ref)
            try:
                result: ShardResult = ray.get(ref)
            except (ray.exceptions.RayError, OSError) as e:
                failed[shard.relpath] = _describe_failure(e)
                log(f"shard {shard.relpath} FAILED: {failed[shard.relpath]}")
                continue
            done += 1
            copies.assembler.done(shard, result.checkpoint)
            if result.resumed_tokens or result.redone_tokens:
                resumed.append(result)
                log(f"shard {shard.relpath}: resumed at {result.resumed_tokens:,} tokens, redid {result.redone_tokens:,}")
            if result.encoder_resets:
                log(f"shard {shard.relpath}: encoder cache dropped {result.encoder_resets} times to stay under {spec.memory_limit >> 20} MiB")
        copies.feed()
        now = time.time()
        if now - last_look < POLL_EVERY:
            continue
        last_look = now
        totals, beats = _read_board(board, totals, beats)
        progress.update(*totals, done=done, running=len(running) + len(stalled), failed=len(failed))
        for ref, (shard, stalls, submitted) in list(running.items()):
            quiet = now - max(beats.get(f"{shard.split}/{shard.key}", 0.0), submitted)
            if quiet < opts.stall_timeout:
                continue
            del running[ref]
            ray.cancel(ref, force=True)
            dump = out / "logs" / f"stall-{shard.split}-{shard.key}.txt"
            log(f"shard {shard.relpath}: no progress for {quiet:.0f}s, cancelled (stack dump: {dump})")
            if stalls < opts.max_retries:
                stalled.append((shard, stalls + 1))
            else:
                failed[shard.relpath] = f"stalled {stalls + 1} times (no progress for {opts.stall_timeout:.0f}s); stacks in {dump}"
    totals, _ = _read_board(board, totals, beats)
    progress.update(*totals, done=done, running=0, failed=len(failed), final=True)
    return failed, resumed


@dataclass
class Timeline:
    """Where a run's time went, for run.log and the summary: plan (inputs, checkpoints, Ray, backend
    check), tokenize (until the last shard is done), finalize (from then until meta.json is written)."""

    start: float
    planned: float | None = None
    tokenized: float | None = None
    read_bytes: int = 0  # of input, by this run's workers
    assembled_bytes: int = 0  # of tokens, copied into place while shards tokenized

    def report(self, finished: float, meta: dict) -> str:
        planned = self.planned or finished
        tokenized = self.tokenized or planned
        token_bytes = sum(s["tokens"] for s in meta["splits"].values()) * np.dtype(meta["dtype"]).itemsize
        tokenize_s, finalize_s = tokenized - planned, finished - tokenized
        return (
            f"phases: plan {planned - self.start:.1f}s | tokenize {tokenize_s:.1f}s, {self.read_bytes / 1e6:,.1f} MB of input read"
            f" ({self.read_bytes / 1e6 / max(tokenize_s, 1e-9):.1f} MB/s) | finalize {finalize_s:.2f}s ({100 * finalize_s / max(tokenize_s, 1e-9):.0f}% of tokenize):"
            f" {token_bytes / 1e6:,.1f} MB of tokens, {self.assembled_bytes / 1e6:,.1f} MB of them assembled while tokenizing,"
            f" {(token_bytes - self.assembled_bytes) / 1e6:,.1f} MB after ({(token_bytes - self.assembled_bytes) / 1e9 / max(finalize_s, 1e-9):.2f} GB/s)"
        )


def _tokenize(manifest: Manifest, out: Path, info: TokenizerInfo, opts: RunOptions, assembler: Assembler, log: RunLog, plan: Plan, clock: Timeline) -> tuple[dict[str, str], list[ShardResult]]:
    """Tokenize every unfinished shard on Ray, assembling the split files as shards finish; returns
    (failures, shards that resumed). Ray is up when it returns: what finalize has left is the last copies."""
    with ThreadPoolExecutor(1) as pool:
        # The backend's self-check and Ray's start-up take seconds each: do them at the same time.
        choice = pool.submit(choose_backend, opts.backend, info.path, _sample_texts(manifest, opts.text_field))
        workers, read_ahead = _start_ray(opts)
        backend, why = choice.result()
    print(f"backend {backend}: {why}")
    log(f"backend {backend}: {why}")
    where = f"cluster {ray.get_runtime_context().gcs_address}" if opts.address or os.environ.get("RAY_ADDRESS") else "embedded local instance"
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    print(f"ray: {where}, {workers} workers" + (" (2 CPUs each: reading overlaps encoding)" if read_ahead else "") + (f" on {nodes} nodes" if nodes > 1 else ""))
    spec = opts.encode_spec(info, backend, read_ahead)
    progress = Progress(out, manifest.size, plan.done_bytes, plan.shards)
    copies = Copies(assembler, out, np.dtype(info.dtype).itemsize, nodes)
    clock.planned = time.monotonic()
    try:
        failed, resumed = _schedule(manifest, out, spec, opts, workers, progress, copies, log, plan.done)
    finally:
        progress.close()
    clock.tokenized = time.monotonic()
    clock.read_bytes = progress.read_this_run
    clock.assembled_bytes = sum(copies.bytes_by_node.values())
    # Failed shards block their split's assembly; with --skip-failed it goes on without them.
    copies.drain(frozenset(failed) if opts.skip_failed else frozenset())
    if nodes > 1:
        log("assembled by node: " + ", ".join(f"{node[:8]} {size / 1e6:,.1f} MB" for node, size in copies.bytes_by_node.most_common()))
    return failed, resumed


def _print_summary(meta: dict, out: Path, seconds: float, phases: str) -> None:
    for split, s in meta["splits"].items():
        skipped = sum(s["skipped"].values())
        why = ", ".join(f"{k} {v}" for k, v in s["skipped"].items())
        print(f"{split}: {s['tokens']:,} tokens, {s['documents']:,} documents, {skipped:,} lines skipped{' (' + why + ')' if why else ''} -> {out / s['file']}")
    if meta["excluded"]:
        print(f"EXCLUDED {len(meta['excluded'])} failed shards (recorded in meta['excluded']): {', '.join(meta['excluded'])}")
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    print(phases)
    print(f"done in {seconds:.1f}s ({tokens / seconds / 1e6:.2f}M tokens/s overall); meta: {out / 'meta.pkl'}. Next: tokpipe verify {out}")


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
        ckpt = Checkpoint.load(ShardFiles.of(out, shard).checkpoint)
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
    log(f"run: manifest {manifest_path} ({manifest.fingerprint[:16]}), tokenizer {info.id}, {shards} shards: {done} done, {partial} partial")
    return Plan(shards, done, partial, done_bytes)


def _report_failures(out: Path, failed: dict[str, str], resumed: list[ShardResult], opts: RunOptions, log: RunLog) -> bool:
    """Say what resumed and what failed; returns whether to finalize."""
    if resumed:
        kept, redone = sum(r.resumed_tokens for r in resumed), sum(r.redone_tokens for r in resumed)
        print(f"resumed {len(resumed)} shards from their checkpoints: {kept:,} tokens kept, {redone:,} tokens written after the last checkpoints redone")
    failures_file = out / "logs" / "failed.json"
    if not failed:
        failures_file.unlink(missing_ok=True)
        return True
    write_json_atomic(failures_file, failed)
    for relpath, error in failed.items():
        print(f"FAILED {relpath}: {error}", file=sys.stderr)
    if not opts.skip_failed:
        log(f"{len(failed)} shards failed; not finalized")
        return False
    print(f"--skip-failed: finalizing without these {len(failed)} shards; meta records them as excluded", file=sys.stderr)
    log(f"{len(failed)} shards failed; finalizing without them (--skip-failed)")
    return True


def run(manifest_path: str | os.PathLike, tokenizer: str | os.PathLike, out: str | os.PathLike, opts: RunOptions = RunOptions()) -> RunSummary:
    clock = Timeline(time.monotonic())
    manifest = load_manifest(manifest_path)
    info = load_tokenizer_info(tokenizer, opts.eos, opts.bos_token)
    check_layout(opts, info, tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock_out(out)
    try:
        record_run(out, manifest, info, opts)
        write_manifest(manifest, out / "manifest.json")  # what `verify --sample` and `status` read
        manifest = replace(manifest, source=out / "manifest.json")  # from here on, its shards stream from OUT's copy
        log = RunLog(out)
        meta = load_meta_json(out)
        if meta is not None and meta.get("manifest_sha256") == manifest.fingerprint and not meta.get("excluded"):
            print(f"{out} is already finished ({out / 'meta.json'}); nothing to do. Check it with: tokpipe verify {out}")
            return RunSummary(True, {}, meta, 0, time.monotonic() - clock.start)
        plan = _plan(out, manifest, info, log, manifest_path)
        assembler = Assembler(out, manifest, np.dtype(info.dtype).itemsize, opts.val_fraction)
        failed, resumed = {}, []
        try:
            if plan.done < plan.shards:
                failed, resumed = _tokenize(manifest, out, info, opts, assembler, log, plan, clock)
            redone = sum(r.redone_tokens for r in resumed)
            if not _report_failures(out, failed, resumed, opts, log):
                return RunSummary(False, failed, None, redone, time.monotonic() - clock.start)
            meta = finalize(out, manifest, info, opts.text_field, failed, assembler, **opts.layout)
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

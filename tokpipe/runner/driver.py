"""`tokpipe run`: the driver. Plan (inputs, identity, checkpoints), tokenize every unfinished shard on
Ray while finished ones are copied into their split files, report failures, finalize, summarize.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokpipe.durability import write_json_atomic
from tokpipe.errors import RayUnavailable, UserError, terminate_on_sigterm, terminated
from tokpipe.fmt import plural
from tokpipe.inputs.encoders import choose_backend, likely_backend
from tokpipe.inputs.manifest import Manifest, load_manifest
from tokpipe.inputs.objects import check_reachable, manifest_here
from tokpipe.inputs.tokenizer import TokenizerInfo, load_tokenizer_info
from tokpipe.layout.files import FAILED, RAY_LOG, Layout
from tokpipe.layout.meta import Meta
from tokpipe.layout.run import STOPPED, finished_with
from tokpipe.layout.series import Series
from tokpipe.options import RunOptions
from tokpipe.runner.cluster import Cluster
from tokpipe.runner.events import Finished, Listener, Said, silent
from tokpipe.runner.identity import check_options, encode_spec
from tokpipe.runner.local import Helpers, Tally, describe_failure, tokenize_while
from tokpipe.runner.progress import Progress, RunLog, Timeline
from tokpipe.runner.sample import SAMPLE_LINE_BYTES, count_groups, sample_texts
from tokpipe.runner.storage import Folder, Prefix, storage_of

# Ray's start takes a small machine's core for seconds (2 cores here: 5-8 s until its workers are busy; 424 MB of
# distinct text took 12.8 s with it, 8.1 without; 800 MB 16.8 and 13.3), and on one machine it makes no run
# faster: what it brings is a long run's safety (stalled shards cancelled, crashed workers retried, memory watched).
# A run that the driver and a helper a core end within RAY_PAYS seconds, over by the time Ray would be up, or whose
# work Ray's own start (RAY_START_CPU: its GCS, raylet, agents and monitors took 4.7 CPU-s here) would add over a
# fifth to, is tokenized here and Ray is never started. A longer one starts Ray at once if its input says so, or
# once its rate here does (after MEASURED seconds: past the helpers' start, ~1 s); the cores tokenize meanwhile. A
# run the driver alone ends within LOCAL_SECONDS has no helpers either.
RAY_PAYS = 8.0
RAY_START_CPU = 5.0
MEASURED = 3.0
LOCAL_SECONDS = 1.5
# A core's work before any is measured, at its fastest (a wrong guess here costs Ray's start MEASURED seconds late):
# compressed input a core tokenizes a second (3.5-16 MB/s here, by corpus), and a shard's own cost, as input bytes
# (its checkpoint, lock and place: ~0.3 ms a two-document shard).
CORE_BYTES = 16 << 20
SHARD_BYTES = 5 << 10
LOOK_EVERY = 0.05  # seconds: how often the driver, tokenizing while Ray starts, asks whether Ray took over


@dataclass
class RunSummary:
    """What a run did, as a value: `tokpipe run` renders it (cli.summary_lines), a library caller reads it."""

    finished: bool
    failed: dict[str, str]  # shard relpath -> last error
    meta: dict | None
    redone_tokens: int
    seconds: float
    out: Path | str | None = None  # set when this call finalized OUT (a folder, a prefix's URL); then the fields below
    phases: str = ""  # where the time went (Timeline.report)
    lacking: list[tuple[str, int, int]] = field(default_factory=list)  # shards with no --text-field on most lines
    text_field: str = "text"


@dataclass(frozen=True)
class Standing:
    """Where the shards stand before this run starts."""

    shards: int
    done: int
    partial: int
    done_bytes: int  # of input already covered by checkpoints


@dataclass(frozen=True)
class _Run:
    """What the steps of one run share: its inputs, options, and where it tells and times what it does."""

    manifest: Manifest  # OUT's copy, which its shards stream from
    out: Folder | Prefix  # where OUT lives (runner/storage.py)
    info: TokenizerInfo
    opts: RunOptions
    log: RunLog
    clock: Timeline
    cluster: Cluster
    tell: Listener  # what the run says as it goes (events.Said)
    handover: _Handover
    helpers: Helpers | None

    def say(self, text: str, logged: str | None = None) -> None:
        """Tell it, and log it (or `logged`, its longer form)."""
        self.tell(Said(text))
        self.log(logged or text)


@dataclass
class _Handover:
    """The driver (and its helpers) tokenize until Ray can take over, or to the end if the run is short (RAY_PAYS):
    `driver_goes_on` is asked between batches, `helpers` whenever the driver hands them shards."""

    cluster: Cluster
    ray_only: bool
    seconds: float  # one core's, for the shards left (_core_seconds)
    stall_timeout: float  # --stall-timeout
    progress: Progress | None = None  # the run's, once it tokenizes
    since: float = 0.0  # when the run began to tokenize
    looked: float = float("-inf")  # when Ray was last asked whether it is working
    goes_on: bool = True  # what that ask said
    moved: tuple[tuple[int, int], float] = ((-1, -1), 0.0)  # (bytes read, shards done) here, and when they last grew

    def driver_goes_on(self) -> bool:
        """Start Ray if the run turns out long; then whether the driver goes on: while there is no Ray ready to
        take over. Asked of Ray at most every LOOK_EVERY: once up, each ask is a ray.wait, ~1 s of the driver's CPU
        over the 6,000 two-document shards it tokenized while Ray's workers loaded their encoders (py-spy)."""
        if self.cluster.address or self.ray_only:
            return False
        now = time.monotonic()
        if not self.cluster.started:
            # A helper stuck in a shard holds the run no longer than --stall-timeout: Ray starts, the helpers are told
            # to stop, the stuck one is killed (STOP_WAIT), and its shard goes to Ray's workers, watched for stalls.
            if (amount := (self.progress.read_this_run, self.progress.done)) != self.moved[0]:
                self.moved = (amount, now)
            long = now - self.since > MEASURED and _ray_pays(self._left(now) * self.cluster.fit[0], self.cluster.fit[0])
            if long or now - self.moved[1] > self.stall_timeout:
                self.cluster.start()
            return True
        if self.goes_on and now - self.looked >= LOOK_EVERY:
            self.looked, self.goes_on = now, not self.cluster.working()
        return self.goes_on

    def helpers(self) -> int:
        """Processes beside the driver now: one a core but the driver's, but for the core Ray's start takes once
        started (on 2 cores a helper beside it made the run slower: 8.9-12.1 s against 7.4-10.5 s on 241 MB, its
        encoder's load and Ray's start contending with the driver); one a second of the run's work at most (its
        start is ~1 s of a core), none for a run the driver alone ends soon."""
        if self.cluster.address or self.ray_only or self.seconds <= LOCAL_SECONDS:
            return 0
        return min(self.cluster.fit[0] - (2 if self.cluster.started else 1), int(self.seconds))

    def _left(self, now: float) -> float:
        """The seconds the run has left at the rate it has gone here: its work (_core_seconds) left over done."""
        p = self.progress
        done = _core_seconds(p.read_this_run, p.done - p.done_before)
        left = _core_seconds(p.total - p.start_bytes - p.read_this_run, p.shards - p.done)
        return (now - self.since) * left / done if done else float("inf")


def _core_seconds(size: int, shards: int) -> float:
    """What one core takes to tokenize `shards` shards of `size` bytes of input."""
    return (size + SHARD_BYTES * shards) / CORE_BYTES


def _ray_pays(core_seconds: float, cores: int) -> bool:
    """Whether work of `core_seconds` on `cores` is long enough for Ray's start: over RAY_PAYS seconds on every core,
    and over five times what Ray's start costs."""
    return core_seconds > max(RAY_PAYS * cores, 5 * RAY_START_CPU)


def _plan(run: _Run, manifest_path) -> Standing:
    manifest, info, log = run.manifest, run.info, run.log
    shards, done, partial, done_bytes = sum(manifest.counts.values()), 0, 0, 0
    for shard in manifest.shards():  # one checkpoint in memory at a time: manifests may hold 100,000s of shards
        ckpt = run.out.checkpoint(shard)
        done += ckpt is not None and ckpt.done
        partial += ckpt is not None and not ckpt.done
        done_bytes += shard.size if ckpt and ckpt.done else (ckpt.source_pos if ckpt else 0)
    eos = f"eos {info.eos_token!r} = {info.eos_id}"
    if run.opts.bos:  # what a trainer's config must match: the ids around every document, as placed
        eos = f"bos {info.bos_token!r} = {info.bos_id} before each document, " + (
            "no eos" if run.opts.no_eos else f"{eos} after it"
        )
    vocab = f"vocab_size {info.vocab_size:,} (len(tokenizer), added tokens included)"
    run.tell(Said(f"tokenizer {info.id}: {vocab}, {eos}, dtype {info.dtype}"))
    run.tell(
        Said(
            f"manifest {manifest.repo_id or manifest.root}: {plural(shards, 'shard')}, "
            f"{manifest.size / 2**20:,.1f} MiB; {done} done, {partial} partial, {shards - done - partial} to start"
        )
    )
    log(
        f"run: manifest {manifest_path} ({manifest.fingerprint[:16]}), tokenizer {info.id}, {plural(shards, 'shard')}: "
        f"{done} done, {partial} partial"
    )
    return Standing(shards, done, partial, done_bytes)


def _choose_backend(run: _Run) -> str:
    """The encoder, proven exact on the first documents of each split; --group-by's field checked first."""
    sample, passed_over = sample_texts(run.manifest, run.opts.text_field)
    backend, why = choose_backend(run.opts.backend, run.info.path, sample)
    if passed_over and backend != "hf":
        why += (
            f"; the sample passed over {passed_over} line(s) over {SAMPLE_LINE_BYTES >> 20} MiB"
            " (verify --sample re-encodes such documents with tokenizers)"
        )
    if run.opts.group_by is not None:
        count_groups(run.manifest, run.opts.text_field, run.opts.group_by)
    run.say(f"backend {backend}: {why}")
    return backend


def _tokenize(run: _Run, assembler, plan: Standing) -> Tally:
    """Tokenize every unfinished shard, assembling the split files as shards finish: in this process and its
    helpers (started with the run, their encoders loading while the driver plans and checks the backend) while
    Ray starts or instead of it, then on Ray. What finalize has left is the last copies."""
    handover = run.handover
    handover.seconds = _core_seconds(run.manifest.size - plan.done_bytes, plan.shards - plan.done)
    backend = _choose_backend(run)
    # On a cluster (where the driver tokenizes nothing) the encoders load once the node check is done: sent while its
    # probes ran, each probe started a worker process of its own beside the loads, and the shard tasks went to it,
    # its encoder not loaded (measured: 8 worker processes for a run of --workers 2 on two nodes of one CPU, ~0.6
    # CPU-s each to start, against 6). Sent after, a load takes the probe's worker.
    if not run.cluster.address:
        run.cluster.warm(backend, run.info.path)
    itemsize = np.dtype(run.info.dtype).itemsize
    series, on_disk = run.clock.series, run.out.on_disk
    progress = Progress(run.out.records, run.manifest.size, plan, itemsize, series, run.tell, on_disk=on_disk)
    handover.progress, handover.since = progress, time.monotonic()  # its rate, from here
    tally = Tally(run.opts.worker_memory << 20)
    run.clock.planned = time.monotonic()
    run.clock.series.mark("tokenize")
    try:
        spec = encode_spec(run.opts, run.info, backend, spill=run.out.spill)
        if not run.cluster.address and run.cluster.fit[1]:
            run.say(run.cluster.fit[1])
        if not run.cluster.address:  # the cores, tokenizing here or waiting for Ray (a cluster's: once it is joined)
            progress.workers = run.cluster.fit[0]
        done = plan.done + tokenize_while(
            run.manifest,
            run.out.name,
            spec,
            handover.driver_goes_on,
            progress,
            tally,
            run.log,
            assembler,
            run.out.is_done,
            run.helpers,
        )
        # A shard that failed here failed as a task would after its retries (what raised here, a source
        # error or a full disk, raises again on a worker): it is no reason to start Ray.
        if done + len(tally.failed) < plan.shards:
            _tokenize_on_ray(run, backend, assembler, progress, tally, done)
        else:
            what = "tokenized (or failed)" if tally.failed else "tokenized"
            here = " while it started" if run.cluster.started else ""
            run.tell(Said(f"ray: not needed, every shard was {what} here{here}"))
            progress.update(0, 0, 0, done=done, running=0, failed=len(tally.failed), final=True)
            run.clock.tokenized_now(assembler.placed_tokens * itemsize)
            if tally.failed and not run.opts.skip_failed:
                _kept(run, run.out.keep(assembler))
    finally:
        progress.close()
    run.clock.read_bytes, run.clock.shard_seconds = progress.read_this_run, tally.shard_seconds
    run.clock.workers = progress.worker_range
    run.clock.worker_seconds = progress.worker_seconds(run.clock.tokenized or time.monotonic())
    return tally


def _tokenize_on_ray(run: _Run, backend: str, assembler, progress: Progress, tally: Tally, done: int) -> None:
    """The shards the driver did not finish, on Ray's workers; their copies into the split files too."""
    from tokpipe.runner.copies import placing  # with Ray's import: only for runs that use it
    from tokpipe.runner.nodes import NodeWatch, check_nodes
    from tokpipe.runner.schedule import Scheduler, Tasks

    if run.cluster.address and not run.cluster.ready.is_set():  # said, where the wait is Ray's client's (minutes)
        run.tell(Said(f"ray: joining the cluster at {run.cluster.address}"))
    shape = run.cluster.wait()
    # Over the C++ handler of Ray's core worker, where Ray was imported before the run could
    # switch it off (a Python caller's process; runner/cluster.py, Cluster._start).
    terminate_on_sigterm()
    if shape.note and run.cluster.address:  # an embedded Ray's was said before it started
        run.say(shape.note)
    both = " (2 CPUs each: reading overlaps encoding)" if shape.read_ahead else ""
    nodes = f" on {shape.nodes} nodes" if shape.nodes > 1 else ""
    run.tell(Said(f"ray: {shape.where}, {plural(shape.workers, 'worker')}{both}{nodes}"))
    watch, check = NodeWatch(), None
    if run.cluster.address:  # every node sees the shards, the tokenizer and OUT, or the run stops here
        check = check_nodes(run.manifest, run.info, run.out, run.log, watch)
        run.cluster.warm(backend, run.info.path)  # after the check: _tokenize says why
    spec = encode_spec(run.opts, run.info, backend, shape.read_ahead, run.out.spill)
    progress.workers = shape.workers
    tasks = Tasks(run.manifest, run.out, spec, run.opts, shape.workers, run.log, tally, check, watch)
    copies = placing(run.out, assembler, shape.nodes, check, run.log, lambda: tasks.workers * spec.buffer_bytes)
    scheduler = Scheduler(tasks, run.tell)
    scheduler.run(progress, copies, done)
    run.clock.tokenized_now(assembler.placed_tokens * assembler.itemsize)
    # Failed shards block their split's assembly; with --skip-failed it goes on without them.
    scheduler.drain(progress, copies, frozenset(tally.failed) if run.opts.skip_failed else frozenset())
    if tally.failed and not run.opts.skip_failed:
        _kept(run, run.out.keep(assembler, copies))
    if shape.nodes > 1:
        by_node = copies.bytes_by_node.most_common()
        run.log("assembled by node: " + ", ".join(f"{node[:8]} {size / 1e6:,.1f} MB" for node, size in by_node))


def _kept(run: _Run, kept: int) -> None:
    """Log the done shards that a failed one kept from their place, written to their own files (shard.keep)."""
    if kept:
        run.log(f"{plural(kept, 'shard')} done after a failed one kept in their own files: the rerun places them")


def _report_failures(run: _Run, tally: Tally) -> bool:
    """Say what resumed and what failed; returns whether to finalize."""
    failed, resumed, opts, log = tally.failed, tally.resumed, run.opts, run.log
    if resumed:
        kept, redone = sum(r.resumed_tokens for r in resumed), sum(r.redone_tokens for r in resumed)
        run.tell(
            Said(
                f"resumed {plural(len(resumed), 'shard')} from checkpoints: {kept:,} tokens kept, "
                f"{redone:,} tokens written after the last checkpoints redone"
            )
        )
    failures_file = Layout(run.out.records).log(FAILED)
    if not failed:
        failures_file.unlink(missing_ok=True)
        return True
    write_json_atomic(failures_file, failed)
    for relpath, error in failed.items():
        run.tell(Said(f"FAILED {relpath}: {error}", stderr=True))
    if not opts.skip_failed:
        log(f"{plural(len(failed), 'shard')} failed; not finalized")
        return False
    excluded = f"the failed {plural(len(failed), 'shard')}"
    run.tell(Said(f"--skip-failed: finalizing without {excluded}; meta records them as excluded", stderr=True))
    log(f"{plural(len(failed), 'shard')} failed; finalizing without them (--skip-failed)")
    return True


def run(
    manifest_path: str | os.PathLike,
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    opts: RunOptions = RunOptions(),
    *,
    wait_for_ray: bool = True,
    tell: Listener = silent,
) -> RunSummary:
    """`wait_for_ray=False` (the CLI, whose process exits next): Ray's processes are killed at the end
    instead of shut down (1.4 s here), the caller must exit without Ray's own exit handler (os._exit), and Ray's
    lines go to OUT/logs/ray.log instead of this process's stderr. `tell` hears what the run says as it goes
    (events.Said); by default nothing is said, and a progress bar is drawn only for a listener."""
    clock = Timeline(time.monotonic())
    storage = storage_of(out)  # OUT refused before any input is read
    cluster = Cluster(opts, exits_after=not wait_for_ray)
    try:
        with manifest_here(manifest_path) as here:  # run.log names the manifest as given, not a copy's path
            return _run(load_manifest(here), manifest_path, tokenizer, storage, opts, clock, cluster, tell)
    finally:
        cluster.stop()


def _run(
    manifest: Manifest,
    manifest_path,
    tokenizer,
    out: Folder | Prefix,
    opts: RunOptions,
    clock: Timeline,
    cluster: Cluster,
    tell: Listener,
) -> RunSummary:
    check_reachable(manifest)  # shards on a store: a wrong key, no bucket, no store there refused before any work
    out.check()
    # Its work is the manifest's until the plan says what is left (_tokenize); none where OUT is finished with it: its
    # rerun starts no Ray and no helper (OUT's meta read before it is held, a hint; the check that counts comes then).
    finished = finished_with(out.finished(), manifest)
    work = 0.0 if finished else _core_seconds(manifest.size, sum(manifest.counts.values()))
    if not finished and (cluster.address or opts.ray_only or _ray_pays(work, cluster.fit[0])):
        cluster.start()  # now, while the driver plans: a cluster to join, or a run longer than Ray's start
    handover = _Handover(cluster, opts.ray_only, work, opts.stall_timeout)
    # The helpers start now, their imports beside the tokenizer's load: a helper's first shard came 0.9 s after the
    # driver's when started after the plan (800 MB, 2 cores).
    helpers = Helpers(handover.helpers, str(out.name)) if handover.helpers() else None
    with helpers or contextlib.nullcontext():
        backend = likely_backend(opts.backend)  # its encoder loading meanwhile, for the backend check
        info = load_tokenizer_info(tokenizer, opts.eos, opts.bos_token, opts.tokenizer_revision, prefetch=backend)
        if helpers is not None:
            helpers.warm(backend, info.path)
        check_options(opts, info, tokenizer)
        if (meta := out.read_only(manifest, info, opts)) is not None:  # a read-only mount: finished, nothing to do
            return _nothing_to_do(out, meta, clock, tell)
        with out.held(manifest, info, opts, tell) as manifest:
            run = _Run(manifest, out, info, opts, RunLog(out.records), clock, cluster, tell, handover, helpers)
            cluster.log_to(Layout(out.records).log(RAY_LOG), run.log, out.save_logs)  # OUT is this run's from here
            with _stop_noted(run):
                if finished_with(meta := out.finished(), manifest):
                    out.clean(meta, tell)
                    return _nothing_to_do(out, meta, clock, tell)
                # Before the plan: it may find placed shards whose place is not kept, to tokenize again.
                assembler = out.assembly(manifest, np.dtype(info.dtype).itemsize, opts.output, run.say)
                clock.series = Series(out.records)
                return _work(run, assembler, _plan(run, manifest_path))


@contextlib.contextmanager
def _stop_noted(run: _Run):
    """What stops the run, in run.log's last line (STOPPED), where `tokpipe status` says it: without it, a run stopped
    by a full disk or a lost cluster was "killed or crashed" there. OUT taken over by another run: said, not noted."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, Exception):
            run.out.still_held()
        if isinstance(e, KeyboardInterrupt):
            why = "terminated (SIGTERM)" if terminated(e) else "interrupted (Ctrl-C)"
        else:
            why = str(e) if isinstance(e, (UserError, RayUnavailable)) else describe_failure(e)
        with contextlib.suppress(OSError):  # a full disk: the error to say is the run's, not the note's
            run.log(STOPPED + why)
        raise


def _work(run: _Run, assembler, plan: Standing) -> RunSummary:
    """Tokenize what is left, say what failed, finalize."""
    tally = _tokenize(run, assembler, plan) if plan.done < plan.shards else Tally(run.opts.worker_memory << 20)
    redone = sum(r.redone_tokens for r in tally.resumed)
    if not _report_failures(run, tally):
        run.clock.series.mark("failed")
        return RunSummary(False, tally.failed, None, redone, time.monotonic() - run.clock.start)
    summary = _finalize(run, assembler, tally, redone)
    run.tell(Finished(summary))  # before Ray's stop, which may wait for its start to end
    return summary


def _nothing_to_do(out: Folder | Prefix, meta: Meta, clock: Timeline, tell: Listener) -> RunSummary:
    verify = f"Check it with: tokpipe verify {shlex.quote(out.name)}"
    tell(Said(f"{out.name} is already finished ({out.show(Layout('').meta_json.name)}); nothing to do. {verify}"))
    return RunSummary(True, {}, meta.as_dict(), 0, time.monotonic() - clock.start)


def _finalize(run: _Run, assembler, tally: Tally, redone: int) -> RunSummary:
    """The last copies and meta; then what the run made, as a value."""
    run.clock.finalizing()
    meta = Meta.of(run.out.finalize(assembler, run.manifest, run.info, run.opts.output, tally.failed))
    seconds = time.monotonic() - run.clock.start
    phases = run.clock.report(time.monotonic(), meta)
    run.clock.series.mark("finished")
    run.log(phases)
    run.log(f"finished: {meta.tokens:,} tokens in {seconds:.1f}s")
    return RunSummary(
        True, tally.failed, meta.as_dict(), redone, seconds, run.out.where, phases, tally.lacking, run.opts.text_field
    )

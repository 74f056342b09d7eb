"""`tokpipe status OUT`: where a run stands and what to run next, from OUT's files alone (no Ray).

Works the same on a running, a killed, a failed and a finished run, because every source is a file
`tokpipe run` keeps current: OUT/manifest.json (the shards), each shard's checkpoint (what is
committed), OUT/.lock (flock-ed by a live run; the kernel drops it when the run dies, however it
dies), OUT/logs/progress.json (rate and ETA, rewritten every 2 s while shards run),
OUT/logs/failed.json (the last run's failures), OUT/logs/refused.json (a run refused before OUT
held a token: the command that works is then the corrected one), OUT/run.json (the tokenizer and
options to resume with) and OUT/meta.json (written last: the run finished). A damaged file of the run's state
stops it with the loader's one line (tokpipe/layout/); a damaged log is said in a warning, and status goes on
without it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from dataclasses import asdict, dataclass, field

from tokpipe.errors import UserError
from tokpipe.fmt import disk_line, disk_now, duration, plural
from tokpipe.inputs.manifest import load_manifest
from tokpipe.layout.checkpoints import Checkpoint, Checkpoints
from tokpipe.layout.files import FAILED, PROGRESS, REFUSED, RUN_LOG, Layout
from tokpipe.layout.locks import shard_locked
from tokpipe.layout.meta import load_meta
from tokpipe.layout.run import RunRecord, load_run, stopped_note
from tokpipe.layout.stored import held_by, left_over, on_store, reader_out, records_of, shown

# progress.json is rewritten every 2 s while shards run; older than this, the live run is doing
# something else (starting Ray, finalizing) or is stuck.
PROGRESS_FRESH_S = 10.0
# A run on a store uploads its logs every minute (runner/storage.py LOGS_EVERY): read on another machine than its
# driver's, that copy of its progress is the live run's while it is this fresh.
UPLOADED_FRESH_S = 70.0
LIST_AT_MOST = 10  # partial and failed shards listed by name; the rest are counted
STATES = ("done", "partial", "pending", "failed")  # a shard's, in the order status counts them


@dataclass(frozen=True)
class ShardStatus:
    split: str
    relpath: str
    state: str  # one of STATES
    size: int  # bytes of the shard file
    read: int  # of those, covered by the checkpoint
    tokens: int  # committed
    documents: int
    error: str | None = None  # the last run's error, for a failed shard
    writing: bool = False  # a worker holds the shard's lock: live, or left over from a killed run
    lines: int = 0  # read, by the checkpoint
    skipped: dict[str, int] = field(default_factory=dict)  # lines skipped, by reason
    text_bytes: int = 0  # decompressed input bytes consumed (0: a checkpoint older than the field)
    seconds: float = 0.0  # tokenizing, summed over attempts
    held: int = 0  # of `tokens`, those of the documents held out for val.bin (--val-fraction)

    @property
    def bytes_per_token(self) -> float | None:
        return self.text_bytes / self.tokens if self.tokens and self.text_bytes else None


@dataclass(frozen=True)
class RunStatus:
    out: str
    state: str  # finished | running | stopped
    shards: list[ShardStatus]
    holder: str | None  # "pid N on HOST" of the run holding OUT, if one does
    progress: dict | None  # the live run's progress.json, while fresh
    last_report_age: float | None  # seconds since progress.json was last written, by any run
    next: str  # what to run next
    disk: dict | None = None  # the last run's projection of the output's size (progress.json); held and free now
    # --group-by: split -> group -> [tokens, documents] committed (held-out documents under validation)
    groups: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    refused: str | None = None  # why the last run stopped before OUT held a token
    warnings: list[str] = field(default_factory=list)  # the logs found damaged, passed over
    left_over: tuple[str, int] | None = None  # where a finish killed after meta.json left objects, and how many
    stopped: str | None = None  # what stopped the last run, where it said (run.log's STOPPED line)

    def count(self, state: str, split: str | None = None) -> int:
        return sum(1 for s in self.shards if s.state == state and split in (None, s.split))


def resume_command(out: str, run: RunRecord | None, fix: dict | None = None) -> str:
    """The `tokpipe run` that continues OUT: its manifest copy, the recorded tokenizer and options, with
    `fix` (option -> value, None: without it) over them."""
    manifest = os.path.join(out, Layout(out).manifest.name)  # as OUT was named, not normalized
    tokenizer = (run and run.tokenizer_path) or "TOKENIZER"
    args = ["tokpipe", "run", "--manifest", manifest, "--tokenizer", tokenizer, "--out", out]
    # run.json keeps the options given other than their defaults, by RunOptions field name; the CLI
    # flags are those names with dashes.
    for name, value in {**(run.options if run else {}), **(fix or {})}.items():
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]  # a switch (--bos, --skip-failed) takes no value
    return shlex.join(args)


def status(out: str | os.PathLike) -> RunStatus:
    copy = reader_out(out, segments=False)  # which shards are done, not where their tokens are
    folder = Layout(copy)
    out = folder.where  # as the user names it: a reader's copy of an OUT on a store by its URL
    if not folder.manifest.is_file():
        raise UserError(
            f"{out} holds no tokpipe run (no manifest.json): start one with tokpipe run --manifest M "
            f"--tokenizer T --out {shlex.quote(out)}"
        )
    manifest = load_manifest(folder.manifest)
    run = load_run(folder)
    meta = load_meta(folder)
    holder = held_by(copy)
    warnings: list[str] = []
    # failed.json is the last finished attempt's verdict; a live run is retrying those shards.
    failures = {} if holder else _log(folder, FAILED, warnings) or {}
    refused = None if holder else _log(folder, REFUSED, warnings)

    shards, groups, checkpoints = [], {}, Checkpoints(copy)
    for shard in manifest.shards():
        found = checkpoints.of(shard)
        ckpt = found or Checkpoint()
        if ckpt.done:
            state = "done"
        elif shard.relpath in failures:
            state = "failed"
        else:
            state = "partial" if found else "pending"
        read = shard.size if ckpt.done else ckpt.source_pos
        # Ray workers can outlive a killed driver for a while; their shard locks say which are still written.
        writing = not ckpt.done and shard_locked(folder.shard(shard))
        error = failures.get(shard.relpath) if state == "failed" else None
        # A shard's committed work includes the documents it holds out for val.bin (--val-fraction).
        held_tokens, held_documents = ckpt.counts(True)
        tokens, documents = ckpt.tokens + held_tokens, ckpt.documents + held_documents
        shards.append(ShardStatus(
            shard.split, shard.relpath, state, shard.size, read, tokens, documents, error, writing,
            ckpt.lines, dict(ckpt.skipped), ckpt.text_bytes, round(ckpt.seconds, 3), held_tokens,
        ))  # fmt: skip
        for split, part in ckpt.group_parts(shard.split):
            committed = groups.setdefault(split, {}).setdefault(part.group, [0, 0])
            committed[0] += part.tokens
            committed[1] += part.documents

    # A live run's progress is in its records: on a store, in its driver's folder where that is this machine's, else
    # in the copy it uploads.
    here = holder is None or Layout(records_of(out)).log(PROGRESS).exists()
    progress = _log(Layout(records_of(out)) if holder and here else folder, PROGRESS, warnings)
    age = time.time() - progress["updated_at"] if progress else None
    fresh = progress is not None and age < (PROGRESS_FRESH_S if here else UPLOADED_FRESH_S)
    live = progress if holder is not None and fresh and holder.startswith(f"pid {progress['pid']} ") else None
    if meta is not None:
        state, next_step = "finished", f"tokpipe verify {shlex.quote(out)}"
    elif holder is not None:
        state, next_step = "running", f"nothing yet; check again with: tokpipe status {shlex.quote(out)}"
    else:
        state = "stopped"
        next_step = resume_command(out, run, refused and refused["fix"])
        if refused and not refused["fix"]:
            next_step = f"what the refusal above says, then: {next_step} (with other inputs: OUT holds no token yet)"
        if failures:
            log = shown(copy, folder.log(RUN_LOG).relative_to(copy))
            next_step = f"fix the cause of the failures above (details in {log}), then: {next_step}"
        if not (run and run.tokenizer_path):
            sha = ((run and run.tokenizer_sha256) or "?")[:16]
            next_step += f"   (TOKENIZER: the one with sha256 {sha}…; this run.json does not record its path)"
    disk = progress.get("disk") if progress and state != "finished" else None
    if disk:
        disk = disk_now(disk["projected_bytes"], out)  # the run's projection beside OUT's disk as it is now
    groups = {split: dict(sorted(g.items())) for split, g in groups.items()}
    why = refused and refused["error"]
    left = left_over(copy, meta.concat) if meta is not None else None
    stopped = _stopped(folder) if state == "stopped" else None
    return RunStatus(out, state, shards, holder, live, age, next_step, disk, groups, why, warnings, left, stopped)


def _stopped(folder: Layout) -> str | None:
    """What stopped the last run, where it said (layout/run.py stopped_note); run.log's last 64 KiB are enough."""
    try:
        with open(folder.log(RUN_LOG), "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - (64 << 10)))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return stopped_note(lines)


def _log(folder: Layout, name: str, warnings: list[str]) -> dict | None:
    """A log of OUT's, None where there is none; where it is damaged, also None, said in `warnings`: a log is
    not the run's state, so status goes on without it."""
    try:
        return folder.load_log(name)
    except UserError as e:
        warnings.append(str(e))
        return None


def _headline(st: RunStatus) -> str:
    """Where the run stands, in a line."""
    if st.state == "finished":
        return f"{st.out}: finished"
    if st.state == "running" and st.count("done") == len(st.shards):
        return f"{st.out}: finalizing ({st.holder}): every shard is done, the split files are being written"
    if st.state == "running" and st.progress:
        return f"{st.out}: running ({st.holder}), started {duration(time.time() - st.progress['started_at'])} ago"
    if st.state == "running" and on_store(st.out) and not st.holder.endswith(f" on {socket.gethostname()}"):
        return f"{st.out}: running ({st.holder}): its progress is kept on that machine, where status shows it"
    if st.state == "running":
        log = Layout(records_of(st.out)).log(RUN_LOG)
        return f"{st.out}: a run holds it ({st.holder}) but is not tokenizing now: starting up, or stuck (see {log})"
    if st.refused:
        return f"{st.out}: holds no token yet; the last run was refused: {st.refused}"
    failed = st.count("failed")
    why = f"{plural(failed, 'shard')} failed in the last run" if failed else "no run holds it (killed or crashed)"
    if st.stopped and not failed:
        why = f"no run holds it; the last one stopped: {st.stopped}"
    since = f"; last progress report {duration(st.last_report_age)} ago" if st.last_report_age is not None else ""
    return f"{st.out}: stopped before finishing: {why}{since}"


def report(st: RunStatus) -> str:
    size = sum(s.size for s in st.shards)
    read = sum(s.read for s in st.shards)
    lines = [_headline(st)]
    if st.left_over:
        where, n = st.left_over
        lines.append(
            f"LEFT OVER: {plural(n, 'object')} under {where} that a finish killed after meta.json left (a second copy"
            " of tokens, segments/ or kept parts): the run's command removes them"
        )
    orphans = sum(s.writing for s in st.shards) if st.state == "stopped" else 0
    if orphans:
        lines.append(
            f"  {plural(orphans, 'shard')} {'is' if orphans == 1 else 'are'} still being written by workers of the"
            " stopped run; a rerun waits for them"
        )
    lines.append(f"shards: {', '.join(f'{st.count(s)} {s}' for s in STATES)} (of {len(st.shards)})")
    for split in dict.fromkeys(s.split for s in st.shards):
        mine = [s for s in st.shards if s.split == split]
        held = sum(s.held for s in mine)
        lines.append(
            f"  {split:<11} {st.count('done', split)}/{len(mine)} done  "
            f"{sum(s.tokens for s in mine):>15,} tokens  {sum(s.documents for s in mine):>12,} documents"
            + (f"  ({held:,} of the tokens held out for val.bin)" if held else "")
        )
    for split, groups in st.groups.items():
        largest = sorted(groups.items(), key=lambda g: -g[1][0])
        shown = ", ".join(f"{value} {n:,}" for value, (n, _) in largest[:LIST_AT_MOST])
        more = f", … and {len(largest) - LIST_AT_MOST} more" if len(largest) > LIST_AT_MOST else ""
        lines.append(f"  {split:<11} {len(groups):,} groups, tokens: {shown}{more}")
    tokens, documents = sum(s.tokens for s in st.shards), sum(s.documents for s in st.shards)
    lines.append(
        f"committed: {tokens:,} tokens, {documents:,} documents; {100 * read / size if size else 100:.1f}% of "
        f"{size / 2**20:,.1f} MiB read"
    )
    if st.progress:
        p = st.progress
        eta = f"ETA {duration(p['eta_s'])}" if p.get("eta_s") is not None else "ETA unknown"
        late = f" (as of {duration(st.last_report_age)} ago)" if st.last_report_age > PROGRESS_FRESH_S else ""
        running = f"{p['shards']['running']} shards running{late}"
        lines.append(f"rate: {p['tokens_per_s'] / 1e6:.2f}M tokens/s; {eta}; {running}")
    for state, label in (("partial", "partial"), ("failed", "FAILED ")):
        listed = [s for s in st.shards if s.state == state]
        for s in listed[:LIST_AT_MOST]:
            what = s.error or f"{100 * s.read / s.size if s.size else 0:.0f}% read, {s.tokens:,} tokens committed"
            lines.append(f"  {label} {s.relpath}: {what}")
        if len(listed) > LIST_AT_MOST:
            lines.append(f"  … and {len(listed) - LIST_AT_MOST} more {state}")
    if st.disk:
        lines.append(disk_line(st.disk))
    lines += [f"warning: {w}" for w in st.warnings]
    lines.append(f"next: {st.next}")
    return "\n".join(lines)


def as_json(st: RunStatus) -> str:
    return json.dumps(asdict(st), indent=1)

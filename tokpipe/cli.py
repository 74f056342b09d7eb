"""`tokpipe` command line: argument parsing, messages, exit codes — nothing else.

Exit codes (docs/commands.md#exit-codes): 0 success; 1 the work failed (a shard failed, a verify check
failed); 2 bad usage or input (one readable line, no traceback); 130 interrupted (Ctrl-C); 143 terminated
(SIGTERM, as Slurm, Kubernetes and systemd stop a job). A reader of stdout that goes away (`tokpipe status OUT |
head -1`) changes none of them: the command goes on, its output going nowhere.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from tokpipe._version import __version__
from tokpipe.errors import RayUnavailable, ReaderMayLeave, UserError, terminate_on_sigterm, terminated
from tokpipe.fmt import plural
from tokpipe.inputs.source.batch import MISSING_GROUP
from tokpipe.layout.files import RUN_LOG, Layout
from tokpipe.layout.meta import Meta, SplitEntry
from tokpipe.layout.stored import on_store
from tokpipe.options import RunOptions, positive

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


def _here(path: str) -> str:
    """An argparse type: a path on this machine (a manifest written, a tokenizer, a page, an export's folder). Only
    OUT, --dataset-dir and run's --manifest may be on an object store; a URL here was taken for a folder `s3:`."""
    if on_store(path):
        raise argparse.ArgumentTypeError(f"{path} is on an object store: give a path on this machine")
    return path


def _a_file(output: str | None, whose: str, example: str) -> None:
    """-o names a file: a folder is refused before the work (the rename into it would fail after)."""
    if output is not None and Path(output).is_dir():
        raise UserError(f"-o {output} is a folder: name the {whose} file (e.g. -o {Path(output) / example})")


def _cmd_manifest(args) -> int:
    import tokpipe
    from tokpipe.inputs.manifest import write_manifest

    _a_file(args.output, "manifest's", "NAME.json")
    manifest = tokpipe.build_manifest(
        args.dataset_dir,
        repo_id=args.repo_id,
        revision=args.revision,
        allow_outside=args.allow_outside,
        configs=tuple(args.config),
    )
    name = (manifest.repo_id or Path(manifest.root).name).replace("/", "--")
    dest = Path(args.output or Path("manifests") / f"{name}.json")
    write_manifest(manifest, dest)
    print("\n".join(_manifest_lines(manifest, dest)))
    return EXIT_OK


MANIFEST_NAMES_SHOWN = 3  # of a split's shards, by `tokpipe manifest`: its first ones and its last
PASSED_OVER_SHOWN = 10  # folders (and files) the manifest passed over, each on a line of its own


def _manifest_lines(manifest, dest: Path) -> list[str]:
    """What `tokpipe manifest` prints of a built manifest (inputs.manifest.Manifest): the shards per split, a few
    names of each so that a glance shows which files went where, and every folder it passed over, and why."""
    counts = manifest.counts
    where = f"{manifest.repo_id}@{manifest.revision[:12]}" if manifest.repo_id else manifest.root
    lines = [
        f"{where}: {plural(sum(counts.values()), 'shard')} ({', '.join(f'{k} {v}' for k, v in counts.items())}), "
        f"{manifest.size / 2**20:,.1f} MiB -> {dest}"
    ]
    if manifest.config is not None:
        lines.append(f"  config {manifest.config}: the files its README.md's data_files name, in its splits")
    for split, n in counts.items():
        shards = list(manifest.shards(split))
        names = [s.relpath for s in shards]
        if n > MANIFEST_NAMES_SHOWN:
            names = [*names[: MANIFEST_NAMES_SHOWN - 1], f"... ({n - MANIFEST_NAMES_SHOWN:,} more) ...", names[-1]]
        size = sum(s.size for s in shards) / 2**20
        lines.append(f"  {split}: {plural(n, 'shard')}, {size:,.1f} MiB: {', '.join(names)}")
    for passed, slash, what in (
        (manifest.passed_over, "/", "folders"),
        (manifest.files_passed_over, "", "files of data"),
    ):
        lines += [f"passed over {relpath}{slash}: {why}" for relpath, why in passed[:PASSED_OVER_SHOWN]]
        if len(passed) > PASSED_OVER_SHOWN:
            lines.append(f"passed over {len(passed) - PASSED_OVER_SHOWN:,} more {what}")
    return lines


def _where(out: Path | str, split: SplitEntry) -> str:
    """Where a split's tokens are: OUT a folder, or on a store (its URL)."""
    meta_json = f"{out}/{Layout('').meta_json.name}"
    if split.groups is not None:  # --group-by
        return f"the files of {plural(len(split.groups), 'group')} listed in {meta_json}"
    if split.file is None:  # --no-concat
        return f"{plural(len(split.files), 'file')} listed in {meta_json}"
    return f"{out}/{split.file}"


def _groups_line(group_by: str, groups: dict[str, SplitEntry]) -> str:
    """A split's groups in one line: how many, the largest, and how many documents lacked the field."""
    largest = sorted(groups.items(), key=lambda g: -g[1].tokens)
    shown = ", ".join(f"{value} {g.tokens:,}" for value, g in largest[:5]) + (", ..." if len(largest) > 5 else "")
    missing = groups[MISSING_GROUP].documents if MISSING_GROUP in groups else 0
    are = "is" if missing == 1 else "are"
    lacking = f"; {plural(missing, 'document')} without {group_by} {are} in group {MISSING_GROUP}" if missing else ""
    return f"  {plural(len(groups), 'group')} by {group_by} (tokens: {shown}){lacking}"


def summary_lines(summary) -> list[str]:
    """What `tokpipe run` prints of a run that finalized OUT (a runner.driver.RunSummary): each split, what
    was left out, where the time went, and what to do next."""
    meta, out, lines = Meta.of(summary.meta), summary.out, []
    for split, s in meta.splits.items():
        skipped = sum(s.skipped.values())
        why = ", ".join(f"{k} {v}" for k, v in s.skipped.items())
        lines.append(
            f"{split}: {plural(s.tokens, 'token')}, {plural(s.documents, 'document')}, {plural(skipped, 'line')} "
            f"skipped{' (' + why + ')' if why else ''} -> {_where(out, s)}"
        )
        if s.groups is not None:
            lines.append(_groups_line(meta.group_by, s.groups))
    if meta.excluded:
        lines.append(
            f"EXCLUDED {plural(len(meta.excluded), 'failed shard')} (recorded in meta['excluded']):"
            f" {', '.join(meta.excluded)}"
        )
    if summary.lacking:
        shard, missing, read = summary.lacking[0]
        lines.append(
            f"NOTE: {plural(len(summary.lacking), 'shard')} {'has' if len(summary.lacking) == 1 else 'have'} no"
            f" {summary.text_field!r} field on most lines (e.g. {shard}:"
            f" {missing:,} of {read:,} lines): is --text-field right for them?"
        )
    lines.append(summary.phases)
    meta_pkl = f"{out}/{Layout('').meta_pkl.name}"  # OUT a folder, or on a store (its URL)
    lines.append(
        f"done in {summary.seconds:.1f}s ({meta.tokens / summary.seconds / 1e6:.2f}M tokens/s overall); "
        f"meta: {meta_pkl}. Next: tokpipe verify {shlex.quote(str(out))}"
    )
    return lines


def _print_event(event) -> None:
    """How `tokpipe run` tells what a run says (runner.events): a Said, one line on stdout or stderr, at once; a
    Finished, the run's summary."""
    from tokpipe.runner.events import Finished  # loaded already: by the run that tells it

    if isinstance(event, Finished):
        print("\n".join(summary_lines(event.summary)), flush=True)
    else:
        print(event.text, file=sys.stderr if event.stderr else sys.stdout, flush=True)


def _cmd_run(args) -> int:
    from tokpipe.runner.driver import run

    opts = RunOptions(**{f.name: getattr(args, f.name) for f in fields(RunOptions)})
    summary = run(args.manifest, args.tokenizer, args.out, opts, wait_for_ray=False, tell=_print_event)
    if not summary.finished:
        print(
            f"{plural(len(summary.failed), 'shard')} failed; the rest are kept. Fix the cause and rerun the same"
            " command to retry them.",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


def _cmd_verify(args) -> int:
    from tokpipe.read.verify import as_json, report, verify

    checks = verify(args.out, args.jobs)
    if args.sample and all(c.ok for c in checks):
        from tokpipe.read.sample import verify_sample  # the reference encoder and the sources: only for --sample

        checks += verify_sample(args.out, args.sample, args.seed, args.tokenizer)
    print(as_json(checks) if args.json else report(checks))
    return EXIT_OK if all(c.ok for c in checks) else EXIT_FAILED


def _cmd_status(args) -> int:
    from tokpipe.commands.status import as_json, report, status

    st = status(args.out)
    print(as_json(st) if args.json else report(st))
    return EXIT_OK


def _cmd_inspect(args) -> int:
    from tokpipe.commands.inspect import inspect, report

    result = inspect(args.out, args.split, args.n, args.window, args.seed, args.tokenizer)
    print(report(result))
    return EXIT_OK if result.ok else EXIT_FAILED


def _cmd_export(args) -> int:
    from tokpipe.commands.export import export, llmc_line, megatron_line

    written = export(args.out, args.format, args.dest, force=args.force, shuffle=args.shuffle)
    for e in written:
        print(f"{e.path}: {e.tokens:,} tokens, {e.documents:,} documents{'; ' + e.how if e.how else ''}")
    print(megatron_line(written) if args.format == "megatron" else llmc_line(written, args.dest, args.shuffle))
    return EXIT_OK


def _cmd_report(args) -> int:
    from tokpipe.commands.report import write_report

    _a_file(args.output, "page's", "report.html")
    path, size = write_report(args.out, args.output, args.tokenizer)
    print(f"{path}: {size / 1e6:,.2f} MB, one self-contained page (opens offline in any browser)")
    return EXIT_OK


def _add_options(p: argparse.ArgumentParser) -> None:
    """One flag per RunOptions field, with the field's default and help (a False default: a switch)."""
    for f in fields(RunOptions):
        assert f.default is not MISSING
        cli = dict(f.metadata)
        if f.default is False:
            cli["action"] = "store_true"
        p.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, **cli)


class _Parser(argparse.ArgumentParser):
    """argparse's, with a usage error in one line as every other error (`--help` shows the usage), and no empty
    value taken: `--out "$OUT"` with OUT unset was the current folder, `--address ""` an embedded Ray, `--eos ""` and
    `--tokenizer-revision ""` the defaults, without a word."""

    def add_argument(self, *names, **kwargs):
        if kwargs.get("action") in (None, "append"):  # an option that takes a value
            kwargs["type"] = _given(kwargs.get("type", str))
        return super().add_argument(*names, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _given(kind):
    """`kind`, an argparse type, refusing an empty value first."""

    def given(text: str):
        if not text.strip():
            raise argparse.ArgumentTypeError("is empty (an unset shell variable?): give a value")
        return kind(text)

    given.__name__ = getattr(kind, "__name__", "given")  # argparse's "invalid int value: 'x'" names it
    return given


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tokpipe",
        description="Parallel, resumable tokenization of pretraining corpora into flat token files\n"
        "a trainer memory-maps. Reads JSON Lines or JSON arrays (plain, zstd, gzip, bz2, xz), Parquet,\n"
        "Arrow: shards in a Hugging Face cache or a plain folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tokpipe {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("manifest", help="list a dataset's shards, splits and order into a manifest")
    m.add_argument(
        "--dataset-dir",
        required=True,
        help="HF cache root, datasets--ORG--NAME folder, snapshots/REV folder, or a folder of shards; a hub name"
        " ORG/NAME in your Hugging Face cache; on an object store: s3://BUCKET/PREFIX",
    )
    m.add_argument("-o", "--output", type=_here, help="manifest path (default: manifests/NAME.json)")
    m.add_argument("--repo-id", help="ORG/NAME, when the cache holds several datasets")
    m.add_argument("--revision", help="ref or commit of the snapshot (default: refs/main)")
    m.add_argument("--allow-outside", action="store_true", help="accept shards that symlink to files outside DIR")
    m.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME",
        help="read this config of the dataset card's (README.md's configs:), as load_dataset(NAME) does; repeat it to"
        " read several (default: the card's default config)",
    )
    m.set_defaults(func=_cmd_manifest)

    r = sub.add_parser("run", help="tokenize a manifest into OUT (rerun the same command to resume)")
    r.add_argument("--manifest", required=True, metavar="M", help="the shards to tokenize: a `tokpipe manifest` file")
    r.add_argument(
        "--tokenizer",
        required=True,
        type=_here,
        metavar="T",
        help="local tokenizer folder or tokenizer.json, or a hub name ORG/NAME already in the Hugging Face cache "
        "(never downloaded)",
    )
    r.add_argument(
        "--out",
        required=True,
        metavar="OUT",
        help="the output folder: a new one, or this run's to resume it (`tokpipe status OUT` says where it stands)",
    )
    _add_options(r)
    r.set_defaults(func=_cmd_run)

    def reader(name: str, func, help: str) -> argparse.ArgumentParser:
        """The parser of a command that reads an OUT: its first argument."""
        command = sub.add_parser(name, help=help)
        command.add_argument("out")
        command.set_defaults(func=func)
        return command

    v = reader("verify", _cmd_verify, "check a finished OUT; exit 0 only when every check holds")
    v.add_argument("--json", action="store_true", help="machine-readable report")
    v.add_argument(
        "--sample",
        type=positive(int),
        metavar="K",
        help="also re-tokenize K random source documents with tokenizers and compare",
    )
    v.add_argument("--seed", type=int, default=0, help="which documents --sample picks (default: 0)")
    v.add_argument(
        "--tokenizer", type=_here, help="the run's tokenizer, if it moved since the run (default: the path in meta)"
    )
    v.add_argument(
        "--jobs", type=positive(int), help="threads checking checksums and ids (default: all cores; 16 for a store)"
    )

    st = reader("status", _cmd_status, "where a run stands (running, killed, failed or finished) and what to run next")
    st.add_argument("--json", action="store_true", help="machine-readable status")

    i = reader(
        "inspect", _cmd_inspect, "the eye test: decode random windows, flag broken token ids; exit 1 on a red flag"
    )
    i.add_argument("--split", default="train", help="train, validation (or val), test (default: train)")
    i.add_argument(
        "-n",
        type=positive(int, zero_ok=True),
        default=5,
        help="windows to decode (default: 5; 0 for the id checks alone)",
    )
    i.add_argument("--window", type=positive(int), default=64, help="tokens per window (default: 64)")
    i.add_argument("--seed", type=int, help="seed of the window positions (default: a new one, printed)")
    i.add_argument("--tokenizer", type=_here, help="the run's tokenizer, if it is no longer where run.json says")

    rp = reader(
        "report", _cmd_report, "draw a run (finished, running, killed or failed) on one self-contained HTML page"
    )
    rp.add_argument(
        "-o", "--output", type=_here, metavar="FILE", help="where to write the page (default: OUT/report.html)"
    )
    rp.add_argument(
        "--tokenizer",
        type=_here,
        help="the run's tokenizer, if it is no longer where run.json says (to decode the common ids)",
    )

    e = reader("export", _cmd_export, "write a finished OUT as Megatron-LM or llm.c training files")
    e.add_argument("--format", required=True, choices=("megatron", "llmc"))
    e.add_argument(
        "-o", "--dest", required=True, type=_here, help="folder to write to (must be empty, unless --force)"
    )
    e.add_argument(
        "--force", action="store_true", help="write into a non-empty --dest, replacing files of the same names"
    )
    e.add_argument(
        "--shuffle",
        type=int,
        metavar="SEED",
        help="llmc: write the documents in an order drawn from SEED (each once, whole), not the split's order",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args, code, stdout, stderr = None, EXIT_FAILED, sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderMayLeave(stdout), ReaderMayLeave(stderr)
    try:
        args = parser().parse_args(argv)  # --help and --version write to stdout, then raise SystemExit
        terminate_on_sigterm()  # SIGTERM stops any command as Ctrl-C does (the run keeps it so while Ray starts)
        code = _command(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = stdout, stderr
        if args is not None and args.command == "run":
            # The run killed Ray's processes once its work was durable (runner/cluster.py), and this process must
            # not run libc's exit handlers after it, whatever happened: among them is Ray's
            # CoreWorkerProcess::HandleAtExit, which destroys the driver's core worker while its io thread still
            # runs callbacks (a worker lease asked of a raylet that is gone), a use after free: SIGSEGV or SIGABRT
            # (gdb on a core of a run that lost a node, issue 44). Leave at once.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def _command(args) -> int:
    try:
        return args.func(args)
    except (UserError, RayUnavailable) as e:  # RayUnavailable: Ray did not start, or no node left can run a shard
        print(f"tokpipe {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UserError) else EXIT_FAILED
    except OSError as e:  # disk full, permissions, a vanished mount: the cause is outside tokpipe
        print(f"tokpipe {args.command}: error: {e}; fix the cause and rerun the same command", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        why = "terminated (SIGTERM)" if terminated(e) else "interrupted"
        again = " to resume" if args.command == "run" else ""  # the other commands start over
        print(f"tokpipe {args.command}: {why}; rerun the same command{again}", file=sys.stderr)
        return EXIT_TERMINATED if terminated(e) else EXIT_INTERRUPTED
    except Exception as e:
        if args.command != "run":
            raise
        print(_unexpected(args.out, e), file=sys.stderr)
        return EXIT_FAILED


def _unexpected(out: str, error: Exception) -> str:
    """The one line of a run that an error tokpipe did not foresee stopped (what is done is kept); the traceback
    goes to OUT/logs/run.log, or, before the run had one, after the line."""
    import traceback

    from tokpipe.runner.local import describe_failure

    trace, log = "".join(traceback.format_exception(error)).rstrip(), Layout(out).log(RUN_LOG)
    if log.is_file():
        with open(log, "a") as file:  # after the run's note of what stopped it (runner/driver.py, STOPPED)
            file.write(f"{trace}\n")
        where, trace = f"is in {log}", ""
    else:
        where, trace = "follows", f"\n{trace}"
    what = describe_failure(error)
    return f"tokpipe run: error: unexpected {what} (its traceback {where}); rerun the same command{trace}"


if __name__ == "__main__":
    sys.exit(main())

"""cli: the command line's contract. Exit 0 on success, 1 when the work failed (a shard, a check, the disk),
2 on bad usage or input, 130 when interrupted, 143 when terminated; a reader of stdout that goes away changes
none of them; every error is one readable line naming the command, never a traceback. The commands' own
output is documented with each command's module."""

import argparse
import errno
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from helpers import EXAMPLE_CACHE, QWEN3, REPO, assert_out_is, run_args, stopped_as_status_says, tokpipe
from helpers import cli as in_process

from tokpipe import __doc__ as PACKAGE_DOC
from tokpipe import cli
from tokpipe._version import __version__
from tokpipe.cli import parser
from tokpipe.errors import UserError
from tokpipe.layout.meta import SplitEntry


@pytest.mark.parametrize(
    "error, code, message",
    [
        (UserError("/data holds no tokpipe run"), 2, "tokpipe status: error: /data holds no tokpipe run"),
        (
            OSError(errno.ENOSPC, "No space left on device"),
            1,
            "tokpipe status: error: [Errno 28] No space left on device; fix the cause and rerun the same command",
        ),
        (KeyboardInterrupt(), 130, "tokpipe status: interrupted; rerun the same command"),
    ],
    ids=["usage", "os_error", "interrupted"],
)
def test_errors_are_one_line_and_an_exit_code(monkeypatch, capsys, error, code, message):
    def fails(args):
        raise error

    monkeypatch.setattr(cli, "_cmd_status", fails)
    assert cli.main(["status", "/data"]) == code
    assert capsys.readouterr() == ("", message + "\n")


def test_exit_codes_are_the_documented_ones():
    codes = (cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_INTERRUPTED, cli.EXIT_TERMINATED)
    assert codes == (0, 1, 2, 130, 143)


def test_version_and_bad_usage_as_a_user_sees_them(tmp_path):
    version = tokpipe("--version")
    assert (version.returncode, version.stdout) == (0, f"tokpipe {__version__}\n")
    missing = tokpipe("run", "--manifest", tmp_path / "m.json")
    assert missing.returncode == 2 and missing.stdout == ""
    assert (
        missing.stderr.splitlines()[-1]
        == "tokpipe run: error: the following arguments are required: --tokenizer, --out"
    )
    unknown = tokpipe("nonsense")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.splitlines()[-1].startswith("tokpipe: error: argument command: invalid choice: 'nonsense'")


def test_a_missing_input_is_a_usage_error_not_a_traceback(tmp_path):
    result = tokpipe("run", "--manifest", tmp_path / "nope.json", "--tokenizer", tmp_path, "--out", tmp_path / "o")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("tokpipe run: error: ")


def _with_reader_gone(*args, stderr_too: bool = False) -> subprocess.CompletedProcess:
    """The CLI with a stdout whose reader is gone before the command writes a byte, so that every write fails
    (`tokpipe status OUT | head -1` once head has its line: with head, when that comes is a race); with
    `stderr_too`, stderr to the same pipe (`2>&1 | head -1`)."""
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "wb") as stdout:
        return subprocess.run(
            [sys.executable, "-m", "tokpipe.cli", *map(str, args)],
            stdout=stdout,
            stderr=subprocess.STDOUT if stderr_too else subprocess.PIPE,
            text=True,
            timeout=300,
        )


@pytest.mark.parametrize(
    "command",
    [
        ["status", "{out}"],
        ["verify", "{out}", "--json"],
        ["inspect", "{out}", "-n", "1"],
        ["report", "{out}", "-o", "{tmp}/report.html"],
        ["manifest", "--dataset-dir", str(EXAMPLE_CACHE), "-o", "{tmp}/m.json"],
        ["status", "--help"],
    ],
    ids=["status", "verify", "inspect", "report", "manifest", "help"],
)
def test_a_command_whose_reader_went_away_ends_as_it_would_have(finished_example, tmp_path, command):
    """The reader of stdout going away is no error of the command: exit 0 (the command's own status), nothing
    on stderr, whenever the reader left (one exit status where there were two, 141 and 0, by a race)."""
    result = _with_reader_gone(*(a.format(out=finished_example, tmp=tmp_path) for a in command))
    assert (result.returncode, result.stderr) == (0, "")


def test_a_run_whose_reader_went_away_finishes(tmp_path, small_tokenizer, small_reference):
    """`tokpipe run ... | head -1`: the run goes on to the end (it used to stop at its next line)."""
    assert tokpipe("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", tmp_path / "m.json").returncode == 0
    result = _with_reader_gone(*run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert_out_is(tmp_path / "out", small_reference)


def test_a_run_whose_stderr_reader_went_away_finishes(tmp_path, small_tokenizer, small_reference):
    """`tokpipe run ... 2>&1 | head -1`: the progress lines on stderr go nowhere and the run goes on to the end
    (the first of them failed the shard the driver was on, as if its data were at fault)."""
    assert tokpipe("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", tmp_path / "m.json").returncode == 0
    run = run_args(tmp_path / "m.json", tmp_path / "out", tokenizer=small_tokenizer)
    result = _with_reader_gone(*run, stderr_too=True)
    assert result.returncode == 0
    assert "FAILED" not in (tmp_path / "out" / "logs" / "run.log").read_text()
    assert_out_is(tmp_path / "out", small_reference)


URL = "s3://tok/x"
LOCAL_PATHS = {  # each flag that names a path on this machine, with a URL: only OUT and --dataset-dir are s3://
    "manifest -o": ["manifest", "--dataset-dir", "d", "-o", URL],
    "run --tokenizer": ["run", "--manifest", "m", "--tokenizer", URL, "--out", "o"],
    "verify --tokenizer": ["verify", "o", "--tokenizer", URL],
    "inspect --tokenizer": ["inspect", "o", "--tokenizer", URL],
    "report -o": ["report", "o", "-o", URL],
    "report --tokenizer": ["report", "o", "--tokenizer", URL],
    "export -o": ["export", "o", "--format", "megatron", "-o", URL],
}


@pytest.mark.parametrize("flag", list(LOCAL_PATHS))
def test_a_url_where_a_local_path_goes_is_one_line_and_makes_no_s3_folder(flag, tmp_path, monkeypatch):
    # `export --dest s3://walk/meg` hard-linked the split files into ./s3:/walk/meg, and said so with one slash.
    monkeypatch.chdir(tmp_path)
    result = in_process(*LOCAL_PATHS[flag])
    name = flag.split()[1].replace("-o", "-o/--dest" if flag.startswith("export") else "-o/--output")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1] == (
        f"tokpipe {flag.split()[0]}: error: argument {name}: {URL} is on an object store: give a path on this machine"
    )
    assert list(tmp_path.iterdir()) == []


def test_out_naming_a_file_is_one_line_exit_2(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run")
    is_a_file = f"{a_file} is a file, not a folder: OUT is a folder, a new one or a tokpipe run's"
    # `run --out`: refused before anything is read or started (the manifest named here does not even exist).
    for out, message in [
        (a_file, is_a_file),
        (a_file / "out", is_a_file.replace(": OUT", f" (on the way to {a_file / 'out'}): OUT")),
    ]:
        result = tokpipe(*run_args(tmp_path / "m.json", out))
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"tokpipe run: error: {message}\n")
    # The readers' OUT: a file, or nothing at all.
    missing = tmp_path / "nothing"
    for command in (["status"], ["verify"], ["inspect"], ["report"], ["export", "--format", "llmc", "--dest", "d"]):
        for out, message in [
            (a_file, is_a_file),
            (missing, f"{missing} does not exist: give the --out folder of a tokpipe run"),
        ]:
            assert cli.main([command[0], str(out), *command[1:]]) == 2
            assert capsys.readouterr() == ("", f"tokpipe {command[0]}: error: {message}\n")


@pytest.mark.parametrize(
    "argv",
    [
        ["status", ""],  # was the current folder's status
        ["manifest", "--dataset-dir", ""],  # was a manifest of the current folder
        ["manifest", "--dataset-dir", "d", "--config", ""],  # a repeatable one
        ["run", "--manifest", "m.json", "--tokenizer", "t", "--out", " "],  # was OUT in the current folder
        ["run", "--manifest", "m.json", "--tokenizer", "t", "--out", "o", "--address", ""],  # was an embedded Ray
        ["run", "--manifest", "m.json", "--tokenizer", "t", "--out", "o", "--tokenizer-revision", ""],  # was main
        ["run", "--manifest", "m.json", "--tokenizer", "t", "--out", "o", "--eos", ""],  # was the tokenizer's
        ["inspect", "o", "--window", ""],
    ],
)
def test_an_empty_value_is_refused_in_one_line_never_taken_for_the_current_folder_or_a_default(argv, capsys):
    """`--out "$OUT"`, OUT unset: every option and argument refuses an empty value before any work."""
    flag = argv[-2] if argv[-2].startswith("-") else "out"
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(argv)  # (without the refusal, an in-process `run` would end the test's process)
    assert exit.value.code == 2
    assert capsys.readouterr() == (
        "",
        f"tokpipe {argv[0]}: error: argument {flag}: is empty (an unset shell variable?): give a value\n",
    )


# -- a damaged file of OUT: one line naming it and what to do, from every command that reads it ------------------

CHECKPOINT = "shards/train/train__chunk1__example_train_0.json"  # the first train shard's
CUT = "line 1 column 11 (char 10)"  # where each file's text ends, cut after its first 10 bytes
RERUN = "rerun the run's command (tokpipe status {out} prints it)"
DAMAGED = {  # each file of OUT cut short: what it is said to be, and what to do about it
    "meta.json": f"JSONDecodeError: Expecting value: {CUT}): remove it and {RERUN}: it writes it again",
    "meta.pkl": f"UnpicklingError: pickle data was truncated): remove it and meta.json, and {RERUN}: it writes both"
    " again",
    "run.json": f"JSONDecodeError: Expecting value: {CUT}): it records what OUT's tokens were made from; remove it and"
    " rerun the command that made OUT with the same inputs (nothing can check them without it), or start over in a"
    " new --out",
    CHECKPOINT: f"JSONDecodeError: Expecting value: {CUT}): remove it and {RERUN}: the shard is tokenized again",
    "train.parts": f"JSONDecodeError: unexpected end of data: {CUT}): remove {{out}}/meta.json and {RERUN}: it lists"
    " the split's parts again",
}
# What each command makes of a finished OUT with that file damaged: 2, refused with the file's line; a check's
# name, verify fails it with that line; 0, nothing said, since the command does not read the file.
READS = {
    "meta.json": {"status": 2, "report": 2, "inspect": 0, "verify": "meta.json readable", "export": 0, "run": 2},
    "meta.pkl": {"status": 0, "report": 2, "inspect": 2, "verify": "meta.pkl readable", "export": 2, "run": 0},
    "run.json": {"status": 2, "report": 2, "inspect": 2, "verify": 0, "export": 0, "run": 2},
    CHECKPOINT: {"status": 2, "report": 2, "inspect": 0, "verify": 0, "export": 0, "run": 0},
    "train.parts": {"status": 0, "report": 2, "inspect": 0, "verify": "train: parts list", "export": 0, "run": 0},
}


def cut(path):
    """The file as damaged storage leaves it: its first 10 bytes."""
    path.write_bytes(path.read_bytes()[:10])


def command(name: str, out, tmp_path, tokenizer) -> list:
    return {
        "status": ["status", out],
        "report": ["report", out, "-o", tmp_path / "report.html"],
        "inspect": ["inspect", out, "-n", "1", "--seed", "1"],
        "verify": ["verify", out],
        "export": ["export", out, "--format", "megatron", "--dest", tmp_path / "megatron"],
        "run": run_args(out / "manifest.json", out, tokenizer=tokenizer),
    }[name]


@pytest.mark.parametrize("damaged", list(DAMAGED))
def test_every_command_that_reads_a_damaged_file_of_out_says_so_in_one_line(
    damaged, finished_small, small_tokenizer, tmp_path
):
    """A file of a finished OUT cut short, as no crash leaves one (each is written whole): every command that
    reads it names it and says what to do in one line, exit 2, having written nothing; verify fails the check
    that reads it; a command that does not read it goes on. (Each 2 was a JSONDecodeError traceback, or for
    meta.pkl a line with no fix.)"""
    for name, outcome in READS[damaged].items():
        out, here = tmp_path / name / "out", tmp_path / name
        shutil.copytree(finished_small, out)
        cut(out / damaged)
        result = in_process(*command(name, out, here, small_tokenizer))
        line = f"{out}/{damaged} is damaged ({DAMAGED[damaged].format(out=out)}"
        if outcome == 2:
            assert (name, result.returncode, result.stderr) == (name, 2, f"tokpipe {name}: error: {line}\n")
            assert not (here / "report.html").exists() and not (here / "megatron").exists()
        elif outcome == "train: parts list":  # verify hashes the list before it reads a line of it
            failed = f"FAIL  train: parts list sha256 matches meta  ({out}/train.parts changed since finalize)"
            assert result.returncode == 1 and failed in result.stdout.splitlines()
        elif outcome:
            assert (result.returncode, result.stdout) == (1, f"FAIL  {outcome}  ({line})\n1 of 1 checks FAILED\n")
        else:
            assert (name, result.returncode, result.stderr) == (name, 0, "")


@pytest.mark.parametrize("name", ["status", "report", "inspect", "run"])
def test_a_damaged_checkpoint_of_an_unfinished_run_stops_every_command_that_reads_it(name, killed_example, tmp_path):
    """The run too, before it tokenizes anything: it would build on the storage that lost the checkpoint, which
    holds the tokens it covers. Removing it, as the line says, has the shard tokenized again."""
    out = tmp_path / "out"
    shutil.copytree(killed_example, out)
    cut(out / CHECKPOINT)
    result = in_process(*command(name, out, tmp_path, QWEN3))
    line = f"{out}/{CHECKPOINT} is damaged ({DAMAGED[CHECKPOINT].format(out=out)}"
    assert (result.returncode, result.stderr) == (2, f"tokpipe {name}: error: {line}\n")
    assert not (tmp_path / "report.html").exists()


def test_every_command_tokpipe_prints_for_you_to_run_is_quoted_for_the_shell(tmp_path, small_tokenizer):
    """Paths with a space and a quote: each command tokpipe prints to be run (the run's `Next:`, its no-op's check,
    status's, the readers' pointers, Megatron-LM's data flags) is one the shell splits back into those paths."""
    manifest, out, dest = tmp_path / "m.json", tmp_path / "my out's", tmp_path / "Megatron's data"
    assert in_process("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", manifest).returncode == 0
    assert in_process("export", out, "--format", "megatron", "--dest", dest).returncode == 2  # no OUT yet
    run = tokpipe(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert run.returncode == 0, run.stderr
    assert shlex.split(run.stdout.splitlines()[-1].split("Next: ")[1]) == ["tokpipe", "verify", str(out)]
    again = in_process(*run_args(manifest, out, tokenizer=small_tokenizer))
    assert shlex.split(again.stdout.split("Check it with: ")[1]) == ["tokpipe", "verify", str(out)]
    status = in_process("status", out)
    assert shlex.split(status.stdout.splitlines()[-1].removeprefix("next: ")) == ["tokpipe", "verify", str(out)]
    exported = in_process("export", out, "--format", "megatron", "--dest", dest).stdout.splitlines()[-1]
    assert shlex.split(exported)[:5] == [
        "Megatron-LM:",
        "--train-data-path",
        str(dest / "train"),
        "--valid-data-path",
        str(dest / "val"),
    ]
    (out / "meta.pkl").unlink()
    unfinished = in_process("export", out, "--format", "megatron", "--dest", tmp_path / "elsewhere")
    assert shlex.split(unfinished.stderr.split("see where it stands with ")[1]) == ["tokpipe", "status", str(out)]


# A `tokpipe run` whose driver meets an error that tokpipe does not foresee (a bug, a library failing as no test
# saw) at the first call of a method (argv: module.Class.method, then the CLI's arguments).
FAILING_RUN = """
import importlib, sys
module, cls, attr = sys.argv[1].rsplit(".", 2)
def fails(*args, **kw):
    raise RuntimeError("an error no one foresaw")
setattr(getattr(importlib.import_module(module), cls), attr, fails)
from tokpipe import cli
cli.main(sys.argv[2:])
"""


def test_an_unexpected_error_once_ray_is_up_is_one_line_and_the_run_resumes(
    tmp_path, small_tokenizer, small_reference, ray_address
):
    # The first shard placed on Ray's workers is to be listed when it strikes: Ray is up, its processes are killed
    # on the way out, and the interpreter's exit is not run (cli.main: os._exit). Before, the line went to the
    # /dev/null the cluster's stop had put over stderr, and the exit was 1, now and then a SIGSEGV (139).
    assert tokpipe("manifest", "--dataset-dir", EXAMPLE_CACHE, "-o", tmp_path / "m.json").returncode == 0
    out = tmp_path / "out"
    args = run_args(tmp_path / "m.json", out, "--ray-only", tokenizer=small_tokenizer)
    failing = subprocess.run(
        [sys.executable, "-c", FAILING_RUN, "tokpipe.write.assembly.Assembler.placed", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_ADDRESS": ray_address},
    )
    assert failing.returncode == 1, failing.stdout + failing.stderr
    log = out / "logs" / "run.log"
    assert failing.stderr.splitlines()[-1] == (
        f"tokpipe run: error: unexpected RuntimeError: an error no one foresaw (its traceback is in {log});"
        " rerun the same command"
    )
    assert "Traceback" not in failing.stderr
    assert "Traceback (most recent call last):" in log.read_text()
    assert log.read_text().rstrip().endswith("RuntimeError: an error no one foresaw")
    stopped = "stopped before finishing: no run holds it; the last one stopped"
    assert stopped_as_status_says(out) == f"{out}: {stopped}: RuntimeError: an error no one foresaw"
    rerun = tokpipe(*args, ray=ray_address)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_out_is(out, small_reference)


# -- help -----------------------------------------------------------------------------------------------------
# What tokpipe reads is said where a user first looks: `tokpipe --help`, the package's description.


FORMATS = "JSON Lines or JSON arrays (plain, zstd, gzip, bz2, xz), Parquet, Arrow"


def test_help_and_description_say_which_formats_are_read():
    result = tokpipe("--help")
    assert result.returncode == 0
    assert FORMATS in " ".join(result.stdout.split())  # argparse wraps the description
    assert FORMATS in " ".join(PACKAGE_DOC.split())
    assert (
        f"tokenization of pretraining corpora ({FORMATS}) into flat token files"
        in (REPO / "pyproject.toml").read_text()
    )


def test_run_help_says_what_every_option_does():
    """`tokpipe run --help`: every option has its help (the Ray-only switch for the tests is hidden), and what it
    says is what the code does: --workers' default is what runner/cluster.py counts, a Parquet shard's text is a
    column."""
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    run = commands.choices["run"]
    options = [a for a in run._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in options if not a.help] == []
    assert [a.dest for a in options if a.help == argparse.SUPPRESS] == ["ray_only"]
    result = tokpipe("run", "--help")
    assert result.returncode == 0
    shown = " ".join(result.stdout.split())  # argparse wraps the lines
    for line in [
        "--manifest M the shards to tokenize: a `tokpipe manifest` file",
        "--out OUT the output folder: a new one, or this run's to resume it (`tokpipe status OUT` says where it"
        " stands)",
        "--workers N shard tasks at once (default: the CPUs this process may use: its CPU affinity and cgroup quota)",
        "--text-field NAME JSON field or Parquet column holding the document text (default: text)",
    ]:
        assert line in shown


def test_a_split_s_groups_line_counts_them_in_words():
    one = {"__missing__": SplitEntry(442_827, 165)}
    assert cli._groups_line("source", one) == (
        "  1 group by source (tokens: __missing__ 442,827); 165 documents without source are in group __missing__"
    )
    two = {"code": SplitEntry(10, 2), "web": SplitEntry(30, 5)}
    assert cli._groups_line("meta.source", two) == "  2 groups by meta.source (tokens: web 30, code 10)"
    lone = {"web": SplitEntry(30, 5), "__missing__": SplitEntry(4, 1)}
    assert cli._groups_line("source", lone) == (
        "  2 groups by source (tokens: web 30, __missing__ 4); 1 document without source is in group __missing__"
    )

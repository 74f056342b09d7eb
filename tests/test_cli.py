"""cli: the command line's contract. Exit 0 on success, 1 when the work failed (a shard, a check, the disk),
2 on bad usage or input, 130 when interrupted, 143 when terminated; a reader of stdout that goes away changes
none of them; every error is one readable line naming the command, never a traceback. The commands' own
output is documented with each command's module."""

import errno
import os
import subprocess
import sys

import pytest
from helpers import EXAMPLE_CACHE, assert_out_is, run_args, tokpipe

from tokpipe import cli
from tokpipe._version import __version__
from tokpipe.errors import UserError


@pytest.mark.parametrize(
    "error, code, message",
    [
        (UserError("/data holds no tokpipe run"), 2, "tokpipe status: error: /data holds no tokpipe run"),
        (
            OSError(errno.ENOSPC, "No space left on device"),
            1,
            "tokpipe status: error: [Errno 28] No space left on device; fix the cause and rerun the same command",
        ),
        (KeyboardInterrupt(), 130, "tokpipe status: interrupted; rerun the same command to resume"),
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

"""cli: the command line's contract. Exit 0 on success, 1 when the work failed (a shard, a check, the disk),
2 on bad usage or input, 130 when interrupted, 141 (quietly) when the reader of stdout went away; every
error is one readable line naming the command, never a traceback. The commands' own output is documented
with each command's module."""

import errno
import os
import subprocess
import sys

import pytest
from helpers import EXAMPLE_CACHE, run_args, tokpipe

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
    assert (cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_INTERRUPTED) == (0, 1, 2, 130)
    assert (cli.EXIT_PIPE, cli.EXIT_TERMINATED) == (141, 143)


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


@pytest.mark.parametrize(
    "command, code",
    [
        (["status", "{out}"], 141),
        (["verify", "{out}", "--json"], 141),
        (["inspect", "{out}", "-n", "1"], 141),
        (["report", "{out}", "-o", "{tmp}/report.html"], 141),
        (["manifest", "--dataset-dir", str(EXAMPLE_CACHE), "-o", "{tmp}/m.json"], 141),
        (["status", "--help"], 0),  # argparse itself passes over a failed write of its help
    ],
    ids=["status", "verify", "inspect", "report", "manifest", "help"],
)
def test_a_command_whose_reader_went_away_stops_quietly(finished_example, tmp_path, command, code):
    """`tokpipe status OUT | head -1`: once head has its line, the pipe's reader is gone. The command ends as
    `yes | head -1` does (exit 141, as 128 + SIGPIPE), nothing on stderr. The reader here is gone before the
    command writes a byte, so the write surely fails (with head, it is a race)."""
    reader, writer = os.pipe()
    os.close(reader)
    args = [a.format(out=finished_example, tmp=tmp_path) for a in command]
    with os.fdopen(writer, "wb") as stdout:
        result = subprocess.run(
            [sys.executable, "-m", "tokpipe.cli", *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert (result.returncode, result.stderr) == (code, "")


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

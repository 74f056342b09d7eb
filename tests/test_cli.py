"""cli: the command line's contract. Exit 0 on success, 1 when the work failed (a shard, a check, the disk),
2 on bad usage or input, 130 when interrupted; every error is one readable line naming the command,
never a traceback. The commands' own output is documented with each command's module."""

import errno

import pytest
from helpers import tokpipe

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

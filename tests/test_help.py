"""What tokpipe reads is said where a user first looks: `tokpipe --help`, the package's description."""

import argparse

from helpers import REPO
from helpers import tokpipe as run_cli

import tokpipe
from tokpipe.cli import parser

FORMATS = "JSONL, zstd- or gzip-compressed JSONL, Parquet"


def test_help_and_description_say_which_formats_are_read():
    result = run_cli("--help")
    assert result.returncode == 0
    assert FORMATS in " ".join(result.stdout.split())  # argparse wraps the description
    assert FORMATS in " ".join(tokpipe.__doc__.split())
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
    result = run_cli("run", "--help")
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

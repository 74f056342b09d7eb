"""What tokpipe reads is said where a user first looks: `tokpipe --help`, the package's description."""

from helpers import REPO
from helpers import tokpipe as run_cli

import tokpipe

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

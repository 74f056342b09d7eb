"""What a run tells as it goes: events, not prints. The driver hands each to its listener (`tell`); the CLI
prints them, one line each, as `tokpipe run` always has; a library caller of `tokpipe.run` hears nothing
unless it passes a listener (`tell=print` prints them all on stdout). The run's outcome is no event: it is
the value `run` returns (driver.RunSummary), which the CLI renders (cli.summary_lines)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Said:
    """A line the run tells: about its plan, its backend, Ray, what it resumed, what failed, its progress.
    `stderr`: a line the CLI prints on stderr (progress, failures), not stdout."""

    text: str
    stderr: bool = False

    def __str__(self) -> str:
        return self.text


Listener = Callable[[Said], None]


def silent(event: Said) -> None:
    """The listener of a caller that asked for none."""

"""What a run tells as it goes: events, not prints. The driver hands each to its listener (`tell`); the CLI
prints them, one line each, as `tokpipe run` always has; a library caller of `tokpipe.run` hears nothing
unless it passes a listener (`tell=print` prints them all on stdout). The run's outcome is the value `run`
returns (driver.RunSummary); a run that finalized OUT also tells it (`Finished`), before Ray is stopped, so the
CLI renders it (cli.summary_lines) as soon as it is known, as it always has."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Said:
    """A line the run tells: about its plan, its backend, Ray, what it resumed, what failed, its progress.
    `stderr`: a line the CLI prints on stderr (progress, failures), not stdout."""

    text: str
    stderr: bool = False

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Finished:
    """The run finalized OUT: its summary (driver.RunSummary), the value `run` then returns."""

    summary: Any


Listener = Callable[[Said | Finished], None]


def lines_only(tell: Callable[[Said], None]) -> Listener:
    """A listener that passes `tell` the lines a run says, not its summary (which the caller gets as a value)."""
    return lambda event: tell(event) if isinstance(event, Said) else None


def silent(event: Said | Finished) -> None:
    """The listener of a caller that asked for none."""

"""`tokpipe report OUT [-o FILE]`: a run drawn on one self-contained HTML page (default OUT/report.html).

For a finished run and for one still running, killed or failed: the summary a trainer needs, document
lengths, per-shard tokens / bytes per token / time / skips, throughput over time with the phases and
attempts, token-id health as `inspect` judges it, and where an unfinished run stands with the command
that resumes it. `data` computes it from OUT's files (a `Report`); `page` writes the HTML around the
figures `charts` draws (matplotlib, imported only when a page is drawn, so `tokpipe --help` and
`import tokpipe` never load it).
"""

from __future__ import annotations

import os
from pathlib import Path

from tokpipe.commands.report.data import Report, build
from tokpipe.durability import write_atomic
from tokpipe.layout.files import Layout

__all__ = ["Report", "build", "write_report"]


def write_report(
    out: str | os.PathLike, dest: str | os.PathLike | None = None, tokenizer: str | None = None
) -> tuple[Path, int]:
    """Write the page; returns (its path, its size in bytes)."""
    from tokpipe.commands.report.page import render

    report = build(out, tokenizer)
    path = Path(dest) if dest is not None else Layout(out).report
    data = render(report).encode("utf-8")
    write_atomic(path, data)
    return path, len(data)

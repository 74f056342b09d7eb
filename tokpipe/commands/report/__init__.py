"""`tokpipe report OUT [-o FILE]`: a run drawn on one self-contained HTML page (default OUT/report.html; for an OUT on
a store, `<its last name>-report.html` in the current folder: such an OUT has one writer, its run, and the page is for
a browser here).

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
from tokpipe.errors import UserError
from tokpipe.layout.files import Layout
from tokpipe.layout.stored import reader_out, stored_of

__all__ = ["Report", "build", "write_report"]


def write_report(
    out: str | os.PathLike, dest: str | os.PathLike | None = None, tokenizer: str | None = None
) -> tuple[Path, int]:
    """Write the page; returns (its path, its size in bytes)."""
    from tokpipe.commands.report.page import render

    out = reader_out(out)  # once: build reads the same copy of a store's records
    stored = stored_of(out)
    if dest is not None:
        path = Path(dest)
    elif stored is not None:
        path = Path(f"{Path(stored.url.key).name or stored.url.bucket}-report.html")
    else:
        path = Layout(out).report
        if not os.access(out, os.W_OK):  # a trainer's read-only mount of OUT: asked before the page is drawn
            raise UserError(f"cannot write the page into {out} (read-only here): name its place with -o FILE")
    data = render(build(out, tokenizer)).encode("utf-8")
    write_atomic(path, data)
    return path, len(data)

"""The report's figures: matplotlib, drawn to inline SVG strings for `page`.

matplotlib is imported inside `_plt` only, when a page is drawn: importing this module (and `tokpipe`,
`tokpipe --help`) never loads it. Text in the charts is drawn as glyph outlines (the layout matplotlib
measured is the one shown, in any browser). Colours mean one thing each: red a red flag or failure,
orange partial, grey pending, green ok or done; data without a verdict is blue.
"""

from __future__ import annotations

import io
import logging
import warnings

import numpy as np

from tokpipe.commands.report.data import STATES, GroupStats, Health, Lengths, ProgressStats, Shards

RED, ORANGE, GREY, GREEN, BLUE = "#c62828", "#ef6c00", "#9e9e9e", "#2e7d32", "#3b6ea8"
SKIP = "#8d6e63"  # lines skipped: counted, not a failure
STATE_COLOURS = {"done": GREEN, "partial": ORANGE, "pending": GREY, "failed": RED}
SPLIT_COLOURS = {"train": BLUE, "validation": "#7b52a3", "test": "#8d6e3f"}
PHASE_COLOURS = {"plan": "#e0e0e0", "tokenize": "#dbe8f6", "finalize": "#dcefdc"}
BARS_AT_MOST = 40  # shards drawn as labelled bars; more are drawn as dots in manifest order
WIDTH = 11.0  # inches of a full-width chart (at 96 dpi: ~1,050 px)
RC = {
    "font.size": 10,
    "svg.fonttype": "path",
    "svg.hashsalt": "tokpipe",
    "text.parse_math": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
}


def _plt():
    """matplotlib, imported here only: the rest of tokpipe starts without it."""
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)  # a glyph DejaVu lacks: a box, not a warning
    plt.rcParams.update(RC)
    return plt


def _si(value: float, _pos=None) -> str:
    """Axis numbers that stay short: 950, 12k, 1.5M, 4.3G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def _axis(ax, which: str = "x", log: bool = False) -> None:
    """Short numbers on an axis (and no minor labels on a log one)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    if log:
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(_si))


def _bar_labels(ax, y, values, labels: list[str], points: float, **style) -> None:
    """Each horizontal bar's label just past its end, `points` to the right."""
    for yy, v, label in zip(y, values, labels):
        ax.annotate(label, (v, yy), xytext=(points, 0), textcoords="offset points", va="center", **style)


def _svg(fig) -> str:
    buf = io.StringIO()
    # A label in a script its font lacks (a group named in Chinese: FineWeb-2's languages) is drawn as boxes, and the
    # table beside the chart names it exactly; matplotlib warned on the terminal for each glyph, twice.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Glyph \d+ .* missing from font", UserWarning)
        fig.tight_layout()
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    _plt().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def lengths(found: list[Lengths]) -> str:
    """One histogram per split of tokens per document (log scale), median, p99 and max marked."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(found), figsize=(WIDTH, 3.2), squeeze=False)
    for ax, L in zip(axes[0], found):
        edges = np.array(L.edges, dtype=float)
        ax.bar(
            edges[:-1],
            L.counts,
            width=np.diff(edges),
            align="edge",
            color=SPLIT_COLOURS.get(L.split, BLUE),
            alpha=0.85,
            edgecolor="white",
            linewidth=0.4,
        )
        _axis(ax, log=True)
        _axis(ax, "y")
        for value, style, label in ((L.median, "-", "median"), (L.p99, "--", "p99"), (L.max, ":", "max")):
            ax.axvline(value, color="#222", linestyle=style, linewidth=1.1, label=f"{label} {value:,.0f}")
        ax.legend(loc="upper left", fontsize=8.5, frameon=False)
        sampled = "" if L.sampled == L.documents else f", {L.sampled:,} sampled"
        ax.set_title(f"{L.split}: {L.documents:,} documents{sampled}")
        ax.set_xlabel("tokens per document (log scale)")
        ax.set_ylabel("documents")
    return _svg(fig)


def shards(S: Shards) -> str:
    """Tokens, input bytes per token, seconds and lines skipped per shard: bars, or dots for many shards."""
    rows = S.rows
    plt = _plt()
    outliers = set(S.outliers)

    def colour(x) -> str:
        if x.state != "done":
            return STATE_COLOURS[x.state]
        return RED if x.relpath in outliers else SPLIT_COLOURS.get(x.split, BLUE)

    colours = [colour(x) for x in rows]
    bpt = np.array([x.bytes_per_token or np.nan for x in rows])
    panels = [  # (title, values, the median's line, colours)
        ("tokens", np.array([x.tokens for x in rows]), None, colours),
        ("input bytes per token", bpt, S.median_bytes_per_token, colours),
        ("seconds tokenizing", np.array([x.seconds for x in rows]), None, colours),
        ("lines skipped", np.array([sum(x.skipped.values()) for x in rows]), None, SKIP),
    ]
    if len(rows) <= BARS_AT_MOST:
        fig, axes = plt.subplots(1, 4, figsize=(WIDTH, 1.2 + 0.28 * len(rows)), sharey=True)
        y = np.arange(len(rows))[::-1]
        for ax, (title, values, median, c) in zip(axes, panels):
            ax.barh(y, np.nan_to_num(values), color=c, height=0.7)
            if median:
                ax.axvline(median, color="#222", linestyle="--", linewidth=1)
            ax.set_title(title, fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
            _axis(ax)
        axes[0].set_yticks(y, [_short(x.relpath) for x in rows], fontsize=8.5)
    else:
        fig, axes = plt.subplots(4, 1, figsize=(WIDTH, 7.5), sharex=True)
        x = np.arange(len(rows))
        marked = [i for i, c in enumerate(colours) if c in (RED, ORANGE)]  # outliers, failed, partial
        for ax, (title, values, median, c) in zip(axes, panels):
            ax.scatter(x, values, s=6 if len(rows) < 2000 else 2, c=c, linewidths=0, rasterized=True)
            if marked and c is colours:  # drawn larger, on top
                ax.scatter(
                    x[marked], values[marked], s=14, c=[colours[i] for i in marked], linewidths=0, rasterized=True
                )
            if median:
                ax.axhline(median, color="#222", linestyle="--", linewidth=1)
            ax.set_ylabel(title, fontsize=9)
            _axis(ax, "y")
        axes[-1].set_xlabel(f"shard, in manifest order ({len(rows):,} shards: every shard drawn)")
    return _svg(fig)


def _short(relpath: str, width: int = 34) -> str:
    return relpath if len(relpath) <= width else "…" + relpath[-(width - 1) :]


def _rates(points: list[dict]) -> tuple[np.ndarray, ...]:
    """Per interval between consecutive points of one attempt: (midpoint time, tokens/s, MB/s, workers busy %)."""
    t = np.array([p["t"] for p in points], dtype=float)
    k, b = np.array([p["k"] for p in points], dtype=float), np.array([p["b"] for p in points], dtype=float)
    dt = np.maximum(np.diff(t), 1e-9)
    return t, np.diff(k) / dt, np.diff(b) / dt / 1e6, np.array([_busy(p) for p in points])


def _busy(point: dict) -> float:
    """The share of the workers on a shard at a point, in %; a series of a tokpipe that did not record its
    workers ("w") counts the driver alone."""
    return 100 * min(point["r"] / max(point.get("w", 1), 1), 1.0)


def attempts(series: list[dict]) -> list:
    """The attempts a series tells of, in order."""
    return sorted({x.get("attempt", x.get("a")) for x in series})


def throughput(series: list[dict], state: str) -> str:
    """Tokens/s, input MB/s and the workers' busy share over time, with the phases shaded and each attempt marked."""
    plt = _plt()
    t0 = min(x["t"] for x in series)
    span = max(x["t"] for x in series) - t0
    unit, scale = ("hours", 3600) if span > 3 * 3600 else ("minutes", 60) if span > 180 else ("seconds", 1)

    def at(t):  # a time on the x axis
        return (t - t0) / scale

    corner = {"xycoords": ("data", "axes fraction"), "textcoords": "offset points", "va": "top", "fontsize": 8.5}
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 6.2), sharex=True, gridspec_kw={"height_ratios": [3, 3, 2]})
    tried = attempts(series)
    for a in tried:
        mine = [x for x in series if x.get("attempt", x.get("a")) == a]
        points = [x for x in mine if "b" in x]
        marks = [(x["t"], "plan") for x in mine if "attempt" in x]
        marks += [(x["t"], x["phase"]) for x in mine if "phase" in x]
        end = max(x["t"] for x in mine)
        for (start, phase), nxt in zip(marks, [m[0] for m in marks[1:]] + [end]):
            if phase in PHASE_COLOURS and nxt > start:
                for ax in axes:
                    ax.axvspan(at(start), at(nxt), color=PHASE_COLOURS[phase], zorder=0, linewidth=0)
        if len(tried) > 1:
            for ax in axes:
                ax.axvline(at(marks[0][0]), color="#555", linestyle="--", linewidth=0.9)
            axes[0].annotate(f"attempt {a}", (at(marks[0][0]), 1), xytext=(3, -2), color="#333", **corner)
        ended = {p for _, p in marks} & {"failed", "finished"}
        live = a == tried[-1] and state == "running"
        if not ended and not live:
            ended = {"stopped (killed?)"}
        if ended - {"finished"}:
            what = (ended - {"finished"}).pop()
            colour = RED if what == "failed" else "#555"
            axes[0].annotate(what, (at(end), 1), xytext=(-3, -2), ha="right", color=colour, **corner)
        if len(points) >= 2:
            t, tok, mb, running = _rates(points)
            x = at(t)
            axes[0].stairs(tok / 1e6, x, color=BLUE, linewidth=1.4, baseline=None)
            axes[1].stairs(mb, x, color="#00897b", linewidth=1.4, baseline=None)
            axes[2].step(x, running, where="post", color=ORANGE, linewidth=1.4)
        elif points:
            axes[2].plot([at(points[0]["t"])], [_busy(points[0])], "o", color=ORANGE)
    for ax, label in zip(axes, ("M tokens/s", "input MB/s", "workers busy %")):
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[2].set_ylim(0, 105)
    axes[-1].set_xlabel(f"{unit} since the first attempt started")
    return _svg(fig)


def _label(c: dict) -> str:
    text = c["text"]
    if text is None:
        return f"id {c['id']}"
    shown = repr(text) if all(ord(ch) < 0x2000 for ch in text) else ascii(text)
    return f"{c['id']}  {shown[:22]}"


def health(h: Health) -> str:
    """One split's ids against vocab_size and the dtype, and the shares of its most frequent ids."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 3.4), gridspec_kw={"width_ratios": [2, 3]})
    limit_bad = h.vocab_size > h.dtype_limit
    names, values = ["max id", "vocab_size", f"{h.dtype} limit"], [h.max_id, h.vocab_size, h.dtype_limit]
    colours = [RED if h.max_id >= h.vocab_size else GREEN, RED if limit_bad else BLUE, RED if limit_bad else GREY]
    y = np.arange(3)[::-1]
    ax1.barh(y, values, left=1, color=colours, height=0.6)
    _axis(ax1, log=True)
    ax1.set_xlim(1, max(values) * 300)
    ax1.set_yticks(y, names)
    _bar_labels(ax1, y, values, [f"{v:,}" for v in values], 4, fontsize=8.5)
    ax1.set_title("ids vs what holds them (log scale)")
    flagged = {f["name"] for f in h.flags if not f["ok"]}
    boundary_bad = any(n.startswith(f"share of {h.boundary}") for n in flagged)
    zero_bad = "share of id 0" in flagged
    # The delimiter and id 0 always get a bar, below the most frequent ids: their shares are the checks.
    bars = [(_label(c), 100 * c["share"], RED if c["id"] == 0 and zero_bad else BLUE) for c in h.common]
    bars += [
        (
            f"{h.boundary} ({h.boundary_id}), expected {100 * h.expected_boundary_share:.2f}%",
            100 * h.boundary_share,
            RED if boundary_bad else GREEN,
        ),
        ("id 0", 100 * h.zero_share, RED if zero_bad else GREEN),
    ]
    yc = np.arange(len(bars))[::-1]
    ax2.barh(yc, [b[1] for b in bars], color=[b[2] for b in bars], height=0.7)
    ax2.set_yticks(yc, [b[0] for b in bars], fontsize=8.5)
    _bar_labels(ax2, yc, [b[1] for b in bars], [f"{b[1]:.2f}%" for b in bars], 3, fontsize=7.5, color="#444")
    ax2.set_xlabel("% of ids scanned")
    ax2.set_title("most frequent ids (decoded), the delimiter and id 0")
    return _svg(fig)


def progress(p: ProgressStats) -> str:
    """Shards per split by state, stacked."""
    plt = _plt()
    splits = list(p.by_split)
    fig, ax = plt.subplots(figsize=(WIDTH, 0.7 + 0.45 * len(splits)))
    y = np.arange(len(splits))[::-1]
    left = np.zeros(len(splits))
    total = max(sum(p.by_split[s][x] for x in STATES for s in splits), 1)
    inside = {"ha": "center", "va": "center", "color": "white", "fontsize": 8.5, "fontweight": "bold"}
    for state in STATES:
        values = np.array([p.by_split[s][state] for s in splits], dtype=float)
        if values.any():
            ax.barh(
                y, values, left=left, color=STATE_COLOURS[state], height=0.6, label=f"{state} {int(values.sum()):,}"
            )
            for yy, lft, v in zip(y, left, values):
                if v and v / total > 0.04:
                    ax.annotate(f"{int(v):,}", (lft + v / 2, yy), **inside)
            left += values
    ax.set_yticks(y, splits)
    ax.set_xlabel("shards")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=9)
    return _svg(fig)


def groups(found: list[GroupStats]) -> str:
    """Tokens per group, one panel per split, each bar labelled with its documents and bytes per token: past
    BARS_AT_MOST groups, the largest and a bar of the others (the table lists every one)."""
    plt = _plt()
    drawn = {split: _largest([g for g in found if g.split == split]) for split in dict.fromkeys(g.split for g in found)}
    rows = sum(map(len, drawn.values()))
    height = 0.8 + 0.32 * rows + 0.5 * len(drawn)  # a row a group, a title a split
    fig, axes = plt.subplots(len(drawn), 1, figsize=(WIDTH, height), squeeze=False)
    for ax, (split, mine) in zip(axes[:, 0], drawn.items()):
        y = np.arange(len(mine))[::-1]
        ax.barh(y, [g.tokens for g in mine], color="#1f77b4", height=0.6)
        labels = [f" {g.documents:,} docs, {g.bytes_per_token or 0:.2f} B/token" for g in mine]
        _bar_labels(ax, y, [g.tokens for g in mine], labels, 0, fontsize=8, color="#444")
        ax.set_yticks(y, [_short(g.group, 28) for g in mine])
        ax.set_title(f"{split}: tokens per group")
        _axis(ax)
        ax.set_xlim(0, max(g.tokens for g in mine) * 1.45 or 1)
    return _svg(fig)


def _largest(mine: list[GroupStats]) -> list[GroupStats]:
    """A split's groups to draw, in order of their values: all, or the largest and one of the others (FineWeb-2's
    1,868 languages were a chart 600 inches tall)."""
    if len(mine) <= BARS_AT_MOST:
        return mine
    kept = set(sorted(mine, key=lambda g: -g.tokens)[: BARS_AT_MOST - 1])
    rest = [g for g in mine if g not in kept]
    tokens, documents, text_bytes = (sum(n) for n in zip(*((g.tokens, g.documents, g.text_bytes) for g in rest)))
    other = GroupStats(mine[0].split, f"{len(rest):,} other groups", tokens, documents, text_bytes)
    return [g for g in mine if g in kept] + [other]

"""The report's page: charts drawn by matplotlib as inline SVG, tables, and the data as a JSON blob.

No script runs and nothing is fetched: the page is HTML, CSS and SVG, so it opens the same offline,
in any browser, printed, or in a mail client. Text in the charts is drawn as glyph outlines (the
layout matplotlib measured is the one shown, in any browser). Colours mean one thing each: red a
red flag or failure, orange partial, grey pending, green ok or done; data without a verdict is blue.
"""

from __future__ import annotations

import html
import io
import json
import logging
import time

import numpy as np

from tokpipe.report.data import STATES, Report
from tokpipe.status import duration

RED, ORANGE, GREY, GREEN, BLUE = "#c62828", "#ef6c00", "#9e9e9e", "#2e7d32", "#3b6ea8"
SKIP = "#8d6e63"  # lines skipped: counted, not a failure
STATE_COLOURS = {"done": GREEN, "partial": ORANGE, "pending": GREY, "failed": RED}
SPLIT_COLOURS = {"train": BLUE, "validation": "#7b52a3", "test": "#8d6e3f"}
PHASE_COLOURS = {"plan": "#e0e0e0", "tokenize": "#dbe8f6", "finalize": "#dcefdc"}
BARS_AT_MOST = 40  # shards drawn as labelled bars; more are drawn as dots in manifest order
WIDTH = 11.0  # inches of a full-width chart (at 96 dpi: ~1,050 px)
STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:6px 0 10px} td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums} code,pre{font:12.5px ui-monospace,Menlo,Consolas,monospace}
pre{background:#f6f6f6;padding:8px 10px;white-space:pre-wrap;word-break:break-all}
.badge{display:inline-block;padding:1px 9px;border-radius:10px;color:#fff;font-weight:600}
.ok{color:#2e7d32} .bad{color:#c62828;font-weight:600} .warn{color:#ef6c00} .muted{color:#777}
tr.bad td{background:#fdecea} tr.ok td:first-child{border-left:4px solid #2e7d32} tr.bad td:first-child{border-left:4px solid #c62828}
svg{max-width:100%;height:auto} .note{color:#555;font-size:13px}
"""


def _plt():
    """matplotlib, imported here only: the rest of tokpipe starts without it."""
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)  # a glyph DejaVu lacks: a box, not a warning
    plt.rcParams.update({"font.size": 10, "svg.fonttype": "path", "svg.hashsalt": "tokpipe", "text.parse_math": False,
                         "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 11, "axes.titleweight": "bold"})  # fmt: skip
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


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    _plt().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _e(x) -> str:
    return html.escape(str(x))


def _n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:,.3g}" if isinstance(x, float) else _e(x)


def _table(head: list[str], rows: list[list], numeric: set[int] = frozenset(), classes: list[str] | None = None) -> str:
    th = "".join(f'<th class="n">{_e(h)}</th>' if i in numeric else f"<th>{_e(h)}</th>" for i, h in enumerate(head))
    body = []
    for k, row in enumerate(rows):
        cls = f' class="{classes[k]}"' if classes and classes[k] else ""
        body.append(
            f"<tr{cls}>"
            + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
            + "</tr>"
        )
    return f"<table><tr>{th}</tr>{''.join(body)}</table>"


def _reasons(d: dict) -> str:
    return ", ".join(f"{_e(k)} {v:,}" for k, v in d.items()) or '<span class="muted">none</span>'


def _summary(r: Report) -> str:
    s = r.summary
    delims = " and ".join(k.upper() for k in ("bos", "eos") if s["delimiters"][k])
    where = (
        "before"
        if s["delimiters"]["bos"] and not s["delimiters"]["eos"]
        else "after"
        if not s["delimiters"]["bos"]
        else "around"
    )
    rows = [
        ["dtype", f"<code>{_e(s['dtype'])}</code>"],
        ["vocab_size", f"{s['vocab_size']:,} <span class=muted>(len(tokenizer): build the model's embedding from this)</span>"],
        ["EOS", f"<code>{_e(s['eos_token'])}</code> = {s['eos_token_id']}"],
        ["BOS", f"<code>{_e(s.get('bos_token'))}</code> = {s['bos_token_id']}" if s["bos_token_id"] is not None else '<span class="muted">none</span>'],
        ["delimiters", f"{_e(delims)} {where} each document"],
        ["tokenizer", (f"<code>{_e(s['tokenizer'])}</code><br><span class=muted>sha256</span> <code>{_e(s['tokenizer_sha256'])}</code>"
                       f"<br><span class=muted>path</span> <code>{_e(s['tokenizer_path'])}</code>")],
        ["text field", f"<code>{_e(s['text_field'])}</code>"],
        ["val fraction", f"{s['val_fraction']}"],
    ]  # fmt: skip
    if s.get("excluded"):
        rows.append(
            [
                "EXCLUDED",
                f'<span class="bad">{len(s["excluded"])} failed shards left out: {_e(", ".join(s["excluded"]))}</span>',
            ]
        )
    facts = _table(["what a trainer needs", ""], rows)
    head = [
        "split",
        "file",
        "tokens",
        "documents",
        "lines read",
        "lines skipped",
        "skipped by reason",
        "repaired",
        "held out",
        "held in",
        "shards",
    ]
    split_rows = [
        [_e(x.name), f"<code>{_e(x.file)}</code>", _n(x.tokens), _n(x.documents), _n(x.lines), _n(sum(x.skipped.values())),
         _reasons(x.skipped), _reasons(x.repaired), _n(x.held_out), _n(x.held_in), _n(x.shards)]
        for x in r.splits
    ]  # fmt: skip
    what = "meta.json: exact" if r.finished else "committed so far (shard checkpoints): the run is not finished"
    return f"<h2>Summary</h2><p class=note>{what}</p>{facts}{_table(head, split_rows, {2, 3, 4, 5, 8, 9, 10})}"


def _lengths(r: Report) -> str:
    if not r.lengths:
        return "<h2>Document lengths</h2><p>No documents written yet.</p>"
    plt = _plt()
    fig, axes = plt.subplots(1, len(r.lengths), figsize=(WIDTH, 3.2), squeeze=False)
    for ax, L in zip(axes[0], r.lengths):
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
    fig.tight_layout()
    return f"<h2>Document lengths</h2>{_svg(fig)}"


def _shards(r: Report) -> str:
    S, rows = r.shards, r.shards.rows
    if not rows:
        return ""
    plt = _plt()
    outliers = set(S.outliers)
    bpt = np.array([x.bytes_per_token or np.nan for x in rows])
    skipped = np.array([sum(x.skipped.values()) for x in rows])
    panels = [("tokens", np.array([x.tokens for x in rows]), None), ("input bytes per token", bpt, S.median_bytes_per_token),
              ("seconds tokenizing", np.array([x.seconds for x in rows]), None), ("lines skipped", skipped, None)]  # fmt: skip

    def colour(x) -> str:
        if x.state != "done":
            return STATE_COLOURS[x.state]
        return RED if x.relpath in outliers else SPLIT_COLOURS.get(x.split, BLUE)

    colours = [colour(x) for x in rows]
    if len(rows) <= BARS_AT_MOST:
        fig, axes = plt.subplots(1, 4, figsize=(WIDTH, 1.2 + 0.28 * len(rows)), sharey=True)
        y = np.arange(len(rows))[::-1]
        for ax, (title, values, median) in zip(axes, panels):
            ax.barh(y, np.nan_to_num(values), color=SKIP if title == "lines skipped" else colours, height=0.7)
            if median:
                ax.axvline(median, color="#222", linestyle="--", linewidth=1)
            ax.set_title(title, fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
            _axis(ax)
        axes[0].set_yticks(y, [_short(x.relpath) for x in rows], fontsize=8.5)
    else:
        fig, axes = plt.subplots(4, 1, figsize=(WIDTH, 7.5), sharex=True)
        x = np.arange(len(rows))
        for ax, (title, values, median) in zip(axes, panels):
            ax.scatter(
                x,
                values,
                s=6 if len(rows) < 2000 else 2,
                c=SKIP if title == "lines skipped" else colours,
                linewidths=0,
                rasterized=True,
            )
            marked = [
                i for i, c in enumerate(colours) if c in (RED, ORANGE)
            ]  # outliers, failed, partial: drawn larger, on top
            if marked and title != "lines skipped":
                ax.scatter(
                    x[marked], values[marked], s=14, c=[colours[i] for i in marked], linewidths=0, rasterized=True
                )
            if median:
                ax.axhline(median, color="#222", linestyle="--", linewidth=1)
            ax.set_ylabel(title, fontsize=9)
            _axis(ax, "y")
        axes[-1].set_xlabel(f"shard, in manifest order ({len(rows):,} shards: every shard drawn)")
    fig.tight_layout()
    legend = " ".join(
        f'<span style="color:{c}">■</span> {k}' for k, c in SPLIT_COLOURS.items() if any(x.split == k for x in rows)
    )
    legend += f' <span style="color:{RED}">■</span> bytes per token off the median by more than 1.5× (or failed)'
    legend += "".join(
        f' <span style="color:{STATE_COLOURS[s]}">■</span> {s}'
        for s in ("partial", "pending")
        if any(x.state == s for x in rows)
    )
    median = (
        f"median {S.median_bytes_per_token:.2f} input bytes per token (dashed)"
        if S.median_bytes_per_token
        else "no input bytes recorded (checkpoints of an earlier tokpipe)"
    )
    out = [(f"<h2>Shards</h2><p class=note>{legend}<br>{median}; input bytes are the decompressed lines (JSONL) or texts (Parquet) read."
            f" Lines skipped by reason: {_reasons(S.skipped)}</p>"), _svg(fig)]  # fmt: skip
    named = [x for x in rows if x.relpath in outliers or x.state == "failed" or (x.state == "partial")]
    if named:
        shown = named[:15]
        table = [[_e(x.relpath), f'<span class="{"bad" if x.state == "failed" else ""}">{x.state}</span>', _n(x.tokens),
                  f"{x.bytes_per_token:.2f}" if x.bytes_per_token else "–", _e(x.error or "")] for x in shown]  # fmt: skip
        more = (
            f"<p class=note>… and {len(named) - len(shown):,} more (the page's data lists up to 500)</p>"
            if len(named) > len(shown)
            else ""
        )
        out.append(
            "<p><b>Shards to look at</b> (outliers, failed, partial):</p>"
            + _table(["shard", "state", "tokens", "bytes/token", "error"], table, {2, 3})
            + more
        )
    return "".join(out)


def _short(relpath: str, width: int = 34) -> str:
    return relpath if len(relpath) <= width else "…" + relpath[-(width - 1) :]


def _rates(points: list[dict]) -> tuple[np.ndarray, ...]:
    """Per interval between consecutive points of one attempt: (midpoint time, tokens/s, MB/s, shards running)."""
    t = np.array([p["t"] for p in points], dtype=float)
    k, b = np.array([p["k"] for p in points], dtype=float), np.array([p["b"] for p in points], dtype=float)
    dt = np.maximum(np.diff(t), 1e-9)
    return t, np.diff(k) / dt, np.diff(b) / dt / 1e6, np.array([p["r"] for p in points])


def _throughput(r: Report) -> str:
    head = "<h2>Throughput over the run</h2>"
    if not r.series:
        return (
            head
            + "<p class=note>No time series in this OUT (logs/series.jsonl is written by <code>tokpipe run</code> from this version on).</p>"
        )
    plt = _plt()
    t0 = min(x["t"] for x in r.series)
    span = max(x["t"] for x in r.series) - t0
    unit, scale = ("hours", 3600) if span > 3 * 3600 else ("minutes", 60) if span > 180 else ("seconds", 1)
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 6.2), sharex=True, gridspec_kw={"height_ratios": [3, 3, 2]})
    attempts = sorted({x.get("attempt", x.get("a")) for x in r.series})
    for a in attempts:
        mine = [x for x in r.series if x.get("attempt", x.get("a")) == a]
        points = [x for x in mine if "b" in x]
        marks = [(x["t"], "plan") for x in mine if "attempt" in x] + [
            (x["t"], x["phase"]) for x in mine if "phase" in x
        ]
        end = max(x["t"] for x in mine)
        for (start, phase), nxt in zip(marks, [m[0] for m in marks[1:]] + [end]):
            if phase in PHASE_COLOURS and nxt > start:
                for ax in axes:
                    ax.axvspan(
                        (start - t0) / scale, (nxt - t0) / scale, color=PHASE_COLOURS[phase], zorder=0, linewidth=0
                    )
        if len(attempts) > 1:
            for ax in axes:
                ax.axvline((marks[0][0] - t0) / scale, color="#555", linestyle="--", linewidth=0.9)
            axes[0].annotate(f"attempt {a}", ((marks[0][0] - t0) / scale, 1), xycoords=("data", "axes fraction"), xytext=(3, -2),
                             textcoords="offset points", va="top", fontsize=8.5, color="#333")  # fmt: skip
        ended = {p for _, p in marks} & {"failed", "finished"}
        live = a == attempts[-1] and r.progress.state == "running"
        if not ended and not live:
            ended = {"stopped (killed?)"}
        if ended - {"finished"}:
            what = (ended - {"finished"}).pop()
            axes[0].annotate(what, ((end - t0) / scale, 1), xycoords=("data", "axes fraction"), xytext=(-3, -2), textcoords="offset points",
                             ha="right", va="top", color=RED if what == "failed" else "#555", fontsize=8.5)  # fmt: skip
        if len(points) >= 2:
            t, tok, mb, running = _rates(points)
            x = (t - t0) / scale
            axes[0].stairs(tok / 1e6, x, color=BLUE, linewidth=1.4, baseline=None)
            axes[1].stairs(mb, x, color="#00897b", linewidth=1.4, baseline=None)
            axes[2].step(x, running, where="post", color=ORANGE, linewidth=1.4)
        elif points:
            axes[2].plot([(points[0]["t"] - t0) / scale], [points[0]["r"]], "o", color=ORANGE)
    for ax, label in zip(axes, ("M tokens/s", "input MB/s", "shards running")):
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[2].yaxis.get_major_locator().set_params(integer=True)
    axes[-1].set_xlabel(f"{unit} since the first attempt started")
    fig.tight_layout()
    legend = " ".join(
        f'<span style="background:{c};padding:0 8px;border:1px solid #ccc"></span> {p}'
        for p, c in PHASE_COLOURS.items()
    )
    points = sum(1 for x in r.series if "b" in x)
    note = f"{len(attempts)} attempt{'s' if len(attempts) > 1 else ''}, {points:,} points; phases: {legend}. Rates are per interval between points (input bytes: compressed, as read)."
    return f"{head}<p class=note>{note}</p>{_svg(fig)}"


def _label(c: dict) -> str:
    text = c["text"]
    if text is None:
        return f"id {c['id']}"
    shown = repr(text) if all(ord(ch) < 0x2000 for ch in text) else ascii(text)
    return f"{c['id']}  {shown[:22]}"


def _health(r: Report) -> str:
    out = [
        "<h2>Token-id health</h2><p class=note>As <code>tokpipe inspect</code> judges it (red: a red flag; do not train before you know why).</p>"
    ]
    if not r.health:
        return out[0] + "<p>No tokens written yet.</p>"
    plt = _plt()
    for h in r.health:
        scanned = "the whole split" if h.whole else "evenly spread blocks"
        out.append(f"<h3>{_e(h.split)}: {h.scanned:,} ids scanned ({scanned})</h3>")
        rows = [[("✔ " if f["ok"] else "✘ ") + _e(f["name"]), _e(f["detail"])] for f in h.flags]
        out.append(_table(["check", "found"], rows, classes=["ok" if f["ok"] else "bad" for f in h.flags]))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 3.4), gridspec_kw={"width_ratios": [2, 3]})
        limit_bad = h.vocab_size > h.dtype_limit
        names, values = ["max id", "vocab_size", f"{h.dtype} limit"], [h.max_id, h.vocab_size, h.dtype_limit]
        colours = [RED if h.max_id >= h.vocab_size else GREEN, RED if limit_bad else BLUE, RED if limit_bad else GREY]
        y = np.arange(3)[::-1]
        ax1.barh(y, values, left=1, color=colours, height=0.6)
        _axis(ax1, log=True)
        ax1.set_xlim(1, max(values) * 300)
        ax1.set_yticks(y, names)
        for yy, v in zip(y, values):
            ax1.annotate(
                f"{v:,}", (v, yy), xytext=(4, 0), textcoords="offset points", ha="left", va="center", fontsize=8.5
            )
        ax1.set_title("ids vs what holds them (log scale)")
        flagged = {f["name"] for f in h.flags if not f["ok"]}
        boundary_bad, zero_bad = (
            any(n.startswith(f"share of {h.boundary}") for n in flagged),
            "share of id 0" in flagged,
        )
        # The delimiter and id 0 always get a bar, below the most frequent ids: their shares are the checks.
        bars = [(_label(c), 100 * c["share"], RED if c["id"] == 0 and zero_bad else BLUE) for c in h.common]
        bars += [(f"{h.boundary} ({h.boundary_id}), expected {100 * h.expected_boundary_share:.2f}%", 100 * h.boundary_share, RED if boundary_bad else GREEN),
                 ("id 0", 100 * h.zero_share, RED if zero_bad else GREEN)]  # fmt: skip
        yc = np.arange(len(bars))[::-1]
        ax2.barh(yc, [b[1] for b in bars], color=[b[2] for b in bars], height=0.7)
        ax2.set_yticks(yc, [b[0] for b in bars], fontsize=8.5)
        for yy, (_, share, _) in zip(yc, bars):
            ax2.annotate(
                f"{share:.2f}%",
                (share, yy),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7.5,
                color="#444",
            )
        ax2.set_xlabel("% of ids scanned")
        ax2.set_title("most frequent ids (decoded), the delimiter and id 0")
        fig.tight_layout()
        out.append(_svg(fig))
        if h.decoded:
            out.append(f"<p class=note>ids not decoded: {_e(h.decoded)}</p>")
    return "".join(out)


def _progress(r: Report) -> str:
    p = r.progress
    badge = {"finished": GREEN, "running": ORANGE, "stopped": RED if p.counts["failed"] else GREY}[p.state]
    head = f'<h2>Where the run stands: <span class="badge" style="background:{badge}">{p.state}</span></h2>'
    plt = _plt()
    splits = list(p.by_split)
    fig, ax = plt.subplots(figsize=(WIDTH, 0.7 + 0.45 * len(splits)))
    y = np.arange(len(splits))[::-1]
    left = np.zeros(len(splits))
    for state in STATES:
        values = np.array([p.by_split[s][state] for s in splits], dtype=float)
        if values.any():
            ax.barh(
                y, values, left=left, color=STATE_COLOURS[state], height=0.6, label=f"{state} {int(values.sum()):,}"
            )
            for yy, lft, v in zip(y, left, values):
                if v and v / max(sum(p.by_split[s][x] for x in STATES for s in splits), 1) > 0.04:
                    ax.annotate(
                        f"{int(v):,}",
                        (lft + v / 2, yy),
                        ha="center",
                        va="center",
                        color="white",
                        fontsize=8.5,
                        fontweight="bold",
                    )
            left += values
    ax.set_yticks(y, splits)
    ax.set_xlabel("shards")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=9)
    fig.tight_layout()
    lines = [(f"shards: {', '.join(f'{p.counts[s]:,} {s}' for s in STATES)} (of {sum(p.counts.values()):,}); "
              f"{100 * p.bytes_read / max(p.bytes_total, 1):.1f}% of {p.bytes_total / 2**20:,.1f} MiB of input read")]  # fmt: skip
    if p.rate_mb_s:
        lines.append(
            f"input rate: {p.rate_mb_s:.2f} MB/s ({'this run' if p.state == 'running' else 'the last attempt'})"
        )
    if p.projected_finish:
        lines.append(
            f"projected finish: {time.strftime('%Y-%m-%d %H:%M', time.localtime(p.projected_finish))} (in {duration(p.eta_s)})"
        )
    elif p.eta_s is not None:
        lines.append(f"left: ~{duration(p.eta_s)} of tokenizing at that rate, once resumed")
    if p.holder:
        lines.append(f"held by {_e(p.holder)}")
    return f"{head}<p>{'<br>'.join(lines)}</p>{_svg(fig)}<p>Next:</p><pre>{_e(p.next)}</pre>"


def render(r: Report) -> str:
    state = r.progress.state
    colour = {"finished": GREEN, "running": ORANGE}.get(state, RED if r.progress.counts["failed"] else GREY)
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.generated_at))
    blob = json.dumps(r.as_json(), separators=(",", ":"), ensure_ascii=True).replace("</", "<\\/")
    notes = "".join(f"<li>{_e(n)}</li>" for n in r.notes)
    sections = [_summary(r), _lengths(r), _shards(r), _throughput(r), _health(r), _progress(r)]
    if state != "finished":  # what an unfinished run needs first: where it stands and how to go on
        sections = [sections[-1], *sections[:-1]]
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>tokpipe report: {_e(r.out)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head><body>'
        f'<h1>tokpipe report: <code>{_e(r.out)}</code> <span class="badge" style="background:{colour}">{state}</span></h1>'
        f"<p class=note>generated {generated} by <code>tokpipe report</code> from OUT's files; the data behind it is in the "
        f"<code>tokpipe-data</code> JSON block of this page.</p>"
        + (f"<ul class=note>{notes}</ul>" if notes else "")
        + "".join(sections)
        + f'<script type="application/json" id="tokpipe-data">{blob}</script></body></html>'
    )

"""The report's page: HTML tables and sections around the charts (`charts`, matplotlib as inline SVG),
and the data as a JSON blob.

No script runs and nothing is fetched: the page is HTML, CSS and SVG, so it opens the same offline,
in any browser, printed, or in a mail client. Colours mean one thing each: red a red flag or failure,
orange partial, grey pending, green ok or done; data without a verdict is blue.
"""

from __future__ import annotations

import html
import json
import time

from tokpipe.commands.report import charts
from tokpipe.commands.report.charts import GREEN, GREY, ORANGE, PHASE_COLOURS, RED, SPLIT_COLOURS, STATE_COLOURS
from tokpipe.commands.report.data import STATES, ProgressStats, Report
from tokpipe.fmt import duration

STYLE = (
    "\n"
    'body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;'
    "margin:24px auto;max-width:1100px;color:#222;padding:0 16px}\n"
    "h1{font-size:22px;margin:0 0 4px} "
    "h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}\n"
    "table{border-collapse:collapse;margin:6px 0 10px} "
    "td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}\n"
    "td.n,th.n{text-align:right;font-variant-numeric:tabular-nums} "
    "code,pre{font:12.5px ui-monospace,Menlo,Consolas,monospace}\n"
    "pre{background:#f6f6f6;padding:8px 10px;white-space:pre-wrap;word-break:break-all}\n"
    ".badge{display:inline-block;padding:1px 9px;border-radius:10px;color:#fff;font-weight:600}\n"
    ".ok{color:#2e7d32} .bad{color:#c62828;font-weight:600} .warn{color:#ef6c00} .muted{color:#777}\n"
    "tr.bad td{background:#fdecea} tr.ok td:first-child{border-left:4px solid #2e7d32} "
    "tr.bad td:first-child{border-left:4px solid #c62828}\n"
    "svg{max-width:100%;height:auto} .note{color:#555;font-size:13px}\n"
)


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
    placed = s["delimiters"]
    delims = " and ".join(k.upper() for k in ("bos", "eos") if placed[k])
    where = "around" if placed["bos"] and placed["eos"] else "before" if placed["bos"] else "after"
    bos = (
        f"<code>{_e(s.get('bos_token'))}</code> = {s['bos_token_id']}"
        if s["bos_token_id"] is not None
        else '<span class="muted">none</span>'
    )
    tokenizer = (
        f"<code>{_e(s['tokenizer'])}</code>"
        f"<br><span class=muted>sha256</span> <code>{_e(s['tokenizer_sha256'])}</code>"
        f"<br><span class=muted>path</span> <code>{_e(s['tokenizer_path'])}</code>"
    )
    vocab = f"{s['vocab_size']:,} <span class=muted>(len(tokenizer): build the model's embedding from this)</span>"
    rows = [
        ["dtype", f"<code>{_e(s['dtype'])}</code>"],
        ["vocab_size", vocab],
        ["EOS", f"<code>{_e(s['eos_token'])}</code> = {s['eos_token_id']}"],
        ["BOS", bos],
        ["delimiters", f"{_e(delims)} {where} each document"],
        ["tokenizer", tokenizer],
        ["text field", f"<code>{_e(s['text_field'])}</code>"],
        ["val fraction", f"{s['val_fraction']}"],
    ]
    if s.get("excluded"):
        excluded = f"{len(s['excluded'])} failed shards left out: {_e(', '.join(s['excluded']))}"
        rows.append(["EXCLUDED", f'<span class="bad">{excluded}</span>'])
    facts = _table(["what a trainer needs", ""], rows)
    head = ["split", "file", "tokens", "documents", "lines read", "lines skipped", "skipped by reason", "repaired"]
    head += ["held out", "held in", "shards"]
    split_rows = [
        [_e(x.name), f"<code>{_e(x.file)}</code>", *map(_n, (x.tokens, x.documents, x.lines, sum(x.skipped.values())))]
        + [_reasons(x.skipped), _reasons(x.repaired), *map(_n, (x.held_out, x.held_in, x.shards))]
        for x in r.splits
    ]
    what = "meta.json: exact" if r.finished else "committed so far (shard checkpoints): the run is not finished"
    return f"<h2>Summary</h2><p class=note>{what}</p>{facts}{_table(head, split_rows, {2, 3, 4, 5, 8, 9, 10})}"


def _groups(r: Report) -> str:
    if not r.groups:
        return ""
    rows = [
        [_e(g.split), _e(g.group), _n(g.tokens), _n(g.documents), _n(g.text_bytes), f"{g.bytes_per_token or 0:.2f}"]
        for g in r.groups
    ]
    head = ["split", "group", "tokens", "documents", "text bytes", "bytes per token"]
    what = "meta.json: exact" if r.finished else "committed so far (shard checkpoints)"
    return (
        f"<h2>Groups (<code>--group-by {_e(r.summary.get('group_by'))}</code>)</h2><p class=note>{what}; bytes per"
        f" token are the UTF-8 bytes of the group's texts per token</p>{_table(head, rows, {2, 3, 4, 5})}"
        f"{charts.groups(r.groups)}"
    )


def _lengths(r: Report) -> str:
    if not r.lengths:
        return "<h2>Document lengths</h2><p>No documents written yet.</p>"
    return f"<h2>Document lengths</h2>{charts.lengths(r.lengths)}"


def _shards(r: Report) -> str:
    S, rows = r.shards, r.shards.rows
    if not rows:
        return ""
    outliers = set(S.outliers)
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
    out = [
        f"<h2>Shards</h2><p class=note>{legend}<br>{median}; "
        "input bytes are the decompressed lines (JSONL) or texts (Parquet) read."
        f" Lines skipped by reason: {_reasons(S.skipped)}</p>",
        charts.shards(S),
    ]
    named = [x for x in rows if x.relpath in outliers or x.state == "failed" or (x.state == "partial")]
    if named:
        shown = named[:15]
        table = [
            [
                _e(x.relpath),
                f'<span class="{"bad" if x.state == "failed" else ""}">{x.state}</span>',
                _n(x.tokens),
                f"{x.bytes_per_token:.2f}" if x.bytes_per_token else "–",
                _e(x.error or ""),
            ]
            for x in shown
        ]
        out.append(
            "<p><b>Shards to look at</b> (outliers, failed, partial):</p>"
            + _table(["shard", "state", "tokens", "bytes/token", "error"], table, {2, 3})
        )
        if len(named) > len(shown):
            out.append(f"<p class=note>… and {len(named) - len(shown):,} more (the page's data lists up to 500)</p>")
    return "".join(out)


def _throughput(r: Report) -> str:
    head = "<h2>Throughput over the run</h2>"
    if not r.series:
        return (
            head + "<p class=note>No time series in this OUT (logs/series.jsonl is written by <code>tokpipe run</code>"
            " from this version on).</p>"
        )
    attempts = charts.attempts(r.series)
    legend = " ".join(
        f'<span style="background:{c};padding:0 8px;border:1px solid #ccc"></span> {p}'
        for p, c in PHASE_COLOURS.items()
    )
    points = sum(1 for x in r.series if "b" in x)
    note = (
        f"{len(attempts)} attempt{'s' if len(attempts) > 1 else ''}, {points:,} points; phases: {legend}."
        " Rates are per interval between points (input bytes: compressed, as read)."
    )
    return f"{head}<p class=note>{note}</p>{charts.throughput(r.series, r.progress.state)}"


def _health(r: Report) -> str:
    out = [
        "<h2>Token-id health</h2><p class=note>As <code>tokpipe inspect</code> judges it"
        " (red: a red flag; do not train before you know why).</p>"
    ]
    if not r.health:
        return out[0] + "<p>No tokens written yet.</p>"
    for h in r.health:
        scanned = "the whole split" if h.whole else "evenly spread blocks"
        rows = [[("✔ " if f["ok"] else "✘ ") + _e(f["name"]), _e(f["detail"])] for f in h.flags]
        table = _table(["check", "found"], rows, classes=["ok" if f["ok"] else "bad" for f in h.flags])
        out += [f"<h3>{_e(h.split)}: {h.scanned:,} ids scanned ({scanned})</h3>", table, charts.health(h)]
        if h.decoded:
            out.append(f"<p class=note>ids not decoded: {_e(h.decoded)}</p>")
    return "".join(out)


def _badge(p: ProgressStats) -> str:
    colour = {"finished": GREEN, "running": ORANGE}.get(p.state, RED if p.counts["failed"] else GREY)
    return f'<span class="badge" style="background:{colour}">{p.state}</span>'


def _progress(r: Report) -> str:
    p = r.progress
    head = f"<h2>Where the run stands: {_badge(p)}</h2>"
    lines = [
        f"shards: {', '.join(f'{p.counts[s]:,} {s}' for s in STATES)} (of {sum(p.counts.values()):,}); "
        f"{100 * p.bytes_read / max(p.bytes_total, 1):.1f}% of {p.bytes_total / 2**20:,.1f} MiB of input read"
    ]
    if p.rate_mb_s:
        lines.append(
            f"input rate: {p.rate_mb_s:.2f} MB/s ({'this run' if p.state == 'running' else 'the last attempt'})"
        )
    if p.projected_finish:
        finish = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.projected_finish))
        lines.append(f"projected finish: {finish} (in {duration(p.eta_s)})")
    elif p.eta_s is not None:
        lines.append(f"left: ~{duration(p.eta_s)} of tokenizing at that rate, once resumed")
    if p.holder:
        lines.append(f"held by {_e(p.holder)}")
    return f"{head}<p>{'<br>'.join(lines)}</p>{charts.progress(p)}<p>Next:</p><pre>{_e(p.next)}</pre>"


def render(r: Report) -> str:
    state = r.progress.state
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.generated_at))
    blob = json.dumps(r.as_json(), separators=(",", ":"), ensure_ascii=True).replace("</", "<\\/")
    notes = "".join(f"<li>{_e(n)}</li>" for n in r.notes)
    sections = [_summary(r), _groups(r), _lengths(r), _shards(r), _throughput(r), _health(r), _progress(r)]
    if state != "finished":  # what an unfinished run needs first: where it stands and how to go on
        sections = [sections[-1], *sections[:-1]]
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>tokpipe report: {_e(r.out)}</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{STYLE}</style></head><body>"
        f"<h1>tokpipe report: <code>{_e(r.out)}</code> {_badge(r.progress)}</h1>"
        f"<p class=note>generated {generated} by <code>tokpipe report</code> from OUT's files; "
        "the data behind it is in the "
        "<code>tokpipe-data</code> JSON block of this page.</p>"
        + (f"<ul class=note>{notes}</ul>" if notes else "")
        + "".join(sections)
        + f'<script type="application/json" id="tokpipe-data">{blob}</script></body></html>'
    )

"""`tokpipe report`: the page's numbers against OUT's own files, for a finished and a killed run; the
time series writer (bounded, torn lines, attempts); the CLI's messages; matplotlib stays out of the CLI's start."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import EXAMPLE_CACHE, QWEN3, REPO, can_make_mount_namespaces, checkpoints_by_key, cli, tokpipe, unguarded

from tokpipe.layout import series as series_mod
from tokpipe.layout.series import Series, read_series

BLOB = re.compile(r'<script type="application/json" id="tokpipe-data">(.*?)</script>', re.DOTALL)


def page_data(page: str) -> dict:
    found = BLOB.findall(page)
    assert len(found) == 1
    return json.loads(found[0])


def assert_offline(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE), (
        "the page fetches something"
    )
    assert not re.search(r"@import|url\(\s*['\"]?https?:", page, re.IGNORECASE)
    for tag in re.findall(r"<script[^>]*>", page):  # no code runs: data only
        assert 'type="application/json"' in tag


def lengths_of(idx: Path) -> np.ndarray:
    return np.diff(np.fromfile(idx, dtype="<i8"), prepend=0)


def test_finished_run_page_matches_meta_parts_idx_and_bins(finished_example, tmp_path):
    out = finished_example
    dest = tmp_path / "page.html"
    result = cli("report", out, "-o", dest)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{dest}: ") and " MB" in result.stdout and len(result.stdout.splitlines()) == 1
    page = dest.read_text()
    assert_offline(page)
    data = page_data(page)
    meta = json.loads((out / "meta.json").read_text())

    assert data["finished"] and data["progress"]["state"] == "finished"
    for key in (
        "dtype",
        "vocab_size",
        "eos_token",
        "eos_token_id",
        "bos_token",
        "bos_token_id",
        "delimiters",
        "val_fraction",
        "tokenizer",
        "tokenizer_sha256",
    ):
        assert data["summary"][key] == meta[key], key
    assert [s["name"] for s in data["splits"]] == list(meta["splits"])
    for s in data["splits"]:
        m = meta["splits"][s["name"]]
        for key in ("tokens", "documents", "lines", "skipped", "repaired", "held_out", "held_in", "shards"):
            assert s[key] == m[key], (s["name"], key)
        assert f"{m['tokens']:,}" in page and f"{m['documents']:,}" in page  # the exact numbers are on the page too

    # Document lengths: from the .idx, independently.
    for L in data["lengths"]:
        lengths = lengths_of(out / meta["splits"][L["split"]]["idx"])
        assert L["documents"] == L["sampled"] == len(lengths) == meta["splits"][L["split"]]["documents"]
        assert (L["median"], L["max"]) == (float(np.median(lengths)), int(lengths.max()))
        assert L["p99"] == pytest.approx(float(np.percentile(lengths, 99)))
        assert sum(L["counts"]) == len(lengths)

    # Per shard: the .parts lines, and the checkpoints' new fields.
    parts = {}
    for m in meta["splits"].values():
        for line in (out / m["parts"]).read_text().splitlines():
            r = json.loads(line)
            parts[r["shard"]] = r
    rows = data["shards"]["listed"]
    assert data["shards"]["all_listed"] and data["shards"]["count"] == len(rows) == 3
    for row in rows:
        r = parts[row["relpath"]]
        assert (row["tokens"], row["documents"], row["lines"], row["skipped"], row["state"]) == (
            r["tokens"],
            r["documents"],
            r["lines"],
            r["skipped"],
            "done",
        )
        [ckpt] = [c for key, c in checkpoints_by_key(out).items() if Path(row["relpath"]).name.split(".")[0] in key]
        assert row["text_bytes"] == ckpt["text_bytes"] == ckpt["offset"] > 0  # JSONL: every decompressed byte read
        assert row["seconds"] == ckpt["seconds"] > 0
    assert sum(data["shards"]["skipped"].values()) == sum(sum(m["skipped"].values()) for m in meta["splits"].values())

    # Token-id health: against the bins, read here.
    for h in data["health"]:
        ids = np.fromfile(out / meta["splits"][h["split"]]["file"], dtype=meta["dtype"])
        assert h["whole"] and h["scanned"] == len(ids)
        assert h["max_id"] == int(ids.max()) < h["vocab_size"] == meta["vocab_size"]
        assert h["zero_share"] == np.count_nonzero(ids == 0) / len(ids)
        assert h["boundary_share"] == np.count_nonzero(ids == meta["eos_token_id"]) / len(ids)
        assert all(f["ok"] for f in h["flags"])
        assert h["decoded"] is None and all(c["text"] is not None for c in h["common"])
    assert data["progress"]["counts"] == {"done": 3, "partial": 0, "pending": 0, "failed": 0}
    assert data["progress"]["next"] == f"tokpipe verify {out}"


def _killed_out(tmp_path: Path) -> Path:
    """OUT of a run stopped after some shards: one done, one cut after its first checkpoint, one never started;
    a series of two attempts, the second's last line torn as a kill -9 leaves it."""
    from tokpipe.inputs.manifest import build_manifest, write_manifest
    from tokpipe.inputs.tokenizer import load_tokenizer_info
    from tokpipe.options import RunOptions
    from tokpipe.runner.identity import encode_spec, record_run
    from tokpipe.write.shard import tokenize_shard

    out = tmp_path / "out"
    out.mkdir()
    manifest = build_manifest(EXAMPLE_CACHE)
    info = load_tokenizer_info(QWEN3)
    record_run(out, manifest, info, RunOptions())
    write_manifest(manifest, out / "manifest.json")
    spec = unguarded(encode_spec(RunOptions(), info, "gigatoken"), batch_bytes=64 << 10, checkpoint_interval=0.0)
    first, second, _ = manifest.shards()
    tokenize_shard(first, out, spec)
    calls = []

    def killed(*_):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the worker dies: two batches were checkpointed

    with pytest.raises(KeyboardInterrupt):
        tokenize_shard(second, out, spec, killed)
    lines = [
        {"attempt": 1, "t": 1000.0, "every": 1.0},
        {"a": 1, "t": 1002.0, "phase": "tokenize"},
        {"a": 1, "t": 1003.0, "b": 0, "k": 0, "d": 0, "r": 2, "s": 0},
        {"a": 1, "t": 1005.0, "b": 200_000, "k": 150_000, "d": 40, "r": 2, "s": 0},
        {"attempt": 2, "t": 2000.0, "every": 1.0},
        {"a": 2, "t": 2001.0, "phase": "tokenize"},
        {"a": 2, "t": 2002.0, "b": 200_000, "k": 0, "d": 0, "r": 2, "s": 0},
        {"a": 2, "t": 2004.0, "b": 600_000, "k": 400_000, "d": 150, "r": 1, "s": 1},
    ]
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "series.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"a":2,"t":2005.0,"b":7')
    return out


def test_killed_run_page_matches_checkpoints_and_status(tmp_path):
    from tokpipe.commands.report import build
    from tokpipe.commands.report.page import render
    from tokpipe.commands.status import status

    out = _killed_out(tmp_path)
    page = render(build(out))
    assert_offline(page)
    data = page_data(page)
    st = status(out)
    assert not data["finished"] and data["progress"]["state"] == st.state == "stopped"
    assert data["progress"]["counts"] == {"done": 1, "partial": 1, "pending": 1, "failed": 0}
    assert data["progress"]["next"] == st.next and "tokpipe run --manifest" in page
    assert data["progress"]["bytes_read"] == sum(s.read for s in st.shards)
    assert data["progress"]["rate_mb_s"] == pytest.approx(0.2)  # the last attempt: 400,000 bytes in 2 s
    assert data["progress"]["eta_s"] == pytest.approx(
        (sum(s.size for s in st.shards) - sum(s.read for s in st.shards)) / 200_000
    )

    ckpts = checkpoints_by_key(out)
    assert sorted(c["done"] for c in ckpts.values()) == [False, True]
    run = json.loads((out / "run.json").read_text())
    for key in ("dtype", "vocab_size", "eos_token_id", "tokenizer", "tokenizer_sha256", "delimiters", "val_fraction"):
        assert data["summary"][key] == run[key], key
    [train] = [s for s in data["splits"] if s["name"] == "train"]
    assert train["tokens"] == sum(c["tokens"] for c in ckpts.values()) and train["documents"] == sum(
        c["documents"] for c in ckpts.values()
    )
    assert train["lines"] == sum(c["lines"] for c in ckpts.values())
    [val] = [s for s in data["splits"] if s["name"] == "validation"]
    assert (val["tokens"], val["documents"]) == (0, 0)
    rows = {r["relpath"]: r for r in data["shards"]["listed"]}
    for s in st.shards:
        assert (rows[s.relpath]["state"], rows[s.relpath]["tokens"], rows[s.relpath]["documents"]) == (
            s.state,
            s.tokens,
            s.documents,
        )
    [partial] = [r for r in rows.values() if r["state"] == "partial"]
    assert 0 < partial["text_bytes"] < partial["size"] * 10 and partial["seconds"] > 0

    [L] = data["lengths"]  # train only: what the checkpoints cover, shard by shard
    lengths = np.concatenate(
        [lengths_of(p)[: ckpts[p.stem]["documents"]] for p in sorted((out / "shards" / "train").glob("*.idx"))]
    )
    assert L["documents"] == len(lengths) == train["documents"] and L["max"] == int(lengths.max())
    [h] = data["health"]
    assert h["split"] == "train" and h["scanned"] == train["tokens"]
    # The torn line is skipped; both attempts are drawn.
    assert len(data["series"]) == 8 and {x.get("attempt") for x in data["series"]} >= {1, 2}
    assert "attempt 2" in page or "2 attempts" in page


def test_series_is_bounded_keeps_attempts_and_survives_a_torn_line(tmp_path, monkeypatch):
    monkeypatch.setattr(series_mod, "MAX_POINTS", 20)
    s = Series(tmp_path)
    s.mark("tokenize")
    for i in range(101):
        s.point(i * 10, i * 7, i, 2, i // 10, 4, final=True)
    s.close()
    records = read_series(tmp_path)
    points = [r for r in records if "b" in r]
    assert 10 <= len(points) <= 20
    assert points[0]["b"] == 0 and points[-1]["b"] == 1000  # first and last kept
    assert [r["phase"] for r in records if "phase" in r] == ["tokenize"]
    assert records[0]["every"] > 1.0  # each thinning doubles the interval
    with open(tmp_path / "logs" / "series.jsonl", "ab") as f:
        f.write(b'{"a":1,"t":12')  # kill -9 mid-line
    assert read_series(tmp_path) == records
    again = Series(tmp_path)
    again.point(2000, 1, 1, 1, 1, 1, final=True)
    again.close()
    after = read_series(tmp_path)
    assert after[: len(records)] == records and after[len(records)]["attempt"] == 2 and after[-1]["b"] == 2000
    assert (tmp_path / "logs" / "series.jsonl").read_bytes().endswith(b"\n")


def test_cli_errors_and_matplotlib_stays_out_of_the_cli(tmp_path):
    missing = cli("report", tmp_path / "nothing")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    empty = cli("report", tmp_path)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "holds no tokpipe run" in empty.stderr
    code = (
        "import sys, tokpipe, tokpipe.cli; tokpipe.cli.parser().parse_args(['report', 'X']); "
        "assert 'matplotlib' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0
    assert "report" in cli("--help").stdout


def test_report_shows_each_groups_tokens_documents_and_bytes_per_token(finished_grouped, grouped_reference):
    """--group-by: a table and a chart of each split's groups, their text's UTF-8 bytes per token exact."""
    from tokpipe.commands.report.data import build
    from tokpipe.commands.report.page import render

    r = build(finished_grouped)
    expected = [
        (split, group, len(tokens), documents, round(text_bytes / len(tokens), 6))
        for split, stem in (("train", "train"), ("validation", "val"))
        for group, (tokens, documents, text_bytes) in grouped_reference[stem].items()
    ]
    assert [(g.split, g.group, g.tokens, g.documents, round(g.bytes_per_token, 6)) for g in r.groups] == expected
    page = render(r)
    assert "<h2>Groups (<code>--group-by meta.redpajama_set_name</code>)</h2>" in page


def test_a_group_named_in_a_script_the_font_lacks_is_drawn_without_a_word_on_the_terminal():
    """Groups are the data's values: matplotlib's font has no CJK and no glyph for a control character, and it
    warned on the terminal for each (4 lines from one report); the chart draws boxes, the table names them."""
    from tokpipe.commands.report.charts import groups
    from tokpipe.commands.report.data import GroupStats

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        page = groups([GroupStats("train", name, 10, 2, 40) for name in ("中文", "日本語", "nul\u0000byte", "en")])
    assert page.startswith("<svg") and [str(w.message) for w in said] == []

def test_past_40_groups_the_chart_draws_the_largest_and_one_bar_of_the_others():
    """FineWeb-2's 1,868 languages were a chart 600 inches tall: 39 bars of the largest groups, in order of their
    values, then one of the rest with their sums; the table above it lists every group."""
    from tokpipe.commands.report.charts import _largest, groups
    from tokpipe.commands.report.data import GroupStats

    found = [GroupStats("train", f"g{i:03d}", i + 1, 2, 4 * (i + 1)) for i in range(100)]
    drawn = _largest(found)
    other = GroupStats("train", "61 other groups", sum(range(1, 62)), 122, 4 * sum(range(1, 62)))
    assert drawn == found[61:] + [other] and other.bytes_per_token == 4.0
    svg = groups(found)
    assert all(f"<!-- {g.group} -->" in svg for g in drawn) and "<!-- g060 -->" not in svg
    assert _largest(found[:40]) == found[:40]


def test_a_damaged_log_is_a_note_of_the_page_and_the_rest_is_drawn(killed_example, tmp_path):
    """A log is not the run's state: the page says a damaged progress.json (a JSONDecodeError traceback before)
    among its notes, as status's warning, and draws the rest."""
    out = tmp_path / "out"
    shutil.copytree(killed_example, out)
    (out / "logs").mkdir()
    (out / "logs" / "progress.json").write_text('{"pid": 4242, "updated_at": 17')
    result = cli("report", out)
    assert (result.returncode, result.stderr) == (0, "")
    assert page_data((out / "report.html").read_text())["notes"] == [
        f"{out}/logs/progress.json is damaged (JSONDecodeError: Expecting ',' delimiter: line 1 column 31 (char 30)):"
        " a log, not the run's state: the next run writes it anew"
    ]


def test_the_page_s_default_place_is_out_in_a_folder_and_the_current_folder_for_an_out_on_a_store(
    finished_either, tmp_path
):
    result = tokpipe("report", finished_either, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    if finished_either.startswith("s3://"):
        shown = f"{finished_either.rsplit('/', 1)[1]}-report.html"
        page = tmp_path / shown
    else:
        page = Path(finished_either) / "report.html"
        shown = str(page)
    assert result.stdout.startswith(f"{shown}: ")
    assert "859,703" in page.read_text()  # train's tokens, as meta says
    # -o names the page's file: a folder is refused before the page is drawn, and nothing is left beside it.
    folder = tmp_path / "pages"
    folder.mkdir()
    refused = cli("report", finished_either, "-o", folder)
    assert (refused.returncode, refused.stderr) == (
        2,
        f"tokpipe report: error: -o {folder} is a folder: name the page's file (e.g. -o {folder}/report.html)\n",
    )
    assert not list(folder.iterdir()) and not list(tmp_path.glob("pages.*"))  # no page, no page's temporary file


@pytest.mark.skipif(not can_make_mount_namespaces(), reason="needs root and unshare -m")
def test_an_out_mounted_read_only_asks_for_the_page_s_place_in_one_line(out, tmp_path):
    mounted = f"mount --bind {out} {out} && mount -o remount,ro,bind {out}"
    report = f"{sys.executable} -m tokpipe.cli report {out}"
    refused = subprocess.run(["unshare", "-m", "sh", "-c", f"{mounted} && {report}"], capture_output=True, text=True)
    assert (refused.returncode, refused.stderr) == (
        2,
        f"tokpipe report: error: cannot write the page into {out} (read-only here): name its place with -o FILE\n",
    )


def test_an_unfinished_out_on_a_store_is_drawn_from_its_checkpoints_and_segments(unfinished_stored, small_reference):
    """Killed as its finish began: the page counts its checkpoints, and reads its documents and ids in its segments;
    the command it gives names OUT by its URL."""
    from tokpipe.commands.report import build
    from tokpipe.commands.report.page import render

    page = render(build(unfinished_stored))
    assert f"<title>tokpipe report: {unfinished_stored}</title>" in page
    data = page_data(page)
    assert not data["finished"] and data["progress"]["state"] == "stopped"
    assert data["progress"]["counts"] == {"done": 3, "partial": 0, "pending": 0, "failed": 0}
    assert data["progress"]["next"].endswith(f" --out {unfinished_stored}")
    for entry, stem in zip(data["lengths"], ("train", "val")):
        ends = np.flatnonzero(small_reference[stem] == 0) + 1  # the 600-id tokenizer's EOS is id 0
        assert (entry["documents"], entry["max"]) == (len(ends), np.diff(ends, prepend=0).max())
    assert [(h["split"], h["scanned"]) for h in data["health"]] == [
        ("train", len(small_reference["train"])),
        ("validation", len(small_reference["val"])),
    ]

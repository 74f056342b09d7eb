"""tokpipe throughput and memory benchmark: one command, one machine, one results table (+ JSON).

    python benchmarks/bench.py --source ../shared/data/hf-cache --sizes 100MB,300MB --workers 2 \
        --tokenizer examples/tokenizers/qwen3 [--datatrove /tmp/venv-dt/bin/python]

On the same cores, in one run:
  1. corpora of each size (zstd JSONL shards repeating the source; cached under --work-dir);
  2. raw encoder throughput: N processes encoding in-memory text (gigatoken as tokpipe calls it, the
     bare Rust call, and tokenizers for scale), on the same text each pipeline run tokenizes;
  3. `tokpipe run --workers N` end to end on each size: wall time, MB/s of text, tokens/s, the phases
     (from the driver's timestamped output), peak RSS and CPU of the driver, each Ray worker and
     Ray's own processes;
  4. the marginal throughput between the two sizes (fixed start-up cancels) and its ratio to raw;
  5. finalize and verify timed on their own (GB/s of token files);
  6. datatrove's DocumentTokenizer on the same corpora and worker count (--datatrove PYTHON);
  7. worker memory: peak RSS of tokenize_shard on growing shards and growing documents;
  8. driver scaling: the driver's RSS while it plans and runs manifests of many tiny shards, and
     finalize alone on as many finished shards.
Every timing is the median of --repeats runs; the machine is noisy, the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from corpus import build_corpus, build_distinct_corpus, parse_size, tiny_shards  # noqa: E402
from procmon import TreeMonitor  # noqa: E402

MiB = 2**20
TARGETS = {
    "marginal_vs_raw": 0.85,
    "vs_datatrove": 10.0,
    "worker_rss_mib": 1024,
    "finalize_gb_s": 1.0,
    "verify_gb_s": 0.5,
}


# ---------------------------------------------------------------------------------------------- runs


def run_monitored(cmd: list[str], *, env: dict | None = None, stop=None, timeout: float = 3600, interval: float = 0.1, cwd: str | None = None) -> dict:
    """Run cmd with its process tree watched; its output lines timestamped (seconds since start).

    `stop(mon, now, lines) -> bool` is asked at every poll; True interrupts the run (SIGINT, as a user's
    Ctrl-C, then SIGTERM/SIGKILL of its process group if it lingers).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env = {k: v for k, v in env.items() if v != "" or k != "RAY_ADDRESS"}
    lines: list[tuple[float, str]] = []
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, cwd=cwd)

    def pump() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = {"at": None}

    def on_sample(mon: TreeMonitor, now: float) -> None:
        if stopped["at"] is None and ((stop is not None and stop(mon, now, lines)) or now > timeout):
            stopped["at"] = now
            try:
                os.kill(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    with TreeMonitor(proc.pid, interval=interval, on_sample=on_sample) as mon:
        mon.t0 = started
        while proc.poll() is None:
            if stopped["at"] is not None and time.monotonic() - started - stopped["at"] > 60:
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
    wall = time.monotonic() - started
    reader.join(timeout=5)
    return {"cmd": cmd, "rc": proc.returncode, "wall_s": wall, "lines": lines, "stopped_at": stopped["at"], "procs": mon.summary(), "driver_samples": mon.samples}


def _first(lines, prefix: str, last: bool = False) -> float | None:
    hits = [t for t, line in lines if line.startswith(prefix)]
    return (hits[-1] if last else hits[0]) if hits else None


def phases(lines: list[tuple[float, str]], wall: float) -> dict:
    """Where the wall time of `tokpipe run` went, from the driver's own (unbuffered) output lines."""
    t_tok = _first(lines, "tokenizer ")  # imports, manifest load, tokenizer info, OUT lock/identity
    t_backend = _first(lines, "backend ")  # + sample texts, both encoders loaded, the self-check
    t_ray = _first(lines, "ray: ")  # + ray.init
    t_sched = _first(lines, "[tokpipe] ", last=True)  # the final progress line: every shard done
    t_split = next((t for t, line in lines if ": " in line and " tokens, " in line and " documents, " in line), None)
    t_done = _first(lines, "done in ")
    out = {}
    if None not in (t_tok, t_backend, t_ray, t_sched, t_split, t_done):
        out = {
            "startup_s": t_tok,
            "backend_check_s": t_backend - t_tok,
            "ray_init_s": t_ray - t_backend,
            "tokenize_s": t_sched - t_ray,
            "shutdown_finalize_s": t_split - t_sched,
            "exit_s": wall - t_done,
        }
    return out


def tokpipe_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokpipe.cli", *args]


# tokpipe's embedded Ray calls ray.init() without address="local", which joins any Ray cluster that
# another user started on this machine (/tmp/ray/ray_current_cluster). Benchmark runs get their own
# Ray temp dir, so they always start their own instance. Kept short: Ray's socket paths have a limit.
RAY_ENV = {"RAY_TMPDIR": "/tmp/tpb-ray", "RAY_ADDRESS": ""}
# The folder tokpipe commands run in. `python -m` puts the current directory first on sys.path, ahead
# of PYTHONPATH: ab.py sets this to the checkout under test, or the tokpipe in the cwd would be measured.
TOKPIPE_CWD: str | None = None


def tokpipe_env() -> dict:
    os.makedirs(RAY_ENV["RAY_TMPDIR"], exist_ok=True)
    return RAY_ENV


def e2e_run(corpus, manifest: Path, tokenizer: str, workers: int, out: Path) -> dict:
    import shutil

    if out.exists():
        shutil.rmtree(out)
    res = run_monitored(tokpipe_cmd("run", "--manifest", str(manifest), "--tokenizer", tokenizer, "--out", str(out), "--workers", str(workers)), env=tokpipe_env(), cwd=TOKPIPE_CWD)
    if res["rc"] != 0:
        tail = "\n".join(line for _, line in res["lines"][-20:])
        raise RuntimeError(f"tokpipe run failed ({res['rc']}):\n{tail}")
    meta = json.loads((out / "meta.json").read_text())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    wall = res["wall_s"]
    ph = phases(res["lines"], wall)
    workers_rows = res["procs"]["workers"]
    tasks = [w for w in workers_rows if w["kind"] == "task"]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "mb_s": corpus.text_bytes / wall / 1e6,
        "tok_s": tokens / wall,
        "tokenize_phase_mb_s": corpus.text_bytes / ph["tokenize_s"] / 1e6 if ph else None,
        "phases": ph,
        "driver": res["procs"]["driver"],
        "workers": workers_rows,
        "task_worker_peak_rss_mib": max((w["peak_rss_mib"] for w in tasks), default=None),
        "task_worker_peak_anon_mib": max((w["peak_anon_mib"] for w in tasks), default=None),
        "ray_system": res["procs"]["system"],
        "cpu_s": {
            "total": round(res["procs"]["driver"]["cpu_s"] + sum(w["cpu_s"] for w in workers_rows) + sum(s["cpu_s"] for s in res["procs"]["system"]), 2),
            "driver": res["procs"]["driver"]["cpu_s"],
            "task_workers": round(sum(w["cpu_s"] for w in tasks), 2),
            "other_workers": round(sum(w["cpu_s"] for w in workers_rows if w["kind"] != "task"), 2),
            "ray_system": round(sum(s["cpu_s"] for s in res["procs"]["system"]), 2),
        },
        "text_bytes": corpus.text_bytes,
    }


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, result


def finalize_and_verify(out: Path, tokenizer: str, repeats: int) -> dict:
    """finalize (again: it rebuilds the same bytes from the shards) and verify, each timed alone."""
    from tokpipe.finalize import finalize
    from tokpipe.manifest import load_manifest
    from tokpipe.tokenizer import load_tokenizer_info
    from tokpipe.verify import verify

    manifest = load_manifest(out / "manifest.json")
    info = load_tokenizer_info(tokenizer)
    meta = json.loads((out / "meta.json").read_text())
    token_bytes = sum((out / s["file"]).stat().st_size for s in meta["splits"].values())
    fin_s, fin_all, _ = timed(lambda: finalize(out, manifest, info, "text"), repeats)
    ver_s, ver_all, checks = timed(lambda: verify(out), repeats)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        raise RuntimeError(f"verify failed on a benchmark output: {failed}")
    return {
        "token_file_bytes": token_bytes,
        "shards": sum(manifest.counts.values()),
        "finalize_s": fin_s,
        "finalize_gb_s": token_bytes / fin_s / 1e9,
        "finalize_s_all": [round(t, 3) for t in fin_all],
        "verify_s": ver_s,
        "verify_gb_s": token_bytes / ver_s / 1e9,
        "verify_s_all": [round(t, 3) for t in ver_all],
        "verify_checks": len(checks),
    }


def datatrove_run(python: str, corpus, tokenizer_json: str, eos: str, workers: int, out: Path) -> dict:
    import shutil

    if out.exists():
        shutil.rmtree(out)
    res = run_monitored([python, str(HERE / "datatrove_run.py"), corpus.path, tokenizer_json, eos, str(workers), str(out)])
    if res["rc"] != 0:
        tail = "\n".join(line for _, line in res["lines"][-30:])
        raise RuntimeError(f"datatrove run failed ({res['rc']}):\n{tail}")
    result = json.loads([line for _, line in res["lines"] if line.startswith("{")][-1])
    everyone = [res["procs"]["driver"], *res["procs"]["system"], *res["procs"]["workers"]]
    return {
        "wall_s": res["wall_s"],
        "tokens": result["tokens"],
        "mb_s": corpus.text_bytes / res["wall_s"] / 1e6,
        "tok_s": result["tokens"] / res["wall_s"],
        "driver_peak_rss_mib": res["procs"]["driver"]["peak_rss_mib"],
        "max_process_peak_rss_mib": max(p["peak_rss_mib"] for p in everyone),
        "processes": len(everyone),
    }


# ------------------------------------------------------------------------------------ worker memory

RSS_PROBE = """
import sys, time
from pathlib import Path
from tokpipe.manifest import Shard
from tokpipe.shard import EncodeSpec, tokenize_shard
from tokpipe.tokenizer import load_tokenizer_info
info = load_tokenizer_info(sys.argv[2])
spec = EncodeSpec(info.path, "gigatoken", info.eos_id, info.vocab_size, info.dtype)
path = sys.argv[1]
t0 = time.perf_counter()
r = tokenize_shard(Shard("train", "probe", path, Path(path).stat().st_size, "probe"), sys.argv[3], spec)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # not ru_maxrss: inherited across fork
print(int(hwm.split()[1]) * 1024, r.checkpoint.tokens, time.perf_counter() - t0)
"""


def worker_rss(work_dir: Path, source: str, tokenizer: str, cases: list[tuple[int, int | None]]) -> list[dict]:
    """Peak RSS of one process running tokenize_shard (what a Ray task runs, without Ray's own ~80 MiB)
    on shards of growing size and documents of growing size."""
    import shutil

    from corpus import rss_shard

    rows = []
    for shard_bytes, doc_bytes in cases:
        path = rss_shard(work_dir, source, shard_bytes, doc_bytes)
        out = work_dir / "out" / "rss-probe"
        shutil.rmtree(out, ignore_errors=True)
        got = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path), tokenizer, str(out)], capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if got.returncode != 0:
            raise RuntimeError(f"rss probe failed on {path}:\n{got.stderr[-2000:]}")
        peak, tokens, seconds = got.stdout.split()
        rows.append({"shard_mb": shard_bytes / 1e6, "doc_mb": doc_bytes / 1e6 if doc_bytes else None, "peak_rss_mib": round(int(peak) / MiB, 1), "tokens": int(tokens), "seconds": round(float(seconds), 2)})
    shutil.rmtree(work_dir / "out" / "rss-probe", ignore_errors=True)
    return rows


# ----------------------------------------------------------------------------------- driver scaling


def driver_scaling(count: int, work_dir: Path, tokenizer: str, workers: int, run_seconds: float) -> dict:
    """Plan and run a manifest of `count` tiny shards; stop `run_seconds` after Ray is up."""
    import shutil

    folder = tiny_shards(count, work_dir)
    manifest = work_dir / "manifests" / f"tiny-{count}.json"
    built = run_monitored(tokpipe_cmd("manifest", "--dataset-dir", str(folder), "-o", str(manifest)))
    if built["rc"] != 0:
        raise RuntimeError("tokpipe manifest failed: " + "\n".join(line for _, line in built["lines"][-10:]))
    out = work_dir / "out" / f"tiny-{count}"
    if out.exists():
        shutil.rmtree(out)
    timeline: list[dict] = []
    state = {"ray_at": None, "next_read": 0.0}

    def stop(mon: TreeMonitor, now: float, lines) -> bool:
        if state["ray_at"] is None:
            state["ray_at"] = _first(lines, "ray: ")
        if now >= state["next_read"]:
            state["next_read"] = now + 1.0
            try:
                done = json.loads((out / "logs" / "progress.json").read_text())["shards"]["done"]
            except (OSError, ValueError, KeyError):
                done = None
            driver = mon.stats.get(mon.root)
            timeline.append({"t": round(now, 2), "done": done, "driver_rss_mib": round(driver.rss / MiB, 1) if driver else None})
        return state["ray_at"] is not None and now - state["ray_at"] >= run_seconds

    res = run_monitored(tokpipe_cmd("run", "--manifest", str(manifest), "--tokenizer", tokenizer, "--out", str(out), "--workers", str(workers)), stop=stop, env=tokpipe_env(), cwd=TOKPIPE_CWD)
    ray_at = _first(res["lines"], "ray: ")
    samples = res["driver_samples"]
    at_plan = next((rss for t, rss in samples if ray_at is not None and t >= ray_at), None)
    run_points = [p for p in timeline if ray_at is not None and p["t"] >= ray_at and p["done"] is not None]
    done = max((p["done"] for p in run_points), default=0)
    if res["rc"] == 0:
        done = count
    slope = None
    if len(run_points) >= 3 and run_points[-1]["done"] > run_points[0]["done"]:
        xs = [p["done"] for p in run_points]
        ys = [p["driver_rss_mib"] for p in run_points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 1000 if var else None
    run_s = (res["stopped_at"] or res["wall_s"]) - (ray_at or 0)
    by_name = {}
    for row in res["procs"]["system"] + res["procs"]["workers"]:
        key = "ProgressBoard actor" if row["kind"] == "actor" else row["names"][-1]
        by_name[key] = max(by_name.get(key, 0), row["peak_rss_mib"])
    return {
        "shards": count,
        "manifest_build_s": built["wall_s"],
        "manifest_build_peak_rss_mib": built["procs"]["driver"]["peak_rss_mib"],
        "manifest_file_mib": manifest.stat().st_size / MiB,
        "planning_s": ray_at,
        "driver_rss_at_plan_mib": round(at_plan / MiB, 1) if at_plan else None,
        "driver_peak_rss_mib": res["procs"]["driver"]["peak_rss_mib"],
        "driver_cpu_s": res["procs"]["driver"]["cpu_s"],
        "driver_rss_slope_mib_per_1k_shards": round(slope, 2) if slope is not None else None,
        "shards_done": done,
        "finished": res["rc"] == 0,
        "run_s": round(run_s, 1),
        "shards_per_s": round(done / run_s, 1) if run_s > 0 else None,
        "ray_process_peak_rss_mib": by_name,
        "timeline": timeline[:: max(1, len(timeline) // 40)],
        **finalize_scaling(count, manifest, out.with_name(f"finalize-{count}"), tokenizer),
    }


FINALIZE_ONLY = (
    "import sys; from tokpipe.finalize import finalize; from tokpipe.manifest import load_manifest; "
    "from tokpipe.tokenizer import load_tokenizer_info; finalize(sys.argv[1], load_manifest(sys.argv[2]), load_tokenizer_info(sys.argv[3]), 'text')"
)


def finalize_scaling(count: int, manifest: Path, out: Path, tokenizer: str) -> dict:
    """finalize of `count` finished shards in a fresh process: its seconds and peak RSS. The shards are
    written here (one document of two tokens each), not tokenized: this measures finalize alone."""
    import shutil
    from dataclasses import asdict

    import numpy as np

    from tokpipe.manifest import load_manifest
    from tokpipe.shard import IDX_DTYPE, Checkpoint, ShardFiles

    if out.exists():
        shutil.rmtree(out)
    done = json.dumps(asdict(Checkpoint(lines=1, documents=1, tokens=2, done=True)))
    for k, shard in enumerate(load_manifest(manifest).shards()):
        files = ShardFiles.of(out, shard)
        files.bin.parent.mkdir(parents=True, exist_ok=True)
        np.array([k % 1000, 0], dtype=np.uint32).tofile(files.bin)
        np.array([2], dtype=IDX_DTYPE).tofile(files.idx)
        files.checkpoint.write_text(done)
    res = run_monitored([sys.executable, "-c", FINALIZE_ONLY, str(out), str(manifest), tokenizer], cwd=TOKPIPE_CWD)
    if res["rc"] != 0:
        raise RuntimeError("finalize failed: " + "\n".join(line for _, line in res["lines"][-10:]))
    shutil.rmtree(out)
    return {"finalize_s": round(res["wall_s"], 2), "finalize_peak_rss_mib": res["procs"]["driver"]["peak_rss_mib"]}


# -------------------------------------------------------------------------------------------- report


def machine() -> dict:
    fields = {}
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    cpu = f"{fields.get('model name', platform.processor())} (family {fields.get('cpu family')}, model {fields.get('model')}, {float(fields.get('cpu MHz', 0)):.0f} MHz"
    cpu += ", virtual machine)" if "hypervisor" in fields.get("flags", "").split() else ")"
    mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    versions = {}
    for dist in ("tokpipe", "ray", "gigatoken", "tokenizers", "awkward", "numpy", "orjson", "zstandard"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": versions,
        "loadavg_start": os.getloadavg(),
    }


def fmt(value, spec=".1f", none="-"):
    return none if value is None else format(value, spec)


def table(results: dict) -> str:
    rows = []
    m = results["machine"]
    rows.append(f"machine: {m['cpu']}, {m['cores_usable']} cores usable, {m['memory_gib']} GiB, Python {m['python']}; "
                f"load average at start {m['loadavg_start'][0]:.2f}, at end {m.get('loadavg_end', [0])[0]:.2f}")
    rows.append("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + (f", datatrove {results['datatrove_version']}" if results.get("datatrove_version") else ""))
    w = results["args"]["workers"]
    rows.append("")
    rows.append(f"| measurement (workers={w}, medians of {results['args']['repeats']}) | " + " | ".join(c["label"] for c in results["corpora"]) + " | marginal |")
    rows.append("|---|" + "---:|" * (len(results["corpora"]) + 1))

    def line(name, values, marginal=None):
        rows.append(f"| {name} | " + " | ".join(values) + f" | {marginal or ''} |")

    corpora = results["corpora"]
    line("corpus: text MB / docs / shards", [f"{c['text_bytes'] / 1e6:.1f} / {c['documents']:,} / {len(c['shards'])}" for c in corpora])
    raw_of = lambda c: results["raw"].get(c["label"], {})  # noqa: E731
    for enc in results["raw_encoders"]:
        vals = [raw_of(c).get(enc) for c in corpora]
        mg = results["marginal"].get(f"raw_{enc}_mb_s")
        line(f"raw {enc}: MB/s of text", [fmt(v["mb_s"]) if v else "-" for v in vals], fmt(mg) if mg else None)
    for enc in results["raw_encoders"]:
        vals = [raw_of(c).get(enc) for c in corpora]
        line(f"raw {enc}, CPU-based: MB/s (text / (CPU s / N))", [fmt(v["cpu_mb_s"]) if v else "-" for v in vals], fmt(results["marginal"].get(f"raw_{enc}_cpu_mb_s")))
    if results.get("raw_cold"):
        rc = results["raw_cold"]
        line(f"raw gigatoken, cold (distinct text, {rc['text_bytes'] / 1e6:.0f} MB): MB/s", [fmt(rc["mb_s"])] + ["" for _ in corpora[1:]])
    if results.get("raw_tokenizers"):
        rt = results["raw_tokenizers"]
        line(f"raw tokenizers (reference, {rt['text_bytes'] / 1e6:.0f} MB): MB/s", [fmt(rt["mb_s"], ".2f")] + ["" for _ in corpora[1:]])
    if not all(c["label"] in results["e2e"] for c in corpora):
        return _extras(rows, results)
    e2e = [results["e2e"][c["label"]] for c in corpora]
    line("tokpipe run: wall s", [f"{e['wall_s']:.1f}" for e in e2e])
    line("tokpipe run: MB/s of text", [fmt(e["mb_s"]) for e in e2e], fmt(results["marginal"].get("e2e_mb_s")))
    line("tokpipe run: M tokens/s", [fmt(e["tok_s"] / 1e6, ".2f") for e in e2e], fmt((results["marginal"].get("e2e_tok_s") or 0) / 1e6, ".2f"))
    line("tokpipe tokenize phase only: MB/s", [fmt(e["tokenize_phase_mb_s"]) for e in e2e], fmt(results["marginal"].get("tokenize_phase_mb_s")))
    ratio = results["marginal"].get("ratio_e2e_to_raw")
    line("ratio tokpipe / raw gigatoken", [fmt(e["mb_s"] / raw_of(c)["gigatoken"]["mb_s"], ".2f") if "gigatoken" in raw_of(c) else "-" for e, c in zip(e2e, corpora)],
         f"**{ratio:.2f}** (target >= {TARGETS['marginal_vs_raw']})" if ratio else None)
    rc = results["marginal"].get("ratio_e2e_to_raw_cpu")
    line("tokpipe run, CPU-based: MB/s (text / (all CPU s / N))", [fmt(e["text_bytes"] / (e["cpu_s"]["total"] / w) / 1e6) for e in e2e], fmt(results["marginal"].get("e2e_cpu_mb_s")))
    line("ratio tokpipe / raw gigatoken, CPU-based", ["" for _ in e2e], f"**{rc:.2f}**" if rc else None)
    if results["marginal"].get("e2e_cpu_ms_per_mb"):
        c = results["marginal"]["e2e_cpu_ms_per_mb"]
        line("marginal CPU ms per MB of text: total / driver / task workers / other workers / ray system", ["" for _ in e2e], f"{c['total']:.1f} / {c['driver']:.1f} / {c['task_workers']:.1f} / {c['other_workers']:.1f} / {c['ray_system']:.1f}")
    ph_names = ["startup_s", "backend_check_s", "ray_init_s", "tokenize_s", "shutdown_finalize_s", "exit_s"]
    line("phases s: " + " / ".join(p[:-2] for p in ph_names), [" / ".join(fmt(e["phases"].get(p), ".1f") for p in ph_names) for e in e2e])
    line("CPU s: driver / task workers / other workers / ray system", [f"{e['cpu_s']['driver']:.1f} / {e['cpu_s']['task_workers']:.1f} / {e['cpu_s']['other_workers']:.1f} / {e['cpu_s']['ray_system']:.1f}" for e in e2e])
    line("peak RSS MiB: driver", [fmt(e["driver"]["peak_rss_mib"], ".0f") for e in e2e])
    line("peak RSS MiB: each task worker (anon)", [", ".join(f"{x['peak_rss_mib']:.0f} ({x['peak_anon_mib']:.0f})" for x in e["workers"] if x["kind"] == "task") for e in e2e])
    line("peak RSS MiB: other Ray workers", [", ".join(f"{x['names'][-1]} {x['peak_rss_mib']:.0f}" for x in e["workers"] if x["kind"] != "task") or "-" for e in e2e])
    line("peak RSS MiB: Ray system (largest 3)", [", ".join(f"{x['names'][-1]} {x['peak_rss_mib']:.0f}" for x in sorted(e["ray_system"], key=lambda r: -r["peak_rss_mib"])[:3]) for e in e2e])
    fv = [results["finalize_verify"].get(c["label"]) for c in corpora]
    line("finalize: GB/s of token files (s)", [f"{f['finalize_gb_s']:.2f} ({f['finalize_s']:.2f})" if f else "-" for f in fv])
    line("verify: GB/s of token files (s)", [f"{f['verify_gb_s']:.2f} ({f['verify_s']:.2f})" if f else "-" for f in fv])
    if results.get("datatrove"):
        dts = [results["datatrove"].get(c["label"]) for c in corpora]
        line("datatrove DocumentTokenizer: wall s", [fmt(d["wall_s"]) if d else "-" for d in dts])
        line("datatrove: MB/s of text", [fmt(d["mb_s"], ".2f") if d else "-" for d in dts], fmt(results["marginal"].get("datatrove_mb_s"), ".2f"))
        line("datatrove: peak RSS MiB largest process", [fmt(d["max_process_peak_rss_mib"], ".0f") if d else "-" for d in dts])
        line("ratio tokpipe / datatrove", [fmt(e["mb_s"] / d["mb_s"], ".1f") if d else "-" for e, d in zip(e2e, dts)],
             fmt(results["marginal"].get("ratio_e2e_to_datatrove"), ".1f") + f" (target >= {TARGETS['vs_datatrove']:.0f})" if results["marginal"].get("ratio_e2e_to_datatrove") else None)
    return _extras(rows, results)


def _extras(rows: list[str], results: dict) -> str:
    """The worker-memory and driver-scaling tables (also when the throughput parts were skipped)."""
    if results.get("worker_rss"):
        rows.append("")
        rows.append("| worker memory (tokenize_shard alone, no Ray): shard MB | document MB | peak RSS MiB | tokens | s |")
        rows.append("|---:|---:|---:|---:|---:|")
        for r in results["worker_rss"]:
            doc = "source (~8 KB avg)" if r["doc_mb"] is None else f"{r['doc_mb']:.0f}"
            rows.append(f"| {r['shard_mb']:.0f} | {doc} | {r['peak_rss_mib']:.0f} | {r['tokens']:,} | {r['seconds']:.1f} |")
    if results.get("scaling"):
        rows.append("")
        rows.append("| driver scaling: shards | manifest build s (peak RSS MiB) | planning s | driver RSS at plan MiB | driver peak RSS MiB | driver RSS slope MiB/1k shards | shards done (/s) | ProgressBoard actor peak MiB | gcs_server peak MiB | finalize alone s (peak RSS MiB) |")
        rows.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s in results["scaling"]:
            rp = s["ray_process_peak_rss_mib"]
            rows.append(
                f"| {s['shards']:,} | {s['manifest_build_s']:.1f} ({s['manifest_build_peak_rss_mib']:.0f}) | {fmt(s['planning_s'])} | {fmt(s['driver_rss_at_plan_mib'], '.0f')} | "
                f"{s['driver_peak_rss_mib']:.0f} | {fmt(s['driver_rss_slope_mib_per_1k_shards'], '.2f')} | {s['shards_done']:,}{' (all)' if s['finished'] else ''} ({fmt(s['shards_per_s'])}) | "
                f"{fmt(rp.get('ProgressBoard actor'), '.0f')} | {fmt(rp.get('gcs_server'), '.0f')} | {s['finalize_s']:.1f} ({s['finalize_peak_rss_mib']:.0f}) |"
            )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="what `tokpipe manifest` accepts: HF cache, snapshot, or folder of shards")
    p.add_argument("--sizes", default="100MB,300MB", help="corpus sizes, uncompressed JSONL (two: the marginal is taken between the first and last)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tokenizer", default=str(REPO / "examples" / "tokenizers" / "qwen3"))
    p.add_argument("--work-dir", default="/tmp/tokpipe-bench", help="corpora, outputs and results (default: /tmp/tokpipe-bench)")
    p.add_argument("--shard-size", default="16MB", help="target uncompressed size of a corpus shard (default 16MB)")
    p.add_argument("--distinct", action="store_true", help="corpora in which no document appears twice (cold encoder caches throughout); default: the source repeated (warm)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each timed measurement; medians are reported")
    p.add_argument("--datatrove", metavar="PYTHON", help="a Python that has datatrove: compare with its DocumentTokenizer")
    p.add_argument("--datatrove-repeats", type=int, default=1)
    p.add_argument("--datatrove-sizes", help="only these of --sizes for datatrove (it is ~50x slower; default: all)")
    p.add_argument("--hf-mb", type=float, default=4.0, help="MB of text per process for the tokenizers reference (it is slow)")
    p.add_argument("--driver-scaling", default="1000,10000,100000", help="tiny-shard counts for the driver check ('' to skip)")
    p.add_argument("--scaling-seconds", type=float, default=60.0, help="how long to let each scaling run go after Ray is up")
    p.add_argument("--skip", default="", help="comma list of parts to skip: raw,e2e,finalize,datatrove,rss,scaling")
    p.add_argument("--json", help="also write the results here (always written to WORK_DIR/results.json)")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    import raw
    from tokpipe.tokenizer import load_tokenizer_info

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    info = load_tokenizer_info(args.tokenizer)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results: dict = {
        "args": vars(args),
        "machine": machine(),
        "targets": TARGETS,
        "corpora": [],
        "raw": {},
        "raw_encoders": ["gigatoken", "gigatoken-core"],
        "e2e": {},
        "e2e_all": {},
        "finalize_verify": {},
        "datatrove": {},
        "marginal": {},
        "scaling": [],
    }
    if args.datatrove:
        results["datatrove_version"] = subprocess.run([args.datatrove, "-c", "import importlib.metadata as m; print(m.version('datatrove'))"], capture_output=True, text=True).stdout.strip()

    def log(msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    corpora = []
    for size in sizes:
        t0 = time.monotonic()
        build = build_distinct_corpus if args.distinct else build_corpus
        c = build(args.source, size, args.workers, parse_size(args.shard_size), work)
        label = f"{size / 1e6:g}MB"
        corpora.append((label, c))
        results["corpora"].append({"label": label, **c.__dict__})
        log(f"corpus {label}: {c.text_bytes / 1e6:.1f} MB text, {c.documents:,} docs, {len(c.shards)} shards ({time.monotonic() - t0:.1f}s)")

    def shard_paths(c) -> list[str]:
        return [str(Path(c.path) / s) for s in c.shards]

    if "raw" not in skip:
        for label, c in corpora:
            results["raw"][label] = {}
            for enc in results["raw_encoders"]:
                r = raw.measure_repeated(enc, info.path, shard_paths(c), args.workers, args.repeats)
                results["raw"][label][enc] = r
                log(f"raw {enc} {label}: {r['mb_s']:.1f} MB/s ({r['mb_s_all']})")
        small = corpora[0][1]
        cold = raw.first_pass_paths(shard_paths(small), small.shard_text_bytes, sum(small.shard_text_bytes) * small.source_jsonl_bytes // small.jsonl_bytes, args.workers)
        results["raw_cold"] = raw.measure_repeated("gigatoken", info.path, cold, args.workers, args.repeats)
        log(f"raw gigatoken cold: {results['raw_cold']['mb_s']:.1f} MB/s")
        results["raw_tokenizers"] = raw.measure_repeated("tokenizers", info.path, shard_paths(small), args.workers, 1, limit_bytes=int(args.hf_mb * 1e6))
        log(f"raw tokenizers: {results['raw_tokenizers']['mb_s']:.2f} MB/s")

    if "e2e" not in skip:
        for label, c in corpora:
            manifest = work / "manifests" / f"{label}.json"
            made = run_monitored(tokpipe_cmd("manifest", "--dataset-dir", c.path, "-o", str(manifest)))
            if made["rc"] != 0:
                raise RuntimeError("tokpipe manifest failed: " + "\n".join(line for _, line in made["lines"]))
            runs = []
            for k in range(args.repeats):
                out = work / "out" / f"{label}"
                r = e2e_run(c, manifest, args.tokenizer, args.workers, out)
                runs.append(r)
                log(f"tokpipe run {label} #{k + 1}: {r['wall_s']:.1f}s, {r['mb_s']:.1f} MB/s, phases {r['phases']}")
            results["e2e_all"][label] = [{k: v for k, v in r.items() if k not in ("workers", "ray_system")} for r in runs]
            results["e2e"][label] = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
            if "finalize" not in skip:
                fv = finalize_and_verify(work / "out" / label, args.tokenizer, args.repeats)
                results["finalize_verify"][label] = fv
                log(f"finalize {label}: {fv['finalize_gb_s']:.2f} GB/s; verify {fv['verify_gb_s']:.2f} GB/s")

    if args.datatrove and "datatrove" not in skip:
        dt_sizes = {parse_size(x) for x in args.datatrove_sizes.split(",")} if args.datatrove_sizes else set(sizes)
        for (label, c), size in zip(corpora, sizes):
            if size not in dt_sizes:
                continue
            runs = [datatrove_run(args.datatrove, c, info.path, info.eos_token, args.workers, work / "out" / f"datatrove-{label}") for _ in range(args.datatrove_repeats)]
            results["datatrove"][label] = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
            log(f"datatrove {label}: {results['datatrove'][label]['wall_s']:.1f}s, {results['datatrove'][label]['mb_s']:.2f} MB/s")

    # marginal: between the first and the last size, fixed costs cancel
    (la, a), (lb, b) = corpora[0], corpora[-1]
    dbytes = b.text_bytes - a.text_bytes
    mg = results["marginal"]
    if len(corpora) > 1 and dbytes > 0:
        n = args.workers
        if results["raw"]:
            for enc in results["raw_encoders"]:
                ra, rb = results["raw"][la][enc], results["raw"][lb][enc]
                dt = rb["seconds"] - ra["seconds"]
                mg[f"raw_{enc}_mb_s"] = dbytes / dt / 1e6 if dt > 0 else None
                dc = statistics.median(rb["cpu_s_all"]) - statistics.median(ra["cpu_s_all"])
                mg[f"raw_{enc}_cpu_mb_s"] = dbytes / (dc / n) / 1e6 if dc > 0 else None
        if results["e2e"]:
            ea, eb = results["e2e"][la], results["e2e"][lb]
            dt = eb["wall_s"] - ea["wall_s"]
            mg["e2e_mb_s"] = dbytes / dt / 1e6 if dt > 0 else None
            mg["e2e_tok_s"] = (eb["tokens"] - ea["tokens"]) / dt if dt > 0 else None
            if ea["phases"] and eb["phases"]:
                dtt = eb["phases"]["tokenize_s"] - ea["phases"]["tokenize_s"]
                mg["tokenize_phase_mb_s"] = dbytes / dtt / 1e6 if dtt > 0 else None
            if mg.get("raw_gigatoken_mb_s") and mg.get("e2e_mb_s"):
                mg["ratio_e2e_to_raw"] = mg["e2e_mb_s"] / mg["raw_gigatoken_mb_s"]
            # the same from CPU seconds (medians over the repeats): steadier on a shared machine
            cpu = {lab: {k: statistics.median(r["cpu_s"][k] for r in results["e2e_all"][lab]) for k in ea["cpu_s"]} for lab in (la, lb)}
            mg["e2e_cpu_ms_per_mb"] = {k: round((cpu[lb][k] - cpu[la][k]) / (dbytes / 1e6) * 1e3, 2) for k in cpu[la]}
            dc = cpu[lb]["total"] - cpu[la]["total"]
            mg["e2e_cpu_mb_s"] = dbytes / (dc / n) / 1e6 if dc > 0 else None
            if mg.get("e2e_cpu_mb_s") and mg.get("raw_gigatoken_cpu_mb_s"):
                mg["ratio_e2e_to_raw_cpu"] = mg["e2e_cpu_mb_s"] / mg["raw_gigatoken_cpu_mb_s"]
        if la in results["datatrove"] and lb in results["datatrove"]:
            dt = results["datatrove"][lb]["wall_s"] - results["datatrove"][la]["wall_s"]
            mg["datatrove_mb_s"] = dbytes / dt / 1e6 if dt > 0 else None
        dt_rate = mg.get("datatrove_mb_s") or max((d["mb_s"] for d in results["datatrove"].values()), default=None)
        if dt_rate and mg.get("e2e_mb_s"):  # without a datatrove marginal: against its best whole-run rate
            mg["ratio_e2e_to_datatrove"] = mg["e2e_mb_s"] / dt_rate

    if "rss" not in skip:
        cases = [(16 * 10**6, None), (256 * 10**6, None), (64 * 10**6, 1 * 10**6), (64 * 10**6, 16 * 10**6), (128 * 10**6, 64 * 10**6)]
        results["worker_rss"] = worker_rss(work, args.source, args.tokenizer, cases)
        log("worker RSS probe: " + ", ".join(f"{r['shard_mb']:.0f}MB shard/{r['doc_mb'] or 'source'} docs {r['peak_rss_mib']:.0f} MiB" for r in results["worker_rss"]))

    if args.driver_scaling and "scaling" not in skip:
        for count in [int(x) for x in args.driver_scaling.split(",")]:
            s = driver_scaling(count, work, args.tokenizer, args.workers, args.scaling_seconds)
            results["scaling"].append(s)
            log(f"driver scaling {count:,}: planning {s['planning_s']}s, driver RSS at plan {s['driver_rss_at_plan_mib']} MiB, peak {s['driver_peak_rss_mib']} MiB, done {s['shards_done']}")

    results["machine"]["loadavg_end"] = os.getloadavg()
    payload = json.dumps(results, indent=1, default=str)
    (work / "results.json").write_text(payload)
    if args.json:
        Path(args.json).write_text(payload)
    text = table(results)
    print(text)
    (work / "results.md").write_text(text + "\n")
    log(f"results: {work / 'results.json'}, table: {work / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

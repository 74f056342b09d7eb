"""Raw encoder throughput: N processes, each encoding in-memory text on its own thread, nothing else.

Each process gets the shards a FIFO scheduler would give it (shard k goes to process k mod N: the
corpus has equal shards and a multiple of N of them), reads and parses them before the clock starts,
then all start together at a barrier and encode their texts in batches of the pipeline's batch size.
Throughput = all text bytes / the slowest process's time: the same accounting as the pipeline's wall
time on the same cores. Also the CPU seconds the processes used (cpu_mb_s = text / (CPU s / N)): on a
shared, noisy machine that is the steadier number.

Encoders: `gigatoken` is exactly what a tokpipe worker calls (tokpipe.tokenizer.GigatokenEncoder:
encode_batch(parallel=False) plus the awkward -> numpy conversion); `gigatoken-core` is the Rust call
alone (the awkward Array is not converted); `tokenizers` is the reference (HFEncoder), for scale.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import orjson

from tokpipe.source import decompressed_blocks

ENCODERS = ("gigatoken", "gigatoken-core", "tokenizers")



def peak_rss_mib() -> float:
    """This process's own high-water mark (VmHWM); ru_maxrss would include what a forked child inherited."""
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024

def _texts(paths: list[str], limit_bytes: int | None) -> tuple[list[str], int]:
    texts, size = [], 0
    for path in paths:
        for line in b"".join(block for block, _ in decompressed_blocks(path)).splitlines():
            text = orjson.loads(line).get("text") if line.strip() else None
            if isinstance(text, str) and text:
                texts.append(text)
                size += len(text.encode("utf-8", "replace"))
                if limit_bytes is not None and size >= limit_bytes:
                    return texts, size
    return texts, size


def _batches(texts: list[str], batch_bytes: int) -> list[list[str]]:
    out, cur, size = [], [], 0
    for text in texts:
        cur.append(text)
        size += len(text)  # characters: close enough to bytes for batching, and free
        if size >= batch_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _worker(encoder: str, tokenizer_json: str, paths: list[str], limit_bytes, batch_bytes: int, barrier, results) -> None:
    from tokpipe.tokenizer import GigatokenEncoder, HFEncoder

    texts, size = _texts(paths, limit_bytes)
    batches = _batches(texts, batch_bytes)
    enc = HFEncoder(tokenizer_json) if encoder == "tokenizers" else GigatokenEncoder(tokenizer_json)
    enc.encode(["warm up the encoder once, outside the clock"])
    core = getattr(enc, "_tok", None)
    barrier.wait()
    started, cpu0 = time.perf_counter(), time.process_time()
    tokens = 0
    if encoder == "gigatoken-core":
        for batch in batches:
            offsets = core.encode_batch(batch, parallel=False).layout.offsets.data
            tokens += int(offsets[-1] - offsets[0])
    else:
        for batch in batches:
            tokens += enc.encode(batch)[0].size
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu0
    results.put({"bytes": size, "tokens": tokens, "seconds": seconds, "cpu_s": cpu, "peak_rss_mib": peak_rss_mib()})


def measure(encoder: str, tokenizer_json: str, shard_paths: list[str], workers: int, batch_bytes: int = 4 << 20, limit_bytes: int | None = None) -> dict:
    """One run: N spawned processes, each encoding its FIFO share of the shards. limit_bytes caps each share."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    shares = [shard_paths[k::workers] for k in range(workers)]
    procs = [ctx.Process(target=_worker, args=(encoder, tokenizer_json, share, limit_bytes, batch_bytes, barrier, results)) for share in shares]
    for p in procs:
        p.start()
    got = [results.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"raw {encoder} worker exited with {p.exitcode}")
    seconds = max(r["seconds"] for r in got)
    text = sum(r["bytes"] for r in got)
    tokens = sum(r["tokens"] for r in got)
    cpu = sum(r["cpu_s"] for r in got)
    return {
        "encoder": encoder,
        "workers": workers,
        "text_bytes": text,
        "tokens": tokens,
        "seconds": seconds,
        "mb_s": text / seconds / 1e6,
        "tok_s": tokens / seconds,
        "cpu_s": cpu,
        "cpu_mb_s": text / (cpu / workers) / 1e6,  # the rate if every process had its core to itself
        "per_worker_s": [round(r["seconds"], 3) for r in got],
        "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in got],
    }


def measure_repeated(encoder: str, tokenizer_json: str, shard_paths: list[str], workers: int, repeats: int, **kw) -> dict:
    runs = [measure(encoder, tokenizer_json, shard_paths, workers, **kw) for _ in range(repeats)]
    best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]  # the median run
    return {**best, "seconds_all": [round(r["seconds"], 3) for r in runs], "mb_s_all": [round(r["mb_s"], 2) for r in runs], "cpu_s_all": [round(r["cpu_s"], 3) for r in runs], "repeats": repeats}


def first_pass_paths(corpus_shards: list[str], corpus_text: list[int], source_text_bytes: int, workers: int) -> list[str]:
    """The leading shards that hold the source once (distinct text): what a cold encoder sees first."""
    out, total = [], 0
    for path, size in zip(corpus_shards, corpus_text):
        if total >= source_text_bytes:
            break
        out.append(path)
        total += size
    return out[: max(workers, len(out) // workers * workers)]


def median(values):
    return statistics.median(values) if values else None


"""Memory of one huge document (issue 27): a JSONL shard holding a small document, one of SIZE, and
another small one; `tokpipe run --workers N` and then `tokpipe verify OUT --sample 3` (which samples all
three), each watched as a whole process tree (driver, Ray's processes, its workers: procmon.TreeMonitor).

    python benchmarks/long_document.py --sizes 5MB --trees before=../OLD
    python benchmarks/long_document.py --sizes 62MB,200MB
    python benchmarks/long_document.py --calls 2MB

`--calls` measures, per backend, what encoding one document costs a process: in a fresh process each,
the peak RSS (VmHWM, its earlier peak cleared) over the RSS just before, for one call on the whole
document and for tokpipe's Encoder.encode (in pieces), and per character.

The huge document is distinct real text: every distinct document of the source, stripped, each after a
label `[ROUND.N] `, joined by newlines; past the source's size, further rounds take them again in
another order (shuffled with the round as seed) under new labels. Its bytes are checked against
`tokenizers` encoding each labelled document with its newline alone: a newline between two non-space
characters ends a pre-token whatever follows (tokpipe/inputs/pieces.py, checked in tests/test_inputs_pieces.py against
whole encodes), so the ids of the parts, each with its newline, joined are the document's. Runs are
sequential, never two at once. Results print as JSON lines and go to WORK_DIR/long-document.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import REPO, SHARED, TOKENIZER, cli, load_texts, manifest_of, parse_size, timed, tokpipe_run  # noqa: E402
from procmon import TreeMonitor  # noqa: E402


def huge_document(texts: list[str], size: int) -> list[str]:
    """The labelled parts of a document of at least `size` UTF-8 bytes (joined by "\\n")."""
    distinct = list(dict.fromkeys(t.strip() for t in texts if t.strip()))
    parts, total, round_ = [], 0, 0
    while total < size:
        order = list(range(len(distinct)))
        if round_:
            random.Random(round_).shuffle(order)
        for n in order:
            part = f"[{round_}.{n}] {distinct[n]}"
            parts.append(part)
            total += len(part.encode("utf-8")) + 1
            if total >= size:
                break
        round_ += 1
    return parts


def write_shard(folder: Path, small: list[str], parts: list[str]) -> Path:
    path = folder / "train" / "part_000.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for text in (small[0], "\n".join(parts), small[1]):
            f.write(orjson.dumps({"text": text}) + b"\n")
    return path


def exact(out: Path, small: list[str], parts: list[str], skipped_huge: bool) -> bool:
    """Whether OUT's train.bin is the reference: each small document's ids, the huge one's as its parts'
    each with its newline (or nothing, when the run skipped it as too long), each followed by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    tok.encode_special_tokens = True
    eos = tok.token_to_id("<|endoftext|>")
    got = np.memmap(out / "train.bin", dtype=np.uint32, mode="r")
    at = 0

    def expect(ids) -> bool:
        nonlocal at
        ids = np.asarray(ids, dtype=np.uint32)
        ok = np.array_equal(got[at : at + ids.size], ids)
        at += ids.size
        return ok

    ok = expect(tok.encode(small[0], add_special_tokens=False).ids + [eos])
    if not skipped_huge:
        with_newlines = [part + "\n" for part in parts[:-1]] + parts[-1:]
        for start in range(0, len(parts), 2000):
            for e in tok.encode_batch(with_newlines[start : start + 2000], add_special_tokens=False):
                ok &= expect(e.ids)
        ok &= expect([eos])
    ok &= expect(tok.encode(small[1], add_special_tokens=False).ids + [eos])
    return ok and at == got.size


CALL = """
import ctypes, sys, time
from tokpipe.inputs.encoders import encoder
backend, path, whole = sys.argv[1], sys.argv[2], sys.argv[3] == "whole"
text = open(path, encoding="utf-8").read()
enc = encoder(backend, {tokenizer!r})
enc.encode(["warm up"])
def status(key):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(key))
ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the load freed goes back: the call's growth shows in full
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (the tokenizer's load) is forgotten: VmHWM starts again from VmRSS
base, started = status("VmRSS"), time.monotonic()
flat, _ = enc._encode([text]) if whole else enc.encode([text])
print(status("VmHWM") - base, time.monotonic() - started, flat.size)
"""


def call_memory(texts: list[str], size: int, work: Path, backends: list[str]) -> list[dict]:
    """Per backend: one call on a document of `size` bytes against pieces, each in a fresh process."""
    import subprocess

    path = work / f"document-{size}.txt"
    path.write_text("\n".join(huge_document(texts, size)), encoding="utf-8")
    chars = len(path.read_text(encoding="utf-8"))
    results = []
    for backend in backends:
        for how in ("whole", "pieces"):
            code = CALL.format(tokenizer=str(TOKENIZER / "tokenizer.json"))
            out = subprocess.run(
                [sys.executable, "-c", code, backend, str(path), how], capture_output=True, text=True, check=True
            )
            grown, seconds, tokens = out.stdout.split()
            result = {
                "backend": backend,
                "how": how,
                "chars": chars,
                "peak_over_loaded_mib": round(int(grown) / 2**20),
                "bytes_per_char": round(int(grown) / chars, 1),
                "seconds": round(float(seconds), 1),
                "tokens": int(tokens),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def watched(command_result) -> dict:
    stats = command_result["watch"].stats.values()
    by_kind: dict[str, int] = {}
    for s in stats:
        by_kind[s.kind] = max(by_kind.get(s.kind, 0), s.hwm)
    return {
        "wall_s": round(command_result["wall"], 1),
        "peak_sum_rss_mib": round(command_result["watch"].peak_sum / 2**20),
        "sum_of_process_peaks_mib": round(sum(s.hwm for s in stats) / 2**20),
        "largest_peak_by_kind_mib": {k: round(v / 2**20) for k, v in sorted(by_kind.items())},
        "processes": len(stats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="62MB,200MB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--trees", default="after=.", help="NAME=CHECKOUT,... (default: after=.)")
    p.add_argument("--source", default=str(SHARED))
    p.add_argument("--work-dir", default="/tmp/tokpipe-long-document")
    p.add_argument("--calls", help="SIZE: measure one encode call per backend on a document of SIZE instead")
    p.add_argument("--backends", default="fastokens,gigatoken,hf", help="of --calls (default: %(default)s)")
    args = p.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    texts = load_texts(args.source)
    if args.calls:
        results = call_memory(texts, parse_size(args.calls), work, args.backends.split(","))
        (work / f"long-document-calls-{args.calls}.json").write_text(json.dumps(results, indent=1))
        return
    small = [texts[0], texts[1]]
    results = []
    for size in args.sizes.split(","):
        parts = huge_document(texts, parse_size(size))
        folder = work / f"long-{size}"
        write_shard(folder, small, parts)
        for name, tree in (t.split("=", 1) for t in args.trees.split(",")):
            tree = (REPO / tree).resolve()
            manifest = manifest_of(folder, work, tree)
            out = work / f"out-{size}-{name}"
            run = tokpipe_run(manifest, out, args.workers, tree=tree, watch=TreeMonitor)
            meta = json.loads((out / "meta.json").read_text())
            skipped = meta["splits"]["train"]["skipped"].get("too_long", 0)
            verify = timed(cli("verify", out, "--sample", "3"), tree=tree, watch=TreeMonitor, check=False)
            result = {
                "tree": name,
                "document_mb": round(sum(len(x.encode()) + 1 for x in parts) / 1e6, 1),
                "run": watched(run),
                "backend": next((line for _, line in run["lines"] if line.startswith("backend ")), ""),
                "documents": meta["splits"]["train"]["documents"],
                "too_long": skipped,
                "verify": {**watched(verify), "exit": verify["returncode"]},
                "verify_sample": [line for _, line in verify["lines"] if "sampled" in line],
                "exact": exact(out, small, parts, skipped_huge=bool(skipped)),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    (work / "long-document.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

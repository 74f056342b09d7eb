"""The one harness of the benchmarks: where things are, the one way to run tokpipe and read its phases,
the one text loader, and the corpora.

Running: `timed` runs a command of a tokpipe checkout (this one, or an older one's worktree: its cwd and
PYTHONPATH, for its Ray workers too) to its exit, with its wall and CPU seconds and its output lines as
they came; `cli` builds the command line of `tokpipe ARGS`, `tokpipe_run` and `manifest_of` the two
commands a benchmark runs; `phases` reads a run's phases from its output, `phases_from_files` from its
OUT alone (the same way for every version, old ones too).

Text: `load_texts` reads the documents of anything `tokpipe manifest` accepts (an HF cache, a snapshot, a
folder of shards, a corpus below); `batches` cuts them into an encoder's ~1 MiB calls.

Corpora, plain folders of JSONL shards under the work dir: `build_distinct_corpus` takes every document
once (the source's, then the text files of the installed packages), optionally with unique identifiers
spliced in; its shard count is a multiple of the worker count and shards are equally sized, so no worker
idles at the end while another finishes a big last shard; same arguments, same bytes: it is cached and
reused while its recipe holds. `tiny_corpus` (20 documents), `tiny_shards` (one document a shard) and
`build_repeated_corpus` (the source's shards copied N times, for the crash soak) are the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import resource
import shutil
import signal
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import zstandard

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data" / "hf-cache"  # the source every corpus is built from
TOKENIZER = REPO / "examples" / "tokenizers" / "qwen3"
# tokpipe imported here (the text loader, scale.py's rates) is this checkout's, as in the commands run.
sys.path.insert(0, str(REPO))

CORPUS_FORMAT = 2
ZSTD_LEVEL = 3


def spawn(command: list, tree: Path = REPO, env: dict | None = None, **popen) -> subprocess.Popen:
    """Start a command of the checkout `tree`: PYTHONPATH (its Ray workers inherit it) and cwd (`python -m`
    puts the working directory first on sys.path, before PYTHONPATH) are the tree. Path arguments are made
    absolute first, as the command runs elsewhere. `env`: variables added (a PYTHONPATH goes before the tree)."""
    env = dict(env or {})
    path = os.pathsep.join(filter(None, [env.pop("PYTHONPATH", None), str(tree)]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **env}
    command = [str(a.resolve()) if isinstance(a, Path) else str(a) for a in command]
    return subprocess.Popen(command, cwd=tree, env=env, **popen)


def cli(*args) -> list:
    """The command line of `tokpipe ARGS`: the CLI of the checkout it is spawned in."""
    return [sys.executable, "-m", "tokpipe.cli", *args]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(
    command: list, *, tree: Path = REPO, watch: Callable | None = None, check: bool = True, env: dict | None = None
) -> dict:
    """Run a command of `tree` (see spawn) to its exit. Returns its wall seconds from start to exit
    (`wall`), the CPU seconds of it and its children (`cpu`: Ray's processes are its children), its
    output lines, stdout and stderr, each with the seconds since the start it came at (`lines`), its
    `returncode`, and `watch`: what `watch(pid)`, a context manager such as procmon.TreeMonitor, made
    of it while it ran (the command is a session of its own: its pid is the session's id).
    A command that fails ends the benchmark with its last lines, unless check=False."""
    cpu, started = children_cpu(), time.monotonic()
    proc = spawn(
        command, tree, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        with watch(proc.pid) if watch else contextlib.nullcontext() as watcher:
            lines = [(time.monotonic() - started, line.rstrip()) for line in proc.stdout]
            proc.wait()
            wall = time.monotonic() - started
    except BaseException:  # Ctrl-C (which no longer reaches its session), or the watch failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        proc.communicate()
        raise
    if check and proc.returncode:
        shown = " ".join(map(str, command[:4]))
        raise SystemExit(
            f"{shown} in {tree} failed (exit {proc.returncode}):\n" + "\n".join(line for _, line in lines[-20:])
        )
    return {"wall": wall, "cpu": children_cpu() - cpu, "lines": lines, "returncode": proc.returncode, "watch": watcher}


def tokpipe_run(manifest: Path, out: Path | str, workers: int, *extra, tree: Path = REPO, watch=None, env=None) -> dict:
    """`tokpipe run` of a manifest with the benchmarks' tokenizer into a fresh OUT (a folder; a URL, the caller's to
    empty): what `timed` returns."""
    if isinstance(out, Path):
        shutil.rmtree(out, ignore_errors=True)
    command = cli("run", "--manifest", manifest, "--tokenizer", TOKENIZER, "--out", out, "--workers", workers, *extra)
    return timed(command, tree=tree, watch=watch, env=env)


def manifest_of(folder: Path, work_dir: Path, tree: Path = REPO) -> Path:
    """`tokpipe manifest` of a folder, written to WORK_DIR/FOLDER-NAME.manifest.json."""
    path = work_dir / f"{folder.name}.manifest.json"
    timed(cli("manifest", "--dataset-dir", folder, "-o", path), tree=tree)
    return path


MARKS = {  # tokpipe's output line that starts with this -> the moment it stands for
    "tokenizer ": "tokenizer loaded",
    "backend ": "backend checked",
    "ray: ": "ray up (or not needed)",
    "phases: ": "tokenized and finalized",
}


def phases(run: dict) -> dict:
    """A `tokpipe run`'s phases from its output: `marks`, the seconds from the command's start at which each
    of the MARKS lines came; `phases`, its `phases:` line; `tokenize_s`, the tokenize phase's seconds in it."""
    marks = {name: t for t, line in run["lines"] for prefix, name in MARKS.items() if line.startswith(prefix)}
    line = next(line for _, line in run["lines"] if line.startswith("phases: "))
    return {"marks": marks, "phases": line, "tokenize_s": float(line.split("tokenize ")[1].split("s,")[0])}


def phases_from_files(out: Path) -> dict:
    """A finished run's phases from OUT's files alone, the same way for every version (older ones print no
    `phases:` line): tokenizing from the first shard lock created to the last checkpoint written, the
    finalize tail from then to meta.json."""
    locks = [p.stat().st_mtime for p in (out / "shards").rglob("*.lock")]
    checkpoints = [p.stat().st_mtime for p in (out / "shards").rglob("*.json")]
    first, last = min(locks), max(checkpoints)
    tail = (out / "meta.json").stat().st_mtime - last
    return {
        "tokenize_s": round(last - first, 2),
        "finalize_tail_s": round(tail, 3),
        "tail_share": round(tail / (last - first), 3),
    }


def load_texts(source: str | Path, limit: int | None = None) -> list[str]:
    """The documents' texts of a source (anything `tokpipe manifest` accepts) in manifest order; with a
    `limit`, the first ones, up to the one that reaches `limit` UTF-8 bytes of text. A line without a
    non-empty string "text" is no document."""
    from tokpipe.inputs.manifest import build_manifest
    from tokpipe.inputs.source import format_of
    from tokpipe.inputs.source.jsonl import decompressed_blocks

    found, size = [], 0
    for shard in build_manifest(str(source)).shards():
        with open(shard.path, "rb") as raw:
            data = b"".join(block for block, *_ in decompressed_blocks(raw, shard.path, format_of(shard.path)[0]))
        for line in data.splitlines():
            try:
                text = orjson.loads(line).get("text")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(text, str) and text:
                found.append(text)
                size += len(text.encode("utf-8", "replace"))
                if limit is not None and size >= limit:
                    return found
    return found


def batches(texts: list[str], size: int = 1 << 20) -> list[list[str]]:
    """The texts in an encoder's calls of about `size` characters each."""
    out, batch, n = [], [], 0
    for t in texts:
        batch.append(t)
        n += len(t)
        if n >= size:
            out.append(batch)
            batch, n = [], 0
    return out + ([batch] if batch else [])


@dataclass
class Corpus:
    path: str
    jsonl_bytes: int  # uncompressed JSONL bytes, the corpus "size"
    text_bytes: int  # UTF-8 bytes of the documents' text fields: what MB/s of text counts
    documents: int
    shards: list[str]
    shard_text_bytes: list[int]
    compressed_bytes: int
    source: str
    source_jsonl_bytes: int

    @classmethod
    def load(cls, folder: Path) -> Corpus:
        data = json.loads((folder / "corpus.json").read_text())
        data.pop("recipe")
        return cls(**data)


def parse_size(text: str) -> int:
    """'100MB' -> 100_000_000 (decimal units, as MB/s is reported); also KB, GB, MiB, GiB, plain bytes."""
    text = text.strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _cached(folder: Path, recipe: dict) -> Corpus | None:
    """The corpus built in `folder` by this recipe; else None, with the folder emptied for a new one."""
    marker = folder / "corpus.json"
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == recipe:
        return Corpus.load(folder)
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "train").mkdir(parents=True)
    return None


def _save(folder: Path, recipe: dict, corpus: Corpus) -> Corpus:
    """Mark the folder's corpus complete: written last, so a killed build is rebuilt."""
    tmp = folder / "corpus.json.tmp"
    tmp.write_text(json.dumps({"recipe": recipe, **asdict(corpus)}, indent=1))
    os.replace(tmp, folder / "corpus.json")
    return corpus


def shard_count(size: int, shard_bytes: int, workers: int) -> int:
    """Shards of about shard_bytes, at least one per worker, a multiple of the workers: every worker gets as many."""
    shards = max(workers, -(-size // shard_bytes))
    return -(-shards // workers) * workers


def tiny_shards(count: int, work_dir: Path) -> Path:
    """A folder of `count` one-document plain JSONL shards (1,000 per sub-folder), for driver scaling."""
    folder = work_dir / "tiny" / f"{count}"
    marker = folder / "done"
    if marker.is_file():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    for k in range(count):
        sub = folder / "train" / f"d{k // 1000:04d}"
        if k % 1000 == 0:
            sub.mkdir(parents=True)
        (sub / f"s{k:07d}.jsonl").write_bytes(
            orjson.dumps({"text": f"tiny shard {k}: the quick brown fox jumps over the lazy dog."}) + b"\n"
        )
    marker.write_text("ok\n")
    return folder


def tiny_corpus(work_dir: Path) -> Path:
    """20 short documents in one zstd shard."""
    folder = work_dir / "corpora" / "price-tiny"
    (folder / "train").mkdir(parents=True, exist_ok=True)
    lines = b"".join(
        orjson.dumps({"text": f"document {i}: the quick brown fox jumps over the lazy dog."}) + b"\n" for i in range(20)
    )
    (folder / "train" / "part-00000.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    return folder


def build_repeated_corpus(source: str, dest: Path, copies: int) -> None:
    """The source's shard files copied `copies` times as a plain folder (train/chunk1..N/,
    validation/chunk1..N/), unless dest exists. For crash tests, not speed: repeated documents keep an
    encoder's word cache warm."""
    from tokpipe.inputs.manifest import build_manifest

    if dest.exists():
        return
    for shard in build_manifest(source).shards():
        top, *rest = shard.relpath.split("/")
        for i in range(1, copies + 1):
            target = dest / top / f"chunk{i}" / "/".join(rest[1:] if rest[0].startswith("chunk") else rest)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shard.path, target)


# Where distinct real text lies on any machine that has tokpipe installed: the sources and docs of the
# installed packages and of Python itself. Each file is one document, taken once (by content).
DISTINCT_ROOTS = (sys.prefix, sys.base_prefix, "/usr/share/doc", "/usr/lib/python3", "/usr/include")
DISTINCT_SUFFIXES = (
    ".py",
    ".pyi",
    ".md",
    ".rst",
    ".txt",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".js",
    ".ts",
    ".html",
    ".tex",
    ".rs",
    ".go",
    ".java",
    ".sh",
    ".css",
)


def distinct_texts(source: str, roots=DISTINCT_ROOTS) -> Iterator[str]:
    """Real texts, none twice: the source's documents, then every UTF-8 text file under roots, by path."""
    seen = set()

    def once(text: str) -> bool:
        digest = hashlib.sha1(text.encode("utf-8", "replace")).digest()
        if digest in seen:
            return False
        seen.add(digest)
        return True

    for text in load_texts(source):
        if once(text):
            yield text
    for root in roots:
        for folder, _, files in sorted(os.walk(root)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                if not name.endswith(DISTINCT_SUFFIXES) or os.path.islink(path):
                    continue
                try:
                    if not 200 <= os.path.getsize(path) <= 2_000_000:
                        continue
                    text = open(path, "rb").read().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if once(text):
                    yield text


IDS_EVERY = 4  # words between two spliced identifiers in a long-tail corpus


def with_unique_ids(text: str, rng: random.Random, every: int = IDS_EVERY) -> str:
    """The text with a never-seen identifier after every `every`-th word, as crawled pages carry
    handles, session ids and hashes. Letters only: the pretokenizer splits at digits, so hex ids
    would be cut into a few cached pieces; long letter runs are each a new pretoken."""
    words = text.split(" ")
    for i in range(every - 1, len(words), every):
        words[i] += " @" + "".join(rng.choices(string.ascii_letters, k=rng.randrange(6, 14)))
    return " ".join(words)


def build_distinct_corpus(
    source: str, size: int, workers: int, shard_bytes: int, work_dir: Path, long_tail: bool = False
) -> Corpus:
    """About `size` bytes of JSONL in which no document appears twice (`long_tail`: with unique
    identifiers spliced in, so an encoder's word cache meets new words to the end), built once."""
    shards = shard_count(size, shard_bytes, workers)
    recipe = {
        "format": CORPUS_FORMAT,
        "source": str(Path(source).resolve()),
        "size": size,
        "shards": shards,
        "distinct": True,
        "long_tail": long_tail and IDS_EVERY,
    }
    folder = work_dir / "corpora" / f"{'longtail' if long_tail else 'distinct'}-{size // 10**6}MB-{shards}shards"
    if (cached := _cached(folder, recipe)) is not None:
        return cached
    rng = random.Random(0)
    # A long tail may pass over the texts more than once: the spliced identifiers keep every document new.
    texts = itertools.chain.from_iterable(distinct_texts(source) for _ in range(3 if long_tail else 1))
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    names, shard_text, written, docs, compressed = [], [], 0, 0, 0
    for k in range(shards):
        name = f"train/part-{k:05d}.jsonl.zst"
        target = round(size / shards * (k + 1))
        chunk, text_size = [], 0
        while written < target and (text := next(texts, None)) is not None:
            text = with_unique_ids(text, rng) if long_tail else text
            line = orjson.dumps({"text": text}) + b"\n"
            chunk.append(line)
            written += len(line)
            text_size += len(text.encode("utf-8"))
            docs += 1
        if not chunk:
            raise SystemExit(f"only {written / 1e6:.0f} MB of distinct text found under {DISTINCT_ROOTS}; ask for less")
        (folder / name).write_bytes(cctx.compress(b"".join(chunk)))
        compressed += (folder / name).stat().st_size
        names.append(name)
        shard_text.append(text_size)
    corpus = Corpus(
        str(folder), written, sum(shard_text), docs, names, shard_text, compressed, recipe["source"], written
    )
    return _save(folder, recipe, corpus)

"""Benchmark corpora: plain folders of zstd JSONL shards of a requested size.

`build_corpus` repeats a source; `build_distinct_corpus` takes every document once (the source's,
then the text files of the installed packages), optionally with unique identifiers spliced in.

The source is anything `tokpipe manifest` accepts (an HF cache, a snapshot, a folder of shards): its
lines are read in manifest order and written again and again, in that order, until the requested
number of uncompressed JSONL bytes is reached. The shard count is a multiple of the worker count and
shards are equally sized, so no worker idles at the end while another finishes a big last shard.
Same arguments, same bytes: a corpus is cached under the work dir and reused while its recipe holds.

Beware: a repeated corpus is easier for gigatoken than fresh text. Its pretoken cache (per process)
learns the source's words on the first pass and hits on every repeat; the raw-encoder measurement in
encoders.py measures cold (first pass) and warm passes
separately.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import string
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import zstandard

CORPUS_FORMAT = 2
ZSTD_LEVEL = 3


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


def source_lines(source: str) -> tuple[list[bytes], list[int]]:
    """(every JSONL line of the source in manifest order, each line's text bytes or 0 for a non-document)."""
    from tokpipe.manifest import build_manifest
    from tokpipe.source import format_of
    from tokpipe.source.jsonl import decompressed_blocks

    manifest = build_manifest(source)
    lines: list[bytes] = []
    for shard in manifest.shards():
        data = b"".join(block for block, _ in decompressed_blocks(shard.path, format_of(shard.path)))
        lines += [line + b"\n" for line in data.splitlines() if line.strip()]
    text_bytes = []
    for line in lines:
        try:
            text = orjson.loads(line).get("text")
        except (orjson.JSONDecodeError, AttributeError):
            text = None
        text_bytes.append(len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0)
    return lines, text_bytes


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


def build_corpus(source: str, size: int, workers: int, shard_bytes: int, work_dir: Path) -> Corpus:
    """A corpus of about `size` JSONL bytes under work_dir/corpora/, built once and reused."""
    shards = shard_count(size, shard_bytes, workers)
    recipe = {
        "format": CORPUS_FORMAT,
        "source": str(Path(source).resolve()),
        "size": size,
        "shards": shards,
        "zstd_level": ZSTD_LEVEL,
    }
    folder = work_dir / "corpora" / f"{size // 10**6}MB-{shards}shards"
    if (cached := _cached(folder, recipe)) is not None:
        return cached

    lines, text_bytes = source_lines(source)
    per_shard = size / shards
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    names, shard_text, written, docs, i, compressed = [], [], 0, 0, 0, 0
    for k in range(shards):
        name = f"train/part-{k:05d}.jsonl.zst"
        target = round(per_shard * (k + 1))
        chunk, text = [], 0
        while written < target:
            line = lines[i % len(lines)]
            chunk.append(line)
            written += len(line)
            text += text_bytes[i % len(lines)]
            docs += text_bytes[i % len(lines)] > 0
            i += 1
        (folder / name).write_bytes(cctx.compress(b"".join(chunk)))
        compressed += (folder / name).stat().st_size
        names.append(name)
        shard_text.append(text)
    corpus = Corpus(
        path=str(folder),
        jsonl_bytes=written,
        text_bytes=sum(shard_text),
        documents=docs,
        shards=names,
        shard_text_bytes=shard_text,
        compressed_bytes=compressed,
        source=recipe["source"],
        source_jsonl_bytes=sum(map(len, lines)),
    )
    return _save(folder, recipe, corpus)


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


def rss_shard(work_dir: Path, source: str, shard_bytes: int, doc_bytes: int | None) -> Path:
    """One zstd JSONL shard of about `shard_bytes`: the source's documents, or (doc_bytes) documents
    made by joining source texts until each holds about doc_bytes of text. For the worker-memory probe."""
    name = (
        f"shard-{shard_bytes // 10**6}MB-docs-{'source' if doc_bytes is None else f'{doc_bytes // 10**6}MB'}.jsonl.zst"
    )
    path = work_dir / "rss" / name
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines, _ = source_lines(source)
    texts = [t for t in (orjson.loads(line).get("text") for line in lines) if isinstance(t, str) and t]
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    tmp = path.with_name(path.name + ".tmp")
    written, i = 0, 0
    with open(tmp, "wb") as raw, cctx.stream_writer(raw) as out:
        while written < shard_bytes:
            if doc_bytes is None:
                line = lines[i % len(lines)]
                i += 1
            else:
                parts, size = [], 0
                while size < doc_bytes:
                    parts.append(texts[i % len(texts)])
                    size += len(parts[-1].encode("utf-8", "replace"))
                    i += 1
                line = orjson.dumps({"text": "\n\n".join(parts)}) + b"\n"
            out.write(line)
            written += len(line)
    os.replace(tmp, path)
    return path


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

    lines, text_bytes = source_lines(source)
    for line, size in zip(lines, text_bytes):
        if size and once(text := orjson.loads(line)["text"]):
            yield text
    for root in roots:
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
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

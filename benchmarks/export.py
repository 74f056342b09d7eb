"""Export times: Megatron's .bin as a hard link against a copy (in the kernel, and through a buffer),
and llm.c's shards in order against --shuffle, on one OUT, with the page cache warm and cold.

OUT is `tokpipe run` of the shared data's shards copied --copies times (repeated text: the export reads
tokens, and the text's variety does not change how fast it copies them). "cold": the OUT's files are
dropped from the page cache first (posix_fadvise DONTNEED on those files alone, nothing else's), so
the tokens come from the disk. Each variant runs in this process (`tokpipe.commands.export.export`); the copy
variants are the link's fallbacks forced (os.link refused as across file systems, no reflink on ext4,
and copy_file_range refused for the buffer). The CLI's own start is timed once beside them.

    python benchmarks/export.py --copies 40 [--source ../shared/data/hf-cache]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import time
from pathlib import Path
from unittest import mock

import numpy as np
from harness import SHARED, build_repeated_corpus, cli, manifest_of, timed, tokpipe_run

from tokpipe import durability
from tokpipe.commands.export import _in_order as in_order
from tokpipe.commands.export import _megatron_split as megatron_split
from tokpipe.commands.export import _shuffled as shuffled
from tokpipe.commands.export import export
from tokpipe.layout.tokens import to_dtype
from tokpipe.read.output import Output, Split, TokenFile, open_output


def drop_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def allocated(folder: Path) -> int:
    """Blocks the export added: those of files that are not also OUT's (a hard link adds none)."""
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir() if p.stat().st_nlink == 1)


def no_link(src, dst):
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


def no_copy_file_range(*args):
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


VARIANTS = {  # name -> (format, shuffle seed, patches)
    "megatron: hard link": ("megatron", None, []),
    "megatron: copy_file_range": ("megatron", None, [("os.link", no_link)]),
    "megatron: buffered copy": ("megatron", None, [("os.link", no_link), ("os.copy_file_range", no_copy_file_range)]),
    "llmc in order": ("llmc", None, []),
    "llmc --shuffle": ("llmc", 1, []),
}


def measure(out: Path, dest: Path, variant: str, cold: bool) -> dict:
    fmt, seed, patches = VARIANTS[variant]
    shutil.rmtree(dest, ignore_errors=True)
    if cold:
        drop_cache(out)
    with mock.patch.object(durability, "reflink", lambda src_fd, dst_fd: False):
        for target, replacement in patches:
            mock.patch(target, replacement).start()
        try:
            started = time.perf_counter()
            written = export(out, fmt, dest, shuffle=seed)
            seconds = time.perf_counter() - started
        finally:
            mock.patch.stopall()
    return {
        "variant": variant,
        "cache": "cold" if cold else "warm",
        "seconds": seconds,
        "added_bytes": allocated(dest),
        "how": sorted({e.how for e in written if e.how}),
    }


def read_only(out: Path, seed: int | None, cold: bool) -> dict:
    """The read side of an llmc export alone (its documents gathered, in order or shuffled, not
    written): what the export costs where the destination writes faster than this disk."""
    if cold:
        drop_cache(out)
    split = open_output(out).splits["train"]
    started = time.perf_counter()
    for tokens, _lengths in in_order(split) if seed is None else shuffled(split, seed):
        to_dtype(np.asarray(tokens), "uint32")  # as the export does: every token read
    seconds = time.perf_counter() - started
    return {
        "variant": f"llmc {'--shuffle' if seed is not None else 'in order'}, read only (train)",
        "cache": "cold" if cold else "warm",
        "seconds": seconds,
        "tokens": len(split.tokens),
    }


def index_at_scale(work: Path, documents: int, tokens_per_document: int = 1000) -> dict:
    """The hard-link export of a split of `documents` documents: the link is one call whatever the size,
    the .idx (20 bytes a document) is the export's cost. The split's tokens are a sparse file (no block
    used), its document ends real: an OUT of FineWeb's shape (~1,000 tokens a document) at that count."""
    folder = work / f"export-index-{documents:.0e}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tokens = documents * tokens_per_document
    with open(folder / "train.bin", "wb") as f:
        f.truncate(tokens * 4)
    ends = np.lib.format.open_memmap(folder / "ends.npy", mode="w+", dtype="<i8", shape=(documents,))
    for begin in range(0, documents, 1 << 24):
        stop = min(begin + (1 << 24), documents)
        ends[begin:stop] = np.arange(begin + 1, stop + 1, dtype=np.int64) * tokens_per_document
    ends.flush()
    split = Split("train", [TokenFile("train.bin", np.memmap(folder / "train.bin", dtype="<u4", mode="r"), ends)])
    data = Output(folder, {"dtype": "uint32", "vocab_size": 151_669}, {"train": split})
    (folder / "dest").mkdir()
    started = time.perf_counter()
    pairs, how = megatron_split(data, split, folder / "dest" / "train", "int32")
    seconds = time.perf_counter() - started
    index_bytes = pairs[1][0].stat().st_size
    shutil.rmtree(folder)
    print(
        f"megatron, hard link, {documents:,} documents ({tokens * 4 / 1e12:.1f} TB of uint32 tokens, sparse):"
        f" {seconds:.1f} s, .idx {index_bytes / 1e9:.2f} GB, {documents / seconds / 1e6:.1f} M documents/s; {how}"
    )
    return {"documents": documents, "tokens": tokens, "seconds": seconds, "index_bytes": index_bytes, "how": how}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=40, help="copies of the shared data's shards (29 MB each)")
    parser.add_argument("--source", type=Path, default=SHARED, help="the shards to copy (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--index-documents", type=int, default=100_000_000, help="documents of the .idx at scale")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tokpipe-bench"))
    args = parser.parse_args()
    work = args.work_dir
    corpus, out = work / f"export-corpus-x{args.copies}", work / f"export-out-x{args.copies}"
    dest = work / "export-dest"
    work.mkdir(parents=True, exist_ok=True)
    build_repeated_corpus(str(args.source), corpus, args.copies)
    if not (out / "meta.json").exists():
        run = tokpipe_run(manifest_of(corpus, work), out, args.workers)
        print(f"OUT built in {run['wall']:.1f} s")
    data = open_output(out)
    tokens = sum(len(s.tokens) for s in data.splits.values())
    documents = sum(len(s.ends) for s in data.splits.values())
    size = sum(len(s.tokens) * data.dtype.itemsize for s in data.splits.values())
    print(f"OUT: {size / 1e9:.3f} GB, {tokens:,} tokens ({data.dtype}), {documents:,} documents")
    results = []
    for variant in VARIANTS:
        for cold in (True, False):
            r = measure(out, dest, variant, cold)
            results.append(r)
            print(
                f"{variant:28s} {r['cache']:5s} {r['seconds']:7.3f} s  {size / r['seconds'] / 1e9:7.2f} GB/s of tokens"
                f"  {tokens / r['seconds'] / 1e6:8.1f} M tokens/s  added {r['added_bytes'] / 1e6:8.1f} MB  {r['how']}"
            )
    for seed in (None, 1):
        for cold in (True, False):
            r = read_only(out, seed, cold)
            results.append(r)
            print(
                f"{r['variant']:44s} {r['cache']:5s} {r['seconds']:7.3f} s"
                f"  {r['tokens'] / r['seconds'] / 1e6:8.1f} M tokens/s"
            )
    shutil.rmtree(dest, ignore_errors=True)
    startup = timed(cli("export", out, "--format", "megatron", "--dest", dest))["wall"]
    print(f"CLI `tokpipe export --format megatron` (hard link), wall from start to exit: {startup:.2f} s")
    shutil.rmtree(dest, ignore_errors=True)
    scale = index_at_scale(work, args.index_documents)
    summary = {
        "out_bytes": size,
        "tokens": tokens,
        "documents": documents,
        "mean_document_tokens": float(np.divide(tokens, max(documents, 1))),
        "results": results,
        "cli_link_wall": startup,
        "index_at_scale": scale,
    }
    (work / "export.json").write_text(json.dumps(summary, indent=1))
    print(f"written: {work / 'export.json'}")


if __name__ == "__main__":
    main()

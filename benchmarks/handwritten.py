"""The pipeline a user would write by hand instead of tokpipe: the baseline of price.py, and nothing more.

N spawned processes; each takes every N-th shard of the manifest, streams it through zstandard's
stream reader, parses each line with orjson, encodes the non-empty texts in batches of 512 with the
encoder tokpipe's `auto` picks, appends EOS, and writes uint32 ids to a file of its own. No Ray, no
checkpoints, no checksums, no assembly.

    python benchmarks/handwritten.py MANIFEST TOKENIZER_JSON OUT_DIR --workers 2 --backend fastokens
"""

import argparse
import io
import json
import multiprocessing
import time

import numpy as np
import orjson
import zstandard


def work(k: int, paths: list[str], backend: str, tokenizer_json: str, eos: int, out_dir: str) -> int:
    from tokpipe.inputs.encoders import encoder  # the same encoder object tokpipe's workers call

    enc, tokens = encoder(backend, tokenizer_json), 0
    with open(f"{out_dir}/part-{k:03d}.bin", "wb") as out:

        def flush(batch: list[str]) -> int:
            flat, lengths = enc.encode(batch)
            ids = np.insert(flat.astype(np.uint32), np.cumsum(lengths), eos)  # EOS after every document
            out.write(ids.tobytes())
            return len(ids)

        for path in paths:
            with open(path, "rb") as raw:
                lines = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
                batch = []
                for line in lines:
                    text = orjson.loads(line).get("text")
                    if isinstance(text, str) and text:
                        batch.append(text)
                    if len(batch) == 512:
                        tokens, batch = tokens + flush(batch), []
                if batch:
                    tokens += flush(batch)
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("manifest")
    p.add_argument("tokenizer_json")
    p.add_argument("out_dir")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backend", default="fastokens")
    p.add_argument("--eos", type=int, default=151643)
    args = p.parse_args()
    started = time.monotonic()
    with open(args.manifest) as f:
        paths = [shard["path"] for shard in json.load(f)["shards"]]
    jobs = [
        (k, paths[k :: args.workers], args.backend, args.tokenizer_json, args.eos, args.out_dir)
        for k in range(args.workers)
    ]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        tokens = sum(pool.starmap(work, jobs))
    print(f"handwritten: {tokens} tokens in {time.monotonic() - started:.2f}s")


if __name__ == "__main__":
    main()

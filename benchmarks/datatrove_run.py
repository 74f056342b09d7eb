"""Tokenize a benchmark corpus with datatrove's DocumentTokenizer: the peer that bench.py compares with.

Runs under a separate Python that has datatrove (never tokpipe's environment; tokpipe is not imported
here). The same corpus folder, the same tokenizer.json, the same EOS, one task per shard and
`--workers` processes (LocalPipelineExecutor), documents not shuffled (tokpipe keeps file order, and
shuffling would be a second pass over the tokens). Prints one JSON line: tokens written and files.

    /tmp/venv-dt/bin/python benchmarks/datatrove_run.py CORPUS TOKENIZER_JSON EOS WORKERS OUT
"""

from __future__ import annotations

import glob
import json
import os
import sys


def main() -> None:
    corpus, tokenizer_json, eos, workers, out = sys.argv[1:6]
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    shards = sorted(glob.glob(os.path.join(corpus, "**", "*.jsonl.zst"), recursive=True))
    executor = LocalPipelineExecutor(
        pipeline=[
            JsonlReader(corpus, glob_pattern="**/*.jsonl.zst", text_key="text", compression="zstd"),
            DocumentTokenizer(
                output_folder=os.path.join(out, "tokens"),
                tokenizer_name_or_path=tokenizer_json,
                eos_token=eos,
                shuffle_documents=False,
            ),
        ],
        tasks=len(shards),
        workers=int(workers),
        logging_dir=os.path.join(out, "logs"),
        skip_completed=False,
    )
    executor.run()
    files = sorted(glob.glob(os.path.join(out, "tokens", "*.ds")))
    token_bytes = sum(os.path.getsize(f) for f in files)
    tokens = 0
    for f in files:  # "<tokenizer>|<token size>\n<token count>\n<humanized>"
        with open(f + ".metadata") as meta:
            tokens += int(meta.read().splitlines()[1])
    print(json.dumps({"files": len(files), "token_bytes": token_bytes, "tokens": tokens, "tasks": len(shards)}))


if __name__ == "__main__":
    main()

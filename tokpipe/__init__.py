"""tokpipe: a parallel, resumable tokenization pipeline for LLM pretraining data: JSON Lines or JSON arrays
(plain, zstd, gzip, bz2, xz), Parquet, Arrow (a Hugging Face cache or a plain folder) into flat token files.

The Python API mirrors the commands:

    import tokpipe

    tokpipe.build_manifest("/raid/hf-cache", "manifests/sp.json", repo_id="cerebras/SlimPajama-627B")
    summary = tokpipe.run("manifests/sp.json", "tokenizers/qwen3", "out/sp", workers=64)
    assert summary.finished and all(check.ok for check in tokpipe.verify("out/sp"))

    data = tokpipe.open_output("out/sp")             # a finished OUT
    vocab_size = data.meta["vocab_size"]             # build the embedding from this
    train = data.splits["train"]                     # .tokens: read-only np.memmap, .ends: document ends
    x = train.tokens[i : i + block_size].astype(np.int64)
    first_document = train.document(0)               # ends with EOS

Failures of input or usage raise `tokpipe.errors.UserError`, whose message says what to do.
"""

from __future__ import annotations

import os

from tokpipe._version import __version__
from tokpipe.errors import UserError
from tokpipe.inputs.manifest import Manifest, write_manifest
from tokpipe.inputs.manifest import build_manifest as _build_manifest
from tokpipe.layout.files import is_out
from tokpipe.layout.stored import on_store
from tokpipe.read.output import Output, Split, open_output
from tokpipe.read.verify import verify

__all__ = ["build_manifest", "run", "verify", "open_output", "Output", "Split", "Manifest", "__version__"]


def build_manifest(
    dataset_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    repo_id: str | None = None,
    revision: str | None = None,
    allow_outside: bool = False,
    configs: tuple[str, ...] = (),
) -> Manifest:
    """`tokpipe manifest`: the dataset's shards, splits and order; also written to `output` when given
    (what `run` reads). A tokpipe OUT inside the dataset is passed over (`Manifest.passed_over` says so).
    `dataset_dir`: a folder, or a prefix on an object store (s3://BUCKET/PREFIX, docs/stores.md). `configs`: which
    of the dataset card's configs to read (default: its default one; tokpipe/inputs/card.py)."""
    if output is not None and on_store(output):  # refused before the walk; a run reads one there (OUT's own)
        raise UserError(f"{output} is on an object store: write the manifest on this machine")
    build = _build_manifest
    if on_store(dataset_dir):
        from tokpipe.inputs.objects import build_store_manifest as build  # boto3 only for a dataset on a store

    manifest = build(dataset_dir, repo_id, revision, allow_outside, is_out, configs)
    if output is not None:
        write_manifest(manifest, output)
    return manifest


def run(manifest: str | os.PathLike, tokenizer: str | os.PathLike, out: str | os.PathLike, *, tell=None, **options):
    """`tokpipe run`: tokenize on Ray (embedded, or the cluster at `address=`); rerun to resume.

    `options` are `tokpipe.options.RunOptions`' fields, the `run` command's flags by their Python
    names (workers, text_field, val_fraction, ...), with the same defaults. Returns a
    `tokpipe.runner.driver.RunSummary`: what the run did, as a value. Nothing is printed; `tell`, if given,
    is called with each line the command would print as the run goes (`tokpipe.runner.events.Said`;
    `tell=print` prints them).
    """
    from tokpipe.options import RunOptions
    from tokpipe.runner.driver import run as run_manifest  # Ray is imported only by who runs
    from tokpipe.runner.events import lines_only, silent

    return run_manifest(
        manifest, tokenizer, out, RunOptions(**options), tell=silent if tell is None else lines_only(tell)
    )

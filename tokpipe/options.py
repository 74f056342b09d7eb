"""The options of `tokpipe run`, each defined once: its default, its help, how the command line parses it.

`tokpipe.cli` builds the `run` flags from these fields (`--text-field` for `text_field`), the Python
API (`tokpipe.run(..., text_field=...)`) takes the same names, and run.json records those given
other than their defaults, by the same names.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tokpipe.inputs.source.batch import MISSING_GROUP
from tokpipe.inputs.tokenizer import BACKENDS
from tokpipe.out.run import OutputSpec


def positive(kind, zero_ok: bool = False):
    """An argparse type: a number > 0 (or >= 0)."""

    def parse(text: str):
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero_ok else '>'} 0, got {text}")
        return value

    return parse


def option(default, help: str, **cli):
    """A RunOptions field: `help` as --help shows it (%(default)s is the default), `cli` the rest of
    argparse's add_argument keywords (type, choices, metavar); a False default makes a switch."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class RunOptions:
    tokenizer_revision: str | None = option(
        None,
        "branch, tag or commit of a hub --tokenizer ORG/NAME in the Hugging Face cache (default: main)",
        metavar="REV",
    )
    workers: int | None = option(
        None,
        "shard tasks at once (default: the CPUs this process may use: its CPU affinity and cgroup quota)",
        type=positive(int),
        metavar="N",
    )
    address: str | None = option(None, "Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray)")
    backend: str = option("auto", "encoder; all give the same bytes (default: %(default)s)", choices=BACKENDS)
    text_field: str = option(
        "text", "JSON field or Parquet column holding the document text (default: %(default)s)", metavar="NAME"
    )
    group_by: str | None = option(
        None,
        "keep each split's documents by this field's value, each group in files of its own: a dotted path into"
        " each JSON line (meta.redpajama_set_name), or a Parquet column (a struct's field by dot); documents"
        f" without it go to group {MISSING_GROUP}",
        metavar="FIELD",
    )
    eos: str | None = option(None, "EOS token (default: the tokenizer's eos_token)")
    bos: bool = option(False, "place BOS before every document (the tokenizer's bos_token, or --bos-token)")
    bos_token: str | None = option(None, "the BOS token --bos places (default: the tokenizer's bos_token)")
    no_eos: bool = option(False, "no EOS after documents (with --bos: BOS-delimited documents)")
    no_concat: bool = option(
        False, "keep each split as its shards' token files in order (listed in meta), never copied into one file"
    )
    val_fraction: float = option(
        0.0,
        "hold out this share of train documents for val.bin, chosen by a hash of their text (default: %(default)g)",
        type=positive(float, zero_ok=True),
        metavar="F",
    )
    # Every shard on Ray's workers, none in the driver (by default the driver tokenizes until Ray's workers
    # are ready, and a run it finishes alone never starts Ray): for the tests of Ray's own paths (stalls,
    # retries, SIGTERM while workers run), so not in `run --help`.
    ray_only: bool = option(False, argparse.SUPPRESS)
    checkpoint_interval: float = option(
        30.0, "seconds between shard checkpoints (default: %(default)g)", type=positive(float)
    )
    stall_timeout: float = option(
        600.0,
        "cancel and retry a shard with no progress for this long once a worker has taken it (default: %(default)g)",
        type=positive(float),
    )
    max_retries: int = option(3, "retries of a shard whose worker died or stalled (default: %(default)s)", type=int)
    skip_failed: bool = option(False, "finalize without shards that fail (recorded in meta as excluded)")
    # 128 workers of 768 MiB fit a 128 GiB node.
    worker_memory: int = option(
        768,
        "RSS each worker stays under, by dropping the encoder's word cache (default: %(default)s)",
        type=positive(int),
        metavar="MIB",
    )

    shard_buffer: int | None = option(
        None,
        "MiB of tokens a shard keeps in memory until its place in the split file is known, to be written once,"
        " there; a larger shard goes on in files of its own, checkpointed, and is copied into place"
        " (default: a quarter of --worker-memory; 0: every shard so)",
        type=positive(int, zero_ok=True),
        metavar="MIB",
    )

    @property
    def delimiters(self) -> dict:
        """What goes around every document, as run.json and meta record it."""
        return {"bos": self.bos, "eos": not self.no_eos}

    @property
    def buffer_mib(self) -> int:
        """--shard-buffer, by default a quarter of the worker's memory: its encoder and word cache keep the rest
        (memory.MemoryGuard). --no-concat's shards are written to their own files, which are its output."""
        return self.worker_memory // 4 if self.shard_buffer is None else self.shard_buffer

    @property
    def output(self) -> OutputSpec:
        """What these options say of the output's files and meta: what the write path is given of them."""
        return OutputSpec(self.text_field, self.delimiters, self.val_fraction, not self.no_concat, self.group_by)

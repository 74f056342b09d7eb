"""The options of `tokpipe run`, each defined once: its default, its help, how the command line parses it.

`tokpipe.cli` builds the `run` flags from these fields (`--text-field` for `text_field`), the Python
API (`tokpipe.run(..., text_field=...)`) takes the same names, and run.json records those given
other than their defaults, by the same names. A number an option cannot take (`Number`) is refused by both, in
the same words, before any work.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields

from tokpipe.errors import UserError
from tokpipe.inputs.encoders import BACKENDS
from tokpipe.inputs.source.batch import MISSING_GROUP
from tokpipe.layout.run import WriteSpec


@dataclass(frozen=True)
class Number:
    """The values a numeric option takes: of `kind` (int; or float, and finite: never NaN or inf), `least` or more
    (`above`: more than `least`), less than `below` where given. An argparse type (called with the flag's text),
    and the check of what the Python API was given (`problem`): both refuse the same values in the same words."""

    kind: type
    least: float
    above: bool = False
    below: float | None = None

    def problem(self, value) -> str | None:
        """What is wrong with `value`, or None; the kind is named only where it is what is wrong."""
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            what = "an integer " if self.kind is int else "a number "
        elif not math.isfinite(value):
            what = "a finite number "
        elif (value > self.least if self.above else value >= self.least) and (self.below is None or value < self.below):
            return None
        else:
            what = ""
        bound = f" and < {self.below:g}" if self.below is not None else ""
        return f"must be {what}{'>' if self.above else '>='} {self.least:g}{bound}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            value = text  # not a number of its kind: refused below, in the same words
        if (problem := self.problem(value)) is not None:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value


def positive(kind, zero_ok: bool = False) -> Number:
    """A number > 0 (or >= 0) of `kind`."""
    return Number(kind, 0, above=not zero_ok)


# A worker's least --worker-memory: what it holds with its encoder just loaded, plus the BATCH_HEADROOM (64 MiB)
# the memory guard gives the encoder before it drops it (write/memory.py). Below that the guard drops the encoder
# before every batch and the worker is past its limit all the same. Measured in a Ray worker with Qwen3 (RSS less
# shared pages, as the guard counts it): fastokens 167 MiB loaded, 223 MiB after 23 M characters of text;
# gigatoken 148 and 195.
WORKER_MEMORY_LEAST = 256


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
    eos: str | None = option(None, "EOS token (default: the tokenizer's eos_token, unless a chat model's turn end)")
    bos: bool = option(False, "place BOS before every document (the tokenizer's bos_token, or --bos-token)")
    bos_token: str | None = option(None, "the BOS token --bos places (default: the tokenizer's bos_token)")
    no_bos: bool = option(False, "no BOS before documents, though the tokenizer places one before a text")
    no_eos: bool = option(False, "no EOS after documents (with --bos: BOS-delimited documents)")
    no_concat: bool = option(
        False, "keep each split as its shards' token files in order (listed in meta), never copied into one file"
    )
    val_fraction: float = option(
        0.0,
        "hold out this share of train documents for val.bin, chosen by a hash of their text (default: %(default)g)",
        type=Number(float, 0, below=1),
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
    max_retries: int = option(
        3, "retries of a shard whose worker died or stalled (default: %(default)s)", type=positive(int, zero_ok=True)
    )
    skip_failed: bool = option(False, "finalize without shards that fail (recorded in meta as excluded)")
    # 128 workers of 768 MiB fit a 128 GiB node.
    worker_memory: int = option(
        768,
        f"RSS each worker stays under, by dropping the encoder's word cache (default: %(default)s; at least"
        f" {WORKER_MEMORY_LEAST}: a worker holds ~170 MiB with Qwen3's encoder loaded)",
        type=Number(int, WORKER_MEMORY_LEAST),
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

    def __post_init__(self):
        """What the Python API was given, refused as the command line refuses it (a dataclass parses nothing)."""
        for f in fields(self):
            rule, value = f.metadata.get("type"), getattr(self, f.name)
            if isinstance(rule, Number) and value is not None and (problem := rule.problem(value)) is not None:
                raise UserError(f"{f.name} {problem}, got {value!r}")
            if isinstance(value, str) and not value.strip():  # as the command line refuses it (cli._given)
                raise UserError(f"{f.name} is empty: give a value, or leave it out for the default")

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
    def output(self) -> WriteSpec:
        """What these options say of the output's files and meta: what the write path is given of them."""
        return WriteSpec(self.text_field, self.delimiters, self.val_fraction, not self.no_concat, self.group_by)

"""Tokenizing in the driver's own process: while Ray starts, or instead of it when the run ends first
(the shipped example does). What became of each shard, here or on Ray, is kept in a Tally.

Nothing here imports Ray: a run that never needs it never pays for its import (0.7 CPU-s here).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokpipe.assembly import Assembler
from tokpipe.errors import TooManyGroups
from tokpipe.layout import Checkpoint
from tokpipe.manifest import Manifest, Shard
from tokpipe.runner.progress import Progress, RunLog
from tokpipe.shard import EncodeSpec, ShardResult, tokenize_shard


@dataclass
class Tally:
    """What became of the shards this run worked on."""

    memory_limit: int  # of a worker, for the log
    shard_seconds: float = 0.0  # that shards took in this run, whether done or stopped (ShardResult.seconds)
    failed: dict[str, str] = field(default_factory=dict)  # shard relpath -> last error
    resumed: list[ShardResult] = field(default_factory=list)  # shards that went on from a checkpoint
    lacking: list[tuple[str, int, int]] = field(default_factory=list)  # (shard, lines without the text, lines)

    def add(self, shard: Shard, result: ShardResult, log: RunLog) -> None:
        """A shard done."""
        ckpt = result.checkpoint
        self.shard_seconds += result.seconds
        if result.resumed_tokens or result.redone_tokens:
            self.resumed.append(result)
            log(f"shard {shard.relpath}: resumed at {result.resumed_tokens:,} tokens, redid {result.redone_tokens:,}")
        if result.encoder_resets:
            log(
                f"shard {shard.relpath}: encoder cache dropped {result.encoder_resets} times to stay under "
                f"{self.memory_limit >> 20} MiB"
            )
        if 2 * ckpt.skipped.get("no_text", 0) > ckpt.lines:
            self.lacking.append((shard.relpath, ckpt.skipped["no_text"], ckpt.lines))


def tokenize_while(
    manifest: Manifest,
    out: Path,
    spec: EncodeSpec,
    busy: Callable[[], bool],
    progress: Progress,
    tally: Tally,
    log,
    assembler: Assembler,
) -> int:
    """Tokenize shards in this process while `busy()` (Ray starting): each shard stops at its next batch
    once Ray is up, checkpointed, and a worker goes on from there. Returns the shards finished.

    Ray's start takes seconds that the driver would otherwise wait through; a corpus of a few small
    shards is done before it is up. Only regular files: a pipe could block the driver, which alone
    watches for stalls."""
    done, totals = 0, [0, 0, 0]

    def on_batch(file_bytes: int, documents: int, tokens: int) -> None:
        totals[0] += file_bytes
        totals[1] += documents
        totals[2] += tokens
        progress.update(*totals, done=progress.done_before + done, running=1, failed=0)

    for shard in manifest.shards():
        if not busy():
            break
        if finished(out, shard) or not stat.S_ISREG(os.stat(shard.path).st_mode):
            continue
        try:
            result = tokenize_shard(shard, out, spec, on_batch, stop=lambda: not busy())
        except TooManyGroups:  # no shard of this run can do better: the run stops here
            raise
        except Exception as e:  # what a task's failure would be: the shard is failed, the others go on
            tally.failed[shard.relpath] = describe_failure(e)
            log(f"shard {shard.relpath} FAILED: {tally.failed[shard.relpath]}")
            continue
        if not result.checkpoint.done:  # stopped for Ray's workers, which go on from its checkpoint
            tally.shard_seconds += result.seconds
        else:
            done += 1
            tally.add(shard, result, log)
            assembler.done(shard, result.checkpoint, result.buffered)
            assembler.place_ready()  # into the split file now, as a Ray run's copies do: no tail at the end
    progress.base = totals
    return done


def describe_failure(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def finished(out: Path, shard: Shard) -> bool:
    ckpt = Checkpoint.of(out, shard)
    return ckpt is not None and ckpt.done

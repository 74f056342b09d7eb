"""A finished OUT's split as training windows: every window once per epoch, in an order that depends on
(seed, epoch) alone, split between ranks without overlap, resumed exactly from a small JSON state.

Window i is tokens [i*seq_len, i*seq_len + seq_len + 1): inputs and targets of one row, so consecutive
windows share one token and nothing else (the Qwen3 incident log's sliding window shared 2047 of 2048
and took the loss from 2.8 to 1.5 in 300 iterations). Epoch e's order is Permutation(len, key(seed, e)),
computed per batch: nothing is held per window, and a --no-concat split costs one entry per file.

The global position of the epoch's order that rank r of W reads next is offset + r, then offset + r + W,
...: from global offset O (0 at an epoch's start), each rank takes floor((len - O) / W) windows, then
the next epoch starts at 0. At O = 0 that stops at len - len % W. `offset` counts the positions all
ranks took together, so the state is the same on every rank, and a state loaded under another world
size continues at the same global position: the ranks split what is left of the epoch, and the fewer
than W windows at its end that do not divide evenly are skipped, as at the end of every epoch.

With `group` (an OUT made with --group-by), the windows are those of one group of the split alone: a
Mixture of one OUT's groups mixes its sources at any weights without tokenizing again.

The state's fingerprint is meta's `parts_sha256` of the split (the sha256 of its .parts list, whose lines
hold each part's token sha256, idx sha256 and counts; of a group, hashed with the group's value): a state
saved on other data (another group) is refused
(Open-Sora's saved loader state outlived a dataset change: batches repeated and training diverged).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.data.permutation import Permutation
from tokpipe.errors import UserError
from tokpipe.layout import load_meta_json
from tokpipe.output import open_output

STATE_FORMAT = 1
AHEAD = 4096  # a rank's windows looked up at once: a Permutation lookup costs per call, not per window


@dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # (B, seq_len + 1) int64
    windows: np.ndarray  # (B,) window numbers in their source
    doc_starts: list[np.ndarray]  # per row, int64 offsets j in [0, seq_len] where a document's first token sits
    sources: list[str] | None = None  # per row, its source's name (Mixture only)

    @property
    def inputs(self) -> np.ndarray:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[:, 1:]


def epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"tokpipe.data epoch {seed} {epoch}".encode(), digest_size=8).digest(), "little"
    )


class Sequences:
    """The windows of one split (or of one group of it) of a finished OUT, for rank `rank` of `world_size`."""

    def __init__(
        self,
        out: str | os.PathLike,
        split: str = "train",
        seq_len: int = 2048,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        group: str | None = None,
    ):
        if seq_len < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"seq_len {seq_len}, rank {rank} of world_size {world_size}: need seq_len >= 1, 0 <= rank < world_size"
            )
        self.out, self.split, self.seq_len = Path(out), split, int(seq_len)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        if load_meta_json(self.out) is None:  # meta.json is the last file a run writes
            raise ValueError(
                f"{out} is not a finished tokpipe output (no meta.json): see where it stands with tokpipe status {out}"
            )
        try:
            data = open_output(self.out)
        except UserError as e:
            raise ValueError(str(e)) from None
        if split not in data.splits:
            raise ValueError(f"{out} has no split {split!r}; its splits: {', '.join(data.splits)}")
        self.meta = data.meta
        info = data.meta["splits"][split]
        self.fingerprint = info.get("parts_sha256") or info.get("sha256")  # the latter: a tokpipe 0.1 OUT's
        if self.fingerprint is None:
            raise ValueError(
                f"{out}'s meta holds no checksum of split {split}: a loader state could not be checked against it"
            )
        chosen = data.splits[split]
        if group is not None:
            if group not in chosen.groups:
                have = f"its groups: {', '.join(chosen.groups)}" if chosen.groups else "it was made without --group-by"
                raise ValueError(f"split {split} of {out} has no group {group!r}; {have}")
            chosen = chosen.groups[group]
            self.fingerprint = hashlib.sha256(f"{self.fingerprint} group {group}".encode()).hexdigest()
        self.files = chosen.files
        self.file_starts = np.cumsum([0] + [len(f.tokens) for f in self.files])  # one entry per file
        tokens = int(self.file_starts[-1])
        self.len = max(tokens - 1, 0) // self.seq_len
        if self.len < self.world_size:
            raise ValueError(
                f"split {split} of {out} has {tokens:,} tokens: {self.len} windows of seq_len {self.seq_len}, "
                f"fewer than world_size {self.world_size:,}"
            )
        self.tokens = [f.tokens.view(np.ndarray) for f in self.files]  # slicing a memmap costs 2x a plain view
        self.ends = [f.ends.view(np.ndarray) for f in self.files]
        self.epoch, self.offset = 0, 0
        self._order = Permutation(self.len, epoch_seed(self.seed, 0))
        self._ahead = np.zeros(0, np.int64)  # this rank's next windows of the epoch, from `offset` on

    def __len__(self) -> int:
        return self.len

    def window(self, i: int) -> np.ndarray:
        """Window i: tokens [i*seq_len, i*seq_len + seq_len + 1), as int64."""
        if not 0 <= i < self.len:
            raise IndexError(
                f"window {i} is out of range: split {self.split} has {self.len} windows of seq_len {self.seq_len}"
            )
        start = int(i) * self.seq_len
        return self._read(start, start + self.seq_len + 1).astype(np.int64)

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split, across files where a window crosses from one into the next."""
        if len(self.tokens) == 1:
            return self.tokens[0][start:stop]
        f = int(np.searchsorted(self.file_starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            base = int(self.file_starts[f])
            piece = self.tokens[f][start - base : stop - base]
            pieces.append(piece)
            start += len(piece)
            f += 1
        return np.concatenate(pieces)

    def take(self, count: int) -> np.ndarray:
        """The next `count` window numbers of this rank (across epochs), advancing the position."""
        taken = []
        while count:
            if not self._ahead.size:
                n = min(AHEAD, (self.len - self.offset) // self.world_size)
                self._ahead = self._order[self.offset + self.rank + self.world_size * np.arange(n, dtype=np.int64)]
            n = min(count, self._ahead.size)
            taken.append(self._ahead[:n])
            self._ahead = self._ahead[n:]
            self.offset += n * self.world_size
            count -= n
            self._next_epoch_if_done()
        return np.concatenate(taken) if taken else np.zeros(0, np.int64)

    def _next_epoch_if_done(self) -> None:
        if (self.len - self.offset) // self.world_size == 0:
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = Permutation(self.len, epoch_seed(self.seed, self.epoch))
            self._ahead = np.zeros(0, np.int64)

    def batch_of(self, windows: np.ndarray) -> Batch:
        """These windows' tokens and document starts (no position advanced)."""
        starts = windows * self.seq_len
        tokens = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            tokens[row] = self._read(start, start + self.seq_len + 1)
        return Batch(tokens, windows, self._doc_starts(starts))

    def next_batch(self, batch_size: int) -> Batch:
        return self.batch_of(self.take(batch_size))

    def _doc_starts(self, starts: np.ndarray) -> list[np.ndarray]:
        """Per window, where documents start in it: the split's document ends in [start, start + seq_len]
        (a document starts where the one before ends), and 0 for the window at the split's start."""
        if len(self.ends) == 1:
            ends = self.ends[0]
            lo = np.searchsorted(ends, starts, side="left")
            hi = np.searchsorted(ends, starts + self.seq_len, side="right")
            counts = hi - lo
            first = np.cumsum(counts) - counts
            picked = np.arange(counts.sum()) + np.repeat(lo - first, counts)
            rows = np.repeat(np.arange(len(starts)), counts)
            found = np.asarray(ends[picked], dtype=np.int64) - np.repeat(starts, counts)
        else:
            per_row = [self._doc_starts_across_files(int(s)) for s in starts]
            rows = np.repeat(np.arange(len(starts)), [len(p) for p in per_row])
            found = np.concatenate(per_row) if per_row else np.zeros(0, np.int64)
        # An empty document's end repeats the one before: no document's first token sits there twice.
        keep = np.ones(len(found), dtype=bool)
        keep[1:] = (found[1:] != found[:-1]) | (rows[1:] != rows[:-1])
        result = np.split(found[keep], np.cumsum(np.bincount(rows[keep], minlength=len(starts)))[:-1])
        for row in np.flatnonzero(starts == 0):
            result[row] = np.unique(np.concatenate([[0], result[row]]))
        return result

    def _doc_starts_across_files(self, start: int) -> np.ndarray:
        """The split's document ends in [start, start + seq_len], from the files whose ends can hold them."""
        stop = start + self.seq_len
        first = int(np.searchsorted(self.file_starts[1:], start, side="left"))
        last = int(np.searchsorted(self.file_starts[:-1], stop, side="left"))
        found = []
        for f in range(first, last):
            base, ends = int(self.file_starts[f]), self.ends[f]
            lo, hi = np.searchsorted(ends, start - base, side="left"), np.searchsorted(ends, stop - base, side="right")
            found.append(np.asarray(ends[lo:hi], dtype=np.int64) + (base - start))
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def state_dict(self) -> dict:
        """Where the ranks are, the same on every rank: save it beside the model's checkpoint."""
        return {
            "format": STATE_FORMAT,
            "split": self.split,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was saved, under this world_size. Refused (ValueError) when it was saved
        on other data, seq_len, seed or split."""
        missing = [key for key in self.state_dict() if key not in state]
        if state.get("format") != STATE_FORMAT or missing:
            raise ValueError(
                f"not a Sequences loader state of format {STATE_FORMAT} (format {state.get('format')!r}, "
                f"missing {', '.join(missing) or 'nothing'})"
            )
        differ = []
        if state["fingerprint"] != self.fingerprint:
            differ.append(
                f"the content of the split differs (fingerprint {state['fingerprint'][:12]} saved, "
                f"{self.fingerprint[:12]} in {self.out}: the data changed since the state was saved)"
            )
        for key in ("seq_len", "seed", "split"):
            if state[key] != getattr(self, key):
                differ.append(f"{key} differs ({state[key]!r} saved, {getattr(self, key)!r} here)")
        if differ:
            raise ValueError(f"cannot load this loader state: {'; '.join(differ)}")
        if not (isinstance(state["offset"], int) and 0 <= state["offset"] <= self.len and state["epoch"] >= 0):
            raise ValueError(
                f"loader state at epoch {state['epoch']}, offset {state['offset']}: out of {self.len} windows"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = Permutation(self.len, epoch_seed(self.seed, self.epoch))
        self._ahead = np.zeros(0, np.int64)
        self._next_epoch_if_done()

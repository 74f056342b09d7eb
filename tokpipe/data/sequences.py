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

The state's fingerprint is that of the token stream: the sha256 of the dtype and, in order, each part's
token count and token sha256 from the split's .parts list (of a group: its parts alone). A state saved
on other tokens is refused, naming what differs (Open-Sora's saved loader state outlived a dataset
change: batches repeated and training diverged); one saved on the same tokens is taken whatever the
files are called or however they are laid out (--no-concat or not). States of format 1 held meta's
parts_sha256 instead (which names the files too) and are checked against it.

Inputs are checked as a long run needs them (tokpipe.data.arguments), a state loaded all or nothing,
and the position moves only once a batch is read: a read that fails (a file changed, no descriptor
left) leaves it where it was, so a trainer that retries skips no window. OUT is made absolute at once
(Hydra changes the working directory). One Sequences may be shared by threads (a batch is taken and
read under its lock: one thread at a time), and it pickles as a reference (OUT, options, position;
under 1 KB): a DataLoader worker reopens the files.

An OUT on a store (a URL) is read through a bounded local cache (tokpipe.data.cache) in an order a store can serve
(tokpipe.data.blocks: its blocks in a seeded order, the windows of a buffer of blocks shuffled): every rule above
holds but the order, which the state records ("order": None for a folder's), and a loader of another order refuses.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpipe.data.arguments import integer, name
from tokpipe.data.blocks import BlockOrder, Geometry
from tokpipe.data.cache import BlockCache
from tokpipe.data.permutation import Permutation, epoch_seed, epoch_seeds
from tokpipe.errors import UserError
from tokpipe.layout.files import Layout, split_named
from tokpipe.layout.meta import OutputError, SplitEntry, finished_meta
from tokpipe.layout.records import read_parts
from tokpipe.layout.stored import copy_records, meta_copy, on_store, reader_out, shown, stored_of
from tokpipe.read.files import TokenFiles
from tokpipe.read.maps import seen_all

STATE_FORMAT = 4  # 1: the fingerprint was meta's parts_sha256; 2: the group was not recorded; 3: nor the order
STATE_KEYS = ("split", "group", "seq_len", "seed", "tokens", "fingerprint", "order", "epoch", "offset")
WITHOUT = {1: ("group", "tokens", "order"), 2: ("group", "order"), 3: ("order",), 4: ()}  # an older format lacks
CACHE_SIZE = 4 << 30  # bytes of blocks a loader on a store keeps in its cache_dir: a buffer read and the next
AHEAD = 16384  # a rank's windows looked up at once: a Permutation lookup costs mostly per call (its passes)
ORDERS = 1 << 16  # values encrypted at once for the orders of a split of at most ORDERS // 16 windows (512 KB)


@dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # (B, seq_len + 1) int64
    windows: np.ndarray  # (B,) window numbers in their source
    doc_offsets: np.ndarray  # int64 offsets j in [0, seq_len] where a document's first token sits, row by row
    doc_bounds: np.ndarray  # (B + 1,) row i's are doc_offsets[doc_bounds[i]:doc_bounds[i + 1]] (varlen's cu_seqlens)
    sources: list[str] | None = None  # per row, its source's name (Mixture only)
    state: dict | None = None  # the loader's state right after this batch: save it to resume from here

    @property
    def inputs(self) -> np.ndarray:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[:, 1:]

    @functools.cached_property
    def doc_starts(self) -> list[np.ndarray]:
        """Per row, its document starts (views of doc_offsets), made on first use. Where most rows may hold
        one, a view a row made by map (12 us a batch of 64, a comprehension 19); where fewer starts than half
        the rows are found, the rows without one share one empty view (4.6 us against 12 where 11.6 rows of
        64 held a start: documents of ~2,600 tokens, seq_len 512)."""
        bounds, offsets = self.doc_bounds.tolist(), self.doc_offsets
        if 2 * bounds[-1] >= len(bounds):
            return list(map(offsets.__getitem__, map(slice, bounds[:-1], bounds[1:])))
        empty = offsets[:0]
        return [offsets[a:b] if b > a else empty for a, b in zip(bounds[:-1], bounds[1:])]

    def pin_memory(self) -> Batch:
        """The batch with its arrays copied into page-locked memory (still numpy arrays): what
        torch's DataLoader(pin_memory=True) calls in its pin thread (torch pins an object by its
        pin_memory method; it handed a Batch back unchanged before). A tensor made of one with
        torch.from_numpy is then pinned, and its .to("cuda", non_blocking=True) overlaps compute. Needs torch."""
        import torch

        arrays = ("tokens", "windows", "doc_offsets", "doc_bounds")
        return dataclasses.replace(self, **{a: torch.from_numpy(getattr(self, a)).pin_memory().numpy() for a in arrays})


def stream_fingerprint(out: Path, entry: SplitEntry, dtype: str, group: str | None) -> str:
    """The sha256 of the dtype and each part's (token count, token sha256), in order: the same for the same
    tokens however the files are named or laid out. A tokpipe 0.1 OUT's split has no parts list: its
    file's sha256."""
    if entry.parts is None:
        return entry.sha256
    key = (entry.parts_sha256, dtype)
    with _FINGERPRINTING:
        if key not in _FINGERPRINTS:
            if stored_of(out) is not None:  # a reader's copy of an OUT on a store's meta: the parts list fetched too
                copy_records(out, [entry.parts])
            _FINGERPRINTS[key] = _fingerprints(out / entry.parts, entry.parts_sha256, dtype, out)
    found = _FINGERPRINTS[key]
    return found.get(group) or hashlib.sha256(f"tokpipe token stream {dtype}\n".encode()).hexdigest()


def _fingerprints(parts: Path, parts_sha256: str, dtype: str, out: Path) -> dict[str | None, str]:
    """Every group's stream fingerprint, and the split's (None), in one read of its parts list."""
    raw = parts.read_bytes()
    if hashlib.sha256(raw).hexdigest() != parts_sha256:
        raise ValueError(f"{parts} is not the parts list meta describes: tokpipe verify {out}")
    digests: dict[str | None, object] = {}
    for record in (r for r in read_parts(raw) if r["tokens"]):
        group = record.get("group")
        for key in (None,) if group is None else (None, group):  # the split's, and its group's
            if key not in digests:
                digests[key] = hashlib.sha256(f"tokpipe token stream {dtype}\n".encode())
            digests[key].update(f"{record['tokens']} {record['sha256']}\n".encode())
    return {group: digest.hexdigest() for group, digest in digests.items()}


# (parts list's sha256, dtype) -> every group's fingerprint: a Mixture of 2,000 groups read the list 2,000 times.
_FINGERPRINTS: dict[tuple[str, str], dict[str | None, str]] = {}


_FINGERPRINTING = threading.Lock()  # a fingerprint made once: a Mixture opens its sources at once (mixture._opened)


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
        cache_dir: str | os.PathLike | None = None,
        cache_size: int = CACHE_SIZE,
    ):
        self.seq_len = integer(seq_len, "seq_len", 1)
        self.seed = integer(seed, "seed", None)
        self.world_size = integer(world_size, "world_size", 1)
        self.rank = integer(rank, "rank")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")
        if not isinstance(out, (str, os.PathLike)):
            raise ValueError(f"out {out!r}: need a path (a str or an os.PathLike)")
        self.cache_size = integer(cache_size, "cache_size", 1)
        if cache_dir is None:  # tokpipe's folder of the user's cache (XDG_CACHE_HOME)
            cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokpipe"
        if not isinstance(cache_dir, (str, os.PathLike)) or on_store(cache_dir):  # a URL: a folder `s3:` here
            raise ValueError(f"cache_dir {cache_dir!r}: need a path of this machine (a str or an os.PathLike)")
        self.cache_dir = Path(os.path.abspath(cache_dir))
        self.split, self.group = split_named(name(split, "split")), None if group is None else name(group, "group")
        self.out = os.fspath(out) if on_store(out) else Path(os.path.abspath(out))  # a URL, or a folder
        try:  # a folder that is missing or a file, said so (out_folder); on a store, its meta copied here
            records = meta_copy(self.out) if on_store(self.out) else reader_out(self.out)
        except OutputError:
            raise
        except UserError as e:  # the loader's refusals are ValueErrors
            raise OutputError(str(e)) from None
        try:
            meta = finished_meta(Layout(records))  # not finished: its OutputError, a ValueError
        except OutputError:
            raise
        except UserError as e:  # a hostile or damaged meta.pkl: the restricted unpickler refused it
            raise ValueError(
                f"{shown(records, Layout('').meta_pkl.name)} cannot be read safely ({e}): tokpipe verify {self.out}"
            ) from None
        self.record, self.meta = meta, meta.as_dict()  # meta.pkl, as a record and as its dict, read-only: shared
        if self.split not in meta.splits:
            raise ValueError(f"{self.out} has no split {split!r}; its splits: {', '.join(meta.splits)}")
        entry = meta.splits[self.split]
        self._legacy_fingerprint = entry.parts_sha256 or entry.sha256  # of format 1 states
        if group is not None:
            groups = entry.groups or {}
            if group not in groups:
                have = f"its groups: {', '.join(groups)}" if groups else "it was made without --group-by"
                raise ValueError(f"split {self.split} of {self.out} has no group {group!r}; {have}")
            legacy = f"{self._legacy_fingerprint} group {group}"
            self._legacy_fingerprint = hashlib.sha256(legacy.encode()).hexdigest()
        self.fingerprint = stream_fingerprint(records, entry, meta.dtype, group)
        files = (groups[group] if group else entry).token_files()  # a group's found in a LIST of the split's (maps)
        among = [name for f in entry.token_files() for name in (f.bin, f.idx)]
        found = seen_all(records, [name for f in files for name in (f.bin, f.idx)], among)
        self.files = TokenFiles(records, files, meta.dtype, windows=True, found=found)
        self.len = max(self.files.tokens - 1, 0) // self.seq_len
        if self.len < self.world_size:
            raise ValueError(
                f"split {self.split} of {self.out} has {self.files.tokens:,} tokens: {self.len:,} windows of seq_len "
                f"{self.seq_len}, fewer than world_size {self.world_size:,}"
            )
        self._lock = threading.Lock()  # the position (epoch, offset, _ahead) moves under it
        self._orders = (0, np.zeros((0, 0), np.int64))  # a split of few windows: (first epoch, its and the next orders)
        self.geometry = self._blocks = self._cache = None  # a store's: how blocks cut it, their order, its cache
        self._kept = (-1, 0, 0)  # the epoch and the positions of the buffer whose blocks the cache keeps
        if on_store(out):
            self.geometry = Geometry.fitted(self.len, self.seq_len, self.files.dtype.itemsize, self.cache_size)
            self._blocks = BlockOrder(self.geometry, self.seed)
            # a folder a run's ranks share and another run's never (its order, by its seed, removes others' blocks)
            g, folder = self.geometry, f"{self.fingerprint[:16]}-{self.seq_len}x{self.geometry.per_block}-{self.seed}"
            self._cache = BlockCache(self.files, self.seq_len, g, self.cache_dir / folder)
        self._set_position(0, 0)

    def __len__(self) -> int:
        return self.len

    def __reduce__(self):
        """Pickled as a reference: where the OUT is, the options and the position (a DataLoader's spawned
        worker reopens the files instead of receiving the split)."""
        keys = ("split", "seq_len", "seed", "rank", "world_size", "group", "cache_size")
        options = {key: getattr(self, key) for key in keys} | {"cache_dir": str(self.cache_dir)}
        return reopen, (str(self.out), options, self.state_dict())

    def window(self, i: int) -> np.ndarray:
        """Window i: tokens [i*seq_len, i*seq_len + seq_len + 1), as int64."""
        i = integer(i, "window", None)
        if not 0 <= i < self.len:
            raise IndexError(
                f"window {i} is out of range: split {self.split} has {self.len:,} windows of seq_len {self.seq_len}"
            )
        start = i * self.seq_len
        return self.files.read(start, start + self.seq_len + 1).astype(np.int64)

    def _set_position(self, epoch: int, offset: int) -> None:
        self.epoch, self.offset = epoch, offset
        self._ahead = np.zeros(0, np.int64)  # this rank's next windows from the position on
        if (self.len - self.offset) // self.world_size == 0:
            self._set_position(epoch + 1, 0)
        else:
            self.keep_at(self.epoch, self.offset)

    def keep_at(self, epoch: int, offset: int) -> None:
        """On a store: the blocks of the buffer this rank reads from (epoch, offset) kept in the cache, the next
        buffer's fetched meanwhile, the others let go (tokpipe.data.cache)."""
        position, kept = offset + self.rank, self._kept
        if self._cache is None or (kept[0] == epoch and kept[1] <= position < kept[2]):
            return  # (a look at each batch cost 9% of a batch read from the cache)
        order = self._blocks
        buffer = order.buffer_of(epoch, position)
        self._kept = (epoch, *order.positions_of(epoch, buffer))
        self._cache.keep(order.blocks_of(epoch, buffer), order.blocks_of(*order.after(epoch, buffer)))

    def _windows_ahead(self, epoch: int, offset: int) -> np.ndarray:
        """This rank's next windows from (epoch, offset): the rest of the epoch (AHEAD at most) by a Permutation
        lookup; for a split of few windows, whose epochs pass every few batches, from the whole orders made
        with the next epochs' at once (Permutation.orders: an order of 20 windows by lookup took 80-150 us,
        made 2,048 at a time 1.8 us), and from an epoch's start on, this rank's part of every epoch made,
        taken as one slice (take(32) of 20 windows crossed 2-3 epochs, a loop step of numpy calls each: 23 us
        measured before, 10 after, most of it the epochs' seeds and orders). Twice the epochs each time, up to ORDERS
        values: 400 groups of a Mixture made 256 epochs each at their first batch (2.7 s, 512 KB held each)."""
        first, n, step = offset + self.rank, (self.len - offset) // self.world_size, self.world_size
        if self._blocks is not None:
            return self._blocks.windows(epoch, first + step * np.arange(min(AHEAD, n), dtype=np.int64))
        domain = 1 << max(2, (self.len - 1).bit_length())  # Permutation's: the power of 2 it walks in
        if domain > ORDERS // 16:
            order = Permutation(self.len, epoch_seed(self.seed, epoch))
            return order[first + step * np.arange(min(AHEAD, n), dtype=np.int64)]
        start, orders = self._orders
        if not start <= epoch < start + len(orders):
            seeds = epoch_seeds(self.seed, range(epoch, epoch + min(ORDERS // domain, 2 * len(orders) or 1)))
            start, orders = self._orders = epoch, Permutation.orders(self.len, seeds)
        if offset:
            return orders[epoch - start, first : first + step * n : step].copy()
        return orders[epoch - start :, first : first + step * n : step].reshape(-1)

    def _advance(self, count: int) -> tuple[tuple[int, int, np.ndarray], np.ndarray]:
        """Under the lock, nothing moved: the position `count` of this rank's windows on, across epochs, as
        (epoch, offset, the windows looked up ahead from there), and those windows' numbers."""
        epoch, offset, ahead, taken = self.epoch, self.offset, self._ahead, []
        while count:
            if not ahead.size:
                ahead = self._windows_ahead(epoch, offset)
            n = min(count, ahead.size)
            taken.append(ahead[:n])
            ahead = ahead[n:]  # (it may run on into the next epochs)
            count -= n
            epoch, offset = self.moved(epoch, offset, n)
        windows = taken[0] if len(taken) == 1 else np.concatenate(taken) if taken else np.zeros(0, np.int64)
        return (epoch, offset, ahead), windows

    def moved(self, epoch: int, offset: int, count: int) -> tuple[int, int]:
        """The position `count` of this rank's windows after (epoch, offset)."""
        left, per = (self.len - offset) // self.world_size, self.len // self.world_size
        if count < left:
            return epoch, offset + count * self.world_size
        return epoch + 1 + (count - left) // per, (count - left) % per * self.world_size  # `per` an epoch

    def take(self, count: int) -> np.ndarray:
        """The next `count` window numbers of this rank (across epochs), advancing the position."""
        count = integer(count, "count")
        with self._lock:
            (self.epoch, self.offset, self._ahead), windows = self._advance(count)
        return windows

    def skip(self, count: int) -> None:
        """Advance the position by `count` of this rank's windows without reading them (a DataLoader
        worker skips the batches of the others)."""
        count = integer(count, "count")
        with self._lock:
            epoch, offset = self.moved(self.epoch, self.offset, count)
            self._ahead = self._ahead[count:] if epoch == self.epoch else np.zeros(0, np.int64)
            self.epoch, self.offset = epoch, offset
            self.keep_at(epoch, offset)

    def next_batch(self, batch_size: int) -> Batch:
        """This rank's next `batch_size` windows (0: an empty batch), with the state right after them. The
        position moves once they are read: a read that fails raises and leaves it where it was."""
        batch_size = integer(batch_size, "batch_size")
        with self._lock:
            position, windows = self._advance(batch_size)
            tokens, offsets, bounds = self.read(windows)
            self.epoch, self.offset, self._ahead = position
            self.keep_at(self.epoch, self.offset)
            return Batch(tokens, windows, offsets, bounds, state=self._state())

    def read(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """These windows' tokens (B, seq_len + 1) int64 and document starts (offsets, bounds): from the split's files,
        or on a store through the cache."""
        if self._cache is not None:
            return self._cache.read(windows)
        starts = windows * self.seq_len
        offsets, bounds = self.files.doc_starts(starts, self.seq_len)
        return self.files.windows(starts, self.seq_len), offsets, bounds

    def batch_of(self, windows: np.ndarray, state: dict | None = None) -> Batch:
        """These windows' tokens and document starts (no position advanced)."""
        windows = np.asarray(windows, dtype=np.int64)
        tokens, offsets, bounds = self.read(windows)
        return Batch(tokens, windows, offsets, bounds, state=state)

    def _state(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "split": self.split,
            "group": self.group,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "tokens": self.files.tokens,
            "fingerprint": self.fingerprint,
            "order": None if self.geometry is None else self.geometry.as_state(),
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def state_dict(self) -> dict:
        """Where the ranks are, the same on every rank: save it beside the model's checkpoint."""
        with self._lock:
            return self._state()

    def check_state(self, state) -> tuple[int, int]:
        """The (epoch, offset) that `state` holds, when it can be loaded here; a one-line ValueError naming
        what differs or what is wrong when not. Nothing moves."""
        if not isinstance(state, dict):
            raise ValueError(f"a loader state is a dict (Sequences.state_dict()), not a {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state and k not in WITHOUT.get(state.get("format"), ())]
        if state.get("format") not in WITHOUT or missing:
            raise ValueError(
                f"not a Sequences loader state of format {STATE_FORMAT} (format {state.get('format')!r}, "
                f"missing {', '.join(missing) or 'nothing'})"
            )
        for key in ("seq_len", "seed", "epoch", "offset") + (("tokens",) if state["format"] != 1 else ()):
            integer(state[key], f"loader state's {key}", 1 if key == "seq_len" else 0 if key != "seed" else None)
        differ = [k for k in ("split", "group", "seq_len", "seed") if k in state and state[k] != getattr(self, k)]
        said = [f"{k} differs ({state[k]!r} saved, {getattr(self, k)!r} here)" for k in differ]
        if state.get("order") != (here := None if self.geometry is None else self.geometry.as_state()):
            said.append(f"the order differs ({_order(state.get('order'))} saved; {_order(here)} here)")
        if "split" not in differ and "group" not in differ:  # the same stream, unless its data changed
            said[:0] = self._data_differs(state)
        if said:
            raise ValueError(f"cannot load this loader state: {'; '.join(said)}")
        if state["offset"] > self.len:
            raise ValueError(f"loader state's offset {state['offset']}: out of {self.len} windows")
        return int(state["epoch"]), int(state["offset"])

    def _data_differs(self, state: dict) -> list[str]:
        """What differs in the tokens of a state of this split and group, in words."""
        why = "the data changed since the state was saved"
        if state["format"] != STATE_FORMAT:
            why += f", or it is another group's (a state of format {state['format']} does not record its group)"
        if state["format"] == 1 and state["fingerprint"] != self._legacy_fingerprint:
            saved, here = str(state["fingerprint"])[:12], self._legacy_fingerprint[:12]
            return [f"the content of the split differs (fingerprint {saved} saved, {here} in {self.out}: {why})"]
        if state["format"] != 1 and state["tokens"] != self.files.tokens:
            return [
                f"the split holds other tokens ({state['tokens']:,} saved, {self.files.tokens:,} in {self.out}: {why})"
            ]
        if state["format"] != 1 and state["fingerprint"] != self.fingerprint:
            saved, here = str(state["fingerprint"])[:12], self.fingerprint[:12]
            return [
                f"the split's tokens differ (as many, {self.files.tokens:,}, but fingerprint {saved} saved, {here} "
                f"in {self.out}: {why})"
            ]
        return []

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was saved, under this world_size. Refused (ValueError) when it was saved
        on other tokens, split, group, seq_len or seed, or is not a loader state; then nothing moves."""
        epoch, offset = self.check_state(state)
        with self._lock:
            self._set_position(epoch, offset)


def _order(order: dict | None) -> str:
    """A state's order, in words."""
    if order is None:
        return "every window in one permutation"  # an OUT in a folder
    return f"blocks of {order['block']:,} windows, {order['buffer']:,} a buffer"  # on a store, by its cache_size


def reopen(out: str, options: dict, state: dict | None) -> Sequences:  # (state None: at the start)
    sequences = Sequences(out, **options)
    if state is not None:
        sequences.load_state_dict(state)
    return sequences

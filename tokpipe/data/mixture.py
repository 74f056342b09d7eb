"""Windows drawn from several Sequences in set proportions, deterministically, and resumed exactly.

The draw is Pfair scheduling (Baruah et al., 1996) on one processor: source i, of share p = w / sum(w),
may take its (c+1)-th row from row floor(c / p) on, and must by row ceil((c+1) / p) - 1; each row goes
to the source with the earliest such deadline among those allowed (ties: the first name in sorted
order). That keeps every source's count after k rows strictly within 1 of k * p (its lag stays in
(-1, 1)); choosing by the largest deficit alone, k * p - c, drifts to 1.18 (measured on random weights).
Shares are exact fractions of the weights (integers over a common denominator): no float decides a row.

Every source is a Sequences of the same rank and world size, so each reads its own share of its split's
epochs, rank-sharded as it is alone; all ranks draw the same sequence of sources, so the k-th row of
every rank comes from the same source, and the Mixture's state is the same on every rank.

Rows are drawn a block at a time (up to 4,096, tokpipe.data.draw), and each source takes its windows of
the block at once: a source's own position runs ahead to the block's end, and the Mixture keeps where
each stands at its own position (Sequences.moved), which is what its state holds. A batch reads its rows
through all the sources' files joined (TokenFiles.joined): one search for document starts and one
gather, as a Sequences batch, where a Sequences batch per source merged row by row cost 3x the calls.

The position moves only once a batch is read: its rows are drawn (and the sources' windows taken) ahead
into the rows drawn ahead, read, and only then counted, so a read that fails leaves the Mixture where it
was. Weights are numbers, numpy's too, kept as Python's (an int stays one, any float becomes the nearest
float) and names strings: a state is JSON-able always.

Sources must be read the same way: made with one tokenizer (its content: a re-indented tokenizer.json
is the same tokenizer) and one document convention (EOS after each document, BOS before, or both),
else the model would learn two. A state is loaded all or nothing: every source's state and the
drawn/counts pair (counts summing to drawn, each within 1 of its share) are checked before any moves.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import numpy as np

from tokpipe.data import draw
from tokpipe.data.arguments import integer
from tokpipe.data.sequences import CACHE_SIZE, STATE_FORMAT, Batch, Sequences, reopen
from tokpipe.layout.meta import Meta
from tokpipe.layout.stored import REQUESTS_AT_ONCE, on_store
from tokpipe.read.files import TokenFiles

_NONE = (np.zeros(0, np.int64),) * 3  # no rows: their sources, windows and starts


class Mixture:
    def __init__(self, sources: dict[str, Sequences], weights: dict[str, float]):
        if not isinstance(sources, dict) or not isinstance(weights, dict) or not sources:
            raise ValueError(f"sources {sources!r} and weights {weights!r}: need two dicts, by the sources' names")
        if not all(isinstance(name, str) for name in [*sources, *weights]):
            raise ValueError(f"sources {list(sources)} and weights {list(weights)}: name them by strings")
        if set(sources) != set(weights):
            raise ValueError(f"weights name {sorted(weights)}, sources {sorted(sources)}: name every source once")
        for name, source in sources.items():
            if not isinstance(source, Sequences):
                raise ValueError(f"source {name!r} is a {type(source).__name__}, not a tokpipe.data.Sequences")
        weights = _weights(weights)
        self.names = sorted(sources)
        self._names = np.array(self.names, dtype=object)  # a batch's rows' names by one gather (0.7 us, map 1.7)
        self.sources = {name: sources[name] for name in self.names}
        for what in ("seq_len", "rank", "world_size"):
            values = {name: getattr(s, what) for name, s in self.sources.items()}
            if len(set(values.values())) > 1:
                raise ValueError(f"sources differ in {what}: {values}")
        self.seq_len = self.sources[self.names[0]].seq_len
        _check_same_tokenizer(self.sources)
        conventions = {name: _convention(s.record) for name, s in self.sources.items()}
        if len(set(conventions.values())) > 1:
            named = ", ".join(f"{n}: {c}" for n, c in conventions.items())
            raise ValueError(f"sources delimit documents differently ({named}): a model would learn both conventions")
        self.weights = {name: weights[name] for name in self.names}
        exact = [Fraction(weights[name]) for name in self.names]
        scale = math.lcm(*(w.denominator for w in exact))
        self._shares = [int(w * scale) for w in exact]  # integer weights, in proportion
        self._total = sum(self._shares)
        on_store = any(s.geometry is not None for s in self.sources.values())  # read through their caches
        self.files = None if on_store else TokenFiles.joined([s.files for s in self.sources.values()])
        self._origins = np.cumsum([0] + [s.files.tokens for s in self.sources.values()][:-1])  # each source's
        self._lock = threading.Lock()  # the draw and the sources' positions move together under it
        self.drawn, self.counts = 0, [0] * len(self.names)
        self._block = draw.block(self._shares, self._total)
        self._ahead = list(_NONE)  # the sources, windows and starts of the rows drawn ahead of the position
        self._positions = [(s.epoch, s.offset) for s in self.sources.values()]  # each source's at the position
        self._states = [s.state_dict() for s in self.sources.values()]  # what each source's state holds but them

    @classmethod
    def of_groups(
        cls, out, weights: dict[str, float], split: str = "train", seq_len: int = 2048, cache_size=CACHE_SIZE, **options
    ) -> Mixture:
        """One OUT's groups (made with --group-by) at these weights, each by its name: Sequences(out, split, seq_len,
        group=name, **options), the groups of an OUT on a store opened at once (_opened). On a store, `cache_size` is
        the Mixture's: each group's cache takes its weight's part of it, so that each goes through its buffers in
        about as many batches (a cache_size a group: 2,000 groups asked for up to 8 TB of cache at 4 GiB each)."""
        if not isinstance(weights, dict):
            raise ValueError(f"weights {weights!r}: need a dict, by the groups' names")
        shares, cache_size = _weights(weights), integer(cache_size, "cache_size", 1)
        total, options = sum(shares.values()), options | {"split": split, "seq_len": seq_len}
        parts = {name: max(1, int(cache_size * share / total)) for name, share in shares.items()}
        sources = {name: (out, options | {"group": name, "cache_size": parts[name]}, None) for name in weights}
        return cls(_opened(sources), weights)

    def __reduce__(self):
        """Pickled as references to its sources (each a reference to its OUT, as a Sequences pickles) and its
        position; unpickled, the sources are opened at once."""
        sources = {name: source.__reduce__()[1] for name, source in self.sources.items()}
        return _remix, (sources, self.weights, self.state_dict())

    def _rows(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Under the lock: the next `rows` rows' sources, windows (each in its source) and starts in the
        joined files; the position does not move. Rows are drawn a block at a time (tokpipe.data.draw: 34 us
        a batch of 64 row by row) into the rows drawn ahead, and each source takes its windows of a block at
        once, its own position running ahead to the block's end while the Mixture's moves row by row
        (Sequences.moved): a take per source, their windows scattered into their rows, per batch, made a
        batch 102-111 us, now 97."""
        if len(self._ahead[0]) < rows:
            blocks, counts = [self._ahead], np.bincount(self._ahead[0], minlength=len(self.names)) + self.counts
            drawn, until = self.drawn + len(self._ahead[0]), self.drawn + rows
            while drawn < until:
                blocks.append(self._block_of(counts.tolist(), drawn, until - drawn))
                counts += np.bincount(blocks[-1][0], minlength=len(self.names))
                drawn += len(blocks[-1][0])
            self._ahead = [np.concatenate(a) for a in zip(*blocks)]
        return tuple(a[:rows] for a in self._ahead)

    def _move(self, rows: int) -> None:
        """Under the lock: the position moved past the next `rows` rows (drawn ahead by _rows)."""
        counts = np.bincount(self._ahead[0][:rows], minlength=len(self.names))
        self.counts = [c + n for c, n in zip(self.counts, counts.tolist())]
        sources = list(self.sources.values())
        for i in np.flatnonzero(counts).tolist():  # the sources of these rows alone (a batch of 64 of 2,000 groups)
            self._positions[i] = sources[i].moved(*self._positions[i], int(counts[i]))
            sources[i].keep_at(*self._positions[i])
        self.drawn += rows
        self._ahead = [a[rows:] for a in self._ahead]

    def _block_of(self, counts: list[int], drawn: int, rows: int) -> list[np.ndarray]:
        """The sources, windows and starts of the rows drawn next after `drawn` rows of these counts (all
        taken from the sources, which then stand at their end)."""
        picks = draw.ahead(self._shares, self._total, counts, drawn, rows, self._block)
        counts = np.bincount(picks, minlength=len(self.names)).tolist()
        taken = [s.take(n) for s, n in zip(self.sources.values(), counts)]
        windows = np.empty(len(picks), dtype=np.int64)
        windows[np.argsort(picks, kind="stable")] = np.concatenate(taken)  # each source's, in its rows
        return [picks, windows, self._origins[picks] + windows * self.seq_len]

    def skip(self, rows: int) -> None:
        """Advance past the next `rows` rows without reading them (a DataLoader worker skips the others')."""
        rows = integer(rows, "rows")
        with self._lock:
            self._rows(rows)
            self._move(rows)

    def next_batch(self, batch_size: int) -> Batch:
        """The next `batch_size` rows, read through the sources' files joined: as one Sequences batch reads
        (one gather, one search for document starts), not one batch per source. The position moves once
        they are read: a read that fails raises and leaves it where it was."""
        batch_size = integer(batch_size, "batch_size")
        with self._lock:
            picks, windows, starts = self._rows(batch_size)
            if self.files is None:
                tokens, offsets, bounds = self._read_each(picks, windows)
            else:
                offsets, bounds = self.files.doc_starts(starts, self.seq_len)
                tokens = self.files.windows(starts, self.seq_len)
            self._move(batch_size)
            return Batch(tokens, windows, offsets, bounds, self._names[picks].tolist(), self._state())

    def _read_each(self, picks: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows read by their sources (sources on a store, each through its cache), put back in row order."""
        tokens = np.empty((len(picks), self.seq_len + 1), dtype=np.int64)
        read, counts = [], np.zeros(len(picks), dtype=np.int64)
        for i, source in enumerate(self.sources.values()):
            rows = np.flatnonzero(picks == i)
            if len(rows):
                tokens[rows], offsets, bounds = source.read(windows[rows])
                counts[rows] = np.diff(bounds)
                read.append((rows, offsets, bounds))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        offsets = np.empty(bounds[-1], dtype=np.int64)
        for rows, found, within in read:  # each row's starts at its place
            offsets[np.repeat(bounds[rows] - within[:-1], np.diff(within)) + np.arange(len(found))] = found
        return tokens, offsets, bounds

    def _state(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "weights": self.weights,
            "drawn": self.drawn,
            "counts": dict(zip(self.names, self.counts)),
            "sources": {
                name: {**state, "epoch": epoch, "offset": offset}
                for name, state, (epoch, offset) in zip(self.names, self._states, self._positions)
            },
        }

    def state_dict(self) -> dict:
        with self._lock:
            return self._state()

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was saved; refused (ValueError) for other sources or weights, as each
        Sequences refuses its own, and for a drawn/counts pair the draw cannot reach. All or nothing."""
        if (
            not isinstance(state, dict)
            or state.get("format") not in range(1, STATE_FORMAT + 1)
            or "sources" not in state
        ):
            raise ValueError(f"not a Mixture's loader state of format {STATE_FORMAT}")
        if not isinstance(state["sources"], dict) or sorted(state["sources"]) != self.names:
            saved = sorted(state["sources"]) if isinstance(state["sources"], dict) else state["sources"]
            raise ValueError(f"cannot load this loader state: sources differ ({saved} saved, {self.names} here)")
        if state.get("weights") != self.weights:
            raise ValueError(
                f"cannot load this loader state: weights differ ({state.get('weights')} saved, {self.weights} here)"
            )
        positions = {}
        for name, s in self.sources.items():
            try:
                positions[name] = s.check_state(state["sources"][name])
            except ValueError as e:
                raise ValueError(f"source {name}: {e}") from None
        drawn = integer(state.get("drawn"), "loader state's drawn")
        if not isinstance(state.get("counts"), dict) or sorted(state["counts"]) != self.names:
            raise ValueError(f"loader state's counts {state.get('counts')!r}: need one count per source")
        counts = [integer(state["counts"][name], f"loader state's counts[{name!r}]") for name in self.names]
        # The draw keeps every count strictly within 1 of drawn * share (exactly on it when that is whole).
        if sum(counts) != drawn or any(
            abs(c * self._total - drawn * w) >= self._total for c, w in zip(counts, self._shares)
        ):
            raise ValueError(
                f"loader state's counts {dict(zip(self.names, counts))} after {drawn} rows: the draw never gives "
                f"them (they sum to drawn, each within 1 of drawn x its share)"
            )
        with self._lock:
            for name, s in self.sources.items():
                s.load_state_dict(state["sources"][name])
            self.drawn, self.counts = drawn, counts
            self._ahead = list(_NONE)
            self._positions = [(s.epoch, s.offset) for s in self.sources.values()]


def _weights(weights: dict) -> dict[str, int | float]:
    """The weights as Python numbers (numpy's too: an integer as an int, any float as the nearest float),
    when each is a positive finite number; else a ValueError naming those that are not."""
    taken, bad = {}, {}
    for name, w in weights.items():
        if isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)):
            taken[name] = int(w)
        elif isinstance(w, (float, np.floating)):
            taken[name] = float(w)
        if not (name in taken and math.isfinite(taken[name]) and taken[name] > 0):
            bad[name] = w
    if bad:
        raise ValueError(f"weights must be positive finite numbers: {bad}")
    return taken


def _remix(sources: dict[str, tuple], weights: dict, state: dict) -> Mixture:
    mixture = Mixture(_opened(sources), weights)
    mixture.load_state_dict(state)
    return mixture


def _opened(sources: dict[str, tuple]) -> dict[str, Sequences]:
    """Each source's Sequences by name, from (out, options, state or None); where one is on a store, REQUESTS_AT_ONCE at
    once: a source on a store is opened in 2 round trips (a HEAD of meta.pkl, shared by the groups of one OUT asking at
    once, and a GET of its .idx), and 200 groups one after another took 20 s where the store answers in 20 ms (each
    DataLoader worker too)."""
    if not any(on_store(out) for out, _, _ in sources.values()):
        return {name: reopen(*source) for name, source in sources.items()}
    with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
        return dict(zip(sources, pool.map(lambda source: reopen(*source), sources.values())))


def _convention(meta: Meta) -> str:
    """How a source's documents are delimited, in words."""
    said = []
    if meta.delimiters.bos:
        said.append(f"BOS {meta.bos_token} ({meta.bos_token_id}) before")
    if meta.delimiters.eos:
        said.append(f"EOS {meta.eos_token} ({meta.eos_token_id}) after")
    return " and ".join(said) + " each document" if said else "no delimiter"


def _check_same_tokenizer(sources: dict[str, Sequences]) -> None:
    """One tokenizer: the same tokenizer.json bytes, or else the same JSON content (read from where each
    was recorded, when the file there is still the one the OUT was made with), and the same vocab_size."""
    metas = {name: s.record for name, s in sources.items()}
    named = ", ".join(f"{n}: {m.tokenizer or m.tokenizer_sha256} (vocab_size {m.vocab_size})" for n, m in metas.items())
    if len({m.vocab_size for m in metas.values()}) == 1:
        if len({m.tokenizer_sha256 for m in metas.values()}) == 1:
            return
        contents = {name: _content(m) for name, m in metas.items()}
        if None not in contents.values() and len(set(contents.values())) == 1:
            return
        unread = [f"{metas[n].tokenizer_path} ({n})" for n, content in contents.items() if content is None]
        if unread:
            raise ValueError(
                f"sources were made with different tokenizer.json files ({named}), and {', '.join(unread)} is no "
                f"longer the file recorded to compare their content: put it back, or tokenize again with one tokenizer"
            )
    raise ValueError(f"sources were made with different tokenizers ({named}): their ids mean different tokens")


def _content(meta: Meta) -> str | None:
    """The sha256 of a source's tokenizer.json as parsed JSON (keys sorted, no spacing), or None when the
    file recorded in meta is gone or no longer the one the OUT was made with."""
    try:
        raw = Path(meta.tokenizer_path or "").read_bytes()
    except OSError:
        return None
    if hashlib.sha256(raw).hexdigest() != meta.tokenizer_sha256:
        return None
    parsed = json.loads(raw)
    return hashlib.sha256(json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

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
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from tokpipe.data.sequences import STATE_FORMAT, Batch, Sequences


class Mixture:
    def __init__(self, sources: dict[str, Sequences], weights: dict[str, float]):
        if not sources or set(sources) != set(weights):
            raise ValueError(f"weights name {sorted(weights)}, sources {sorted(sources)}: name every source once")
        bad = {name: w for name, w in weights.items() if not (math.isfinite(w) and w > 0)}
        if bad:
            raise ValueError(f"weights must be positive and finite: {bad}")
        self.names = sorted(sources)
        self.sources = {name: sources[name] for name in self.names}
        first = self.sources[self.names[0]]
        for what in ("seq_len", "rank", "world_size"):
            values = {name: getattr(s, what) for name, s in self.sources.items()}
            if len(set(values.values())) > 1:
                raise ValueError(f"sources differ in {what}: {values}")
        self.seq_len = first.seq_len
        tokenizers = {
            name: (s.meta.get("tokenizer"), s.meta.get("tokenizer_sha256"), s.meta.get("vocab_size"))
            for name, s in self.sources.items()
        }
        if len({sha for _, sha, _ in tokenizers.values()}) > 1 or len({v for _, _, v in tokenizers.values()}) > 1:
            named = ", ".join(f"{n}: {t or f'sha256 {sha}'} (vocab_size {v})" for n, (t, sha, v) in tokenizers.items())
            raise ValueError(f"sources were made with different tokenizers ({named}): their ids mean different tokens")
        self.weights = {name: weights[name] for name in self.names}
        exact = [Fraction(weights[name]) for name in self.names]
        scale = math.lcm(*(w.denominator for w in exact))
        self._shares = [int(w * scale) for w in exact]  # integer weights, in proportion
        self._total = sum(self._shares)
        self.drawn = 0
        self.counts = [0] * len(self.names)

    def _draw(self, rows: int) -> list[int]:
        """The source index of each of the next `rows` rows (advancing the counts)."""
        picks = []
        for _ in range(rows):
            best, best_deadline = None, None
            for i, (w, c) in enumerate(zip(self._shares, self.counts)):
                if self.drawn >= c * self._total // w:  # released: its next row is due from here on
                    deadline = -(-(c + 1) * self._total // w)
                    if best is None or deadline < best_deadline:
                        best, best_deadline = i, deadline
            picks.append(best)
            self.counts[best] += 1
            self.drawn += 1
        return picks

    def next_batch(self, batch_size: int) -> Batch:
        picks = np.array(self._draw(batch_size), dtype=np.int64)
        tokens = np.empty((batch_size, self.seq_len + 1), dtype=np.int64)
        windows = np.empty(batch_size, dtype=np.int64)
        doc_starts = [None] * batch_size
        for i, name in enumerate(self.names):
            rows = np.flatnonzero(picks == i)
            if rows.size:
                part = self.sources[name].next_batch(rows.size)
                tokens[rows], windows[rows] = part.tokens, part.windows
                for row, starts in zip(rows.tolist(), part.doc_starts):
                    doc_starts[row] = starts
        return Batch(tokens, windows, doc_starts, [self.names[i] for i in picks.tolist()])

    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "weights": self.weights,
            "drawn": self.drawn,
            "counts": dict(zip(self.names, self.counts)),
            "sources": {name: s.state_dict() for name, s in self.sources.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was saved; refused (ValueError) for other sources or weights, and as
        each Sequences refuses its own."""
        if state.get("format") != STATE_FORMAT or "sources" not in state:
            raise ValueError(f"not a Mixture's loader state of format {STATE_FORMAT}")
        if sorted(state["sources"]) != self.names:
            raise ValueError(
                f"cannot load this loader state: sources differ ({sorted(state['sources'])} saved, {self.names} here)"
            )
        if state["weights"] != self.weights:
            raise ValueError(
                f"cannot load this loader state: weights differ ({state['weights']} saved, {self.weights} here)"
            )
        for name, s in self.sources.items():
            try:
                s.load_state_dict(state["sources"][name])
            except ValueError as e:
                raise ValueError(f"source {name}: {e}") from None
        self.drawn = int(state["drawn"])
        self.counts = [int(state["counts"][name]) for name in self.names]

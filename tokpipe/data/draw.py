"""The Mixture's draw (Pfair, see tokpipe.data.mixture), many rows at once: the same rows as one at a time.

Source i (integer share w of total T) has turns c = 0, 1, ...: turn c is released at row floor(c T / w) and
due by ceil((c + 1) T / w); each row takes, among the sources whose next turn is released, the one due
first (ties: the lower index). Row by row that is ~0.45 us a row in Python for 3 sources (28-33 us a batch
of 64). Here the next turns of every source are made with numpy and sorted by (due, index): the order the
rows would take them if every turn were released in time. Where one is not (its row comes before its
release), the row takes the first released turn after it in that order, and the late turn goes to the
first row at which it is released and comes first; most often that is the next row, the two swap
(found with numpy: at 0.5/0.3/0.2 about every 5th row). The other cases (none in 200,000 rows at
0.5/0.3/0.2; some weights of the test meet them) are walked row by row over the order from that row until
the rows and the order line up again.

Why that is the draw: each row takes the first turn, in the sorted order, that is released and not yet
taken (a source's later turns come after its earlier ones in the order and are released no earlier), and
a row's choice does not change the order of the turns left. The numbers stay in int64 while a block's
turns over SPLIT times the largest share fit (`block`: 4,096 rows at 0.5/0.3/0.2, whose shares are ~2^54);
shares too large for a block of SORTED_FROM rows (weights whose exact fractions need ~2^60 as a common
denominator, such as 1e-3 beside 3) draw row by row.
"""

from __future__ import annotations

import numpy as np

AHEAD = 4096  # rows drawn at once, at most: ~100 us of numpy a block at 3 sources
SORTED_FROM = 256  # a block of fewer rows costs more than drawing them one by one
SPLIT = 32  # turn k = k1 * SPLIT + k0: sums below (SPLIT + 1 + turns / SPLIT) x the share, not turns x it


def block(shares: list[int], total: int) -> int:
    """The most rows (a power of 2 up to AHEAD) whose turns `sorted_rows` computes within int64; 0 below
    SORTED_FROM."""
    rows = AHEAD
    while rows >= SORTED_FROM:
        turns = [_turns(rows, w, total) for w in shares]
        sums = all((SPLIT + 1 + k // SPLIT) * w < 1 << 62 for k, w in zip(turns, shares))
        keys = all((k + 2) * (total // w + 1) * len(shares) < 1 << 62 for k, w in zip(turns, shares))  # rows too
        if sums and keys:
            return rows
        rows //= 2
    return 0


def _turns(rows: int, share: int, total: int) -> int:
    """Turns made per source for a block of `rows` rows: more than it can take in rows + 1 (its count stays
    within 1 of rows x its share)."""
    return -(-(rows + 1) * share // total) + 3


def ahead(shares: list[int], total: int, counts: list[int], drawn: int, rows: int, size: int) -> np.ndarray:
    """The source of each of the next rows from (counts, drawn): up to `size` (`block`'s) of them, at least
    one, by sorting; when size is 0, exactly `rows` one by one."""
    if size:
        found = sorted_rows(shares, total, counts, drawn, size)
        return found if len(found) else one_by_one(shares, total, counts, drawn, 1)
    return one_by_one(shares, total, counts, drawn, rows)


def one_by_one(shares: list[int], total: int, counts: list[int], drawn: int, rows: int) -> np.ndarray:
    """The next `rows` rows' sources, row by row. Each source's next release and deadline are kept between
    rows: only the picked source's change (2.3x faster than computing every source's each row)."""
    counts = list(counts)
    release = [c * total // w for w, c in zip(shares, counts)]  # its next row is due from here on
    deadline = [-(-(c + 1) * total // w) for w, c in zip(shares, counts)]  # and by here
    sources, picks = range(len(shares)), []
    for row in range(drawn, drawn + rows):
        best = -1
        for i in sources:
            if row >= release[i] and (best < 0 or deadline[i] < deadline[best]):  # ties: the first
                best = i
        picks.append(best)
        c = counts[best] = counts[best] + 1
        release[best], deadline[best] = c * total // shares[best], -(-(c + 1) * total // shares[best])
    return np.array(picks, dtype=np.int64)


def sorted_rows(shares: list[int], total: int, counts: list[int], drawn: int, rows: int) -> np.ndarray:
    """Up to `rows` next rows' sources from (counts, drawn), by sorting every source's next turns (see the
    module's docstring); fewer where the turns made run out."""
    keys, releases, s = [], [], len(shares)
    for i, (w, c) in enumerate(zip(shares, counts)):
        k = np.arange(_turns(rows, w, total) + 1, dtype=np.int64)
        first, rest = divmod(c * total, w)  # turn c's release: first + rest / w
        step, carry = divmod(total, w)  # turn c + k's: first + k * step + (rest + k * carry) / w
        whole, part = divmod(SPLIT * carry, w)  # and k * carry = k1 * (whole * w + part) + k0 * carry
        k1, k0 = k // SPLIT, k % SPLIT
        sums = rest + k0 * carry + k1 * part  # < 2^62 (block)
        release = (first - drawn) + k * step + k1 * whole + sums // w  # counted from the position
        keys.append((release[1:] + (sums[1:] % w != 0)) * s + i)  # due: the next turn's release, rounded up
        releases.append(release[:-1])
    key = np.concatenate(keys)
    order = np.argsort(key)
    key = key[order]
    # Past the first source's last turn made here, the order could miss that source's next turns.
    last = int(np.searchsorted(key, [k[-1] for k in keys]).min())
    rows = min(rows, last)
    source, release, row = key % s, np.concatenate(releases)[order[: last + 1]], np.arange(rows)
    late = release[:rows] > row
    swap = late & (release[1 : rows + 1] <= row) & (release[:rows] <= row + 1)
    picks = source[: rows + 1].copy()
    at = np.flatnonzero(swap)
    picks[at], picks[at + 1] = source[at + 1], source[at]
    walk = np.flatnonzero(late & ~swap)
    if not walk.size:
        return picks[:rows]
    return _walked(picks[:rows].tolist(), source.tolist(), release.tolist(), walk.tolist())


def _walked(picks: list[int], source: list[int], release: list[int], walk: list[int]) -> np.ndarray:
    """`picks` with the rows from each of `walk` on taken one by one (the first released turn not taken, in
    the order) until the rows and the order line up again (no turn waiting, row r taking turn r)."""
    done = 0
    for row in walk:
        if row < done:
            continue
        waiting, turn = [], row
        while row < len(picks):
            ready = next((t for t in waiting if release[t] <= row), None)
            if ready is None:
                while turn < len(release) and release[turn] > row:
                    waiting.append(turn)
                    turn += 1
                if turn == len(release):  # the turns made run out: the rows so far
                    return np.array(picks[:row], dtype=np.int64)
                ready, turn = turn, turn + 1
            else:
                waiting.remove(ready)
            picks[row] = source[ready]
            row += 1
            if turn == row:  # (every turn before it taken: none waits)
                break
        done = row
    return np.array(picks, dtype=np.int64)

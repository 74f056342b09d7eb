"""Arguments as a long run needs them, for every class of tokpipe.data: a number is an integer (numpy's
too, kept as a Python int, so a state stays JSON-able; a bool or a float is refused, never truncated:
Permutation(5.7, 1.9) was once n=5, seed=1, an order shared with seed 1), a name is a str, and a refusal
is one line naming what was given, made before anything moves."""

from __future__ import annotations

import numpy as np


def integer(value, what: str, minimum: int | None = 0) -> int:
    """`value` as an int when it is an integer (Python's or numpy's) >= minimum; else a ValueError naming it."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or (minimum is not None and value < minimum)
    ):
        need = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise ValueError(f"{what} {value!r}: need {need}")
    return int(value)


def name(value, what: str) -> str:
    """`value` as a str when it is one (numpy's too); else a ValueError naming it."""
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r}: need a str")
    return str(value)

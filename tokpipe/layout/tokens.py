"""Two rules of what OUT's bytes mean, shared by who writes them and who checks or converts them: an id is
stored in the output's dtype or refused, never wrapped; and which documents are held out for val.bin."""

from __future__ import annotations

import hashlib

import numpy as np


def to_dtype(ids: np.ndarray, dtype: str) -> np.ndarray:
    """Cast token ids to the output dtype; an id that does not fit is an error, never a wrap."""
    limit = np.iinfo(dtype).max
    if ids.size and int(ids.max()) > limit:
        raise OverflowError(f"token id {int(ids.max())} does not fit {dtype} (max {limit})")
    return ids.astype(dtype, copy=False)


def held_out(texts: list[str], fraction: float) -> np.ndarray:
    """Which documents go to val.bin: those whose text hashes below `fraction` of the hash space.

    A function of the text alone (blake2b-64 of its UTF-8), so the choice is the same whatever the
    workers, crashes, resumes or shard order; a document that appears twice goes the same way twice.
    """
    limit = int(fraction * 2**64)
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
            < limit
            for t in texts
        ),
        dtype=bool,
        count=len(texts),
    )

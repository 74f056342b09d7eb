"""Where a long document may be cut into pieces that a tokenizer encodes one after the other to
exactly the ids of the whole.

One encode call needs 150-350 bytes per character in `tokenizers` and ~10 in fastokens and gigatoken
(measured, benchmarks/README.md): a 62 MB document in one call took a run to 19 GiB with the
reference. A piece ends only where the tokenizer's own pre-tokenizer must end a pre-token whatever
follows (CUT), and BPE never merges across pre-tokens, so the ids of the pieces, joined, are the ids
of the whole (tests/test_inputs_pieces.py checks it on real text against one whole-document encode).
"""

from __future__ import annotations

import re

PIECE_CHARS = 1 << 18  # a piece is at least this long (up to the next CUT): ~40-90 MB in `tokenizers`' encode
# Where a piece may end (the zero-width match), for the pre-tokenizer regexes of PIECE_PATTERNS:
# - after a newline between two non-whitespace characters: no alternative joins a newline to what
#   follows it, and the pre-token holding the newline is the same whether text follows or not;
# - before a space between two non-whitespace characters: no alternative puts a space after a
#   non-space character in one pre-token, and the space starts the next pre-token either way;
# - between an ASCII letter or digit and ASCII punctuation: letters and digits never join what follows.
# None of the regexes looks behind, so the pre-tokens after a cut are those of the text from there.
# Python's \s (str.isspace) holds every Unicode White_Space character (and \x1c-\x1f besides), so its
# \S is never whitespace to the tokenizer's regex. NFC composes nothing across any of these cuts.
CUT = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S)(?= \S)|(?<=[A-Za-z0-9])(?=[!-/:-@\[-`{-~])")
QWEN2_PATTERN = (  # Qwen2/2.5/3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")  # Llama-3, tiktoken's cl100k
PIECE_PATTERNS = (QWEN2_PATTERN, LLAMA3_PATTERN)


def piece_tokens(config: dict) -> tuple[str, ...] | None:
    """The added tokens' texts when this tokenizer encodes a text in pieces cut at CUT exactly as
    whole, else None (the text is encoded whole): a BPE, normalized by NFC or not at all, that
    pre-tokenizes with one of PIECE_PATTERNS and then maps bytes (no prefix space: it would be added
    to every piece). Added tokens are matched before all of that, so no cut is made inside or next to one."""
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    model = config.get("model") or {}
    added = tuple(t["content"] for t in config.get("added_tokens", []))
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or config.get("normalizer") not in (None, {"type": "NFC"})
        or len(steps) != 2
        or (steps[0].get("type"), steps[0].get("behavior"), steps[0].get("invert")) != ("Split", "Isolated", False)
        or (steps[0].get("pattern") or {}).get("Regex") not in PIECE_PATTERNS
        or steps[1].get("type") != "ByteLevel"
        or steps[1].get("add_prefix_space")
        or steps[1].get("use_regex")
        or not all(token.isascii() for token in added)  # matched after NFC: ASCII stays itself
    ):
        return None
    return added


def pieces(text: str, added: tuple[str, ...], size: int = PIECE_CHARS) -> list[tuple[int, int]]:
    """(start, end) of the pieces of `text`, each at least `size` characters (the last may be shorter)
    up to the next CUT that no added token touches; a stretch with no CUT stays in one piece."""
    longest = max(map(len, added), default=0)
    bounds, start, at = [], 0, size
    while at < len(text) and (found := CUT.search(text, at)):
        cut = found.start()
        window = text[max(cut - longest, 0) : cut + longest + 1]  # an added token ending or starting at the cut, too
        if longest and any(token in window for token in added):
            at = cut + 1
            continue
        bounds.append((start, cut))
        start, at = cut, cut + size
    bounds.append((start, len(text)))
    return bounds

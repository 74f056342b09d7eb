"""pieces: a long document cut where the pre-tokenizer must end a pre-token, its pieces encoded one after
the other, gives exactly the ids of one whole-document encode by `tokenizers` (the reference)."""

import json

import numpy as np
import pytest
from helpers import QWEN3, long_document, reference_tokenizer
from tokenizers import Tokenizer

from tokpipe.inputs.pieces import CUT, LLAMA3_PATTERN, PIECE_CHARS, piece_tokens, pieces

QWEN3_CONFIG = json.loads((QWEN3 / "tokenizer.json").read_text())

# Where BPE pre-tokenizers part ways: whitespace runs before and after newlines, CRLF, tabs, NBSP and
# U+3000, digit runs (Qwen: one digit a token, Llama-3: three), CJK and Thai without spaces, contractions,
# combining marks (NFC), punctuation runs, added tokens in text (non-special ones are split out first),
# special tokens as text, emoji, control characters.
TRICKY = (
    "Hello world.\nThe year 2024: 1234567890 items, 3.14159 and 1,000,000!\n\n\n"
    "   indented  \n\t\ttabbed\r\nCRLF line\r\n\r\n  \n  x  \n"
    "吾輩は猫である。名前はまだ無い。\nどこで生れたかとんと見当がつかぬ。 สวัสดีครับ مرحبا بالعالم 안녕하세요\n"
    "I'm sure you'll see they've done it; DON'T STOP. It's 'quoted' and \"double\".\n"
    "e\u0301 cafe\u0301 \u212b \u00c5 \ufb01 \uff21\uff22 \u0130stanbul \u00a0nbsp\u00a0 ideo\u3000space\n"
    'code: def f(x):\n\treturn x**2  # comment\n    if a==b and c!=d: pass\n{"k": [1, 2]}\n'
    "<think>hm</think> a<tool_call>b</tool_call>c <|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>\n"
    "<|endoftext|> and <|im_start|>user\n<|im_end|>\n"
    "emoji 👩‍👩‍👧‍👦 🇩🇪 ok\x00 \x7f \x1c sep \ufffd\ufffd end...!!! ???\n"
    "url https://example.com/a_b-c?d=1&e=2#f base64 QUJDREVGR0g+/=abc== hex 0xDEADBEEF\n"
)


def config_with(pattern: str) -> dict:
    """Qwen3's tokenizer.json with another pre-tokenizer regex: the same vocabulary and merges."""
    config = json.loads(json.dumps(QWEN3_CONFIG))
    config["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = pattern
    return config


@pytest.fixture(scope="module", params=["qwen3", "llama3-regex"])
def tokenizer(request) -> tuple[Tokenizer, dict]:
    """The reference (special-token strings encoded as text) and its tokenizer.json."""
    if request.param == "qwen3":
        return reference_tokenizer(QWEN3 / "tokenizer.json"), QWEN3_CONFIG
    config = config_with(LLAMA3_PATTERN)
    tok = Tokenizer.from_str(json.dumps(config))
    tok.encode_special_tokens = True
    return tok, config


def piecewise_ids(tok: Tokenizer, text: str, bounds: list[tuple[int, int]]) -> list[int]:
    encoded = tok.encode_batch([text[start:end] for start, end in bounds], add_special_tokens=False)
    return [i for e in encoded for i in e.ids]


def test_qwen3_and_llama3_regexes_are_cut_others_are_not():
    assert piece_tokens(QWEN3_CONFIG) == tuple(t["content"] for t in QWEN3_CONFIG["added_tokens"])
    assert piece_tokens(config_with(LLAMA3_PATTERN)) is not None
    prefix_space = json.loads(json.dumps(QWEN3_CONFIG))
    prefix_space["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True  # a space added to every piece
    metaspace = {**QWEN3_CONFIG, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}}
    nfkc = {**QWEN3_CONFIG, "normalizer": {"type": "NFKC"}}
    unknown_regex = config_with(r"\S+|\s+")
    for config in (prefix_space, metaspace, nfkc, unknown_regex):
        assert piece_tokens(config) is None


def test_every_cut_of_tricky_text_keeps_the_ids_of_the_whole(tokenizer):
    tok, config = tokenizer
    added = piece_tokens(config)
    text = TRICKY * 3
    bounds = pieces(text, added, size=1)  # every place a piece may end
    cuts = [end for _, end in bounds[:-1]]
    assert len(cuts) > 250 and "".join(text[s:e] for s, e in bounds) == text
    whole = tok.encode(text, add_special_tokens=False).ids
    assert piecewise_ids(tok, text, bounds) == whole  # all cuts at once
    # and each cut alone: the ids of what is before it, then of what follows, are the whole's
    halves = tok.encode_batch([t for c in cuts for t in (text[:c], text[c:])], add_special_tokens=False)
    broken = [c for c, a, b in zip(cuts, halves[::2], halves[1::2]) if a.ids + b.ids != whole]
    assert broken == []


def test_no_cut_inside_or_next_to_an_added_token():
    tok = reference_tokenizer(QWEN3 / "tokenizer.json")
    text = "abc<|fim_prefix|>def one two three four five six seven eight nine ten"
    cuts = [end for _, end in pieces(text, piece_tokens(QWEN3_CONFIG), size=1)[:-1]]
    token = range(text.index("<"), text.index("def") + 1)  # its first character to just after its last
    assert CUT.match(text, token[0]) and not set(cuts) & set(token) and text.index(" ten") in cuts
    # A cut between the x and the | of <|fim_prefix|> (letter, then punctuation) would break the token:
    inside = text.index("x|>") + 1
    assert CUT.match(text, inside)
    assert (
        piecewise_ids(tok, text, [(0, inside), (inside, len(text))]) != tok.encode(text, add_special_tokens=False).ids
    )


def test_a_cut_the_rules_leave_out_would_change_the_ids():
    """The rules are not vacuous: cutting inside a whitespace run, between newlines or inside a
    contraction changes what the reference gives."""
    tok = reference_tokenizer(QWEN3 / "tokenizer.json")
    for text, at in (("a  \n  b", 2), ("end.\n\nNext", 5), ("a\n\nb", 2), ("it's", 3)):
        assert CUT.match(text, at) is None
        assert piecewise_ids(tok, text, [(0, at), (at, len(text))]) != tok.encode(text, add_special_tokens=False).ids


def test_real_text_in_pieces_is_the_whole_document(tokenizer):
    """A quarter of a megabyte of the example's real documents as one document, cut every ~1,000
    characters (where the text happens to allow it), against one whole encode."""
    tok, config = tokenizer
    text = long_document(250_000 - len(TRICKY)) + TRICKY
    bounds = pieces(text, piece_tokens(config), size=1000)
    assert len(bounds) > 200 and all(e - s >= 1000 for s, e in bounds[:-1])
    assert piecewise_ids(tok, text, bounds) == tok.encode(text, add_special_tokens=False).ids


def test_pieces_are_at_least_the_size_and_text_without_a_cut_stays_whole():
    assert pieces("x" * 10, (), size=3) == [(0, 10)]  # no space, newline or punctuation: nowhere to cut
    text = "ab cd ef gh"
    assert pieces(text, (), size=4) == [(0, 5), (5, 11)]
    assert pieces("short", ()) == [(0, 5)] and PIECE_CHARS == 1 << 18
    assert np.all(np.diff([s for s, _ in pieces(text * 1000, (), size=100)]) >= 100)

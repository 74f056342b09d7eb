"""encoders: every backend gives the reference ids, or auto passes it over; a long document is encoded in pieces
to the ids of the whole."""

import json

import numpy as np
import pytest
from helpers import EXAMPLE_HOLDOUT_FILES, QWEN3, QWEN3_EOS, long_document, reference_ids, reference_texts
from tokenizers import Tokenizer, models, pre_tokenizers

from tokpipe.errors import UserError
from tokpipe.inputs import encoders
from tokpipe.inputs.encoders import HARD_CASES, PIECE_CHARS, choose_backend, encoder

GIGATOKEN_REORDERS = "\U00010d27\U00010f46"  # the hard case gigatoken 0.10 gets wrong
TOKENIZER_JSON = str(QWEN3 / "tokenizer.json")


# The process's encoders (encoders.encoder), as a run's worker uses them: loaded once for all these tests.
@pytest.mark.parametrize("backend", ["hf", "fastokens", "gigatoken"])
def test_backends_give_the_reference_ids(backend):
    hard = [t for t in HARD_CASES if backend != "gigatoken" or t != GIGATOKEN_REORDERS]
    texts = hard + reference_texts(EXAMPLE_HOLDOUT_FILES[0])
    flat, lengths = encoder(backend, TOKENIZER_JSON).encode(texts)
    expected = reference_ids(texts)
    assert lengths.tolist() == [len(ids) for ids in expected]
    assert np.array_equal(flat, np.concatenate([np.array(ids, dtype=np.uint32) for ids in expected]))


@pytest.mark.parametrize("backend", ["fastokens", "gigatoken"])
def test_special_token_strings_in_text_are_text(backend):
    # What tokbench counts as fastokens differing (its adapter left specials as text): here, the reference.
    flat, _ = encoder(backend, TOKENIZER_JSON).encode(["a <|endoftext|> b <|im_start|>"])
    assert flat.tolist() == reference_ids(["a <|endoftext|> b <|im_start|>"])[0]
    assert QWEN3_EOS not in flat and 151644 not in flat


def test_gigatoken_reorders_two_combining_marks_that_the_reference_keeps():
    reference = reference_ids([GIGATOKEN_REORDERS])[0]
    assert reference == [123934, 112, 100, 123934, 121, 228]
    assert encoder("fastokens", TOKENIZER_JSON).encode([GIGATOKEN_REORDERS])[0].tolist() == reference
    assert encoder("gigatoken", TOKENIZER_JSON).encode([GIGATOKEN_REORDERS])[0].tolist() == [
        123934,
        121,
        228,
        123934,
        112,
        100,
    ]


def test_auto_picks_fastokens_after_it_matched():
    assert choose_backend("auto", TOKENIZER_JSON, ["hello world"]) == (
        "fastokens",
        "fastokens matched tokenizers on 9 texts (11 chars of sample)",
    )
    assert choose_backend("hf", TOKENIZER_JSON, []) == ("hf", "requested")


def test_auto_passes_over_a_backend_that_misses_a_hard_case(monkeypatch):
    def cannot_load(tokenizer_json):
        raise ValueError("normalizer error: unsupported normalizer type: NFKC")

    monkeypatch.setitem(encoders._ENCODER_CLASSES, "fastokens", cannot_load)
    monkeypatch.delitem(encoders._encoders, ("fastokens", TOKENIZER_JSON), raising=False)  # back after the test
    assert choose_backend("auto", TOKENIZER_JSON, ["hello world"]) == (
        "hf",
        "fastokens cannot load this tokenizer (ValueError: normalizer error: unsupported normalizer type: NFKC); "
        "gigatoken's ids differ from tokenizers' on 0 sampled and 1 hard-case texts",
    )


def test_a_backend_asked_for_runs_and_says_which_hard_case_it_misses():
    backend, why = choose_backend("gigatoken", TOKENIZER_JSON, ["hello world"])
    assert backend == "gigatoken"
    assert why == (
        "requested; matched tokenizers on the sample, but NOT on 1 known hard case(s), e.g. '\\U00010d27\\U00010f46': "
        "its ids differ where such text occurs (--backend auto picks an exact backend)"
    )
    with pytest.raises(UserError, match="does not reproduce tokenizers' ids"):
        choose_backend("gigatoken", TOKENIZER_JSON, [GIGATOKEN_REORDERS])


def test_auto_falls_back_to_hf_when_no_fast_backend_can_load_the_tokenizer(tmp_path):
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "[SEP]": 1, "a": 2, "##b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[SEP]"}))
    backend, why = choose_backend("auto", str(tmp_path / "tokenizer.json"), ["ab a"])
    assert backend == "hf"
    assert why.startswith("fastokens cannot load this tokenizer (ValueError: ") and "; gigatoken cannot load" in why
    for fast in ("fastokens", "gigatoken"):
        with pytest.raises(UserError, match=f"--backend {fast} cannot load this tokenizer"):
            choose_backend(fast, str(tmp_path / "tokenizer.json"), ["ab a"])


@pytest.fixture(scope="module")
def long_batch():
    """A batch with a document over PIECE_CHARS between two short ones, and each text's reference ids,
    the long one's from one whole-document encode (~350 bytes a character: 0.2 GB here)."""
    texts = ["a short one", long_document(PIECE_CHARS + 5_000), "another <think> short one"]
    return texts, reference_ids(texts)


def largest_encode_call(monkeypatch, enc) -> list[int]:
    """Records the characters of every call the encoder makes to its backend."""
    sizes, encode = [], enc._encode
    monkeypatch.setattr(enc, "_encode", lambda texts: sizes.append(sum(map(len, texts))) or encode(texts))
    return sizes


@pytest.mark.parametrize("backend", ["hf", "fastokens", "gigatoken"])
def test_a_long_document_is_encoded_in_pieces_to_the_ids_of_the_whole(backend, long_batch, monkeypatch):
    texts, reference = long_batch
    enc = encoder(backend, TOKENIZER_JSON)
    calls = largest_encode_call(monkeypatch, enc)
    flat, lengths = enc.encode(texts)
    assert lengths.tolist() == [len(ids) for ids in reference]
    assert np.array_equal(flat, np.concatenate([np.asarray(ids, np.uint32) for ids in reference]))
    # short texts in calls of their own; the long one in two pieces: no call holds the document
    assert len(calls) == 4 and max(calls) < PIECE_CHARS + 100


def test_the_backend_check_looks_at_a_long_documents_beginning_and_says_so(long_batch, monkeypatch):
    texts, _ = long_batch
    calls = largest_encode_call(monkeypatch, encoder("hf", TOKENIZER_JSON))
    backend, why = choose_backend("auto", TOKENIZER_JSON, texts)
    assert backend == "fastokens" and why.endswith(
        f"({PIECE_CHARS + 36:,} chars of sample); 1 longer document(s) of the sample checked on their first "
        "262,144 chars"
    )
    # The reference never sees the whole document: one call of the sample's cut texts and the hard cases.
    assert max(calls) == PIECE_CHARS + 36 + sum(map(len, HARD_CASES))

"""tokenizer: vocab/eos/dtype resolved as a trainer needs them; both backends give the reference ids."""

import json

import numpy as np
import pytest
from helpers import EXAMPLE_HOLDOUT_FILES, QWEN3, QWEN3_EOS, reference_ids, reference_texts
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from tokpipe.errors import UserError
from tokpipe.tokenizer import HARD_CASES, GigatokenEncoder, HFEncoder, choose_backend, dtype_for, load_tokenizer_info


def test_qwen3_info_matches_transformers():
    info = load_tokenizer_info(QWEN3)
    hf = AutoTokenizer.from_pretrained(str(QWEN3), local_files_only=True, trust_remote_code=False)
    assert info.vocab_size == len(hf) == 151669  # base vocabulary plus added tokens, not 151,643 nor 50,304
    assert info.eos_token == hf.eos_token == "<|endoftext|>"
    assert info.eos_id == hf.eos_token_id == QWEN3_EOS
    assert info.bos_id is None
    assert info.dtype == "uint32"  # "Phantom Zero": uint16 would wrap every id >= 65536
    assert info.id.startswith("qwen3@sha256:") and len(info.sha256) == 64


@pytest.mark.parametrize(
    "vocab, dtype", [(256, "uint16"), (65535, "uint16"), (65536, "uint16"), (65537, "uint32"), (151669, "uint32")]
)
def test_dtype_is_the_smallest_that_holds_every_id(vocab, dtype):
    assert dtype_for(vocab) == dtype


def test_missing_tokenizer_and_unknown_eos_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no tokenizer at"):
        load_tokenizer_info(tmp_path)
    with pytest.raises(UserError, match="not in the tokenizer's vocabulary"):
        load_tokenizer_info(QWEN3, eos_token="<|nope|>")
    assert load_tokenizer_info(QWEN3 / "tokenizer.json", eos_token="<|im_end|>").eos_id == 151645


@pytest.mark.parametrize("encoder_class", [HFEncoder, GigatokenEncoder])
def test_backends_give_the_reference_ids(encoder_class):
    texts = HARD_CASES + reference_texts(EXAMPLE_HOLDOUT_FILES[0])
    flat, lengths = encoder_class(str(QWEN3 / "tokenizer.json")).encode(texts)
    expected = reference_ids(texts)
    assert lengths.tolist() == [len(ids) for ids in expected]
    assert np.array_equal(flat, np.concatenate([np.array(ids, dtype=np.uint32) for ids in expected]))


def test_special_token_strings_in_text_are_text():
    flat, _ = GigatokenEncoder(str(QWEN3 / "tokenizer.json")).encode(["a <|endoftext|> b <|im_start|>"])
    assert QWEN3_EOS not in flat and 151644 not in flat


def test_auto_picks_gigatoken_only_after_it_matched():
    backend, why = choose_backend("auto", str(QWEN3 / "tokenizer.json"), ["hello world"])
    assert backend == "gigatoken" and "matched" in why
    assert choose_backend("hf", str(QWEN3 / "tokenizer.json"), [])[0] == "hf"


def test_auto_falls_back_to_hf_when_gigatoken_cannot_do_the_tokenizer(tmp_path):
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "[SEP]": 1, "a": 2, "##b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[SEP]"}))
    backend, why = choose_backend("auto", str(tmp_path / "tokenizer.json"), ["ab a"])
    assert backend == "hf" and why
    with pytest.raises(UserError):
        choose_backend("gigatoken", str(tmp_path / "tokenizer.json"), ["ab a"])

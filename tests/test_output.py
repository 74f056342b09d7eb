"""output: open_output reads a finished OUT as a trainer does (meta, read-only memmaps of each split and its
document ends), and refuses an OUT that is unfinished or does not match its meta."""

import json

import numpy as np
import pytest
from helpers import QWEN3_EOS, QWEN3_VOCAB

import tokpipe
from tokpipe.errors import UserError


def test_open_output_gives_meta_and_read_only_memmaps(finished_example):
    data = tokpipe.open_output(finished_example)
    assert data.meta == json.loads((finished_example / "meta.json").read_text())
    assert data.vocab_size == QWEN3_VOCAB and data.eos_id == QWEN3_EOS and data.dtype == np.uint32
    assert set(data.splits) == {"train", "validation"}
    train = data.splits["train"]
    assert isinstance(train.tokens, np.memmap) and train.tokens.dtype == np.uint32 and not train.tokens.flags.writeable
    assert np.array_equal(train.tokens, np.fromfile(finished_example / "train.bin", dtype=np.uint32))
    assert np.array_equal(train.ends, np.fromfile(finished_example / "train.idx", dtype="<i8"))
    assert len(train.ends) == data.meta["splits"]["train"]["documents"]
    first, last = train.document(0), train.document(len(train.ends) - 1)
    assert first[-1] == last[-1] == QWEN3_EOS and QWEN3_EOS not in first[:-1]
    with pytest.raises(ValueError):
        train.tokens[0] = 1


def test_open_output_refuses_unfinished_and_mismatched_outputs(killed_example, out):
    with pytest.raises(UserError, match="tokpipe status"):
        tokpipe.open_output(killed_example)
    with open(out / "val.bin", "ab") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(UserError, match="val.bin holds .* meta says"):
        tokpipe.open_output(out)


def test_a_grouped_split_is_its_groups_one_after_the_other_in_the_order_of_their_values(
    finished_grouped, grouped_reference
):
    """--group-by: open_output gives each split as its groups in meta's order (sorted by value), and each
    group alone in `groups`."""
    data = tokpipe.open_output(finished_grouped)
    for name, stem in (("train", "train"), ("validation", "val")):
        split, reference = data.splits[name], grouped_reference[stem]
        assert list(split.groups) == sorted(reference) == list(data.meta["splits"][name]["groups"])
        whole = np.concatenate([tokens for tokens, _, _ in reference.values()])
        assert np.array_equal(split.tokens[:], whole)
        assert len(split.ends) == sum(documents for _, documents, _ in reference.values())
        for group, (tokens, documents, _) in reference.items():
            alone = split.groups[group]
            assert np.array_equal(alone.tokens[:], tokens) and len(alone.ends) == documents
            assert np.array_equal(alone.document(documents - 1)[-1:], [QWEN3_EOS])

"""tokpipe.data.Mixture at the edges: a state loaded all or nothing, the drawn/counts pair checked, sources
that must be read the same way (one tokenizer by content, one document convention), a Mixture that
pickles as references to its sources, and its draw made many rows at once against the rule row by row."""

import json
import math
import pickle
import shutil
from fractions import Fraction

import numpy as np
import pytest
from helpers import build_out

from tokpipe.data import Mixture, Sequences, draw

SPLITS = ("train", "validation")


def mixture(out, seed=1, weights=None) -> Mixture:
    return Mixture({s: Sequences(out, s, seq_len=2048, seed=seed) for s in SPLITS}, weights or {s: 1 for s in SPLITS})


def test_a_state_is_loaded_all_or_nothing(finished_example):
    running = mixture(finished_example)
    for _ in range(3):
        running.next_batch(33)
    state = json.loads(json.dumps(running.state_dict()))
    assert state["drawn"] == 99 and state["counts"] == {"train": 50, "validation": 49}
    fresh = mixture(finished_example)
    before = fresh.state_dict()
    broken = json.loads(json.dumps(state))
    broken["sources"]["validation"]["seq_len"] = 1024  # train, loaded first, would have moved
    with pytest.raises(
        ValueError,
        match=r"^source validation: cannot load this loader state: seq_len differs \(1024 saved, 2048 here\)$",
    ):
        fresh.load_state_dict(broken)
    assert fresh.state_dict() == before
    fresh.load_state_dict(state)
    a, b = running.next_batch(40), fresh.next_batch(40)
    assert a.sources == b.sources and np.array_equal(a.tokens, b.tokens) and b.state == running.state_dict()


def test_a_drawn_and_counts_pair_the_draw_never_gives_is_refused(finished_example):
    state = mixture(finished_example).state_dict()
    fresh = mixture(finished_example)
    for drawn, counts in ((5, {"train": 0, "validation": 0}), (5, {"train": 5, "validation": 0})):
        with pytest.raises(
            ValueError,
            match=rf"^loader state's counts {{'train': {counts['train']}, 'validation': 0}} after 5 rows: the draw "
            r"never gives them \(they sum to drawn, each within 1 of drawn x its share\)$",
        ):
            fresh.load_state_dict(state | {"drawn": drawn, "counts": counts})
    with pytest.raises(ValueError, match=r"^loader state's drawn 2.5: need an integer >= 0$"):
        fresh.load_state_dict(state | {"drawn": 2.5})
    with pytest.raises(ValueError, match=r"^loader state's counts\['train'\] True: need an integer >= 0$"):
        fresh.load_state_dict(state | {"drawn": 1, "counts": {"train": True, "validation": 0}})
    assert fresh.state_dict() == state
    fresh.load_state_dict(state | {"drawn": 3, "counts": {"train": 2, "validation": 1}})  # what the draw gives
    assert fresh.next_batch(1).sources == ["validation"]


def test_weights_are_positive_finite_numbers(finished_example):
    sources = {s: Sequences(finished_example, s, seq_len=2048) for s in SPLITS}
    for bad in (True, "1", float("nan"), 0, -1.5):
        with pytest.raises(ValueError, match=r"^weights must be positive finite numbers: \{'train': "):
            Mixture(sources, {"train": bad, "validation": 1})


def test_numpy_weights_are_taken_as_python_numbers_and_the_state_stays_json(finished_example):
    """np.float32/float16/longdouble weights passed the check, then raised TypeError; np.int64 made the
    state unfit for json.dumps. Now each is the Python number (an integer an int, a float the nearest float),
    and the draw is that of those numbers."""
    sources = lambda: {s: Sequences(finished_example, s, seq_len=2048) for s in SPLITS}  # noqa: E731
    expected = Mixture(sources(), {"train": 0.75, "validation": 1}).next_batch(20).sources
    for train, validation in (
        (np.float32(0.75), np.int64(1)),
        (np.float16(0.75), np.uint8(1)),
        (np.longdouble(0.75), 1),
    ):
        mix = Mixture(sources(), {"train": train, "validation": validation})
        assert mix.next_batch(20).sources == expected
        assert [type(w) for w in mix.weights.values()] == [float, int]
        state = json.loads(json.dumps(mix.state_dict()))
        assert state["weights"] == {"train": 0.75, "validation": 1}
        mix.load_state_dict(state)
    with pytest.raises(ValueError, match=r"^source 'a' is a str, not a tokpipe.data.Sequences$"):
        Mixture({"a": "x"}, {"a": 1})
    with pytest.raises(ValueError, match=r"^sources \[1\] and weights \[1\]: name them by strings$"):
        Mixture({1: Sequences(finished_example, seq_len=2048)}, {1: 1})


def test_sources_with_other_document_conventions_are_refused_naming_both(finished_example, finished_bos):
    with pytest.raises(
        ValueError,
        match=r"^sources delimit documents differently \(bos: BOS <\|im_start\|> \(151644\) before and EOS "
        r"<\|endoftext\|> \(151643\) after each document, eos: EOS <\|endoftext\|> \(151643\) after each "
        r"document\): a model would learn both conventions$",
    ):
        Mixture(
            {"eos": Sequences(finished_example, seq_len=64), "bos": Sequences(finished_bos, seq_len=64)},
            {"eos": 1, "bos": 1},
        )


def test_a_re_indented_tokenizer_json_is_the_same_tokenizer(finished_small, small_tokenizer, tmp_path):
    # The 600-id tokenizer: any tokenizer.json re-indents; Qwen3's load and encode (~4 CPU-s) are not the subject.
    tokenizer = tmp_path / "small-indented"
    shutil.copytree(small_tokenizer, tokenizer)
    original = json.loads((small_tokenizer / "tokenizer.json").read_text())
    (tokenizer / "tokenizer.json").write_text(json.dumps(original, indent=3))
    indented = build_out(tmp_path / "out", tokenizer, backend="hf")
    assert (
        json.loads((indented / "meta.json").read_text())["tokenizer_sha256"]
        != json.loads((finished_small / "meta.json").read_text())["tokenizer_sha256"]
    )
    sources = {"a": Sequences(finished_small, seq_len=64), "b": Sequences(indented, seq_len=64)}
    batch = Mixture(sources, {"a": 1, "b": 1}).next_batch(4)
    assert batch.sources == ["a", "b", "a", "b"]
    (tokenizer / "tokenizer.json").unlink()  # then their content cannot be compared: refused, saying why
    name = small_tokenizer.name
    with pytest.raises(
        ValueError,
        match=rf"^sources were made with different tokenizer.json files \(a: {name}@sha256:\w+ \(vocab_size 600\), "
        r"b: small-indented@sha256:\w+ \(vocab_size 600\)\), and .*small-indented/tokenizer.json \(b\) is no "
        r"longer the file recorded to compare their content: put it back, or tokenize again with one tokenizer$",
    ):
        Mixture(sources, {"a": 1, "b": 1})


def test_a_mixture_pickles_as_references_and_resumes_there(finished_example):
    running = mixture(finished_example, seed=3, weights={"train": 0.7, "validation": 0.3})
    running.next_batch(21)
    raw = pickle.dumps(running)
    assert len(raw) < 10_000
    copy = pickle.loads(raw)
    a, b = copy.next_batch(30), running.next_batch(30)
    assert a.sources == b.sources and np.array_equal(a.tokens, b.tokens)


def test_of_groups_is_the_mixture_of_each_groups_sequences_and_refuses_what_is_not_a_group(finished_grouped):
    weights = {"RedPajamaC4": 1, "RedPajamaGithub": 3}
    mixed = Mixture.of_groups(finished_grouped, weights, "train", 64, seed=5)
    by_hand = Mixture({g: Sequences(finished_grouped, "train", 64, seed=5, group=g) for g in weights}, weights)
    a, b = mixed.next_batch(40), by_hand.next_batch(40)
    assert a.sources == b.sources and np.array_equal(a.tokens, b.tokens)
    with pytest.raises(ValueError, match=r"^weights \['RedPajamaC4'\]: need a dict, by the groups' names$"):
        Mixture.of_groups(finished_grouped, ["RedPajamaC4"])
    groups = "RedPajamaC4, RedPajamaCommonCrawl, RedPajamaGithub, RedPajamaWikipedia"
    with pytest.raises(ValueError, match=f"^split train of .* has no group 'RedPajama'; its groups: {groups}$"):
        Mixture.of_groups(finished_grouped, {"RedPajama": 1})


def pfair_by_hand(weights: list[float], rows: int) -> list[int]:
    """The draw's rule, row by row in exact fractions: among the sources whose next turn is released
    (count / share <= row), the one due first (ceil((count + 1) / share)), ties to the lower index."""
    shares = [Fraction(w) / sum(map(Fraction, weights)) for w in weights]
    counts, picks = [0] * len(weights), []
    for row in range(rows):
        ready = [i for i, p in enumerate(shares) if math.floor(counts[i] / p) <= row]
        best = min(ready, key=lambda i: (math.ceil((counts[i] + 1) / shares[i]), i))
        counts[best] += 1
        picks.append(best)
    return picks


@pytest.mark.parametrize(
    "weights",
    [[0.5, 0.3, 0.2], [1, 1, 1], [0.7, 0.2, 0.1], [0.9, 0.05, 0.05], [28, 20, 19, 14], [3, 0.7, 1e-3, 0.25, 1 / 3]]
    + [np.random.default_rng(n).random(n).tolist() for n in (2, 3, 3, 3, 4, 6, 6, 8)],
)
def test_the_draw_made_a_block_at_a_time_is_the_rule_row_by_row(weights):
    """Blocks sorted by due turn (late turns swapped or walked), or row by row where the shares are too large
    for int64, from wherever the rows before left the counts."""
    exact = [Fraction(w) for w in weights]
    scale = math.lcm(*(w.denominator for w in exact))
    shares = [int(w * scale) for w in exact]
    size, rows = draw.block(shares, sum(shares)), 3000
    counts, picks = [0] * len(weights), []
    while len(picks) < rows:
        found = draw.ahead(shares, sum(shares), counts, len(picks), 37, size).tolist()
        counts = [c + found.count(i) for i, c in enumerate(counts)]
        picks += found
    assert picks[:rows] == pfair_by_hand(weights, rows)


# -- Mixture -----------------------------------------------------------------------------------------------


def test_a_mixtures_counts_stay_within_1_with_exact_rows(finished_example, example_reference):
    seq_len = 2048  # validation: 138 windows, train 419: the smaller source goes through several epochs
    weights = {"train": 0.55, "validation": 0.45}
    mix = Mixture(
        {split: Sequences(finished_example, split, seq_len=seq_len, seed=3) for split in weights},
        weights=weights,
    )
    sources = []
    references = {"train": example_reference["train"], "validation": example_reference["val"]}
    for size in (1, 7, 64, 64, 64, 64, 100, 200):
        batch = mix.next_batch(size)
        sources += batch.sources
        for name, row, w in zip(batch.sources, batch.tokens, batch.windows):
            assert np.array_equal(row, references[name][w * seq_len : w * seq_len + seq_len + 1])
    for k in range(1, len(sources) + 1):
        for name, w in weights.items():
            assert abs(sources[:k].count(name) - k * w / sum(weights.values())) <= 1, (k, name)
    at = mix.state_dict()["sources"]  # where each source stands at the Mixture's position
    assert at["validation"]["epoch"] >= 1 and at["train"]["epoch"] == 0  # each its own epochs


def test_a_mixture_resumes_exactly(finished_example):
    def mixture():
        splits = ("train", "validation")
        return Mixture(
            {s: Sequences(finished_example, s, seq_len=2048, seed=1) for s in splits}, {s: 1 for s in splits}
        )

    running = mixture()
    for _ in range(5):
        running.next_batch(33)
    resumed = mixture()
    resumed.load_state_dict(json.loads(json.dumps(running.state_dict())))
    for _ in range(10):
        a, b = running.next_batch(33), resumed.next_batch(33)
        assert a.sources == b.sources and np.array_equal(a.tokens, b.tokens)


def test_a_mixture_refuses_other_tokenizers_and_other_seq_lens(finished_example, finished_small):
    with pytest.raises(
        ValueError,
        match=r"different tokenizers \(a: qwen3@sha256:\w+ \(vocab_size 151669\), "
        r"b: small_tokenizer0@sha256:\w+ \(vocab_size 600\)\): their ids mean different tokens$",
    ):
        Mixture(
            {"a": Sequences(finished_example, seq_len=64), "b": Sequences(finished_small, seq_len=64)}, {"a": 1, "b": 1}
        )
    with pytest.raises(ValueError, match="sources differ in seq_len: {'a': 64, 'b': 128}"):
        Mixture(
            {"a": Sequences(finished_example, seq_len=64), "b": Sequences(finished_example, seq_len=128)},
            {"a": 1, "b": 1},
        )

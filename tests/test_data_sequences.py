"""tokpipe.data: the windows of a finished OUT, every one once per epoch, split between ranks, resumed exactly.

Tokens are compared with the reference encoding of the example (helpers), document starts with the
reference documents' lengths and with the .idx read by hand; the orders with the contract's rules
written out here (rank r of W reads global positions r, r+W, ... of the epoch's order).
"""

import json
import os
import pickle
import shutil
import sys
import threading
import tracemalloc
import types

import numpy as np
import pytest
from helpers import EXAMPLE_TRAIN_FILES, QWEN3, QWEN3_EOS, build_out, reference_documents

from tokpipe.data import Batch, Mixture, Permutation, Sequences
from tokpipe.data.permutation import epoch_seed
from tokpipe.options import RunOptions

L = 512  # seq_len: the example's train split (859,703 tokens) has 1,679 windows of it


@pytest.fixture(scope="module")
def no_concat_out(tmp_path_factory):
    return build_out(tmp_path_factory.mktemp("data_no_concat") / "out", QWEN3, options=RunOptions(no_concat=True))


@pytest.fixture(scope="module")
def reference_doc_starts() -> np.ndarray:
    """Where each document of the example's train split starts: its reference ids plus EOS, one after another."""
    lengths = [
        len(ids) + 1 for path in EXAMPLE_TRAIN_FILES for _, ids in reference_documents(path, QWEN3 / "tokenizer.json")
    ]
    return np.cumsum([0] + lengths[:-1])


def global_order(out, seq_len, seed, epochs=1) -> list[np.ndarray]:
    """Each epoch's order of all windows, as one rank of world size 1 reads it."""
    s = Sequences(out, seq_len=seq_len, seed=seed)
    return [s.next_batch(len(s)).windows for _ in range(epochs)]


# -- Sequences: windows, epochs, ranks -----------------------------------------------------------------


def test_one_epoch_over_4_ranks_covers_every_window_once_with_exact_tokens(finished_example, example_reference):
    reference = example_reference["train"].astype(np.int64)
    ranks = [Sequences(finished_example, seq_len=L, seed=1, rank=r, world_size=4) for r in range(4)]
    n = len(ranks[0])
    assert n == (len(reference) - 1) // L == 1679
    batches = [s.next_batch(n // 4) for s in ranks]
    taken = np.concatenate([b.windows for b in batches])
    assert len(taken) == len(set(taken.tolist())) == n - n % 4  # 419 each; 3 windows of the epoch skipped
    for b in batches:
        assert b.tokens.dtype == np.int64 and b.tokens.shape == (n // 4, L + 1)
        for row, w in zip(b.tokens, b.windows):
            assert np.array_equal(row, reference[w * L : w * L + L + 1])
        assert np.shares_memory(b.inputs, b.tokens) and np.array_equal(b.inputs, b.tokens[:, :-1])
        assert np.array_equal(b.targets, b.tokens[:, 1:])
    # The contract's rule: rank r reads positions r, r+4, ... of the epoch's order, which does not
    # depend on the world size.
    [order] = global_order(finished_example, L, seed=1)
    for r, b in enumerate(batches):
        assert np.array_equal(b.windows, order[r : n - n % 4 : 4])
    assert {s.epoch for s in ranks} == {1}


def test_window_i_is_its_tokens_as_int64(finished_example, example_reference):
    s = Sequences(finished_example, seq_len=L)
    reference = example_reference["train"]
    for i in (0, 1, 838, len(s) - 1):
        assert s.window(i).dtype == np.int64 and np.array_equal(s.window(i), reference[i * L : i * L + L + 1])
    with pytest.raises(IndexError, match="window 1679 is out of range: split train has 1,679 windows of seq_len 512"):
        s.window(1679)


@pytest.mark.parametrize("seq_len", [L, 64])  # 1,679 windows: orders made 32 epochs at once; 13,432: looked up
def test_epoch_e_is_the_permutation_of_its_seed(finished_example, seq_len):
    n = len(Sequences(finished_example, seq_len=seq_len))
    for e, order in enumerate(global_order(finished_example, seq_len, seed=9, epochs=3)):
        assert np.array_equal(order, Permutation(n, epoch_seed(9, e))[np.arange(n)])


def test_a_split_of_few_windows_makes_its_orders_as_its_epochs_pass(finished_example):
    # 20 windows: each epoch one Permutation's order, made a few epochs at a time, not 2,048 at its first take (a
    # group in a Mixture of many may pass an epoch in thousands of batches: 400 such took 2.7 s at their first batch).
    s = Sequences(finished_example, "validation", seq_len=15_000, seed=3)
    tracemalloc.start()
    first = s.take(1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(s) == 20 and peak < 32 << 10, peak
    taken = np.concatenate([first, s.take(40 * 20 - 1)]).reshape(40, 20)
    for e, order in enumerate(taken):
        assert np.array_equal(order, Permutation(20, epoch_seed(3, e))[np.arange(20)]), e


def test_the_held_out_split_is_read_by_its_file_s_name_too(finished_example, example_reference):
    """`val`, as val.bin is named (and nanoGPT calls it), is the split meta names `validation`."""
    val = Sequences(finished_example, "val", seq_len=L)
    assert val.split == "validation" and val.state_dict()["split"] == "validation"
    assert len(val) == (len(example_reference["val"]) - 1) // L
    assert np.array_equal(val.window(0), example_reference["val"][: L + 1])


def test_each_epoch_has_its_own_order_from_seed_and_epoch_alone(finished_example):
    first, second = global_order(finished_example, L, seed=5, epochs=2)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(1679))
    assert np.count_nonzero(first == second) < 10
    again = global_order(finished_example, L, seed=5, epochs=2)
    assert np.array_equal(again[0], first) and np.array_equal(again[1], second)
    assert np.count_nonzero(global_order(finished_example, L, seed=6)[0] == first) < 10
    # A batch may straddle two epochs; s.epoch is that of the next window.
    s = Sequences(finished_example, seq_len=L, seed=5)
    s.next_batch(1670)
    straddling = s.next_batch(20)
    assert s.epoch == 1 and s.state_dict()["offset"] == 11
    assert np.array_equal(straddling.windows, np.concatenate([first[1670:], second[:11]]))


def test_doc_starts_agree_with_the_idx(finished_example, reference_doc_starts):
    ends = np.fromfile(finished_example / "train.idx", dtype="<i8")
    assert np.array_equal(np.concatenate([[0], ends[:-1]]), reference_doc_starts)
    s = Sequences(finished_example, seq_len=L)
    windows = np.concatenate([np.arange(1679), [0, 1678]])  # every window, and the two ends of the split
    batch = s.batch_of(windows)
    assert len(batch.doc_starts) == len(windows)
    for w, found in zip(batch.windows, batch.doc_starts):
        inside = reference_doc_starts[(reference_doc_starts >= w * L) & (reference_doc_starts <= w * L + L)]
        assert found.dtype == np.int64 and np.array_equal(found, inside - w * L)
    assert batch.doc_starts[0][0] == 0  # the first document starts the split
    assert sum(len(d) for d in batch.doc_starts[:1679]) >= 293  # every document start is in some window


def test_no_concat_gives_the_windows_of_a_concatenated_out(no_concat_out, finished_example):
    files = Sequences(no_concat_out, seq_len=L, seed=2, world_size=2, rank=1)
    concat = Sequences(finished_example, seq_len=L, seed=2, world_size=2, rank=1)
    assert len(files.files) == 2 and len(files.files.starts) == 3  # one entry per file, nothing per window
    cut = int(files.files.starts[1])
    crossing = cut // L
    assert crossing * L < cut < crossing * L + L  # a window across the two files
    every = np.arange(len(concat))
    a, b = files.batch_of(every), concat.batch_of(every)
    assert np.array_equal(a.tokens, b.tokens)
    assert all(np.array_equal(x, y) for x, y in zip(a.doc_starts, b.doc_starts))
    for _ in range(3):
        a, b = files.next_batch(64), concat.next_batch(64)
        assert np.array_equal(a.windows, b.windows) and np.array_equal(a.tokens, b.tokens)


# -- state_dict and load_state_dict ----------------------------------------------------------------------


def test_a_resume_is_exact_at_any_step(finished_example):
    seq_len = 4096  # 209 windows: a few batches cross an epoch
    for steps in (0, 1, 5, 13, 29, 30, 31, 61):
        running = Sequences(finished_example, seq_len=seq_len, seed=9, rank=2, world_size=3)
        for _ in range(steps):
            running.next_batch(7)
        state = json.loads(json.dumps(running.state_dict()))
        assert set(state) >= {"epoch", "offset", "seed", "seq_len", "split", "fingerprint"}
        resumed = Sequences(finished_example, seq_len=seq_len, seed=9, rank=2, world_size=3)
        resumed.load_state_dict(state)
        for _ in range(40):
            a, b = running.next_batch(7), resumed.next_batch(7)
            assert np.array_equal(a.windows, b.windows) and np.array_equal(a.tokens, b.tokens)
            assert resumed.epoch == running.epoch


def test_under_another_world_size_a_resume_continues_at_the_same_global_position(finished_example):
    [order] = global_order(finished_example, L, seed=4)
    four = [Sequences(finished_example, seq_len=L, seed=4, rank=r, world_size=4) for r in range(4)]
    before = [s.next_batch(51).windows for s in four]
    states = [json.dumps(s.state_dict()) for s in four]
    assert len(set(states)) == 1 and json.loads(states[0])["offset"] == 204  # one state for every rank
    three = [Sequences(finished_example, seq_len=L, seed=4, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(json.loads(states[0]))
    left = (1679 - 204) // 3  # 491 each; the 2 windows that do not divide evenly are skipped
    after = [s.next_batch(left).windows for s in three]
    for r in range(3):
        assert np.array_equal(after[r], order[204 + r : 204 + 3 * left : 3])
    epoch = np.concatenate(before + after)
    assert len(set(epoch.tolist())) == len(epoch) == 1679 - 2
    assert {s.epoch for s in three} == {1} and {s.state_dict()["offset"] for s in three} == {0}


def test_an_unfinished_out_is_refused(out):
    (out / "meta.json").unlink()  # what finalize does before it changes the split files
    with pytest.raises(ValueError, match=f"^{out} is not a finished tokpipe output \\(no meta.json\\)"):
        Sequences(out)


def test_a_path_that_is_no_folder_is_refused_saying_so(tmp_path):
    """As the commands say it (a typo'd OUT was "not a finished tokpipe output", sent to `tokpipe status`)."""
    with pytest.raises(ValueError) as missing:
        Sequences(tmp_path / "nothing")
    assert str(missing.value) == f"{tmp_path / 'nothing'} does not exist: give the --out folder of a tokpipe run"
    (tmp_path / "train.bin").write_bytes(b"")
    with pytest.raises(ValueError) as a_file:
        Sequences(tmp_path / "train.bin")
    assert str(a_file.value) == (
        f"{tmp_path / 'train.bin'} is a file, not a folder: OUT is a folder, a new one or a tokpipe run's"
    )


def test_a_damaged_out_or_a_missing_split_or_too_few_windows_is_refused(out):
    with pytest.raises(ValueError, match="has no split 'test'; its splits: train, validation"):
        Sequences(out, "test")
    with pytest.raises(ValueError, match="303,964 tokens: 593 windows of seq_len 512, fewer than world_size 2,000"):
        Sequences(out, "validation", seq_len=512, world_size=2000)
    with open(out / "train.bin", "ab") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(ValueError, match="train.bin holds 3,438,816 bytes, meta says 859,703 tokens"):
        Sequences(out)


def test_a_state_from_other_content_seq_len_seed_or_split_is_refused_naming_what_differs(
    finished_example, finished_bos
):
    state = Sequences(finished_example, seq_len=L, seed=0).state_dict()
    refusals = {
        "the split holds other tokens \\(859,703 saved, 859,996 in .*finished_bos": Sequences(finished_bos, seq_len=L),
        "seq_len differs \\(512 saved, 1024 here\\)": Sequences(finished_example, seq_len=1024, seed=0),
        "seed differs \\(0 saved, 1 here\\)": Sequences(finished_example, seq_len=L, seed=1),
        "split differs \\('train' saved, 'validation' here\\)": Sequences(finished_example, "validation", seq_len=L),
    }
    for what, other in refusals.items():
        with pytest.raises(ValueError, match=f"^cannot load this loader state: .*{what}") as refused:
            other.load_state_dict(state)
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="the data changed since the state was saved"):
        Sequences(finished_bos, seq_len=L).load_state_dict(state)
    with pytest.raises(
        ValueError,
        match=r"loader state of format 4 \(format 1, missing split, seq_len, seed, fingerprint, offset\)",
    ):
        Sequences(finished_example, seq_len=L).load_state_dict({"format": 1, "epoch": 0})


# -- groups (--group-by) ---------------------------------------------------------------------------------


def test_a_group_alone_gives_the_windows_of_its_reference_tokens(finished_grouped, grouped_reference):
    """Sequences(..., group=VALUE): the windows of one group of the split, as if it were a split of its own."""
    for group, (tokens, _, _) in grouped_reference["train"].items():
        s = Sequences(finished_grouped, "train", seq_len=64, group=group)
        assert len(s) == (len(tokens) - 1) // 64
        batch = s.next_batch(len(s))
        for row, w in zip(batch.tokens, batch.windows):
            assert np.array_equal(row, tokens[w * 64 : w * 64 + 65])
    with pytest.raises(ValueError, match=r"^split train of .* has no group 'Books'; its groups: RedPajamaC4, "):
        Sequences(finished_grouped, "train", seq_len=64, group="Books")


def test_a_mixture_of_one_outs_groups_mixes_them_at_any_weights_without_tokenizing_again(
    finished_grouped, grouped_reference
):
    reference = grouped_reference["train"]
    weights = {"RedPajamaCommonCrawl": 1, "RedPajamaGithub": 2, "RedPajamaWikipedia": 1}  # not the token shares
    mix = Mixture({g: Sequences(finished_grouped, "train", seq_len=128, seed=5, group=g) for g in weights}, weights)
    batch = mix.next_batch(200)
    # Read through the groups' files joined: each row's tokens and document starts are its own group's.
    ends = {g: np.flatnonzero(reference[g][0] == QWEN3_EOS) + 1 for g in weights}  # each document ends in EOS
    for name, row, w, found in zip(batch.sources, batch.tokens, batch.windows, batch.doc_starts):
        start = w * 128
        assert np.array_equal(row, reference[name][0][start : start + 129])
        inside = ends[name][(ends[name] >= start) & (ends[name] <= start + 128)] - start
        assert found.tolist() == sorted(set(inside.tolist()) | ({0} if start == 0 else set())), (name, w)
    assert [batch.sources.count(g) for g in weights] == [50, 100, 50]


def test_a_loader_a_group_parses_meta_and_reads_the_parts_list_once_in_a_process(finished_grouped, monkeypatch):
    """A Mixture of a split's groups opens a loader a group: each parsed meta and read the parts list whole, so a
    split of 2,000 groups took 73 s and 4.7 GB to open. Each is read once a process for the same bytes, and each
    loader's fingerprint is still the sha256 of the dtype and its parts' (tokens, sha256) lines, in order."""
    import hashlib

    from tokpipe.data import sequences
    from tokpipe.layout import meta
    from tokpipe.layout.records import read_parts

    monkeypatch.setattr(meta, "_FINISHED", {}, raising=False)
    monkeypatch.setattr(sequences, "_FINGERPRINTS", {}, raising=False)
    parsed, read = [], []
    of = meta.Meta.of.__func__
    monkeypatch.setattr(meta.Meta, "of", classmethod(lambda cls, raw: parsed.append(1) or of(cls, raw)))
    monkeypatch.setattr(sequences, "read_parts", lambda raw: read.append(1) or read_parts(raw))
    groups = [None, "RedPajamaC4", "RedPajamaCommonCrawl", "RedPajamaGithub", "RedPajamaWikipedia"]
    loaders = {group: Sequences(finished_grouped, "train", seq_len=64, group=group) for group in groups}
    assert (len(parsed), len(read)) == (1, 1)
    records = list(read_parts((finished_grouped / "train.parts").read_bytes()))
    for group, loader in loaders.items():
        expected = hashlib.sha256(b"tokpipe token stream uint32\n")
        for r in records:
            if r["tokens"] and group in (None, r.get("group")):
                expected.update(f"{r['tokens']} {r['sha256']}\n".encode())
        assert loader.fingerprint == expected.hexdigest(), group


def test_a_state_of_another_group_or_split_is_refused_for_that_reason_alone(finished_grouped):
    """The state names its group: loaded into another group (or split), that is the reason given, not a
    change of the data (whose clause once came first, and was the only one for a group)."""
    github = Sequences(finished_grouped, "train", seq_len=128, group="RedPajamaGithub")
    state = json.loads(json.dumps(github.state_dict()))
    assert state["group"] == "RedPajamaGithub" and state["format"] == 4 and state["order"] is None
    refusals = {
        "group differs ('RedPajamaGithub' saved, 'RedPajamaWikipedia' here)": dict(group="RedPajamaWikipedia"),
        "group differs ('RedPajamaGithub' saved, None here)": dict(),
        "split differs ('train' saved, 'validation' here)": dict(split="validation", group="RedPajamaGithub"),
        "split differs ('train' saved, 'validation' here); group differs ('RedPajamaGithub' saved, None here); "
        "seq_len differs (128 saved, 64 here)": dict(split="validation", seq_len=64),
    }
    for reason, options in refusals.items():
        other = Sequences(finished_grouped, **{"split": "train", "seq_len": 128} | options)
        with pytest.raises(ValueError) as refused:
            other.load_state_dict(state)
        assert str(refused.value) == f"cannot load this loader state: {reason}"
    old = {k: v for k, v in state.items() if k not in ("group", "order")} | {"format": 2}  # names no group
    with pytest.raises(ValueError) as refused:
        Sequences(finished_grouped, "train", seq_len=128, group="RedPajamaWikipedia").load_state_dict(old)
    assert str(refused.value) == (
        f"cannot load this loader state: the split holds other tokens (210,435 saved, 89,542 in {finished_grouped}: "
        f"the data changed since the state was saved, or it is another group's (a state of format 2 does not "
        f"record its group))"
    )
    github.load_state_dict(old)  # of its own group, it loads
    github.load_state_dict({k: v for k, v in state.items() if k != "order"} | {"format": 3})  # nor an order


# -- what a long run meets at the edges -------------------------------------------------------------------


def test_a_batch_size_is_a_count_numpy_integers_included(finished_example, example_reference):
    s = Sequences(finished_example, seq_len=L, seed=3)
    before = s.state_dict()
    for bad, shown in ((-1, "-1"), (2.0, "2.0"), (True, "True"), ("8", "'8'")):
        with pytest.raises(ValueError, match=f"^batch_size {shown}: need an integer >= 0$"):
            s.next_batch(bad)
    assert s.state_dict() == before  # nothing moved
    empty = s.next_batch(0)
    assert empty.tokens.shape == (0, L + 1) and empty.windows.shape == (0,) and empty.doc_starts == []
    assert empty.state == before == s.state_dict()
    batch = s.next_batch(np.int64(8))
    state = s.state_dict()
    assert type(state["offset"]) is int and state["offset"] == 8 and batch.state == state
    [order] = global_order(finished_example, L, seed=3)
    assert np.array_equal(batch.windows, order[:8])
    reference = example_reference["train"]
    for row, w in zip(batch.tokens, batch.windows):
        assert np.array_equal(row, reference[w * L : w * L + L + 1])
    resumed = Sequences(finished_example, seq_len=L, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert np.array_equal(resumed.next_batch(5).windows, order[8:13])


def test_options_are_integers_never_truncated(finished_example):
    refusals = {
        "seq_len 512.9: need an integer >= 1": dict(seq_len=512.9),
        "seq_len True: need an integer >= 1": dict(seq_len=True),
        "seq_len 0: need an integer >= 1": dict(seq_len=0),
        "seed 1.7: need an integer": dict(seed=1.7),
        "rank 1.0: need an integer >= 0": dict(rank=1.0, world_size=2),
        "world_size 2.5: need an integer >= 1": dict(world_size=2.5),
        "rank 2 of world_size 2: need 0 <= rank < world_size": dict(rank=2, world_size=2),
    }
    for message, options in refusals.items():
        with pytest.raises(ValueError, match=f"^{message}$"):
            Sequences(finished_example, **{"seq_len": L} | options)
    s = Sequences(finished_example, seq_len=np.int32(512), seed=np.uint64(7), rank=np.int64(1), world_size=np.int8(2))
    assert [type(v) for v in (s.seq_len, s.seed, s.rank, s.world_size)] == [int] * 4
    assert json.loads(json.dumps(s.state_dict()))["seed"] == 7


def test_a_state_that_is_not_one_is_refused_naming_the_field_and_nothing_moves(finished_example):
    s = Sequences(finished_example, seq_len=L, seed=2)
    s.next_batch(10)
    good = s.state_dict()
    refusals = {
        "loader state's epoch 2.7: need an integer >= 0": {"epoch": 2.7},
        "loader state's epoch 'x': need an integer >= 0": {"epoch": "x"},
        "loader state's epoch None: need an integer >= 0": {"epoch": None},
        "loader state's epoch -1: need an integer >= 0": {"epoch": -1},
        "loader state's offset True: need an integer >= 0": {"offset": True},
        "loader state's offset 1680: out of 1679 windows": {"offset": 1680},
        "loader state's seq_len 512.0: need an integer >= 1": {"seq_len": 512.0},
    }
    for message, change in refusals.items():
        with pytest.raises(ValueError, match=f"^{message}$"):
            s.load_state_dict(good | change)
        assert s.state_dict() == good
    with pytest.raises(ValueError, match=r"^a loader state is a dict \(Sequences.state_dict\(\)\), not a list$"):
        s.load_state_dict([good])
    assert s.state_dict() == good


def test_a_state_goes_to_the_same_tokens_in_any_layout_and_names_what_differs(
    finished_example, no_concat_out, dataset, tmp_path
):
    running = Sequences(finished_example, seq_len=L, seed=8, rank=1, world_size=3)
    running.next_batch(100)
    state = json.loads(json.dumps(running.state_dict()))
    # Same documents, shards named otherwise (in the same order): the same token stream.
    for path in sorted(dataset.rglob("*.jsonl.zst")):
        path.rename(path.with_name("renamed_" + path.name))
    renamed = build_out(tmp_path / "renamed", QWEN3, dataset=dataset)
    assert (
        json.loads((renamed / "meta.json").read_text())["splits"]["train"]["parts_sha256"]
        != json.loads((finished_example / "meta.json").read_text())["splits"]["train"]["parts_sha256"]
    )
    for other in (no_concat_out, renamed):
        resumed = Sequences(other, seq_len=L, seed=8, rank=1, world_size=3)
        resumed.load_state_dict(state)
        expected = Sequences(finished_example, seq_len=L, seed=8, rank=1, world_size=3)
        expected.load_state_dict(state)
        for _ in range(3):
            a, b = resumed.next_batch(64), expected.next_batch(64)
            assert np.array_equal(a.windows, b.windows) and np.array_equal(a.tokens, b.tokens)
    with pytest.raises(
        ValueError,
        match=r"^cannot load this loader state: the split's tokens differ \(as many, 859,703, but fingerprint "
        r"0123456789ab saved, \w{12} in .*: the data changed since the state was saved\)$",
    ):
        running.load_state_dict(state | {"fingerprint": "0123456789abcdef"})


def test_a_format_1_state_is_checked_against_the_parts_list_it_was_saved_with(finished_example):
    meta = json.loads((finished_example / "meta.json").read_text())
    state = {"format": 1, "split": "train", "seq_len": L, "seed": 0, "epoch": 0, "offset": 40}
    s = Sequences(finished_example, seq_len=L)
    s.load_state_dict(state | {"fingerprint": meta["splits"]["train"]["parts_sha256"]})
    assert s.state_dict()["offset"] == 40
    with pytest.raises(ValueError, match="the content of the split differs"):
        s.load_state_dict(state | {"fingerprint": "f" * 64})


def test_threads_sharing_one_sequences_take_each_window_once(finished_example):
    shared = Sequences(finished_example, seq_len=L, seed=6)
    taken = [[] for _ in range(4)]

    def read(mine):
        for _ in range(150):
            batch = shared.next_batch(100)
            mine.append(batch.windows)

    threads = [threading.Thread(target=read, args=(mine,)) for mine in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = np.sort(np.concatenate([w for mine in taken for w in mine]))
    alone = Sequences(finished_example, seq_len=L, seed=6).next_batch(4 * 150 * 100).windows
    assert len(together) == 60_000 and np.array_equal(together, np.sort(alone))  # 35.7 epochs, each window 35-36x
    assert shared.state_dict()["offset"] == 60_000 % 1679 and shared.epoch == 60_000 // 1679


def test_a_sequences_pickles_as_a_reference_and_resumes_there(no_concat_out):
    s = Sequences(no_concat_out, "validation", seq_len=64, seed=4, rank=1, world_size=2)
    s.next_batch(77)
    raw = pickle.dumps(s)
    assert len(raw) < 2_000  # the split's 1.2 MB of tokens stay in their files
    copy = pickle.loads(raw)
    assert copy.state_dict() == s.state_dict() and (copy.rank, copy.world_size) == (1, 2)
    a, b = copy.next_batch(50), s.next_batch(50)
    assert np.array_equal(a.windows, b.windows) and np.array_equal(a.tokens, b.tokens)


def test_a_read_that_fails_moves_no_position_and_a_retry_takes_the_same_windows(out):
    """A batch's read that fails (here: train.bin and val.bin replaced since the loaders were made) raises
    and leaves the position where it was: once the files are back, a trainer that retries gets the windows
    it was to get. (The position moved first once: a retry skipped the failed batch's windows.)"""

    def loaders():
        splits = ("train", "validation")
        mixture = Mixture({sp: Sequences(out, sp, seq_len=L, seed=3) for sp in splits}, {"train": 2, "validation": 1})
        return Sequences(out, seq_len=L, seed=3), mixture

    expected = [loader.next_batch(64) for loader in loaders()]
    running = loaders()
    before = [loader.state_dict() for loader in running]
    for name in ("train.bin", "val.bin"):
        (out / name).rename(out / f"{name}.away")
        shutil.copyfile(out / f"{name}.away", out / name)  # the same bytes in another file
    for loader in running:
        with pytest.raises(
            ValueError, match=r"/train.bin changed since the loader was made \(another file of its size\)"
        ):
            loader.next_batch(64)
    assert [loader.state_dict() for loader in running] == before
    for name in ("train.bin", "val.bin"):
        os.replace(out / f"{name}.away", out / name)
    for loader, batch in zip(running, expected):
        again = loader.next_batch(64)
        assert np.array_equal(again.windows, batch.windows) and np.array_equal(again.tokens, batch.tokens)
        assert again.sources == batch.sources and again.state == batch.state


def test_a_relative_out_is_made_absolute_before_the_working_directory_changes(finished_example, tmp_path, monkeypatch):
    """Hydra changes the working directory after the loader is made: the loader, and a copy pickled then,
    still read the OUT it was given."""
    monkeypatch.chdir(finished_example.parent)
    s = Sequences(finished_example.name, seq_len=L, seed=4)
    assert s.out == finished_example
    monkeypatch.chdir(tmp_path)
    copy = pickle.loads(pickle.dumps(s))
    expected = Sequences(finished_example, seq_len=L, seed=4).next_batch(8)
    for loader in (s, copy):
        assert np.array_equal(loader.next_batch(8).tokens, expected.tokens)


def test_every_argument_is_what_it_says_or_refused_in_one_line(finished_example):
    """Numbers are integers (numpy's too, kept as int), names are strings, OUT a path: anything else is a
    one-line ValueError naming it, before anything moves (Permutation(5.7, 1.9) was n=5, seed=1)."""
    s = Sequences(finished_example, seq_len=L)
    s.next_batch(3)
    before = s.state_dict()
    refusals = {
        "Permutation's n 5.7: need an integer >= 0": lambda: Permutation(5.7, 1),
        "Permutation's seed 1.9: need an integer": lambda: Permutation(5, 1.9),
        "Permutation's seed '7': need an integer": lambda: Permutation(5, "7"),
        "Permutation's n True: need an integer >= 0": lambda: Permutation(True, 0),
        "Permutation's n -1: need an integer >= 0": lambda: Permutation(-1, 0),
        "window True: need an integer": lambda: s.window(True),
        "window 1.0: need an integer": lambda: s.window(1.0),
        "split 5: need a str": lambda: Sequences(finished_example, 5),
        "group 3: need a str": lambda: Sequences(finished_example, group=3),
        "out 5: need a path (a str or an os.PathLike)": lambda: Sequences(5),
        "cache_dir 's3://tok/cache': need a path of this machine (a str or an os.PathLike)": lambda: Sequences(
            finished_example, cache_dir="s3://tok/cache"
        ),
    }
    for message, call in refusals.items():
        with pytest.raises(ValueError) as refused:
            call()
        assert str(refused.value) == message
    assert s.state_dict() == before
    p = Permutation(np.uint8(5), np.int32(-3))
    assert (p.n, p.seed) == (5, -3) and type(p.n) is type(p.seed) is int
    with pytest.raises(IndexError, match="^window -1 is out of range: split train has 1,679 windows of seq_len 512$"):
        s.window(-1)


def test_a_batch_pins_its_arrays_for_torchs_dataloader(finished_example, monkeypatch):
    """DataLoader(pin_memory=True) pins an object by its pin_memory() (and handed a Batch back unpinned
    before): a Batch copies its arrays into page-locked memory through torch, here a stand-in of torch's
    tensors (torch is no dependency), and stays a Batch of numpy arrays, its sources and state kept."""
    pinned = []

    class Tensor:
        def __init__(self, array):
            self.array = array

        def pin_memory(self):
            pinned.append(self.array.copy())
            return Tensor(pinned[-1])

        def numpy(self):
            return self.array

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(from_numpy=Tensor))
    splits = ("train", "validation")
    batch = Mixture(
        {sp: Sequences(finished_example, sp, seq_len=L) for sp in splits}, {sp: 1 for sp in splits}
    ).next_batch(4)
    copy = batch.pin_memory()
    assert type(copy) is Batch and copy.sources == batch.sources and copy.state == batch.state
    arrays = ("tokens", "windows", "doc_offsets", "doc_bounds")
    assert [id(getattr(copy, a)) for a in arrays] == [id(p) for p in pinned]
    for a in arrays:
        assert np.array_equal(getattr(copy, a), getattr(batch, a))
    assert [d.tolist() for d in copy.doc_starts] == [d.tolist() for d in batch.doc_starts]

"""tokpipe.data on an OUT on a store (SeaweedFS): blocks fetched by ranged GETs into a bounded cache that ranks share.

Tokens are compared with the reference encoding of the example (helpers), document starts with those the loader
gives on the local copy (whose own are checked against the reference documents in test_data_sequences), the windows
an epoch covers with the local copy's, and the bytes sent with what the store's GETs returned (Bucket.read wrapped).
"""

import json
import os
import pickle
import select
import shutil
import signal
import threading
import time

import numpy as np
import pytest
from helpers import S3Server

import tokpipe.data.cache
import tokpipe.store.bucket
from tokpipe.data import Mixture, Sequences
from tokpipe.data.workers import Batches

L, B = 256, 16  # the example's train split: 3,358 windows of 256 tokens
CACHE = 128 << 10  # blocks of 32 windows (32 KiB), 2 a buffer: 105 blocks, 53 buffers an epoch


def cache_bytes(folder) -> int:
    """The bytes of the files in the cache (a block being fetched too)."""
    held = 0
    for path in folder.rglob("*"):
        try:
            held += path.stat().st_size
        except FileNotFoundError:  # renamed or removed meanwhile
            pass
    return held


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    """The bytes every GET of this process returns, counted."""
    count, read = [0], tokpipe.store.bucket.Bucket.read

    def counted(self, key, start, end, etag=None):
        data, size = read(self, key, start, end, etag)
        count[0] += len(data)
        return data, size

    monkeypatch.setattr(tokpipe.store.bucket.Bucket, "read", counted)
    return count


def test_two_ranks_in_lockstep_cover_an_epoch_as_on_a_local_copy_through_a_bounded_cache(
    finished_stored, finished_example, example_reference, tmp_path, sent
):
    reference = example_reference["train"].astype(np.int64)
    cache = tmp_path / "cache"
    ranks = [
        Sequences(finished_stored, "train", L, seed=7, rank=r, world_size=2, cache_dir=cache, cache_size=CACHE)
        for r in range(2)
    ]
    local = Sequences(finished_example, "train", L, seed=7)
    assert len(ranks[0]) == 3358 and ranks[0].state_dict()["order"] == {"block": 32, "buffer": 2}
    drawn, most = ([], []), 0
    for _ in range(3358 // 2 // B + 1):  # an epoch, and a batch of the next
        for r, s in enumerate(ranks):
            batch = s.next_batch(B)
            for row, w in zip(batch.tokens, batch.windows.tolist()):
                assert np.array_equal(row, reference[w * L : w * L + L + 1])
            mapped = local.batch_of(batch.windows)
            assert np.array_equal(batch.doc_offsets, mapped.doc_offsets)
            assert np.array_equal(batch.doc_bounds, mapped.doc_bounds)
            drawn[r].append(batch.windows)
            most = max(most, cache_bytes(cache))
    epoch = [np.concatenate(d)[:1679] for d in drawn]  # each rank's part of the epoch
    assert sorted(np.concatenate(epoch).tolist()) == list(range(3358))  # as the ranks on a local copy: each once
    assert most <= 2 * CACHE
    split = (finished_example / "train.bin").stat().st_size
    assert sent[0] <= 1.25 * split, f"{sent[0]:,} bytes sent for a split of {split:,}"
    assert abs(np.corrcoef(np.arange(1679), epoch[0])[0, 1]) < 0.2  # shuffled: no trend from first window to last


@pytest.mark.parametrize("merged", [1 << 21, 64], ids=["ends in memory", "ends by the index"])
def test_document_starts_are_those_of_the_local_copy_also_where_a_document_ends_on_a_blocks_last_token(
    finished_stored, finished_example, tmp_path, monkeypatch, merged
):
    """At most MERGED documents (2^21), every place a document starts is held in memory; past it, index.bin says which
    of the .idx's ends each block takes, fetched with it (MERGED lowered below the example's 293 train documents).
    At seq_len 76, blocks of 107 windows: a document ends at token 97,584, the last token of block 11 (the first of
    block 12's windows), which both blocks hold."""
    monkeypatch.setattr(tokpipe.data.cache, "MERGED", merged)
    reader = Sequences(finished_stored, "train", 76, seed=9, cache_dir=tmp_path, cache_size=CACHE)
    local = Sequences(finished_example, "train", 76, seed=9)
    assert reader.geometry.per_block == 107 and 97_584 == 12 * 107 * 76
    if merged == 64:
        assert (next(tmp_path.iterdir()) / "index.bin").stat().st_size == 8 * (reader.geometry.blocks + 1)
    for _ in range(len(reader) // 256 + 1):
        batch = reader.next_batch(256)
        mapped = local.batch_of(batch.windows)
        assert np.array_equal(batch.doc_offsets, mapped.doc_offsets)
        assert np.array_equal(batch.doc_bounds, mapped.doc_bounds)


def test_a_state_taken_mid_epoch_resumes_exactly_and_is_refused_by_another_order(
    finished_stored, finished_example, tmp_path
):
    def ranks(cache_size=CACHE):
        return [
            Sequences(
                finished_stored, "train", L, seed=2, rank=r, world_size=2, cache_dir=tmp_path, cache_size=cache_size
            )
            for r in range(2)
        ]

    whole, first = ranks(), ranks()
    expected = [[s.next_batch(B).windows for s in whole] for _ in range(60)]
    taken = [[s.next_batch(B).windows for s in first] for _ in range(25)]
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["offset"] == 25 * B * 2
    again = ranks()
    for s in again:
        s.load_state_dict(state)
    taken += [[s.next_batch(B).windows for s in again] for _ in range(35)]  # across the epoch's end
    for got, want in zip(taken, expected):
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    refusals = {
        "the order differs (blocks of 32 windows, 2 a buffer saved; every window in one permutation here)": Sequences(
            finished_example, "train", L, seed=2
        ),
        "the order differs (blocks of 32 windows, 2 a buffer saved; blocks of 64 windows, 2 a buffer here)": ranks(
            2 * CACHE
        )[0],
    }
    for reason, other in refusals.items():
        with pytest.raises(ValueError) as refused:
            other.load_state_dict(state)
        assert str(refused.value) == f"cannot load this loader state: {reason}"
    local_state = Sequences(finished_example, "train", L, seed=2).state_dict()  # of today's order
    with pytest.raises(ValueError, match="the order differs \\(every window in one permutation saved"):
        again[0].load_state_dict(local_state)


def test_dataloader_workers_on_a_store_give_the_loaders_batches_and_it_pickles_as_a_reference(
    finished_stored, tmp_path
):
    reader = Sequences(finished_stored, "train", L, seed=4, cache_dir=tmp_path, cache_size=CACHE)
    assert len(pickle.dumps(reader)) < 2048
    alone = Sequences(finished_stored, "train", L, seed=4, cache_dir=tmp_path, cache_size=CACHE)
    expected = [alone.next_batch(B) for _ in range(30)]
    workers = [Batches(reader, B).worker(w, 3) for w in range(3)]
    got = [next(workers[i % 3]) for i in range(30)]  # DataLoader takes batch i from worker i % 3
    for g, e in zip(got, expected):
        assert np.array_equal(g.tokens, e.tokens) and g.state == e.state


def test_the_caches_of_a_process_share_its_fetch_threads_and_a_forked_child_fetches_with_its_own(
    finished_stored, tmp_path
):
    loaders = [Sequences(finished_stored, "train", L, seed=s, cache_dir=tmp_path, cache_size=CACHE) for s in range(12)]
    batches = [loader.next_batch(B) for loader in loaders]  # 12 caches (a seed each), each fetching its buffers
    fetchers = [t for t in threading.enumerate() if t.name.startswith("tokpipe-fetch")]
    assert 1 <= len(fetchers) <= tokpipe.data.cache.FETCHERS
    # A DataLoader's forked worker: the parent's fetch threads are not in the child, its loader fetches with its own.
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            again = Sequences(finished_stored, "train", L, seed=0, cache_dir=tmp_path / "child", cache_size=CACHE)
            os.write(write, again.next_batch(B).tokens.tobytes())
        finally:
            os._exit(0)
    os.close(write)
    answered = select.select([read], [], [], 60)[0]
    if not answered:
        os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as pipe:
        assert answered and pipe.read() == batches[0].tokens.tobytes()


def test_a_block_a_loader_waits_for_is_fetched_at_once_not_behind_those_other_caches_fetch_ahead(
    finished_stored, finished_example, tmp_path, monkeypatch
):
    options = {"cache_dir": tmp_path, "cache_size": CACHE}  # 2 blocks a buffer, 64 windows
    others = [Sequences(finished_stored, "train", L, seed=s, **options) for s in range(12)]
    gate, fetch = threading.Event(), tokpipe.data.cache.BlockCache._fetch

    def held(self, b):  # the fetch threads hold every block they fetch until the gate opens
        if threading.current_thread().name.startswith("tokpipe-fetch"):
            gate.wait()
        fetch(self, b)

    monkeypatch.setattr(tokpipe.data.cache.BlockCache, "_fetch", held)
    for other in others:  # into its second buffer: its third one's 2 blocks asked ahead, 24 in all (8 threads)
        [other.next_batch(B) for _ in range(64 // B)]
    got = []  # a loader opened and its first batch, while the fetch threads hold the others' blocks

    def read():
        got.append(Sequences(finished_stored, "train", L, seed=12, **options).next_batch(B))

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(30)
    in_time = not reader.is_alive()
    gate.set()
    reader.join()
    local = Sequences(finished_example, "train", L).batch_of(got[0].windows)
    assert in_time and np.array_equal(got[0].tokens, local.tokens)


def test_a_mixture_of_groups_on_a_store_opens_them_at_once_and_reads_each_row_from_its_group(
    finished_grouped, s3_server, s3_prefix, tmp_path, monkeypatch
):
    url = s3_server.upload(finished_grouped, s3_prefix)
    weights = {"RedPajamaGithub": 2, "RedPajamaWikipedia": 1}
    options = {"seed": 1, "cache_dir": tmp_path}
    opening, peak, lock, init = [0], [0], threading.Lock(), Sequences.__init__

    def watched(self, *args, **kwargs):  # the most sources being opened at one time
        with lock:
            opening[0] += 1
            peak[0] = max(peak[0], opening[0])
        time.sleep(0.2)
        try:
            init(self, *args, **kwargs)
        finally:
            with lock:
                opening[0] -= 1

    monkeypatch.setattr(Sequences, "__init__", watched)
    mixture = Mixture.of_groups(url, weights, "train", 128, cache_size=96 << 10, **options)
    assert peak == [2]
    parts = {"RedPajamaGithub": 64 << 10, "RedPajamaWikipedia": 32 << 10}  # the Mixture's cache, by weight
    assert {g: s.cache_size for g, s in mixture.sources.items()} == parts
    peak[0] = 0
    unpickled = pickle.loads(pickle.dumps(mixture))  # as a DataLoader worker gets it
    assert peak == [2]
    by_hand = {g: Sequences(url, "train", 128, group=g, cache_size=parts[g], **options) for g in weights}
    by_hand = Mixture(by_hand, weights)
    local = {g: Sequences(finished_grouped, "train", 128, group=g) for g in weights}
    for _ in range(20):
        batch, again, hand = mixture.next_batch(32), unpickled.next_batch(32), by_hand.next_batch(32)
        assert batch.sources == again.sources == hand.sources
        assert np.array_equal(batch.tokens, again.tokens) and np.array_equal(batch.tokens, hand.tokens)
        for i, (name, w) in enumerate(zip(batch.sources, batch.windows.tolist())):
            one = local[name].batch_of(np.array([w]))
            assert np.array_equal(batch.tokens[i], one.tokens[0])
            assert np.array_equal(batch.doc_starts[i], one.doc_starts[0])
    assert sorted(set(batch.sources)) == sorted(weights)


def test_the_groups_of_a_mixture_opened_at_once_share_one_head_of_meta(
    finished_grouped, s3_server, s3_prefix, tmp_path, monkeypatch
):
    # Each group's Sequences asks whether meta.pkl is the one copied here: a HEAD a group, 2,000 for FineWeb-2's groups
    # in each DataLoader worker. Those asked while one is in flight share its answer (each HEAD held 0.2 s here).
    url = s3_server.upload(finished_grouped, s3_prefix)
    groups = json.loads((finished_grouped / "meta.json").read_text())["splits"]["train"]["groups"]
    heads, head = [], tokpipe.store.bucket.Bucket.head

    def slow(bucket, key):
        if key.endswith("meta.pkl"):
            heads.append(key)
            time.sleep(0.2)
        return head(bucket, key)

    monkeypatch.setattr(tokpipe.store.bucket.Bucket, "head", slow)
    mixture = Mixture.of_groups(url, dict.fromkeys(groups, 1), "train", 128, cache_dir=tmp_path)
    assert len(groups) == 4 and heads == [f"{s3_prefix}/meta.pkl"]
    pickle.loads(pickle.dumps(mixture))  # as a DataLoader worker gets it
    assert heads == [f"{s3_prefix}/meta.pkl"] * 2


def test_the_store_failing_mid_epoch_raises_one_line_and_the_loader_goes_on_from_where_it_was(
    finished_example, tmp_path, monkeypatch
):
    """The store stops answering (its processes stopped: SIGSTOP, so that it comes back as it was, not restarted: a
    SeaweedFS restarted on its folder answered InternalError past every retry once in several runs)."""
    server = S3Server(tmp_path / "s3")  # its own: it is stopped
    server.launch()
    server.ready()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tokpipe.store.bucket, "TRIES", 2)  # botocore's tries before the error (10 take minutes)
    monkeypatch.setattr(tokpipe.store.bucket, "READ_TIMEOUT", 1)  # a request to a stopped server: 1 s a try
    monkeypatch.setattr(tokpipe.store.bucket, "CHECK_READ_TIMEOUT", 1)  # and once it was found silent (15 s a try)
    try:
        url = server.upload(finished_example, "out")
        options = dict(seed=5, cache_size=CACHE)
        whole = Sequences(url, "train", L, cache_dir=tmp_path / "whole", **options)
        expected = [whole.next_batch(B).windows for _ in range(40)]
        reader = Sequences(url, "train", L, cache_dir=tmp_path / "cache", **options)
        taken = [reader.next_batch(B).windows for _ in range(3)]
        os.killpg(server.proc.pid, signal.SIGSTOP)
        for _ in range(40):  # until a batch needs a block the cache does not hold
            before = reader.state_dict()
            try:
                taken.append(reader.next_batch(B).windows)
            except OSError as e:
                failed = str(e)
                break
        assert "\n" not in failed and failed.endswith("not fetched: the loader did not move"), failed
        assert "cannot reach the store" in failed and "after 2 tries" in failed
        assert reader.state_dict() == before
        os.killpg(server.proc.pid, signal.SIGCONT)
        taken += [reader.next_batch(B).windows for _ in range(40 - len(taken))]  # the same call goes on
        assert all(np.array_equal(g, w) for g, w in zip(taken, expected))
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
        server.kill()


def test_a_cache_folder_removed_mid_epoch_is_made_again_and_the_windows_go_on(finished_stored, tmp_path):
    whole = Sequences(finished_stored, "train", L, seed=6, cache_dir=tmp_path / "whole", cache_size=CACHE)
    expected = [whole.next_batch(B).windows for _ in range(60)]
    reader = Sequences(finished_stored, "train", L, seed=6, cache_dir=tmp_path / "cache", cache_size=CACHE)
    taken = [reader.next_batch(B).windows for _ in range(20)]
    while (tmp_path / "cache").exists():  # a user clearing ~/.cache under a live run: the next buffer's
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)  # fetches may land in it meanwhile, as for rm -rf
    taken += [reader.next_batch(B).windows for _ in range(40)]
    assert all(np.array_equal(g, w) for g, w in zip(taken, expected))
    assert cache_bytes(tmp_path / "cache") <= 2 * CACHE


def test_opening_the_cache_removes_files_from_before_the_boot_and_skips_those_another_rank_removes(
    tmp_path, monkeypatch
):
    for name in ("0.blk", "1.blk", "2.fetch"):
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / "0.blk", (0, 0))  # written before this machine's boot: a power loss may have torn it
    listed = tmp_path.iterdir

    def listing(folder):  # a rank's fetch ends between the listing and the look: its lock file is removed
        yield from listed()
        yield folder / "69.fetch"

    monkeypatch.setattr(type(tmp_path), "iterdir", listing)
    tokpipe.data.cache._forget_before_boot(tmp_path)
    assert sorted(p.name for p in listed()) == ["1.blk", "2.fetch"]

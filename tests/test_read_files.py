"""tokpipe.data over many files and many documents: splits of 300 and 2,000 files read holding no
descriptor and a bounded number of maps (under `ulimit -n 64` too), every file checked when it is mapped,
and document starts found through the sparse index of ends, compared with the contract computed by hand
from the documents' lengths (a document starts where the one before ends; 0 starts the split).

The OUTs here are written by hand, as finalize lays them out (meta, .parts, .bin and .idx): random ids
and document lengths, empty documents and empty files included, uint16.
"""

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import hand_made_out

from tokpipe.data import Sequences
from tokpipe.layout.stored import reader_out
from tokpipe.read import files, maps
from tokpipe.read.files import SMALL, SPARSE
from tokpipe.store import Bucket


def doc_starts_by_hand(ends: np.ndarray, start: int, seq_len: int) -> list[int]:
    inside = ends[(ends >= start) & (ends <= start + seq_len)] - start
    return sorted(set(inside.tolist()) | ({0} if start == 0 else set()))


def maps_of(out: Path) -> int:
    """This process's maps of OUT's files (the lines of /proc/self/maps that name one)."""
    return sum(f" {out}/" in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.parametrize("merged", [True, False])
def test_a_split_of_2000_files_holds_no_descriptor_and_at_most_maps_maps(tmp_path, merged, monkeypatch):
    """At most MAPS maps (64 here, to drop and map again), of tokens and, ends searched file by file, of
    .idx files; a merged split maps no .idx. No descriptor stays open (Python's mmap kept one a map)."""
    monkeypatch.setattr(files, "MAPS", 64, raising=False)
    if not merged:
        monkeypatch.setattr(files, "MERGED", 0)
    rng = np.random.default_rng(1)
    lengths = [rng.integers(0, 120, rng.integers(0, 9)) for _ in range(2000)]  # empty files and documents too
    out, tokens, ends = hand_made_out(tmp_path / "out", lengths, concat=False)
    seq_len = 64
    gc.collect()  # an earlier test's garbage, collected mid-test, closed a descriptor of its own (CI, b3617e2)
    descriptors = sorted(os.listdir("/proc/self/fd"))
    s = Sequences(out, seq_len=seq_len, seed=2)
    assert len(s.files) == 2000 and len(s) == (len(tokens) - 1) // seq_len
    batch = s.next_batch(len(s))  # the whole epoch, in its order: files mapped, dropped, mapped again
    assert sorted(os.listdir("/proc/self/fd")) == descriptors
    assert 0 < maps_of(out) == s.files.maps() <= 64
    assert sorted(batch.windows.tolist()) == list(range(len(s)))
    for row, w, found in zip(batch.tokens, batch.windows.tolist(), batch.doc_starts):
        assert np.array_equal(row, tokens[w * seq_len : w * seq_len + seq_len + 1])
        assert found.tolist() == doc_starts_by_hand(ends, w * seq_len, seq_len), w
    for _ in range(40):  # batches of 64 over ~60 files each, from maps kept and made
        batch = s.next_batch(64)
        for row, w in zip(batch.tokens, batch.windows.tolist()):
            assert np.array_equal(row, tokens[w * seq_len : w * seq_len + seq_len + 1]), w
    assert sorted(os.listdir("/proc/self/fd")) == descriptors and maps_of(out) == s.files.maps() <= 64


UNDER_ULIMIT = """
import json, os, resource, sys
import numpy as np
from tokpipe.data import Sequences
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
descriptors = len(os.listdir("/proc/self/fd"))
s = Sequences(sys.argv[1], seq_len=8, seed=2)
epoch = s.next_batch(len(s))
np.save(sys.argv[2], np.concatenate([epoch.windows[:, None], epoch.tokens], axis=1))
held = len(os.listdir("/proc/self/fd")) - descriptors
print(json.dumps({"descriptors": held, "maps": s.files.maps(), "windows": len(s)}))
"""


def test_an_epoch_of_300_files_reads_under_ulimit_64(tmp_path):
    """The issue's split: 300 files under `ulimit -n 64` (in a process of its own: pytest holds more), every
    file mapped once and kept, no descriptor held. Before, 64 maps held 128 descriptors: EMFILE."""
    rng = np.random.default_rng(6)
    out, tokens, _ = hand_made_out(tmp_path / "out", [rng.integers(1, 40, 3) for _ in range(300)], concat=False)
    read = subprocess.run(
        [sys.executable, "-c", UNDER_ULIMIT, str(out), str(tmp_path / "epoch.npy")],
        capture_output=True,
        text=True,
    )
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == {"descriptors": 0, "maps": 300, "windows": (len(tokens) - 1) // 8}
    epoch = np.load(tmp_path / "epoch.npy")
    assert sorted(epoch[:, 0].tolist()) == list(range((len(tokens) - 1) // 8))
    for w, *row in epoch.tolist():
        assert row == tokens[w * 8 : w * 8 + 9].tolist(), w


def test_a_file_replaced_since_the_loader_was_made_is_refused_naming_it(tmp_path, monkeypatch):
    """The issue's replacement (unlink, one token written in its place) under a live loader: refused when
    the file is mapped, and when it is mapped again after its map was dropped; never zeros or other
    memory. A live map keeps the file it was made of: it reads the bytes that were checked."""
    monkeypatch.setattr(files, "MAPS", 8, raising=False)
    rng = np.random.default_rng(7)
    out, tokens, _ = hand_made_out(tmp_path / "out", [rng.integers(20, 40, 4) for _ in range(300)], concat=False)
    s, seq_len = Sequences(out, seq_len=16), 16
    first, second, third = (out / f"shards/{i}.bin" for i in range(3))
    in_file = [w for w in range(len(s)) if s.files.ends[0] - (w * seq_len) > seq_len]  # windows of file 0 alone
    size = first.stat().st_size
    first.unlink()
    np.array([7], "uint16").tofile(first)
    with pytest.raises(ValueError) as refused:
        s.batch_of(np.array(in_file))
    assert str(refused.value) == (
        f"{first} changed since the loader was made (2 bytes, {size:,} then): reopen it on a finished output "
        f"(tokpipe verify)"
    )
    w = int(s.files.starts[1]) // seq_len + 1  # a window of file 1: mapped (and kept while mapped)
    assert np.array_equal(s.batch_of(np.array([w])).tokens[0], tokens[w * seq_len : w * seq_len + seq_len + 1])
    original = second.read_bytes()
    second.unlink()
    second.write_bytes(original[::-1])  # as large, other tokens: the map still reads the ones checked
    assert np.array_equal(s.batch_of(np.array([w])).tokens[0], tokens[w * seq_len : w * seq_len + seq_len + 1])
    s.batch_of(np.arange(len(s) // 2, len(s)))  # later files: file 1's map is dropped
    with pytest.raises(ValueError, match=rf"^{second} changed since the loader was made \(another file of its size\)"):
        s.batch_of(np.array([w]))
    with open(third, "r+b") as f:  # in place, as large: its modification time tells
        reversed_tokens = f.read()[::-1]
        f.seek(0)
        f.write(reversed_tokens)
    os.utime(third, ns=(0, 0))
    with pytest.raises(ValueError, match=rf"^{third} changed since the loader was made \(its size, but modified\)"):
        s.files.read(int(s.files.starts[2]), int(s.files.starts[2]) + 1)


@pytest.mark.parametrize("merged", [True, False])
@pytest.mark.parametrize("concat", [True, False])
def test_document_starts_through_the_sparse_index_are_those_of_the_lengths(tmp_path, concat, merged, monkeypatch):
    """Files of tens of thousands of documents (searched by blocks of 512 ends, a short last block) and of
    fewer (searched whole), lengths 0 to 40; their ends merged in memory, or (a split of more than MERGED
    documents) searched file by file."""
    if not merged:
        monkeypatch.setattr(files, "MERGED", 0)
    rng = np.random.default_rng(3)
    lengths = [rng.integers(0, 41, n) for n in (SMALL + 5 * SPARSE + 17, 3 * SPARSE, 1, SMALL + 2 * SPARSE - 1)]
    out, tokens, ends = hand_made_out(tmp_path / "out", lengths, concat=concat, seed=4)
    for seq_len in (1, 16, 700):
        s = Sequences(out, seq_len=seq_len)
        sample = np.random.default_rng(seq_len).choice(len(s), min(len(s), 500), replace=False)
        at_files = (s.files.starts[1:-1] + seq_len - 1) // seq_len  # the first window starting in each file
        batch = s.batch_of(np.concatenate([sample, at_files[at_files < len(s)], [len(s) - 1, 0]]))
        for row, w, found in zip(batch.tokens, batch.windows.tolist(), batch.doc_starts):
            assert np.array_equal(row, tokens[w * seq_len : w * seq_len + seq_len + 1])
            assert found.tolist() == doc_starts_by_hand(ends, w * seq_len, seq_len), (seq_len, w)


def test_threads_reading_while_maps_are_dropped_get_their_windows(tmp_path, monkeypatch):
    """Windows are gathered from a view of the process's memory, read only where maps lie: with 2 maps at
    most, four threads' batches over 300 files map and drop all the time, and each row is still its tokens."""
    monkeypatch.setattr(files, "MAPS", 2, raising=False)
    rng = np.random.default_rng(5)
    out, tokens, _ = hand_made_out(tmp_path / "out", [rng.integers(1, 60, 4) for _ in range(300)], concat=False)
    s, seq_len, wrong, right = Sequences(out, seq_len=8), 8, [], []

    def read(seed):
        windows = np.random.default_rng(seed).integers(0, len(s), (50, 64))
        for batch in map(s.batch_of, windows):
            for row, w in zip(batch.tokens, batch.windows.tolist()):
                same = np.array_equal(row, tokens[w * seq_len : w * seq_len + seq_len + 1])
                (right if same else wrong).append(w)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == [] and len(right) == 4 * 50 * 64 and s.files.maps() <= 2  # (a thread's error: fewer)


def test_a_store_s_files_are_looked_up_many_at_once_in_order_and_a_folder_s_one_by_one(tmp_path):
    """A request to a store is a round trip: a split of 2,000 group files waited 80 s for its HEADs one after another
    where the store answers in 20 ms (open_output, verify, inspect, the loader)."""
    in_flight, peak, lock = [0], [0], threading.Lock()

    def look(n):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return n * n

    on_a_store = SimpleNamespace(stored=True)  # as a reader's copy of an OUT on a store's records is (reader_out)
    assert maps.each_file(on_a_store, look, list(range(32))) == [n * n for n in range(32)] and peak[0] > 1
    peak[0] = 0
    assert maps.each_file(tmp_path, look, list(range(4))) == [0, 1, 4, 9] and peak[0] == 1


def test_on_a_store_many_files_are_looked_up_in_a_list_of_their_folder_unless_it_holds_many_more(
    finished_stored, s3_server, monkeypatch
):
    """A loader's copy of a store's records holds no LIST of OUT: past LISTED files, one LIST (a page of 1,000 objects
    a request) finds them, where a HEAD a file made a --no-concat split of 60,000 shards 120,000 requests for each
    loader that opened it, and the copy keeps it for the next; a LIST of more than LIST_MOST objects a name is given
    up for the HEADs."""
    asked, head, listing = [], Bucket.head, Bucket.list
    monkeypatch.setattr(Bucket, "head", lambda bucket, key: asked.append("head") or head(bucket, key))
    monkeypatch.setattr(Bucket, "list", lambda bucket, prefix: asked.append("list") or listing(bucket, prefix))
    copy = reader_out(finished_stored, ["meta.json", "meta.pkl"])  # as the loader makes it
    names = ["train.bin", "train.idx", "val.bin", "val.idx", "nothing.bin"]
    prefix = finished_stored.removeprefix(f"s3://{s3_server.bucket}/")
    sizes = [s3_server.client().head_object(Bucket=s3_server.bucket, Key=f"{prefix}/{n}") for n in names[:4]]
    expected = {**{n: (s["ContentLength"], s["ETag"]) for n, s in zip(names, sizes)}, "nothing.bin": None}
    asked.clear()
    monkeypatch.setattr(maps, "LISTED", 5)
    found = maps.seen_all(copy, names)
    assert {n: f and (f.size, f.etag) for n, (_, f) in found.items()} == expected and asked == ["list"]
    assert found["val.bin"][0] == f"{finished_stored}/val.bin"
    asked.clear()  # the copy keeps the LIST: a group's files, found among the split's (Sequences), ask nothing more
    found = maps.seen_all(copy, ["val.bin", "val.idx"], among=names)
    assert {n: (f.size, f.etag) for n, (_, f) in found.items()} == {n: expected[n] for n in found} and asked == []
    copy = reader_out(finished_stored, ["meta.json", "meta.pkl"])
    asked.clear()
    monkeypatch.setattr(maps, "LIST_MOST", 0)  # OUT's objects are more than 0 a name
    found = maps.seen_all(copy, names)
    assert {n: f and (f.size, f.etag) for n, (_, f) in found.items()} == expected and asked == ["list"] + ["head"] * 5

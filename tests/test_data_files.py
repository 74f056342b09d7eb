"""tokpipe.data over many files and many documents: a split of 2,000 files read with a bounded number open,
and document starts found through the sparse index of ends, compared with the contract computed by hand
from the documents' lengths (a document starts where the one before ends; 0 starts the split).

The OUTs here are written by hand, as finalize lays them out (meta, .parts, .bin and .idx): random ids
and document lengths, empty documents and empty files included, uint16.
"""

import hashlib
import json
import os
import resource
import threading

import numpy as np
import pytest

from tokpipe.data import Sequences, files
from tokpipe.data.files import OPEN_FILES, SMALL, SPARSE
from tokpipe.out.files import Out


def hand_made_out(out, lengths_per_file: list[np.ndarray], concat: bool, seed: int = 0):
    """An OUT whose train split holds documents of these lengths, in one file (concat) or one file per
    list; returns (out, every token in order, every document end counted from the split's start)."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    files, parts, all_tokens, all_ends, offset = [], [], [], [], 0
    for i, lengths in enumerate(lengths_per_file):
        tokens = rng.integers(0, 600, int(lengths.sum()), dtype=np.uint16)
        ends = np.cumsum(lengths).astype("<i8")
        all_tokens.append(tokens)
        all_ends.append(ends + offset)
        offset += len(tokens)
        record = {"shard": f"s{i}", "tokens": len(tokens), "documents": len(ends)}
        record["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
        if not concat:
            (out / "shards").mkdir(exist_ok=True)
            tokens.tofile(out / f"shards/{i}.bin")
            ends.tofile(out / f"shards/{i}.idx")
            record |= {"bin": f"shards/{i}.bin", "idx": f"shards/{i}.idx"}
            files.append({k: record[k] for k in ("bin", "idx", "tokens", "documents")})
        parts.append(json.dumps(record) + "\n")
    tokens, ends = np.concatenate(all_tokens), np.concatenate(all_ends)
    raw = "".join(parts).encode()
    (out / "train.parts").write_bytes(raw)
    entry = {"parts": "train.parts", "tokens": len(tokens), "documents": len(ends)}
    entry["parts_sha256"] = hashlib.sha256(raw).hexdigest()
    if concat:
        tokens.tofile(out / "train.bin")
        ends.tofile(out / "train.idx")
        entry |= {"file": "train.bin", "idx": "train.idx"}
    else:
        entry["files"] = files
    meta = {"dtype": "uint16", "vocab_size": 600, "eos_token_id": 0, "delimiters": {"bos": False, "eos": True}}
    Out(out).write_meta(meta | {"concat": concat, "splits": {"train": entry}})
    return out, tokens.astype(np.int64), ends


def doc_starts_by_hand(ends: np.ndarray, start: int, seq_len: int) -> list[int]:
    inside = ends[(ends >= start) & (ends <= start + seq_len)] - start
    return sorted(set(inside.tolist()) | ({0} if start == 0 else set()))


@pytest.mark.parametrize("merged", [True, False])
def test_a_split_of_2000_files_reads_with_at_most_64_open_under_ulimit_256(tmp_path, merged, monkeypatch):
    if not merged:
        monkeypatch.setattr(files, "MERGED", 0)
    rng = np.random.default_rng(1)
    lengths = [rng.integers(0, 120, rng.integers(0, 9)) for _ in range(2000)]  # empty files and documents too
    out, tokens, ends = hand_made_out(tmp_path / "out", lengths, concat=False)
    seq_len = 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        before = len(os.listdir("/proc/self/fd"))
        s = Sequences(out, seq_len=seq_len, seed=2)
        assert len(s.files) == 2000 and len(s) == (len(tokens) - 1) // seq_len
        batch = s.next_batch(len(s))  # the whole epoch, in its order: files opened, dropped, opened again
        assert len(os.listdir("/proc/self/fd")) <= before + 2 * OPEN_FILES
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sorted(batch.windows.tolist()) == list(range(len(s)))
    for row, w, found in zip(batch.tokens, batch.windows.tolist(), batch.doc_starts):
        assert np.array_equal(row, tokens[w * seq_len : w * seq_len + seq_len + 1])
        assert found.tolist() == doc_starts_by_hand(ends, w * seq_len, seq_len), w
    for _ in range(40):  # batches of 64 over ~60 files each: read from the span, files mapped and dropped between
        batch = s.next_batch(64)
        for row, w in zip(batch.tokens, batch.windows.tolist()):
            assert np.array_equal(row, tokens[w * seq_len : w * seq_len + seq_len + 1]), w


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
    """Windows are gathered from a view across the maps (the span): with 2 files mapped at most, four threads'
    batches over 300 files map, drop and re-span all the time, and each row is still its tokens."""
    monkeypatch.setattr(files, "OPEN_FILES", 2)
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
    assert wrong == [] and len(right) == 4 * 50 * 64 and len(s.files._open) <= 2  # (a thread's error: fewer)

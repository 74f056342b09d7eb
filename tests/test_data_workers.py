"""tokpipe.data.workers.Batches as torch's DataLoader(num_workers=k) runs it, torch aside: the dataset pickled
into processes started with 'spawn', worker w of k iterating its share, the main process taking batch i
from worker i % k. Windows are compared with the contract's order (rank r of W reads positions r, r+W, ...
of the epoch's order) and tokens with the reference encoding."""

import json
import multiprocessing
import os
import subprocess
import sys
from itertools import islice

import numpy as np

from tokpipe.data import Mixture, Sequences
from tokpipe.data.workers import Batches

SEQ_LEN, BATCH = 2048, 19  # train: 419 windows; a rank of 2 reads 209 a epoch: 11 batches of 19


def work(batches: Batches, worker: int, workers: int, count: int, results) -> None:
    """What a DataLoader worker does with its copy of the dataset (here: its id given, not torch's)."""
    taken = [(b.windows, b.tokens, b.state) for b in islice(batches.worker(worker, workers), count)]
    results.put((worker, taken))


def through_workers(batches: Batches, workers: int, count: int) -> list:
    """The first `count` batches as the main process receives them from `workers` spawned workers."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    per_worker = -(-count // workers)
    processes = [context.Process(target=work, args=(batches, w, workers, per_worker, results)) for w in range(workers)]
    for p in processes:
        p.start()
    taken = dict(results.get(timeout=300) for _ in processes)
    for p in processes:
        p.join(timeout=60)
    return [taken[i % workers][i // workers] for i in range(count)]


def test_ranks_times_spawned_workers_cover_each_window_once_and_one_state_resumes_them(
    finished_example, example_reference
):
    reference = example_reference["train"].astype(np.int64)
    order = Sequences(finished_example, seq_len=SEQ_LEN, seed=7).next_batch(419).windows  # the epoch's order
    epoch = []
    for rank in range(2):
        sequences = Sequences(finished_example, seq_len=SEQ_LEN, seed=7, rank=rank, world_size=2)
        received = through_workers(Batches(sequences, BATCH), workers=3, count=13)
        windows = np.concatenate([w for w, _, _ in received])
        assert np.array_equal(windows[:209], order[rank:418:2])  # the rank's share of the epoch, in order
        epoch.append(windows[:209])
        for w, tokens, _ in received:
            for row, window in zip(tokens, w):
                assert np.array_equal(row, reference[window * SEQ_LEN : window * SEQ_LEN + SEQ_LEN + 1])
        assert sequences.state_dict()["offset"] == 0  # the main process's loader did not move
        # The state of the 7th batch received, saved in the main process, resumes 2 workers (or 1) there.
        state = json.loads(json.dumps(received[6][2]))
        assert state["offset"] == 7 * BATCH * 2 and state["epoch"] == 0
        for workers in (2, 1):
            resumed = Sequences(finished_example, seq_len=SEQ_LEN, seed=7, rank=rank, world_size=2)
            resumed.load_state_dict(state)
            again = Batches(resumed, BATCH)
            streams = [again.worker(w, workers) for w in range(workers)]
            for i in range(7, 13):
                assert np.array_equal(next(streams[(i - 7) % workers]).windows, received[i][0])
    together = np.concatenate(epoch)
    assert len(together) == len(set(together.tolist())) == 418  # the 419th: the one the 2 ranks skip


def test_a_mixture_through_workers_gives_the_batches_of_next_batch(finished_example):
    def mixture():
        splits = ("train", "validation")
        return Mixture(
            {s: Sequences(finished_example, s, seq_len=512, seed=2) for s in splits},
            {s: 3 - i for i, s in enumerate(splits)},
        )

    alone = mixture()
    expected = [alone.next_batch(16) for _ in range(9)]
    batches = Batches(mixture(), 16)
    streams = [batches.worker(w, 3) for w in range(3)]
    for i, batch in enumerate(expected):
        got = next(streams[i % 3])
        assert got.sources == batch.sources and np.array_equal(got.tokens, batch.tokens) and got.state == batch.state


FORKED = """
import multiprocessing, sys
from tokpipe.data import Sequences

def open_it(_):
    return len(Sequences(sys.argv[1], seq_len=SEQ_LEN))

if __name__ == "__main__":
    pool = multiprocessing.get_context("fork").Pool(2)  # as torch's DataLoader starts its workers on Linux
    print(pool.map(open_it, range(4)) + [open_it(0)])
    pool.close()  # the workers end as a DataLoader's do at an epoch's end: multiprocessing's exit, then os._exit
    pool.join()
""".replace("SEQ_LEN", str(SEQ_LEN))


def test_forked_workers_that_read_an_out_on_a_store_leave_no_copy_of_its_records_behind(finished_stored, tmp_path):
    # Each process keeps a copy of a stored OUT's meta in a temporary folder (layout/stored.py meta_copy). A forked
    # worker ends in os._exit, where an atexit never ran: 8 workers made again each epoch left 8 copies an epoch.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    opened = subprocess.run([sys.executable, "-c", FORKED, finished_stored], capture_output=True, text=True, env=env)
    assert opened.returncode == 0, opened.stderr
    assert json.loads(opened.stdout) == [419] * 5 and list(tmp_path.iterdir()) == []

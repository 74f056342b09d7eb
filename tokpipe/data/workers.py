"""Batches for torch.utils.data.DataLoader(num_workers=k): each worker reads its share, the main process
receives exactly the batches that next_batch would have given, in order, and each carries the state to
resume from right after it.

DataLoader hands each worker a pickled copy of the dataset (a Sequences or a Mixture pickles as a
reference: the worker reopens the files) and, the dataset being iterable, takes batch i from worker
i % k, in turn. So worker w of k yields batches w, w + k, w + 2k, ... of the loader's sequence from where
it stood when iterated, skipping the others' batches between (positions only: no lookups, no reads).
Ranks x workers then cover each window once per epoch, as ranks alone do. The state a batch carries is
its worker's position right after it, which is the global position after that batch: saved from the
main process, it resumes any number of workers (or none) under any world size.

torch is no dependency: with torch importable, Batches is a torch IterableDataset and reads the worker's
id from torch.utils.data.get_worker_info(); `worker(w, k)` takes them explicitly. (Imported on its own,
`from tokpipe.data.workers import Batches`: `import tokpipe.data` never tries torch.)
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

from tokpipe.data.arguments import integer
from tokpipe.data.sequences import Batch

try:
    from torch.utils.data import IterableDataset as _Dataset
    from torch.utils.data import get_worker_info
except ImportError:  # no torch: a plain iterable
    _Dataset, get_worker_info = object, None


class Batches(_Dataset):
    """Endless batches of `batch_size` from a Sequences or a Mixture, from its position when iterated
    (the loader itself does not move: save `batch.state` to resume)."""

    def __init__(self, loader, batch_size: int):
        self.loader, self.batch_size = loader, integer(batch_size, "batch_size", 1)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info() if get_worker_info else None
        return self.worker(0, 1) if info is None else self.worker(info.id, info.num_workers)

    def worker(self, worker: int, workers: int) -> Iterator[Batch]:
        """Worker `worker` of `workers`' batches: numbers worker, worker + workers, ... of the sequence."""
        workers = integer(workers, "workers", 1)
        if not 0 <= integer(worker, "worker") < workers:
            raise ValueError(f"worker {worker} of {workers}: need 0 <= worker < workers")
        loader = pickle.loads(pickle.dumps(self.loader))  # its own position (a reference: files reopened)
        loader.skip(worker * self.batch_size)
        while True:
            yield loader.next_batch(self.batch_size)
            loader.skip((workers - 1) * self.batch_size)

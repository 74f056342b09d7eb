"""runner/task.py: the Ray task around a shard. What it reports to the ProgressBoard: a shard tokenized again, its
tokens lost with a node, was counted when it was first done; it beats (the stall clock) and adds nothing again. Its
last report is on the board before the task returns: the driver's look at the results projects the disk's use."""

import faulthandler

import tokpipe.runner.task
from tokpipe.runner.task import _Progress


class _Board:
    """A ProgressBoard's handle as a task calls it (`board.report.remote(...)`): what it was told, in order; each
    call's reference is what it was told."""

    def __init__(self):
        self.report, self.told = self, []

    def remote(self, tag, file_bytes, documents, tokens, finished=False, node=None):
        self.told.append((tag, file_bytes, documents, tokens, finished))
        return self.told[-1]


def test_a_shard_tokenized_again_beats_and_adds_nothing_to_what_the_run_read(tmp_path, monkeypatch):
    told, waited = {}, []
    monkeypatch.setattr(tokpipe.runner.task.ray, "get", lambda call, timeout: waited.append(call))
    for counted in (True, False):
        board = _Board()
        with open(tmp_path / "stall.txt", "w") as dump:
            progress = _Progress(board, "train/a", "node-1", dump, stall_timeout=60.0, counted=counted)
            progress(1000, 3, 700)  # two batches read and encoded
            progress(500, 1, 300)
            progress.report(finished=True)
            faulthandler.cancel_dump_traceback_later()
        told[counted] = board.told
    assert told[True] == [("train/a", 0, 0, 0, False), ("train/a", 1500, 4, 1000, True)]
    assert told[False] == [("train/a", 0, 0, 0, False), ("train/a", 0, 0, 0, True)]
    assert waited == [("train/a", 1500, 4, 1000, True), ("train/a", 0, 0, 0, True)]  # the last report, each time

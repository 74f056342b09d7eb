"""OUT's contract: every name of its files and every change of its state (files.py), what its records hold
(records.py: checkpoints, parts lists, meta's split entries), what a run is (run.py: run.json, the splits
written), what its ids mean (tokens.py: the dtype, the held-out documents) and its progress over time
(series.py). Every writer and reader of OUT goes through this package; no other module spells a name of OUT's.

Every file of OUT is on one tree, docs/output-format.md ("OUT's files"): tests/test_docs.py checks it against the
names this package makes (files.py) and against real runs' OUTs.
"""

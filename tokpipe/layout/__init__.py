"""OUT's contract: every name of its files and every change of its state (files.py), what a finished OUT is
(meta.py: meta as a record, its splits' entries and the files each is read from), what its records hold
(records.py: checkpoints, parts lists, the entries summed from them, an unfinished split's files), what a run is
(run.py: run.json as a record, the splits written), what its ids mean (tokens.py: the dtype, the held-out
documents) and its progress over time (series.py). Every writer and reader of OUT goes through this package; no
other module spells a name of OUT's, nor a key of its meta or run.json.

Every file of OUT is on one tree, docs/output-format.md ("OUT's files"): tests/test_docs.py checks it against the
names this package makes (files.py) and against real runs' OUTs.
"""

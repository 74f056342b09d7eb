"""OUT's contract: every name of its files and every change of its state (files.py), what its records hold
(records.py: checkpoints, parts lists, meta's split entries), what a run is (run.py: run.json, the splits
written), what its ids mean (tokens.py: the dtype, the held-out documents) and its progress over time
(series.py). Every writer and reader of OUT goes through this package; no other module spells a name of OUT's.

OUT/run.json                     what the run is (its identity), where its tokenizer was, the options given
OUT/manifest.json                the manifest's copy that the run (and status, verify --sample) reads
OUT/.lock                        flock-ed by the live run, holding "pid N on HOST"
OUT/shards/<split>/<key>.bin     a shard's tokens; .idx its document ends (from the shard's start);
                                 .json its checkpoint; .lock held by the worker writing it
OUT/shards/train/held-out/<key>  the .bin/.idx of what a train shard held out for val.bin (--val-fraction)
OUT/shards/<split>/[held-out/]groups/<group>/<key>   with --group-by: a shard's part of one group
OUT/<stem>.bin, .idx, .parts     a split file (stem: train, val, test), its document ends, and its
                                 parts list: one JSON line per part, with its counts and checksums
OUT/<stem>/<group>.bin, .idx     with --group-by: a group's file of the split (the .parts lists them all)
OUT/<stem>.*.tmp                 the same three while the split is assembled (<stem>/<group>.*.tmp)
OUT/moving/<stem>/<n>/           a split's files as they were (links) and their parts list, when shards were
                                 added before finished ones: the source those parts move from (Out.moving)
OUT/meta.pkl, OUT/meta.json      written last, meta.json last of all: its presence marks a finished run
OUT/logs/                        run.log, progress.json, failed.json, skipped.json, stall dumps,
                                 node-check.txt (a cluster run's token that every node reads back)
OUT/report.html                  `tokpipe report`'s page, by default
"""

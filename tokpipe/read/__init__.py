"""The read path: a split's token files read one way (files.py, over maps.py's file access), a finished OUT
opened (output.py), proven (verify.py) and its documents re-tokenized from the sources (sample.py, verify
--sample). With tokpipe.data, the trainer's side, it reads OUT through its contract (tokpipe.layout) and never
imports the write path or the runner."""

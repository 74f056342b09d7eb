"""The read path: a finished OUT opened (output.py) and proven (verify.py). With tokpipe.data, the trainer's side,
it reads OUT through its contract (tokpipe.out) and never imports the write path or the runner."""

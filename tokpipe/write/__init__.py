"""The write path: a shard -> its parts (shard.py, memory.py), the parts placed in their split files while later
shards still tokenize (assembly/: what goes where and what a rerun keeps; place.py: the bytes), then the split
files renamed and meta written (finalize.py). Plain Python: the runner drives it, on Ray or without."""

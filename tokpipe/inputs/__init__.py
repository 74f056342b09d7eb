"""What a run reads, and how text becomes ids: the manifest (the dataset's shards, in order), the sources (a
shard -> batches of texts, every line accounted for), the tokenizer and its encoders. Below both the write path,
which encodes, and the readers that check or show the output (verify --sample re-encodes, inspect decodes)."""

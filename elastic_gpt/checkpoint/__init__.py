"""Sharded checkpoints on any fsspec URL: the store (layout, commit marker, retention), DCP
save and load (sharded), and the synchronous and asynchronous checkpointers the Trainer calls."""

"""Offline dataset producers: the jobs that make what training reads, run before training and
apart from it (`python -m data_pipelines prepare|train-tokenizer ...`, `ray job submit ... --
python -m data_pipelines prepare ...`).

- sources.py: listing the input files and reading their documents; split.py: the held-out
  validation split; shards.py: shard files and their commit markers; tokenize_part.py: one part
  of the input -> its shards; engines.py: running the parts here or as a Ray Data job;
  output.py: the output checks and the manifest, written last; tokenize_job.py: `prepare_data`;
  cli.py: the command line.
- tokenizer_training.py: a byte-level BPE tokenizer.json learnt on a corpus's training split.
- recipes/: one module per corpus that runs the steps above with its settings (`make data` runs
  recipes/stdlib.py).

Imports go one way: this package uses the dataset format of `elastic_gpt.data` (manifest, token
bytes, tokenizers, fingerprints) and `elastic_gpt.console`/`elastic_gpt.errors`, and nothing in
`elastic_gpt` imports it, except the `elastic-gpt prepare-data` subcommand (elastic_gpt/cli.py),
lazily.
"""

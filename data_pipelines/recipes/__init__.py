"""Recipes: one module per corpus, each the steps that make its dataset (a tokenizer, the
tokenized shards) with that corpus's settings, runnable as `python -m data_pipelines.recipes.NAME`
(the way nanoGPT keeps a `data/<corpus>/prepare.py`)."""

"""Token data at training time: the dataset format (manifest, fixed-size records, token bytes,
tokenizers), the sample order (C1 fixed global batch, C2 data order) and the per-rank streaming
reader. The offline jobs that write datasets are in the top-level `data_pipelines/`, which imports
this package, never the other way."""

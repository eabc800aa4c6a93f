"""Token data: tokenizers, the prepare-data job, the manifest, the sample order (C1, C2) and the
per-rank streaming reader."""

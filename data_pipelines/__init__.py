"""Data pipeline: tokenize raw text into token shards (`tokenize`), stream them in the C2 order
(`stream`), shared manifest and tokenizers. See docs/data.md."""

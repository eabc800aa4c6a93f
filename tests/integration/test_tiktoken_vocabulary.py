"""A tiktoken-format vocabulary file as the tokenizer (Llama 3's tokenizer.model is one): a
dataset tokenized with a vocabulary of more than 65,536 ids stores its tokens as uint32, reads
every id back unchanged (ids past 65,535 included), and carries the vocabulary file, so the
dataset alone is enough to decode it. The vocabulary is made here: every byte, then every pair
of bytes, the pairs of common letters ranked last so that they get ids past 65,535."""

from __future__ import annotations

import base64
import itertools
import json

import numpy as np

COMMON = "etaoinshrdlcumwf"  # 16 x 16 = 256 pairs at the top of the vocabulary


def write_vocabulary(path) -> None:
    late = {(ord(a), ord(b)) for a, b in itertools.product(COMMON, COMMON)}
    pairs = [p for p in itertools.product(range(256), range(256)) if p not in late]
    tokens = [bytes([b]) for b in range(256)] + [bytes(p) for p in pairs] + \
        [bytes(p) for p in sorted(late)]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n"
                            for rank, t in enumerate(tokens)))


def test_a_vocabulary_past_65536_ids_is_stored_wide_and_read_back(tmp_path):
    from data_pipelines.tokenize_job import prepare_data
    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.data.tokenizers import get_tokenizer

    vocab = tmp_path / "wide.tiktoken"
    write_vocabulary(vocab)
    raw = tmp_path / "raw"
    raw.mkdir()
    text = "the rain in spain stays mainly in the plain; interest rates rise on demand\n" * 40
    (raw / "doc.txt").write_text(text)
    prepare_data(str(raw), str(tmp_path / "ds"), tokenizer=f"tiktoken:{vocab}", seq_len=16,
                 engine="local", progress=False)
    manifest = load_manifest(str(tmp_path / "ds"))
    assert manifest.dtype == "uint32" and manifest.vocab_size == 256 + 65536 + 1
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["tokenizer"] == \
        "tiktoken:tokenizer.tiktoken"
    vocab.unlink()  # the dataset's own copy is what reads it from now on
    tok = get_tokenizer(manifest.tokenizer, base=manifest.url)
    assert tok.vocab_size == manifest.vocab_size and tok.eos_id == 256 + 65536
    expected = tok.encode(text)
    assert max(expected) > 65535  # the common pairs' ids need the wider storage
    stream = open_step_stream(str(tmp_path / "ds"), batch_split=BatchSplit(2, 2), rank=0,
                              world_size=1, start_step=0, seed=0, shuffle_window=1)
    batch = next(stream)
    stream.close()
    ids = np.concatenate([t.numpy().ravel() for t in batch.tokens])
    assert ids.max() > 65535
    assert set(ids.tolist()) <= set(expected) | {tok.eos_id}
    # a sample is a run of the document's tokens: none truncated to 16 bits
    sample = [i for i in batch.tokens[0][0].tolist() if i != tok.eos_id]
    assert tok.decode(sample) in text * 2

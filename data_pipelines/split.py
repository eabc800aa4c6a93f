"""The held-out validation split: which documents a dataset producer keeps out of training.

A document is held out whole when its seeded content hash (`document_hash`) is below a threshold:
--val-fraction F gives F * 2**64, --val-docs N the threshold just above the N-th smallest hash
(`validation_threshold_for_docs`). The split is a function of the text and the seed alone, so the
tokenization job (tokenize_part.py) and the tokenizer trainer (tokenizer_training.py) agree on it
whatever the parts, the engine or the number of workers.
"""

from __future__ import annotations

import hashlib

from data_pipelines.sources import DocStats, InputFile, iter_documents


def document_hash(encoded_pieces: list[bytes], seed: int) -> int:
    """A document's seeded 64-bit content hash: what decides its side of the split."""
    h = hashlib.blake2b(str(int(seed)).encode(), digest_size=8, person=b"elastic-gpt-val")
    for e in encoded_pieces:
        h.update(e)
    return int.from_bytes(h.digest(), "little")


def in_validation_split(doc_hash: int, threshold: int) -> bool:
    """A document is held out when its seeded content hash is below the threshold
    (--val-fraction F: F * 2**64; --val-docs N: just above the N-th smallest hash): a pure
    function of the text and the seed, whatever the part, the engine or the number of
    workers; identical documents land on the same side."""
    return doc_hash < threshold


def validation_threshold_for_docs(files: list[InputFile], n: int, seed: int, options: dict,
                                  storage_options: dict | None) -> int:
    """The threshold that holds out the n documents of smallest hash: one reading pass over
    the input (no tokenizing), in this process."""
    hashes = []
    for f in files:
        for pieces in iter_documents(f, storage_options, options["text_field"],
                                     options["bad_utf8"], DocStats(), hashlib.sha256(),
                                     options.get("allow_binary", True)):
            hashes.append(document_hash([p.encode("utf-8") for p in pieces], seed))
    if len(hashes) <= n:
        raise ValueError(f"--val-docs {n} would hold out all {len(hashes)} documents of the "
                         "input, leaving none to train on; lower --val-docs")
    return sorted(hashes)[n - 1] + 1

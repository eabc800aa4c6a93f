"""The UTF-8 bytes each token id stands for: what bits per byte divides by.

A byte-level tokenizer (GPT-2's BPE, the byte tokenizer, a byte-level tokenizer.json) maps every
token id to a fixed byte string, so the bytes behind any run of tokens are a table lookup,
exact and cheap; end-of-text (and the padding made of it) stands for no text and counts 0.
prepare-data checks the table against every document it tokenizes (the table's sum over a
document's tokens must equal the document's UTF-8 length) and writes it only when it held for
all of them: for a tokenizer whose tokens are not fixed byte strings the dataset simply has no
byte counts, rather than wrong ones.
"""

from __future__ import annotations

import numpy as np

# GPT-2's byte-level alphabet: each byte 0..255 is one printable character in a token's string.
_BYTE_LEVEL_CHARS = frozenset(
    chr(c) for c in [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                     *range(ord("®"), ord("ÿ") + 1)]) | frozenset(chr(256 + n) for n in range(68))


def token_byte_lengths(tok) -> np.ndarray:
    """int64 array of vocab_size: the UTF-8 byte length of each token id's text (0 for
    end-of-text). Exact for byte-level tokenizers; for others it is a guess that prepare-data's
    per-document check refuses (see the module docstring)."""
    n = tok.vocab_size
    table = np.zeros(n, dtype=np.int64)
    tiktoken_enc = getattr(tok, "_enc", None)  # GPT2Tokenizer: a tiktoken Encoding
    hf = getattr(tok, "_tok", None)            # HFTokenizer: a tokenizers.Tokenizer
    if getattr(tok, "name", None) == "bytes":
        table[:256] = 1
    elif hasattr(tiktoken_enc, "decode_single_token_bytes"):
        for i in range(n):
            if i != tok.eos_id:
                try:
                    table[i] = len(tiktoken_enc.decode_single_token_bytes(i))
                except KeyError:  # an id without a token (gaps in a vocabulary)
                    pass
    elif hf is not None and type(hf.decoder).__name__ == "ByteLevel":
        special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
        for i in range(n):
            piece = hf.id_to_token(i)
            if piece is None or piece in special:
                continue
            table[i] = len(piece) if set(piece) <= _BYTE_LEVEL_CHARS else len(piece.encode())
    else:
        for i in range(n):
            if i != tok.eos_id:
                table[i] = len(tok.decode([i]).encode("utf-8"))
    table[tok.eos_id] = 0
    return table

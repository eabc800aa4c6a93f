"""Tiny GPTs for the checkpoint tests: a model of one block, each copy initialised from its own
seed, so that two copies differ in every weight."""

from __future__ import annotations

from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=32)


def models(n: int) -> list[GPT]:
    out = []
    for i in range(n):
        m = GPT(CFG)
        m.init_weights(seed=i)
        out.append(m)
    return out

"""The model's shape and its arithmetic, without building it: `GPTConfig`, the size presets,
the parameter count and the FLOPs per token.

Imports no torch: the planner and the cost model (`elastic-gpt plan`) read a model's size from
here without paying for torch's import. model/gpt.py builds the modules from a `GPTConfig`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    """Context length (GPT-2 calls it n_positions)."""
    vocab_size: int
    """Embedding rows; usually the tokenizer's vocab padded up to a multiple of 64 for fast matmuls."""
    dropout: float = 0.0
    """0 for pretraining, as in GPT-2/3 at scale: more data beats regularisation."""

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                "pick a head count that divides the width"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def shape(self) -> dict:
        """The fields a checkpoint must agree on to be loadable into this model."""
        return {k: v for k, v in asdict(self).items() if k != "dropout"}


# Shapes from the GPT-2 release and the GPT-3 paper (Brown et al. 2020, table 2.1). seq_len and
# vocab_size are defaults that the data manifest usually overrides.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, seq_len=128),  # tests, ~0.1M non-embedding params
    "mini": dict(n_layer=4, n_head=4, n_embd=128, seq_len=256),  # the default job: minutes on 2 CPUs
    "small": dict(n_layer=6, n_head=6, n_embd=384, seq_len=256),  # nanoGPT's shakespeare-char size
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, seq_len=1024),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024, seq_len=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280, seq_len=1024),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, seq_len=1024),
    "gpt3-1.3b": dict(n_layer=24, n_head=32, n_embd=2048, seq_len=2048),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, seq_len=2048),
    "gpt3-13b": dict(n_layer=40, n_head=40, n_embd=5120, seq_len=2048),
    "gpt3-175b": dict(n_layer=96, n_head=96, n_embd=12288, seq_len=2048),
}
GPT2_VOCAB = 50257

# The fp32 work of the loss (the upcast logits, their log-softmax and softmax) runs on chunks of
# at most this many logits (64 MiB in fp32), whatever the batch: the whole fp32 logits of a
# (16 x 1024)-token micro-batch over GPT-2's vocabulary are 3.3 GB, and their gradient as much.
# model/gpt.py's loss (`chunked_token_losses`) runs so; the memory model counts it.
LOSS_CHUNK_LOGITS = 1 << 24


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """50257 -> 50304: a multiple of 64 keeps the lm_head matmul on fast kernel paths."""
    return -(-vocab_size // multiple) * multiple


def preset_config(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name], vocab_size=pad_vocab(GPT2_VOCAB))
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig(**fields)


def count_params(cfg: GPTConfig) -> dict:
    """Parameter count by arithmetic, without building the model (used by the planner too)."""
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    per_block = (
        2 * 2 * d  # ln_1, ln_2 weight + bias
        + d * 3 * d + 3 * d  # c_attn
        + d * d + d  # attn.c_proj
        + d * 4 * d + 4 * d  # mlp.c_fc
        + 4 * d * d + d  # mlp.c_proj
    )
    embeddings = V * d + T * d
    total = embeddings + L * per_block + 2 * d  # + ln_f
    return {"total": total, "embedding": embeddings, "non_embedding": total - embeddings}


def flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs per token: forward + backward = 3x forward, 2 FLOPs per multiply-add.

    Counts every matmul: per layer 12*d^2 weight MACs (qkv 3d^2, proj d^2, mlp 8d^2) plus attention's
    two T*d products (QK^T and AV, counted over the full T as PaLM and nanoGPT do), and the tied
    lm_head's V*d. This is the `6N + 12*L*d*T` of the PaLM paper's MFU appendix, with N the matmul
    parameters; embedding lookups and layer norms are not FLOPs that matter.
    """
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    matmul_params = L * 12 * d * d + V * d
    return 6 * matmul_params + 12 * L * d * T

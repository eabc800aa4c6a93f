"""The model's shape as the cost model sees it: the parameters of the units FSDP2 gathers (a
block, the root), what tensor parallelism leaves whole on every rank, and the FLOPs per token,
all derived from model/config.py's arithmetic; and the bytes of the dtypes a step computes in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_gpt.model.config import ModelConfig, count_params, flops_per_token

FP32 = 4


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model config, all derived from model/config.py's arithmetic
    (the family's block description: its linears, norms, biases and embeddings)."""

    cfg: ModelConfig
    params: int
    root_params: int
    """Everything outside the blocks: the embeddings, the final norm, an untied output layer."""
    block_params: int
    """One transformer block: FSDP2 gathers and reduces one block at a time."""
    model_flops_per_token: float
    """Training FLOPs per token (fwd + bwd) without recomputation: what MFU counts."""
    block_fwd_flops_per_token: float
    head_fwd_flops_per_token: float
    embedding_params: int = 0
    """The part of the root the first pipeline stage holds: the token (and position) embedding
    (all of the root when the output layer is tied to it: model/families.py)."""
    embeds: bool = True
    """Runs the embedding (wte, wpe): the whole model, or a pipeline's first rank."""
    heads: bool = True
    """Runs ln_f, the output layer and the loss: the whole model, or a pipeline's last rank."""

    # What tensor parallelism leaves whole on every TP rank (the rest is split tp ways): in a
    # block, its norms (SequenceParallel replicates them) and the biases the plan keeps whole
    # (GPT-2: c_attn's, replicated and sliced locally, and the two row-parallel c_proj's, added
    # after the partial sums); in the root, the final norm. The token embedding (and an untied
    # output layer) is split on the vocabulary, GPT-2's positions on the positions.
    @property
    def block_norm_params(self) -> int:
        """The norms of a block: replicated, and their gradients are partial sums over the TP
        ranks (each saw its part of the sequence), all-reduced when FSDP2 reduces the block."""
        return self.cfg.block_norm_params

    @property
    def block_fused_bias_params(self) -> int:
        """A fused q|k|v bias (GPT-2's c_attn): replicated, its gradient holds only this rank's
        heads, all-gathered when FSDP2 reduces the block."""
        return self.cfg.gathered_bias_params

    @property
    def block_replicated_params(self) -> int:
        return self.block_norm_params + self.cfg.replicated_bias_params

    @property
    def root_replicated_params(self) -> int:
        # the final norm, whose gradient is a partial sum like a block norm's; a middle pipeline
        # rank has no root, and an untied model's first rank only the embedding
        holds_norm = self.root_params > self.embedding_params or (
            self.cfg.tie_embeddings and self.root_params)
        return self.cfg.final_norm_params if holds_norm else 0

    def block_local(self, tp: int = 1) -> float:
        """Parameters of one block on one TP rank: what FSDP2 shards, gathers and reduces."""
        rep = self.block_replicated_params
        return (self.block_params - rep) / tp + rep

    def root_local(self, tp: int = 1) -> float:
        rep = self.root_replicated_params
        return (self.root_params - rep) / tp + rep

    def root_gathered_local(self, tp: int = 1) -> float:
        """The most of the root (on one TP rank) FSDP2 holds gathered at once: a tied root is
        one unit, kept gathered through the step; an untied one is two (parallel/fsdp.py), the
        embedding resharded after its forward, the final norm and the output layer kept from
        theirs into the backward: the larger of the two."""
        if self.cfg.tie_embeddings or not self.embedding_params:
            return self.root_local(tp)
        embedding = self.embedding_params / tp
        return max(embedding, self.root_local(tp) - embedding)

    def local_params(self, tp: int = 1) -> float:
        return self.root_local(tp) + self.cfg.n_layer * self.block_local(tp)


def model_shape(cfg: ModelConfig) -> ModelShape:
    no_blocks = dataclasses.replace(cfg, n_layer=0)
    counts = count_params(cfg)
    total, root = counts["total"], count_params(no_blocks)["total"]
    fpt, head_fpt = flops_per_token(cfg), flops_per_token(no_blocks)
    L = max(cfg.n_layer, 1)
    return ModelShape(cfg=cfg, params=total, root_params=root, block_params=(total - root) // L,
                      model_flops_per_token=fpt,
                      block_fwd_flops_per_token=(fpt - head_fpt) / 3 / L,  # fwd = 1/3 of fwd+bwd
                      head_fwd_flops_per_token=head_fpt / 3,
                      embedding_params=root if cfg.tie_embeddings else counts["embedding"])


def training_flops_per_token(shape: ModelShape, activation_checkpointing: bool) -> float:
    """Hardware FLOPs per token: checkpointing re-runs every block's forward in backward."""
    recompute = shape.cfg.n_layer * shape.block_fwd_flops_per_token
    return shape.model_flops_per_token + (recompute if activation_checkpointing else 0.0)


def dtype_bytes(dtype: str) -> int:
    # float8 (`train.float8`) computes the blocks' matmuls in float8 but keeps activations,
    # gradients and the rest in bfloat16
    sizes = {"bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4, "float8": 2}
    if dtype not in sizes:
        raise ValueError(f"dtype={dtype!r} must be bfloat16, float8 or float32")
    return sizes[dtype]

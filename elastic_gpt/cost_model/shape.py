"""The model's shape as the cost model sees it: the parameters of the units FSDP2 gathers (a
block, the root), what tensor parallelism leaves whole on every rank, and the FLOPs per token,
all derived from model/config.py's arithmetic; and the bytes of the dtypes a step computes in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_gpt.model.config import GPTConfig, count_params, flops_per_token

FP32 = 4


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a GPTConfig, all derived from model/config.py's arithmetic."""

    cfg: GPTConfig
    params: int
    root_params: int
    """The root FSDP unit: wte (tied with the lm_head), wpe and ln_f."""
    block_params: int
    """One transformer block: FSDP2 gathers and reduces one block at a time."""
    model_flops_per_token: float
    """Training FLOPs per token (fwd + bwd) without recomputation: what MFU counts."""
    block_fwd_flops_per_token: float
    head_fwd_flops_per_token: float
    embeds: bool = True
    """Runs the embedding (wte, wpe): the whole model, or a pipeline's first rank."""
    heads: bool = True
    """Runs ln_f, the output layer and the loss: the whole model, or a pipeline's last rank."""

    # What tensor parallelism leaves whole on every TP rank (the rest is split tp ways): in a
    # block, ln_1 and ln_2 (SequenceParallel replicates them), c_attn's bias (parallel/tensor.py
    # keeps the fused q|k|v bias replicated and slices it locally) and the biases of the two
    # row-parallel c_proj layers, added after the partial sums; in the root, ln_f. wte (and the
    # lm_head tied to it) is split on the vocabulary, wpe on the positions.
    @property
    def block_norm_params(self) -> int:
        """ln_1 + ln_2 of a block: replicated, and their gradients are partial sums over the TP
        ranks (each saw its part of the sequence), all-reduced when FSDP2 reduces the block."""
        return 4 * self.cfg.n_embd

    @property
    def block_fused_bias_params(self) -> int:
        """c_attn's bias: replicated, its gradient holds only this rank's heads of q, k and v,
        all-gathered when FSDP2 reduces the block."""
        return 3 * self.cfg.n_embd

    @property
    def block_replicated_params(self) -> int:
        # + the attn.c_proj and mlp.c_proj biases
        return self.block_norm_params + self.block_fused_bias_params + 2 * self.cfg.n_embd

    @property
    def root_replicated_params(self) -> int:
        # ln_f, whose gradient is a partial sum like ln_1's; a middle pipeline rank has no root
        return 2 * self.cfg.n_embd if self.root_params else 0

    def block_local(self, tp: int = 1) -> float:
        """Parameters of one block on one TP rank: what FSDP2 shards, gathers and reduces."""
        rep = self.block_replicated_params
        return (self.block_params - rep) / tp + rep

    def root_local(self, tp: int = 1) -> float:
        rep = self.root_replicated_params
        return (self.root_params - rep) / tp + rep

    def local_params(self, tp: int = 1) -> float:
        return self.root_local(tp) + self.cfg.n_layer * self.block_local(tp)


def model_shape(cfg: GPTConfig) -> ModelShape:
    no_blocks = dataclasses.replace(cfg, n_layer=0)
    total, root = count_params(cfg)["total"], count_params(no_blocks)["total"]
    fpt, head_fpt = flops_per_token(cfg), flops_per_token(no_blocks)
    L = max(cfg.n_layer, 1)
    return ModelShape(cfg=cfg, params=total, root_params=root, block_params=(total - root) // L,
                      model_flops_per_token=fpt,
                      block_fwd_flops_per_token=(fpt - head_fpt) / 3 / L,  # fwd = 1/3 of fwd+bwd
                      head_fwd_flops_per_token=head_fpt / 3)


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

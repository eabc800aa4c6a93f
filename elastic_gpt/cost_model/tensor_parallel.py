"""The tensor-parallel collectives of a step as DTensor runs the trainer's plan (parallel/tensor.py:
Megatron-style column and row splits with sequence parallelism), counted per micro-batch and per
gradient sync."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.cost_model.network import ring_bytes
from elastic_gpt.cost_model.shape import FP32, ModelShape


@dataclass(frozen=True)
class TPTraffic:
    """Tensor-parallel collectives of one micro-batch and of one gradient sync: counts and bytes
    per GPU."""

    all_gathers: int
    reduce_scatters: int
    all_reduces: int
    bytes_per_micro_batch: float
    sync_collectives: int
    bytes_per_sync: float


def tp_traffic(shape: ModelShape, micro_batch: int, tp: int, *, activation_checkpointing: bool,
               act_bytes: int, grad_bytes: int) -> TPTraffic:
    """Per block, forward: the attention's and the MLP's inputs are all-gathered over the sequence
    (Shard(1) -> Replicate) and their row-parallel outputs reduce-scattered back (Partial ->
    Shard(1)): 2 all-gathers + 2 reduce-scatters of a (b, s, h) tensor. Backward mirrors each (the
    gradient of an all-gather is a reduce-scatter and back). Activation checkpointing runs the
    forward again but stops at the last tensor backward needs (torch's non-reentrant checkpoint
    stops early), the MLP's c_proj input, so the recomputation repeats 2 all-gathers and 1
    reduce-scatter. The root: wte and wpe are row-parallel embeddings whose outputs are
    reduce-scattered to Shard(1) (wpe's is (1, s, h): the positions are shared by the batch; a
    family without learned positions, Llama, has none), the lm_head all-gathers its input, and
    the vocab-parallel loss all-reduces three fp32 values per token (max, sum of exponentials,
    the target's logit); backward mirrors the three activations and the loss needs none. Per
    gradient sync, the norms' gradients (partial sums over the sequence shards) are all-reduced
    and a fused q|k|v bias gradient (GPT-2's c_attn: this rank's heads) all-gathered, one
    collective per tensor. A block of any family moves the same: its attention's input and its
    MLP's are each gathered once for all their column-parallel matmuls (Llama's q, k and v;
    gate and up), each branch's row-parallel output reduce-scattered once. A pipeline rank runs
    the root's collectives of the parts it holds (`shape.embeds`, `shape.heads`): the
    embeddings' on the first, the output layer's, the loss's and the final norm's on the last,
    none on a rank between."""
    if tp <= 1:
        return TPTraffic(0, 0, 0, 0.0, 0, 0.0)
    cfg, L = shape.cfg, shape.cfg.n_layer
    act = micro_batch * cfg.seq_len * cfg.n_embd
    loss_values = 3 * 2 * ring_bytes(FP32 * micro_batch * cfg.seq_len, tp)
    pos = cfg.seq_len * cfg.n_embd
    positions = 1 if cfg.position_embedding else 0
    ag_blk = 4 + (2 if activation_checkpointing else 0)
    rs_blk = 4 + (1 if activation_checkpointing else 0)
    emb, head = int(shape.embeds), int(shape.heads)
    ag = L * ag_blk + head + emb * (1 + positions)  # root: lm_head fwd, wte (and wpe) bwd
    rs = L * rs_blk + emb * (1 + positions) + head  # root: wte (and wpe) fwd, lm_head bwd
    ar = 3 * head
    moved = ((L * (ag_blk + rs_blk) + 2 * emb + 2 * head) * ring_bytes(act_bytes * act, tp)
             + 2 * emb * positions * ring_bytes(act_bytes * pos, tp)
             + head * loss_values)
    norms_per_block = cfg.block_norm_params // cfg.n_embd  # one tensor of n_embd each
    norms = L * shape.block_norm_params + head * shape.root_replicated_params
    fused_biases = L if shape.block_fused_bias_params else 0
    sync = (2 * ring_bytes(grad_bytes * norms, tp)
            + ring_bytes(grad_bytes * L * shape.block_fused_bias_params, tp))
    sync_collectives = (norms_per_block * L + head * (cfg.final_norm_params // cfg.n_embd)
                        + fused_biases)
    return TPTraffic(ag, rs, ar, moved, sync_collectives, sync)

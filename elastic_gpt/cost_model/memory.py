"""Memory per GPU: the bytes one rank holds at its peak, by what holds them, on top of tensor and
sequence parallelism, and the margins the planner keeps.

The model state (sharded, gathered, accumulated) and the activations a layer saves are the
software's (software.py; this trainer's: fsdp.py, activations.py); the logits and the overhead
are counted here. Each function states its assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.cost_model.shape import ModelShape, dtype_bytes
from elastic_gpt.cost_model.software import Software
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import GiB
from elastic_gpt.model.config import LOSS_CHUNK_LOGITS

CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint holds fp32 params and both Adam moments; gradients are not saved."""
MEMORY_MARGIN = 0.10
"""Fraction of device memory left free on purpose (spikes, allocator rounding)."""
CONTEXT_GIB = 1.0
"""CUDA context, cuBLAS and NCCL workspaces, per GPU."""
FRAGMENTATION = 0.05
"""Allocator fragmentation, as a share of the bytes allocated."""
LOGIT_BYTES = 16
"""Under tensor parallelism (the vocab-parallel loss on whole logits): four fp32 B*T*V/tp buffers
are live at the loss's backward: the fp32 cast of the logits, the log-softmax output, its
gradient and the gradient w.r.t. the logits (`elastic-gpt dry-run` measures them so)."""
CHUNK_FP32_BYTES = 12
"""Without tensor parallelism the loss is chunked (model/gpt.py `chunked_token_losses`): the
logits' gradient in the compute dtype over all B*T*V, plus the fp32 work of one chunk of
LOSS_CHUNK_LOGITS logits (the upcast, its log-softmax and softmax)."""


def zero_model_state_bytes(n_params: float, n_gpus: int, stage: int, k: int = 12) -> float:
    """Rajbhandari et al. 2020 (ZeRO), section 5: model-state bytes per GPU with mixed-precision Adam.

    fp16 params (2) + fp16 grads (2) + K=12 optimizer bytes (fp32 master, m, v); stage 1 shards the
    optimizer states, 2 also the gradients, 3 also the parameters. FSDP2 with fp32 sharded params
    and fp32 reduce_dtype grads holds 4 + 4 + 8 = 16 bytes/param sharded: the stage-3 total.
    """
    psi, n = n_params, n_gpus
    return {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n,
            2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[stage]


@dataclass
class Memory:
    """Peak bytes per GPU, by what holds them."""

    sharded_state: float
    """fp32 params + fp32 grads + Adam m, v: 16 bytes per parameter of this TP rank / the FSDP
    shard degree (all data-parallel ranks; under HSDP only those of one node)."""
    gathered_params: float
    """Unsharded compute-dtype params (root + current and prefetched block with ZeRO-3; root +
    every block when blocks stay gathered) and one block's unsharded grads + fp32 reduce-scatter
    buffer, each the TP rank's part."""
    accumulated_grads: float
    """Unsharded fp32 grads kept across micro-batches when reducing once per step (no_sync)."""
    activations: float
    logits: float
    overhead: float
    """CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation."""

    @property
    def total(self) -> float:
        return (self.sharded_state + self.gathered_params + self.accumulated_grads
                + self.activations + self.logits + self.overhead)


def memory_per_gpu(shape: ModelShape, n_gpus: int, micro_batch: int, *,
                   activation_checkpointing: bool, dtype: str = "bfloat16",
                   grad_sync: str = "microbatch", micro_batches_per_rank: int = 1,
                   reshard_after_forward: bool = True,
                   context_bytes: float = CONTEXT_GIB * GiB, fragmentation: float = FRAGMENTATION,
                   tp: int = 1, dp_shard: int | None = None,
                   in_flight: float = 1.0, loss: str = "chunked",
                   software: Software = TRAINER) -> Memory:
    """Peak memory of one rank: FSDP2 (one unit per block, then the root) over the data-parallel
    ranks, on top of tensor parallelism of degree tp (Megatron-style with sequence parallelism).

    reshard_after_forward=True is ZeRO-3: a block's gathered params are freed after its forward
    and gathered again in backward. False (the trainer's `never`) keeps every block gathered from
    the first forward to the last backward of a step: + (L - 2) blocks in the compute dtype.
    dp_shard is FSDP2's shard degree: n_gpus / tp (every data-parallel rank), or under HSDP the
    data-parallel ranks of one node.

    A pipeline rank (cost_model/pipeline.py): `shape` holds its layers, `in_flight` micro-batches
    of them keep their activations at once, and `loss` says where the loss is: "chunked" (the
    whole model's, from the last hidden states: model/gpt.py), "whole" (the last stage's, on whole
    logits), "none" (not on this rank). Under tensor parallelism the loss is on whole logits.

    `software` holds the model state and says what a layer saves (software.py); the default is
    this trainer.
    """
    cfg, pb = shape.cfg, dtype_bytes(dtype)
    s, b, h, L = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_layer
    shards = dp_shard if dp_shard is not None else max(1, n_gpus // tp)
    sharded, gathered, accumulated = software.model_state_bytes(
        shape, tp, shards, pb, grad_sync=grad_sync, micro_batches_per_rank=micro_batches_per_rank,
        reshard_after_forward=reshard_after_forward)
    per_layer, residual = software.activation_bytes(cfg, b, tp, pb)
    if activation_checkpointing:
        # Each block keeps only its input (sequence-sharded under the trainer's TP); in
        # backward one block at a time is recomputed.
        acts = in_flight * L * residual + per_layer
    else:
        acts = in_flight * L * per_layer
    if loss != "none":
        # ln_f's input and the lm_head's input: under TP the first is of the residual stream and
        # the second the all-gathered whole, which the column-parallel lm_head keeps for its
        # weight gradient.
        acts += residual + pb * s * b * h
    if loss == "none":
        logits = 0.0
    elif tp > 1 or loss == "whole":  # the loss on whole fp32 logits: each TP rank its slice
        logits = LOGIT_BYTES * b * s * cfg.vocab_size / tp
    else:
        logits = (pb * b * s * cfg.vocab_size
                  + CHUNK_FP32_BYTES * min(b * s * cfg.vocab_size, LOSS_CHUNK_LOGITS))
    allocated = sharded + gathered + accumulated + acts + logits
    return Memory(sharded, gathered, accumulated, acts, logits,
                  context_bytes + fragmentation * allocated)

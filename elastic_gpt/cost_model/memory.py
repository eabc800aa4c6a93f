"""Memory per GPU: the model's shape as the planner sees it, and the bytes one rank holds at its
peak under FSDP2 (ZeRO-3 or blocks kept gathered) on top of tensor and sequence parallelism.

Parameter counts and FLOPs come from model/gpt.py. The byte counts per parameter follow
Rajbhandari et al. 2020 (ZeRO, section 5) for the model state and Korthikanti et al. 2022
(section 4.1, 4.2.2) for the activations, adapted to flash attention and to what DTensor keeps;
each function states its assumptions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_gpt.hardware import GiB
from elastic_gpt.model.gpt import LOSS_CHUNK_LOGITS, GPTConfig, count_params, flops_per_token

FP32 = 4
OPTIMIZER_BYTES_PER_PARAM = 16
"""fp32 sharded master params (4) + fp32 grads (4, reduce_dtype) + Adam m and v (4 + 4)."""
MEGATRON_2021_OPTIMIZER_BYTES_PER_PARAM = 12
"""Megatron-LM 2021's mixed-precision optimizer (`Float16OptimizerWithFloat16Params`): fp32
main params (4) + Adam m and v (4 + 4) beside the 16-bit params and grads. The fp32 copy of the
grads it makes for the step lives only in the step, after the activations are freed."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint holds fp32 params and both Adam moments; gradients are not saved."""
MEMORY_MARGIN = 0.10
"""Fraction of device memory left free on purpose (spikes, allocator rounding)."""
CONTEXT_GIB = 1.0
"""CUDA context, cuBLAS and NCCL workspaces, per GPU."""
FRAGMENTATION = 0.05
"""Allocator fragmentation, as a share of the bytes allocated."""
LOGIT_BYTES = 12
"""Under tensor parallelism (the vocab-parallel loss on whole logits): three fp32 B*T*V/tp buffers
are live at the loss's backward: log-softmax output, its gradient and the gradient w.r.t. the
logits (the bf16 logits themselves are freed after the fp32 cast)."""
CHUNK_FP32_BYTES = 12
"""Without tensor parallelism the loss is chunked (model/gpt.py `chunked_token_losses`): the
logits' gradient in the compute dtype over all B*T*V, plus the fp32 work of one chunk of
LOSS_CHUNK_LOGITS logits (the upcast, its log-softmax and softmax)."""

KERNEL_SETS = ("trainer", "megatron-2021")
"""Whose kernels: this trainer's (SDPA's flash attention; under tensor parallelism the layer
norms, dropouts and residual adds on the sequence shard, sequence parallelism), or Megatron-LM's
of 2021, which the published runs ran: QK^T and AV as batched matmuls around a softmax and a
dropout over the (b, a/t, s, s) scores (as Calculon's Megatron block models them), and the
layer norms, dropouts and residual adds over the whole sequence on every TP rank (sequence
parallelism came in 2022). The step (kernels.py) and the memory (`memory_per_gpu`) differ by
it."""


# ----------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class PartialGather:
    """ZeRO-3 as DeepSpeed runs it: parameters gathered module by module, at most `live_params`
    of them at once (its `stage3_max_live_parameters`), and gradients reduce-scattered in buckets
    of `reduce_bucket_params` (its `reduce_bucket_size`), where FSDP2 (this trainer) gathers and
    reduces a whole block at once. Only the memory held is modelled; the more, smaller
    collectives are not."""

    live_params: float
    reduce_bucket_params: float


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a GPTConfig, all derived from model/gpt.py's arithmetic."""

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
    partial_gather: PartialGather | None = None
    """None: ZeRO-3 gathers and reduces one block at a time (FSDP2's unit, this trainer's)."""

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


# ----------------------------------------------------------------------------- memory


def zero_model_state_bytes(n_params: float, n_gpus: int, stage: int, k: int = 12) -> float:
    """Rajbhandari et al. 2020 (ZeRO), section 5: model-state bytes per GPU with mixed-precision Adam.

    fp16 params (2) + fp16 grads (2) + K=12 optimizer bytes (fp32 master, m, v); stage 1 shards the
    optimizer states, 2 also the gradients, 3 also the parameters. FSDP2 with fp32 sharded params
    and fp32 reduce_dtype grads holds 4 + 4 + 8 = 16 bytes/param sharded: the stage-3 total.
    """
    psi, n = n_params, n_gpus
    return {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n,
            2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[stage]


def activation_bytes_per_layer(seq_len: int, micro_batch: int, n_embd: int, n_head: int, *,
                               act_bytes: int = 2, flash: bool = True,
                               dropout: bool = False, tp: int = 1,
                               sequence_parallel: bool = True) -> float:
    """Activations one transformer layer saves for backward (Korthikanti et al. 2022, section 4.1).

    Their count for 16-bit activations, no tensor parallelism, is s*b*h*(34 + 5*a*s/h) bytes:
    attention 11sbh + 5as^2b, MLP 19sbh, two LayerNorms 4sbh, where 2sbh of the 34 are the 1-byte
    dropout masks and 5as^2b is the score matrix (softmax output 2, its dropout mask 1, dropout
    output 2). Adapted here: flash/SDPA attention stores no s*s scores, only the output (s*b*h, an
    extra tensor because the transpose to (B, T, C) copies it) and a fp32 log-sum-exp per row and
    head (4*a*s*b bytes); without dropout there are no masks.

    With tensor parallelism tp and sequence parallelism (their section 4.2.2: sbh(34/t + 5as/(ht)))
    every tensor is split tp ways except two: the inputs of c_attn and c_fc. They are the
    LayerNorm outputs all-gathered over the sequence, and autograd keeps the gathered tensor for
    the column-parallel weight's gradient (Megatron-LM keeps the shard and gathers it again in
    backward; DTensor's ColwiseParallel does not), so they stay whole.

    Without sequence parallelism (Megatron-LM 2021, their section 4.2.1: sbh(10 + 24/t +
    5as/(ht))) the LayerNorms' inputs and the two dropout masks are whole on every TP rank too.
    """
    s, b, h, a = seq_len, micro_batch, n_embd, n_head
    whole = 2  # c_attn's and c_fc's inputs (the gathered LayerNorm outputs under TP)
    split = (2 + 1  # attention: q and k, v ...
             + 1  # ... and c_proj's input
             + 4 + 4)  # MLP: GELU input, c_proj input
    norms = 2  # ln_1 and ln_2 inputs (the residual stream): sequence-sharded, or whole
    if sequence_parallel:
        split += norms
    else:
        whole += norms
    total = (whole + split / tp) * s * b * h * act_bytes
    if dropout:  # 1-byte masks after attention c_proj and after the MLP
        total += 2 * s * b * h / (tp if sequence_parallel else 1)
    if flash:
        total += (act_bytes * s * b * h + FP32 * a * s * b) / tp  # SDPA output + log-sum-exp
    else:
        total += (5 if dropout else 2) * a * s * s * b / tp  # 2-byte scores (+ mask + dropped copy)
    return total


@dataclass
class Memory:
    """Peak bytes per GPU, by what holds them."""

    sharded_state: float
    """fp32 params + fp32 grads + Adam m, v: 16 bytes per parameter of this TP rank / the FSDP
    shard degree (all data-parallel ranks; under HSDP only those of one node). Megatron-LM 2021's
    replicas: fp32 params + Adam m, v, 12 bytes per parameter of the rank's part."""
    gathered_params: float
    """Unsharded compute-dtype params (root + current and prefetched block with ZeRO-3; root +
    every block when blocks stay gathered) and one block's unsharded grads + fp32 reduce-scatter
    buffer, each the TP rank's part. Megatron-LM 2021's replicas: the part's 16-bit params and
    grads."""
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
                   replicated: bool = False, kernel_set: str = "trainer") -> Memory:
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

    replicated: Megatron-LM 2021's data parallelism (step_time.py `DATA_PARALLEL`): the rank
    holds its part whole, 16-bit params and grads and the optimizer's
    `MEGATRON_2021_OPTIMIZER_BYTES_PER_PARAM`, and nothing gathered or accumulated apart.

    kernel_set (`KERNEL_SETS`): this trainer's flash attention and sequence
    parallelism, or Megatron-LM 2021's materialised scores and whole tensors on every TP rank:
    its checkpoint keeps each block's input whole (mpu/random.py `CheckpointFunction` splits it
    over the TP ranks only with `--distribute-checkpointed-activations`, off by default and in
    the GPT-3 example script, at a8d172b3).
    """
    cfg, pb = shape.cfg, dtype_bytes(dtype)
    s, b, h, L = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_layer
    shards = dp_shard if dp_shard is not None else max(1, n_gpus // tp)
    sharded = OPTIMIZER_BYTES_PER_PARAM * shape.local_params(tp) / shards
    # The root stays gathered through forward and backward (FSDP2 never reshards the root after
    # forward) and its grads (wte is tied, so from the lm_head on) live until the end of backward.
    # Blocks: current + prefetched params (ZeRO-3) or all L of them (kept gathered), plus in
    # backward one block's grads in compute dtype and their fp32 copy in the reduce-scatter buffer.
    held_blocks = min(2, L) if reshard_after_forward else L
    block = shape.block_local(tp)
    held_params, reduced_params = held_blocks * block, block
    if reshard_after_forward and shape.partial_gather is not None:
        held_params = min(held_params, shape.partial_gather.live_params)
        reduced_params = min(block, shape.partial_gather.reduce_bucket_params)
    gathered = (shape.root_local(tp) * (pb + pb + FP32)
                + held_params * pb + reduced_params * (pb + FP32))
    accumulated = (FP32 * shape.local_params(tp)
                   if grad_sync == "step" and micro_batches_per_rank > 1 else 0.0)
    if replicated:
        sharded = MEGATRON_2021_OPTIMIZER_BYTES_PER_PARAM * shape.local_params(tp)
        gathered, accumulated = 2 * pb * shape.local_params(tp), 0.0
    if kernel_set not in KERNEL_SETS:
        raise ValueError(f"kernel_set={kernel_set!r} must be one of {', '.join(KERNEL_SETS)}")
    trainer = kernel_set == "trainer"
    per_layer = activation_bytes_per_layer(s, b, h, cfg.n_head, act_bytes=pb, flash=trainer,
                                           dropout=cfg.dropout > 0, tp=tp,
                                           sequence_parallel=trainer)
    residual = pb * s * b * h / (tp if trainer else 1)  # a (b, s, h) of the residual stream
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


def dtype_bytes(dtype: str) -> int:
    # float8 (`train.float8`) computes the blocks' matmuls in float8 but keeps activations,
    # gradients and the rest in bfloat16
    sizes = {"bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4, "float8": 2}
    if dtype not in sizes:
        raise ValueError(f"dtype={dtype!r} must be bfloat16, float8 or float32")
    return sizes[dtype]

"""`elastic-gpt plan`: memory, communication, step time, goodput and cost of a run, before renting it.

Every model here is first-order arithmetic with its assumptions stated next to it (and in
docs/planner.md). Shapes and FLOPs come from model/gpt.py; GPU figures from hardware.py.

Units: bytes, seconds, FLOP/s; GB/s = 1e9 bytes/s; GiB = 2**30 bytes (GPU memory is reported so).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from dataclasses import dataclass, field

import yaml

from elastic_gpt.arguments import (
    fraction,
    margin,
    non_negative_float,
    positive_float,
    positive_int,
    write_output_file,
)
from elastic_gpt.config import ElasticSection
from elastic_gpt.data.order import BatchPlan
from elastic_gpt.hardware import GPU, GPUS, PRICES_AS_OF, GiB, get_gpu, load_overrides
from elastic_gpt.model.gpt import PRESETS, GPTConfig, count_params, flops_per_token, preset_config
from elastic_gpt.parallel.tp_rules import model_problem, nodes_problem, workers_problem

GB = 1e9
HOUR = 3600.0
DAY = 86400.0
FP32 = 4
OPTIMIZER_BYTES_PER_PARAM = 16
"""fp32 sharded master params (4) + fp32 grads (4, reduce_dtype) + Adam m and v (4 + 4)."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint holds fp32 params and both Adam moments; gradients are not saved."""
LOGIT_BYTES = 12
"""Three fp32 B*T*V buffers are live at the loss's backward: log-softmax output, its gradient and
the gradient w.r.t. the logits (the bf16 logits themselves are freed after the fp32 cast)."""


# ----------------------------------------------------------------------------- model shape


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
        return 2 * self.cfg.n_embd  # ln_f, whose gradient is a partial sum like ln_1's

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
                               dropout: bool = False, tp: int = 1) -> float:
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
    """
    s, b, h, a = seq_len, micro_batch, n_embd, n_head
    whole = 2  # c_attn's and c_fc's inputs (the gathered LayerNorm outputs under TP)
    split = (2 + 1  # attention: q and k, v ...
             + 1  # ... and c_proj's input
             + 4 + 4  # MLP: GELU input, c_proj input
             + 2)  # ln_1 and ln_2 inputs (the residual stream)
    total = (whole + split / tp) * s * b * h * act_bytes
    if dropout:  # 1-byte masks after attention c_proj and after the MLP
        total += 2 * s * b * h / tp
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
                   context_bytes: float = 1.0 * GiB, fragmentation: float = 0.05,
                   flash: bool = True, tp: int = 1, dp_shard: int | None = None) -> Memory:
    """Peak memory of one rank: FSDP2 (one unit per block, then the root) over the data-parallel
    ranks, on top of tensor parallelism of degree tp (Megatron-style with sequence parallelism).

    reshard_after_forward=True is ZeRO-3: a block's gathered params are freed after its forward
    and gathered again in backward. False (the trainer's `never`) keeps every block gathered from
    the first forward to the last backward of a step: + (L - 2) blocks in the compute dtype.
    dp_shard is FSDP2's shard degree: n_gpus / tp (every data-parallel rank), or under HSDP the
    data-parallel ranks of one node.
    """
    cfg, pb = shape.cfg, _dtype_bytes(dtype)
    s, b, h, L = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_layer
    shards = dp_shard if dp_shard is not None else max(1, n_gpus // tp)
    sharded = OPTIMIZER_BYTES_PER_PARAM * shape.local_params(tp) / shards
    # The root stays gathered through forward and backward (FSDP2 never reshards the root after
    # forward) and its grads (wte is tied, so from the lm_head on) live until the end of backward.
    # Blocks: current + prefetched params (ZeRO-3) or all L of them (kept gathered), plus in
    # backward one block's grads in compute dtype and their fp32 copy in the reduce-scatter buffer.
    held_blocks = min(2, L) if reshard_after_forward else L
    gathered = (shape.root_local(tp) * (pb + pb + FP32)
                + shape.block_local(tp) * (held_blocks * pb + pb + FP32))
    accumulated = (FP32 * shape.local_params(tp)
                   if grad_sync == "step" and micro_batches_per_rank > 1 else 0.0)
    per_layer = activation_bytes_per_layer(s, b, h, cfg.n_head, act_bytes=pb, flash=flash,
                                           dropout=cfg.dropout > 0, tp=tp)
    if activation_checkpointing:
        # Each block keeps only its input (sequence-sharded under TP); in backward one block at a
        # time is recomputed.
        acts = L * pb * s * b * h / tp + per_layer
    else:
        acts = L * per_layer
    # ln_f's input and the lm_head's input: under TP the first is sequence-sharded and the second
    # the all-gathered whole, which the column-parallel lm_head keeps for its weight gradient.
    acts += pb * s * b * h * (1 / tp + 1)
    logits = LOGIT_BYTES * b * s * cfg.vocab_size / tp  # vocab-parallel loss: each rank its slice
    allocated = sharded + gathered + accumulated + acts + logits
    return Memory(sharded, gathered, accumulated, acts, logits,
                  context_bytes + fragmentation * allocated)


def _dtype_bytes(dtype: str) -> int:
    sizes = {"bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4}
    if dtype not in sizes:
        raise ValueError(f"dtype={dtype!r} must be bfloat16 or float32")
    return sizes[dtype]


# ----------------------------------------------------------------------------- communication


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra_node_gbps: float
    """NCCL bus bandwidth inside a node, GB/s."""
    inter_node_gbps: float
    """NCCL bus bandwidth between nodes: the node's aggregate NIC bandwidth, GB/s."""
    latency_s: float = 20e-6
    """Fixed cost per collective (launch + ring latency), seconds."""

    def nodes(self, n_gpus: int) -> int:
        return -(-n_gpus // self.gpus_per_node)

    def bus_gbps(self, n_gpus: int) -> float:
        """A ring spanning nodes moves every byte through each node's NICs: the slower link
        bounds it, so across nodes the inter-node bandwidth is the bottleneck."""
        if self.nodes(n_gpus) == 1:
            return self.intra_node_gbps
        return min(self.intra_node_gbps, self.inter_node_gbps)

    def collective_s(self, full_bytes: float, n_gpus: int) -> float:
        """All-gather or reduce-scatter of a `full_bytes` tensor: each rank sends and receives
        (N-1)/N of it (ring algorithm)."""
        if n_gpus <= 1:
            return 0.0
        return ring_bytes(full_bytes, n_gpus) / (self.bus_gbps(n_gpus) * GB) + self.latency_s

    def ring_s(self, bytes_per_gpu: float, *, across_nodes: bool, nic_sharing: int = 1) -> float:
        """A ring collective in which each member sends `bytes_per_gpu`.

        Inside a node every GPU has its own NVLink/PCIe bandwidth. A ring across nodes pushes
        each member's bytes through every node's NICs once, and the NICs are the node's: when
        `nic_sharing` such rings run at once with members on the same nodes (one per tensor-
        parallel rank for FSDP's data-parallel groups, one per GPU for HSDP's replicate groups),
        they share them. With nic_sharing=1 this is `collective_s`."""
        if bytes_per_gpu <= 0:
            return 0.0
        t = bytes_per_gpu / (self.intra_node_gbps * GB)
        if across_nodes:
            t = max(t, nic_sharing * bytes_per_gpu / (self.inter_node_gbps * GB))
        return t + self.latency_s


def ring_bytes(full_bytes: float, n_gpus: int) -> float:
    return (n_gpus - 1) / n_gpus * full_bytes


TP_DEGREES = (1, 2, 4, 8)
"""Tensor-parallel degrees the planner weighs: a TP group lives inside one node (8 GPUs)."""


@dataclass(frozen=True)
class Mesh:
    """How the GPUs are laid out: world = dp_replicate x dp_shard x tp, tp innermost (a TP group
    is consecutive ranks of one node). FSDP2 shards over dp_shard and, under HSDP, replicates
    over dp_replicate (one replica per node); the data-parallel degree is dp_replicate x dp_shard."""

    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    spans_nodes: bool = False
    """Whether the group spans more than one node (FSDP's groups then cross nodes unless HSDP)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def short(self) -> str:
        dp = f"HSDP {self.dp_shard}x{self.dp_replicate}" if self.hsdp else f"FSDP {self.dp}"
        return f"tp={self.tp} {dp}"

    def label(self) -> str:
        if self.hsdp:
            dp = (f"HSDP: FSDP over {self.dp_shard} in each node x {self.dp_replicate} replicas "
                  "across nodes")
        else:
            where = "across nodes" if self.spans_nodes else "in one node"
            dp = f"FSDP over {self.dp} {where}"
        return f"tp={self.tp} x dp={self.dp} ({dp})"


def make_mesh(n_gpus: int, tp: int = 1, hsdp: bool = False, gpus_per_node: int = 8) -> Mesh:
    """The mesh the trainer builds for n_gpus workers; hsdp on one node is plain FSDP."""
    spans = n_gpus > gpus_per_node
    if hsdp and spans:
        return Mesh(tp, gpus_per_node // tp, n_gpus // gpus_per_node, True)
    return Mesh(tp, n_gpus // tp, 1, spans)


@dataclass
class StepTime:
    compute_s: float
    """Kernel time at peak * efficiency, recomputation included."""
    comm_s: float
    """All FSDP collective time if none of it overlapped compute."""
    exposed_comm_s: float
    """The part of comm_s compute does not hide."""
    optimizer_s: float
    all_gather_bytes: float
    """FSDP2's, per GPU per step (bytes this rank sends; it receives as many)."""
    reduce_scatter_bytes: float
    all_reduce_bytes: float = 0.0
    """HSDP's gradient all-reduce across nodes, per GPU per step."""
    tp_comm_s: float = 0.0
    """Tensor-parallel collectives: on the critical path, none of it overlapped."""
    tp_bytes: float = 0.0
    """Tensor-parallel all-gathers, reduce-scatters and all-reduces, per GPU per step."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.tp_comm_s + self.optimizer_s

    @property
    def overlapped_fraction(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s else 1.0


@dataclass(frozen=True)
class TPTraffic:
    """Tensor-parallel collectives of one micro-batch and of one gradient sync, as DTensor runs
    the trainer's plan (Megatron-style TP with sequence parallelism): counts and bytes per GPU."""

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
    reduce-scattered to Shard(1) (wpe's is (1, s, h): the positions are shared by the batch), the
    lm_head all-gathers its input, and the vocab-parallel loss all-reduces three fp32 values per
    token (max, sum of exponentials, the target's logit); backward mirrors the three activations
    and the loss needs none. Per gradient sync, the LayerNorm gradients (partial sums over the
    sequence shards) are all-reduced and c_attn's bias gradient (this rank's heads) all-gathered,
    one collective per tensor."""
    if tp <= 1:
        return TPTraffic(0, 0, 0, 0.0, 0, 0.0)
    cfg, L = shape.cfg, shape.cfg.n_layer
    act = micro_batch * cfg.seq_len * cfg.n_embd
    pos = cfg.seq_len * cfg.n_embd
    ag_blk = 4 + (2 if activation_checkpointing else 0)
    rs_blk = 4 + (1 if activation_checkpointing else 0)
    ag = L * ag_blk + 3  # root: lm_head in forward, wte and wpe in backward
    rs = L * rs_blk + 3  # root: wte and wpe in forward, lm_head in backward
    ar = 3
    moved = ((L * (ag_blk + rs_blk) + 4) * ring_bytes(act_bytes * act, tp)
             + 2 * ring_bytes(act_bytes * pos, tp)
             + ar * 2 * ring_bytes(FP32 * micro_batch * cfg.seq_len, tp))
    norms = L * shape.block_norm_params + shape.root_replicated_params
    sync = (2 * ring_bytes(grad_bytes * norms, tp)
            + ring_bytes(grad_bytes * L * shape.block_fused_bias_params, tp))
    return TPTraffic(ag, rs, ar, moved, 4 * L + 2 + L, sync)


def step_time(shape: ModelShape, gpu: GPU, net: Network, n_gpus: int, micro_batch: int,
              micro_batches_per_rank: int, *, activation_checkpointing: bool,
              dtype: str = "bfloat16", grad_sync: str = "microbatch", efficiency: float = 0.6,
              reshard_after_forward: bool = True, tp: int = 1, hsdp: bool = False) -> StepTime:
    """One optimizer step on the slowest rank (the one with ceil(M / dp) micro-batches).

    Overlap (FSDP2's prefetching): the all-gather of block i+1 runs during block i's forward; in
    backward the gather of block i-1 and the reduce-scatter of block i+1 run during block i's
    backward. Exposed per block = max(0, comm - compute); the first gathers (root + block 0) of a
    micro-batch and the last reduce-scatters (block 0 + root) of a synced backward hide under
    nothing. Collectives share one network, so concurrent ones add up.

    reshard_after_forward=True (ZeRO-3): every micro-batch gathers root + L blocks in forward and
    L - 1 blocks again in backward (the last block is not resharded). False (the trainer's
    `never`, which also keeps the weights gathered between micro-batches): root + L blocks are
    gathered once per step, in the first micro-batch's forward, and never in backward.

    tp > 1: each rank computes 1/tp of every matmul; FSDP2 gathers and reduces the TP rank's part
    of each unit over the data-parallel ranks (tp such groups share a node's NICs); the TP
    collectives (`tp_traffic`) run on the intra-node link between the matmuls that need them, so
    they are on the critical path (none overlapped). hsdp: FSDP2's groups are the data-parallel
    ranks of one node, and each gradient sync adds an all-reduce of the reduce-scattered shard
    across nodes (every GPU of a node in its own replicate group: they share the NICs).
    """
    cfg, pb, L, k = shape.cfg, _dtype_bytes(dtype), shape.cfg.n_layer, micro_batches_per_rank
    mesh = make_mesh(n_gpus, tp, hsdp, net.gpus_per_node)
    flops_s = gpu.peak_flops * efficiency
    tokens = micro_batch * cfg.seq_len
    fwd_blk = shape.block_fwd_flops_per_token * tokens / tp / flops_s
    bwd_blk = (2 + activation_checkpointing) * fwd_blk
    head = 3 * shape.head_fwd_flops_per_token * tokens / tp / flops_s
    compute_mb = L * (fwd_blk + bwd_blk) + head

    shard_across = mesh.spans_nodes and not mesh.hsdp
    blk, root = shape.block_local(tp), shape.root_local(tp)

    def gather_s(elems: float) -> float:
        if mesh.dp_shard <= 1:
            return 0.0
        return net.ring_s(ring_bytes(pb * elems, mesh.dp_shard), across_nodes=shard_across,
                          nic_sharing=tp)

    def reduce_s(elems: float) -> float:  # reduce-scatter, then (HSDP) all-reduce of the shard
        rs = 0.0 if mesh.dp_shard <= 1 else net.ring_s(
            ring_bytes(FP32 * elems, mesh.dp_shard), across_nodes=shard_across, nic_sharing=tp)
        ar = 0.0 if mesh.dp_replicate <= 1 else net.ring_s(
            2 * ring_bytes(FP32 * elems / mesh.dp_shard, mesh.dp_replicate), across_nodes=True,
            nic_sharing=mesh.dp_shard * tp)
        return rs + ar

    ag_blk, ag_root = gather_s(blk), gather_s(root)
    rs_blk, rs_root = reduce_s(blk), reduce_s(root)
    regathers = L - 1 if reshard_after_forward else 0  # the last block stays gathered

    def backward_exposed(sync: bool) -> tuple[float, float]:
        rs = rs_blk if sync else 0.0
        comm = regathers * ag_blk + (L * rs_blk + rs_root if sync else 0.0)
        per_block = (ag_blk if reshard_after_forward else 0.0) + rs
        exposed = (L - 1) * max(0.0, per_block - bwd_blk) + (rs_blk + rs_root if sync else 0.0)
        return comm, exposed

    fwd_comm = ag_root + L * ag_blk
    fwd_exposed = ag_root + ag_blk + (L - 1) * max(0.0, ag_blk - fwd_blk)
    n_fwd_gathers = k if reshard_after_forward else 1  # kept gathered: only the first micro-batch
    n_sync = k if grad_sync == "microbatch" else 1
    sync_comm, sync_exposed = backward_exposed(True)
    nosync_comm, nosync_exposed = backward_exposed(False)
    comm_s = n_fwd_gathers * fwd_comm + n_sync * sync_comm + (k - n_sync) * nosync_comm
    exposed_s = n_fwd_gathers * fwd_exposed + n_sync * sync_exposed + (k - n_sync) * nosync_exposed

    # FSDP2 accumulates unsharded grads in the reduce dtype (fp32) when it syncs once per step.
    accumulated = grad_sync == "step" and k > 1
    tpt = tp_traffic(shape, micro_batch, tp, activation_checkpointing=activation_checkpointing,
                     act_bytes=pb, grad_bytes=FP32 if accumulated else pb)
    tp_bytes = k * tpt.bytes_per_micro_batch + n_sync * tpt.bytes_per_sync
    n_tp = (k * (tpt.all_gathers + tpt.reduce_scatters + tpt.all_reduces)
            + n_sync * tpt.sync_collectives)
    tp_s = tp_bytes / (net.intra_node_gbps * GB) + n_tp * net.latency_s if tp > 1 else 0.0

    # Fused AdamW streams p, g, m, v in and p, m, v out (28 B/param) + the grad-norm read (4 B).
    local = shape.local_params(tp)
    optimizer_s = 32 * local / mesh.dp_shard / (0.7 * gpu.hbm_gbps * GB)
    gather_elems = n_fwd_gathers * (root + L * blk) + k * regathers * blk
    shard_bytes = FP32 * local / mesh.dp_shard
    return StepTime(compute_s=k * compute_mb, comm_s=comm_s, exposed_comm_s=exposed_s,
                    optimizer_s=optimizer_s,
                    all_gather_bytes=ring_bytes(pb * gather_elems, mesh.dp_shard),
                    reduce_scatter_bytes=n_sync * ring_bytes(FP32 * local, mesh.dp_shard),
                    all_reduce_bytes=(n_sync * 2 * ring_bytes(shard_bytes, mesh.dp_replicate)
                                      if mesh.hsdp else 0.0),
                    tp_comm_s=tp_s, tp_bytes=tp_bytes)


def time_to_train_s(tokens: float, flops_per_token_: float, n_gpus: int,
                    achieved_flops_per_gpu: float) -> float:
    """Narayanan et al. 2021, eq. (4): end-to-end time = tokens * FLOPs/token / (n * X).

    With FLOPs/token ~ 8P (6P + 2P for recomputation) this is their 8TP / (nX).
    """
    return tokens * flops_per_token_ / (n_gpus * achieved_flops_per_gpu)


# ----------------------------------------------------------------------------- goodput


def goodput(interval_s: float, ckpt_write_s: float, recovery_s: float, mtbf_s: float) -> float:
    """Fraction of wall time spent on work that is kept (first-order Young/Daly model).

    Each cycle trains for `interval_s` then blocks `ckpt_write_s` writing a checkpoint. Failures
    arrive at rate 1/mtbf_s; each costs `recovery_s` (restart + reload) plus, on average, half a
    cycle of lost work. Useful fraction = tau/(tau+delta) * (1 - (R + (tau+delta)/2) / M).
    """
    tau, delta = interval_s, ckpt_write_s
    if tau <= 0:
        return 0.0
    return max(0.0, tau / (tau + delta) * (1.0 - (recovery_s + (tau + delta) / 2) / mtbf_s))


def young_interval_s(ckpt_write_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval that minimises first-order waste, sqrt(2 * delta * MTBF)."""
    return math.sqrt(2.0 * ckpt_write_s * mtbf_s)


def optimal_interval_s(ckpt_write_s: float, recovery_s: float, mtbf_s: float) -> float:
    """The exact maximiser of `goodput`: sqrt(2*delta*(M - R)) - delta (-> Young's when delta,
    R << M)."""
    return max(0.0, math.sqrt(2.0 * ckpt_write_s * max(mtbf_s - recovery_s, 0.0)) - ckpt_write_s)


@dataclass
class Reliability:
    mtbf_s: float
    """Cluster MTBF = per-node MTBF / nodes (independent, exponential node failures)."""
    ckpt_write_s: float
    recovery_s: float
    interval_s: float
    every_steps: int
    goodput: float
    young_interval_s: float
    best_goodput: float


def reliability(node_mtbf_h: float, nodes: int, ckpt_write_s: float, recovery_s: float,
                step_s: float, every_steps: int | None = None,
                max_steps: int | None = None) -> Reliability:
    mtbf = node_mtbf_h * HOUR / nodes
    young = young_interval_s(ckpt_write_s, mtbf)
    if every_steps is None:
        every_steps = max(1, round(young / step_s))
        if max_steps is not None:
            every_steps = min(every_steps, max_steps)
    interval = every_steps * step_s
    best = goodput(optimal_interval_s(ckpt_write_s, recovery_s, mtbf), ckpt_write_s, recovery_s,
                   mtbf)
    return Reliability(mtbf, ckpt_write_s, recovery_s, interval, every_steps,
                       goodput(interval, ckpt_write_s, recovery_s, mtbf), young, best)


# ----------------------------------------------------------------------------- replica groups


DEFAULT_HEARTBEAT_S = 2.0
"""The trainer's default `elastic.replica_heartbeat_timeout_s`."""
MIN_HEARTBEAT_S = 0.1
"""The smallest heartbeat timeout the trainer's config accepts."""
COLLECTIVE_TIMEOUT_S = ElasticSection.replica_collective_timeout_s
"""The trainer's default `elastic.replica_collective_timeout_s`: a lost node's group is dropped
after its heartbeat, and the survivors' step in flight with it gives up after this."""


def replica_goodput(interval_s: float, ckpt_write_s: float, mtbf_s: float, *, stall_s: float,
                    absent_s: float, n_groups: int, groups_lost: int = 1,
                    degraded_speed: float | None = None, fallback_mtbf_s: float = math.inf,
                    fallback_recovery_s: float = 0.0) -> float:
    """Fraction of wall time spent on kept work with `elastic.replica_groups: N` (first order, the
    same form as `goodput`).

    Each cycle trains `interval_s`, then blocks `ckpt_write_s` for the checkpoint the fallback
    needs. Group losses arrive at rate 1/mtbf_s (one per node failure); each costs every live
    group `stall_s` (the heartbeat timeout, the discarded step in flight, and the heal, during
    which the peer sending the state blocks its quorum), and while the lost `groups_lost` groups
    are away (`absent_s`: restart and checkpoint read) the run goes on at `degraded_speed` of its
    throughput (default (N - m) / N): (1 - speed) * absent_s of work per loss.

    The fallback is modelled, not ignored, as the restart path at one node's failure rate:
    losing the driver's node (it holds the Lighthouse and every group's run task) loses every
    group at once, so at rate 1/fallback_mtbf_s the run pays `fallback_recovery_s` plus half a
    cycle, as in `goodput`. The driver's node is counted on top of the training nodes (a head
    node); where it is one of them, its failures are counted twice, on the pessimistic side.
    Losing every group through overlapping failures needs N - 1 more within one group's absence
    (rate ~ 1/M * (absent_s / M)**(N - 1)): second order, ignored, as `goodput` ignores failures
    during a recovery.
    """
    tau, delta = interval_s, ckpt_write_s
    if tau <= 0:
        return 0.0
    if not 1 <= groups_lost < n_groups:
        raise ValueError(f"groups_lost={groups_lost} must be at least 1 and fewer than the "
                         f"n_groups={n_groups}: some group has to survive a failure")
    speed = (n_groups - groups_lost) / n_groups if degraded_speed is None else degraded_speed
    per_loss = stall_s + (1.0 - speed) * absent_s
    fallback = (fallback_recovery_s + (tau + delta) / 2) / fallback_mtbf_s
    return max(0.0, tau / (tau + delta) * (1.0 - per_loss / mtbf_s - fallback))


def cross_group_allreduce(shape: ModelShape, net: Network, group: Mesh, n_groups: int,
                          n_syncs: int, total_gpus: int) -> tuple[float, float]:
    """(bytes each GPU sends, seconds) per step for the average over the replica groups.

    torchft's all-reduce hook (parallel/replicate.py) averages every FSDP unit's reduce-scattered
    fp32 gradient shard, 4 * P_tp / dp_shard bytes per GPU in all, over the N groups at each
    gradient sync: a ring all-reduce, 2 (N-1)/N of it per GPU. Every GPU of a group is in its own
    ring (one per position in the group), so across nodes the rings of a node's GPUs share its
    NICs. One latency per unit (L blocks and the root) per sync.
    """
    if n_groups <= 1:
        return 0.0, 0.0
    shard = FP32 * shape.local_params(group.tp) / group.dp_shard
    per_sync = 2 * ring_bytes(shard, n_groups)
    sharing = min(group.world, net.gpus_per_node)
    seconds = net.ring_s(per_sync, across_nodes=total_gpus > net.gpus_per_node,
                         nic_sharing=sharing) + shape.cfg.n_layer * net.latency_s
    return n_syncs * per_sync, n_syncs * seconds


@dataclass
class ReplicaLayout:
    """`elastic.replica_groups: N`: N groups of `group_gpus` GPUs, each its own FSDP2 (and tp,
    and HSDP if it spans nodes) mesh holding the full sharded state, with the settings that
    fit a group; what does not depend on the market."""

    n_groups: int
    group_gpus: int
    candidate: LayoutCandidate
    """One group's mesh and settings (micro-batch, checkpointing, grad sync, resharding), its
    memory per GPU and its own step (FSDP2 and TP over group_gpus GPUs)."""
    groups_lost: int
    """Groups a node failure takes: 1 when a group is one or more whole nodes, else the groups
    sharing the node."""
    in_group_step_s: float
    """The step inside a group: candidate's, or with --achieved-tflops the measured one."""
    allreduce_bytes: float
    """Cross-group gradient all-reduce, per GPU per step."""
    allreduce_s: float
    """Counted as exposed: the hook's `dist.all_reduce` on torchft's managed process group waits
    for each unit's result before FSDP2's post-backward returns, so the rest of the backward does
    not run under it."""
    degraded_step_s: float
    """The step while groups_lost groups are away: the survivors take the whole global batch
    (more micro-batches per rank, C1's ceil included)."""
    ckpt_write_s: float
    """The leading group writes the whole checkpoint through its own nodes; the others wait for
    it at the next quorum. (torchft's join timeout, two heartbeats, may let them go on without it,
    which then rejoins by healing: not modelled, so long writes are counted pessimistically.)"""
    ckpt_read_s: float
    """A restarted group reads the newest checkpoint before it heals (the lost groups of one node
    read through that node)."""
    heal_bytes: float
    """Per GPU: its shard of fp32 params + Adam moments (12 B/param), from a live peer."""
    heal_s: float

    @property
    def mesh(self) -> Mesh:
        return self.candidate.mesh

    @property
    def memory(self) -> Memory:
        return self.candidate.memory

    @property
    def step_s(self) -> float:
        return self.in_group_step_s + self.allreduce_s

    @property
    def degraded_speed(self) -> float:
        """Throughput while groups are away, relative to all N."""
        return self.step_s / self.degraded_step_s


@dataclass
class ReplicaReliability:
    """A ReplicaLayout's goodput on one market (its node MTBF)."""

    layout: ReplicaLayout
    mtbf_s: float
    """Cluster MTBF: one group loss per node failure."""
    fallback_mtbf_s: float
    """The driver's node: losing it is the restart path."""
    stall_s: float
    """Per loss, every live group: the larger of the heartbeat and the collective timeout + the
    discarded step in flight + heal."""
    absent_s: float
    """Per loss, the lost groups: restart + checkpoint read (the heal is in stall_s)."""
    fallback_recovery_s: float
    interval_s: float
    every_steps: int
    young_interval_s: float
    goodput: float


def replica_reliability(layout: ReplicaLayout, node_mtbf_h: float, nodes: int,
                        heartbeat_s: float, restart_s: float, every_steps: int | None = None,
                        max_steps: int | None = None) -> ReplicaReliability:
    """Goodput of `layout` on a market. Per group loss the survivors stall until the Lighthouse
    drops the silent group (its heartbeat timeout: a node lost on a cloud goes silent, nothing
    refuses a connection) and their collective with it gives up (the collective timeout), plus
    the attempt in flight, whose work is discarded (it runs into the gone peer and is not
    committed): at most one step
    (half of one on average; the bound is counted). Its redo is not counted again: it is a step
    at the survivors' speed, which the absence term already charges. Then the heal: torchft's
    quorum is synchronous (use_async_quorum=False), so the peer sending the state is inside its
    quorum call until the copy is done, and the others wait for it at the step's first
    cross-group all-reduce. The lost group is away for its restart and its read of the newest
    checkpoint (it restores that, then heals to the live step).

    Checkpoints are for the fallback only, so their interval is Young's for the fallback's MTBF
    and the leading group's write time."""
    mtbf, fallback_mtbf = node_mtbf_h * HOUR / nodes, node_mtbf_h * HOUR
    step = layout.step_s
    young = young_interval_s(layout.ckpt_write_s, fallback_mtbf)
    if every_steps is None:
        every_steps = max(1, round(young / step))
        if max_steps is not None:
            every_steps = min(every_steps, max_steps)
    interval = every_steps * step
    stall = max(heartbeat_s, COLLECTIVE_TIMEOUT_S) + step + layout.heal_s
    absent = restart_s + layout.ckpt_read_s
    # every group restarts and reads at once, the groups of a node through it, as lost ones do
    fallback_recovery = restart_s + layout.ckpt_read_s
    g = replica_goodput(interval, layout.ckpt_write_s, mtbf, stall_s=stall, absent_s=absent,
                        n_groups=layout.n_groups, groups_lost=layout.groups_lost,
                        degraded_speed=layout.degraded_speed, fallback_mtbf_s=fallback_mtbf,
                        fallback_recovery_s=fallback_recovery)
    return ReplicaReliability(layout, mtbf, fallback_mtbf, stall, absent, fallback_recovery,
                              interval, every_steps, young, g)


def replica_groups_problem(n_groups: int, n_gpus: int, tp: int, gpus_per_node: int) -> str | None:
    """Why N groups cannot split these GPUs (one line), or None: the launcher's rule (N divides
    the workers into groups of whole TP groups) and the planner's, that groups line up with nodes
    (a group is whole nodes, or a node holds whole groups) and a node failure leaves a survivor."""
    if n_gpus <= gpus_per_node:
        return (f"--gpus={n_gpus} is one node: a node failure takes every replica group, so "
                "none is left to keep training")
    if n_groups < 2:
        return (f"--replica-groups={n_groups}: one group is the restart path with torchft's "
                "overhead; use 2 or more, or off")
    if n_gpus % n_groups or (n_gpus // n_groups) % tp:
        return (f"--replica-groups={n_groups} must divide --gpus={n_gpus} into groups of a "
                f"multiple of tp={tp} GPUs (the launcher's rule)")
    g = n_gpus // n_groups
    if g % gpus_per_node and gpus_per_node % g:
        return (f"--replica-groups={n_groups} gives groups of {g} GPUs, which straddle the "
                f"{gpus_per_node}-GPU nodes: one node failure would take two groups")
    return None


def _replica_layouts(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, G: int,
                     usable: float, ckpt_bytes: float) -> tuple[list[ReplicaLayout], list[str]]:
    """Every N whose groups fit, each with the fastest settings that fit a group (steady state
    and while a group is away), searched as for the whole mesh over the group's own tp x HSDP x
    micro-batch x checkpointing x grad sync x resharding (what is forced stays forced); and why
    the others are not offered (one line for all that do not fit, naming the closest miss; N
    that do not line up with nodes are left out). With a measured throughput (--achieved-tflops)
    the in-group step is the measured one: per GPU a group does the whole mesh's work."""
    gpn, W = net.gpus_per_node, p.n_gpus
    forced = isinstance(p.replica_groups, int)
    if p.replica_groups == "off":
        return [], ["replica groups, by --replica-groups off"]
    if W <= gpn and not forced:
        return [], ["replica groups on one node: a node failure takes every group"]
    ns = [p.replica_groups] if forced else [n for n in range(2, W + 1) if W % n == 0]
    layouts, why_not, too_big = [], [], []
    for n in ns:
        problem = replica_groups_problem(n, W, p.tp or 1, gpn)
        if problem and forced:
            raise PlanError(problem)
        if problem:
            continue
        g = W // n
        lost = max(1, gpn // g)
        try:
            meshes = _meshes(dataclasses.replace(p, n_gpus=g), shape.cfg, net, g)
        except PlanError as e:  # a forced tp or HSDP the group's size cannot take
            if forced:
                raise PlanError(f"--replica-groups={n} gives groups of {g} GPUs: {e}") from None
            continue
        best = _fastest_group_settings(p, shape, gpu, net, meshes, n, lost, G, usable)
        if best is None:
            floors = [_mesh_floor_memory(p, shape, m).total for m in meshes]
            too_big.append((n, g, min(floors, default=math.inf)))
            continue
        c, k_away, ar_bytes, ar_s = best
        mesh, steady_s = c.mesh, c.step.step_s
        if p.achieved_flops_per_gpu:
            hw_fpt = training_flops_per_token(shape, c.activation_checkpointing)
            steady_s = time_to_train_s(G * shape.cfg.seq_len, hw_fpt, W,
                                       p.achieved_flops_per_gpu)
            away_s = steady_s * k_away / c.micro_batches_per_rank
        else:
            away_s = step_time(shape, gpu, net, g, c.micro_batch, k_away,
                               activation_checkpointing=c.activation_checkpointing,
                               dtype=p.dtype, grad_sync=c.grad_sync, efficiency=p.efficiency,
                               reshard_after_forward=c.reshard_after_forward, tp=c.tp,
                               hsdp=c.hsdp).step_s
        _, ar_away_s = cross_group_allreduce(shape, net, mesh, n - lost,
                                             _syncs(c.grad_sync, k_away), W)
        group_nodes = net.nodes(g)
        # A given --ckpt-write-s is for every node writing its part: one group's nodes write all
        write_s = (p.ckpt_write_s * net.nodes(W) / group_nodes if p.ckpt_write_s is not None
                   else ckpt_bytes / (group_nodes * p.ckpt_gbps * GB))
        read_s = lost * ckpt_bytes / (group_nodes * p.ckpt_gbps * GB)
        heal_bytes = CHECKPOINT_BYTES_PER_PARAM * shape.local_params(mesh.tp) / mesh.dp_shard
        # the peer's node sends, the new node receives: every GPU's shard through its NICs
        heal_s = max(heal_bytes / (net.intra_node_gbps * GB),
                     min(g, gpn) * heal_bytes / (net.inter_node_gbps * GB)) + net.latency_s
        layouts.append(ReplicaLayout(
            n_groups=n, group_gpus=g, candidate=c, groups_lost=lost, in_group_step_s=steady_s,
            allreduce_bytes=ar_bytes, allreduce_s=ar_s, degraded_step_s=away_s + ar_away_s,
            ckpt_write_s=write_s, ckpt_read_s=read_s, heal_bytes=heal_bytes, heal_s=heal_s))
    if too_big:
        # the fewest groups that do not fit are the largest groups that do not: the closest miss
        n, g, need = too_big[0]
        size = (f"groups of {g} GPU{'s' if g > 1 else ''} need {need / GiB:.1f} GiB per GPU even "
                f"at micro-batch 1 with checkpointing, {usable / GiB:.1f} usable")
        if forced:
            raise PlanError(f"--replica-groups={n}: {size}; use fewer groups")
        why_not.append(f"N={', '.join(str(t[0]) for t in too_big)} "
                       f"{'do not' if len(too_big) > 1 else 'does not'} fit: at N={n} {size}"
                       + ("" if layouts else "; no group smaller than the whole cluster fits"))
    if not layouts and not why_not:
        why_not.append(f"no N splits {W} GPUs into groups of whole nodes (or whole groups per "
                       "node) of whole tensor-parallel groups")
    return layouts, why_not


def _syncs(grad_sync: str, micro_batches: int) -> int:
    """Gradient syncs per step: the cross-group all-reduce hook runs at each."""
    return micro_batches if grad_sync == "microbatch" else 1


def _fastest_group_settings(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network,
                            meshes: list[Mesh], n: int, lost: int, G: int, usable: float
                            ) -> tuple[LayoutCandidate, int, float, float] | None:
    """One group's fastest candidate of n, by its step plus the cross-group all-reduce (grad
    sync per step does it once), that also fits while `lost` groups are away (the survivors then
    run more micro-batches per rank, and with grad sync per step accumulate unsharded grads).
    Returns (candidate, micro-batches per rank while away, all-reduce bytes and seconds per
    step). C1 is over every group's data-parallel ranks: n x the group's."""
    ckpts = [False, True] if p.activation_checkpointing is None else [p.activation_checkpointing]
    syncs = ["microbatch", "step"] if p.grad_sync == "auto" else [p.grad_sync]
    best, best_key = None, None
    for mesh in meshes:
        for mb in _micro_batch_sizes(p, G, n * mesh.dp):
            k = BatchPlan(G, mb).slots(n * mesh.dp)
            k_away = BatchPlan(G, mb).slots((n - lost) * mesh.dp)
            for ckpt, sync, reshard in itertools.product(ckpts, syncs, _reshard_choices(p)):
                kw = dict(activation_checkpointing=ckpt, dtype=p.dtype, grad_sync=sync,
                          reshard_after_forward=reshard, context_bytes=p.context_gib * GiB,
                          fragmentation=p.fragmentation, tp=mesh.tp, dp_shard=mesh.dp_shard)
                mem = memory_per_gpu(shape, mesh.world, mb, micro_batches_per_rank=k, **kw)
                if mem.total > usable or memory_per_gpu(
                        shape, mesh.world, mb, micro_batches_per_rank=k_away, **kw).total > usable:
                    continue
                st = step_time(shape, gpu, net, mesh.world, mb, k, activation_checkpointing=ckpt,
                               dtype=p.dtype, grad_sync=sync, efficiency=p.efficiency,
                               reshard_after_forward=reshard, tp=mesh.tp, hsdp=mesh.hsdp)
                c = LayoutCandidate(mb, ckpt, sync, k, mem, st, reshard, mesh)
                ar_bytes, ar_s = cross_group_allreduce(shape, net, mesh, n, _syncs(sync, k),
                                                       p.n_gpus)
                key = (st.step_s + ar_s, *_choice_key(c)[1:])
                if best_key is None or key < best_key:
                    best, best_key = (c, k_away, ar_bytes, ar_s), key
    return best


@dataclass
class FaultTolerance:
    """The restart path against the best replica-group count on one market, by effective
    throughput (steady-state tokens/s x goodput): same GPUs, so also by wall time and cost."""

    market: str
    restart: Reliability
    restart_tokens_per_s: float
    replica: list[ReplicaReliability]
    """Every N that fits, highest effective throughput first."""
    tokens_per_step: int
    not_offered: list[str] = field(default_factory=list)
    """Why replica groups (or some N) are not weighed, one line each."""
    forced: bool = False
    """--replica-groups N: the written config uses N whatever the comparison says."""

    @property
    def best(self) -> ReplicaReliability | None:
        return self.replica[0] if self.replica else None

    @property
    def restart_effective(self) -> float:
        return self.restart_tokens_per_s * self.restart.goodput

    def replica_tokens_per_s(self, r: ReplicaReliability) -> float:
        return self.tokens_per_step / r.layout.step_s

    def replica_effective(self, r: ReplicaReliability) -> float:
        return self.replica_tokens_per_s(r) * r.goodput

    @property
    def use_replica_groups(self) -> bool:
        """Only when strictly better: the restart path needs neither torchft nor a Lighthouse."""
        b = self.best
        return b is not None and (self.forced
                                  or self.replica_effective(b) > self.restart_effective)

    def why(self) -> str:
        """One line: which mode, and the two losses that decided it."""
        b = self.best
        lost_restart = 1 - self.restart.goodput
        if b is None:
            return "restart path (not offered: " + "; ".join(self.not_offered[:1]) + ")"
        slower = b.layout.step_s * self.restart_tokens_per_s / self.tokens_per_step - 1
        ratio = self.replica_effective(b) / max(self.restart_effective, 1e-12)
        if self.use_replica_groups:
            mode = (f"replica groups (N={b.layout.n_groups}"
                    + (", as --replica-groups asks" if self.forced else "")
                    + f"), {ratio:.3f}x the restart path's effective throughput")
        elif ratio > 0:
            mode = (f"restart path, {1 / ratio:.3f}x replica groups' (N="
                    f"{b.layout.n_groups}) effective throughput")
        else:
            mode = f"restart path, where replica groups (N={b.layout.n_groups}) keep no goodput"
        restart_step = self.tokens_per_step / self.restart_tokens_per_s
        return (f"{mode}: the restart path loses {100 * lost_restart:.1f}% of wall time to "
                f"failures and checkpoints, replica groups {100 * (1 - b.goodput):.1f}%, at a "
                f"step time {100 * slower:+.1f}% (in the group "
                f"{b.layout.in_group_step_s - restart_step:+.3f} s, cross-group all-reduce "
                f"+{b.layout.allreduce_s:.3f} s)")


# ----------------------------------------------------------------------------- the plan


@dataclass
class PlanInputs:
    """Everything `plan_training` takes; the CLI fills it from flags."""

    model: str | GPTConfig = "gpt2-124m"
    """A preset name or a full GPTConfig."""
    seq_len: int | None = None
    """Override a preset's context length."""
    vocab_size: int | None = None
    gpu: str = "H100"
    n_gpus: int = 8
    global_batch_size: int | None = None
    """Sequences per step. None: GPT-3's batch for the size (`default_global_batch`)."""
    tokens: float | None = None
    """Training token budget. None: 20 tokens per parameter (Chinchilla)."""
    gpus_per_node: int | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    efficiency: float = 0.6
    """Achieved fraction of peak FLOP/s for the model's matmuls (big bf16 GEMMs reach 0.6-0.8)."""
    achieved_flops_per_gpu: float | None = None
    """Measured end-to-end hardware FLOP/s per GPU (recompute included, comm included): replaces
    the compute + communication model for step time (Narayanan et al. report 140e12 on A100)."""
    micro_batch_size: int | None = None
    activation_checkpointing: bool | None = None
    """None: pick the faster of on/off among what fits."""
    grad_sync: str = "auto"
    """microbatch: reduce-scatter every micro-batch; step: once per step (no_sync, holds unsharded
    fp32 grads); auto: the faster that fits."""
    reshard_after_forward: str = "auto"
    """always: ZeRO-3, blocks re-gathered in backward and every micro-batch; never: every block
    stays gathered for the whole step (one all-gather per block per step, L blocks in memory);
    auto: the faster that fits."""
    tp: int | None = None
    """Tensor-parallel degree (1, 2, 4 or 8; inside one node). None: the fastest that fits."""
    hsdp: str = "auto"
    """on: FSDP2 shards within a node and replicates across nodes; off: shards over every
    data-parallel rank; auto: the faster that fits."""
    dtype: str = "bfloat16"
    memory_margin: float = 0.10
    """Fraction of GPU memory left free on purpose (spikes, allocator rounding)."""
    context_gib: float = 1.0
    fragmentation: float = 0.05
    on_demand_usd: float | None = None
    spot_usd: float | None = None
    hardware: dict[str, GPU] = field(default_factory=lambda: dict(GPUS))
    node_mtbf_h: float = 6000.0
    """On-demand node MTBF: Llama 3's 419 interruptions in 54 days on 2048 8-GPU nodes."""
    spot_node_mtbf_h: float = 200.0
    """Spot node time-to-preemption; AWS's '>20%/month' band is 3600 h, scarce GPUs see far less."""
    ckpt_write_s: float | None = None
    """Blocking checkpoint time. None: checkpoint bytes / (nodes * ckpt_gbps)."""
    ckpt_gbps: float = 2.0
    """Write/read bandwidth to checkpoint storage per node, GB/s."""
    restart_s: float = 90.0
    """Restart after a failure before reloading (Ray Train's defaults: over a minute, docs/design.md)."""
    ckpt_every_steps: int | None = None
    market: str = "spot"
    """Which price/MTBF the written config's checkpoint interval (and fault-tolerance mode) is
    tuned for: spot or on-demand."""
    min_workers: int | None = None
    replica_groups: str | int = "auto"
    """auto: weigh every replica-group count N against the restart path and write the better;
    off: the restart path only; N: plan and write N groups."""
    replica_heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_S
    """What the written elastic.replica_heartbeat_timeout_s will be: each group loss stalls the
    survivors this long."""


@dataclass
class LayoutCandidate:
    """One layout the planner weighs: micro-batch, checkpointing, gradient sync and resharding,
    with the memory and step time it predicts for them."""
    micro_batch: int
    activation_checkpointing: bool
    grad_sync: str
    micro_batches_per_rank: int
    memory: Memory
    step: StepTime
    reshard_after_forward: bool = True
    """True: ZeRO-3 (the trainer's `always`); False: blocks stay gathered (`never`)."""
    mesh: Mesh = field(default_factory=Mesh)
    """Tensor parallelism and how FSDP2 spreads over the data-parallel ranks."""

    @property
    def reshard_policy(self) -> str:
        """The value of the trainer's `train.reshard_after_forward` that runs this candidate."""
        return "always" if self.reshard_after_forward else "never"

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def hsdp(self) -> bool:
        return self.mesh.hsdp

    def settings(self) -> str:
        return (f"micro-batch {self.micro_batch}, checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}, grads per {self.grad_sync}, "
                f"reshard {self.reshard_policy}")


@dataclass
class Plan:
    model_name: str
    cfg: GPTConfig
    shape: ModelShape
    gpu: GPU
    n_gpus: int
    nodes: int
    global_batch_size: int
    tokens: float
    usable_bytes: float
    chosen: LayoutCandidate
    max_micro_batch: dict[bool, int]
    """Largest micro-batch that fits, keyed by activation checkpointing."""
    memory_at_chosen: dict[bool, Memory]
    """Memory at the chosen micro-batch with checkpointing off (False) and on (True)."""
    step_s: float
    tokens_per_s: float
    mfu: float
    max_steps: int
    time_to_train_s: float
    on_demand: Reliability
    spot: Reliability
    on_demand_usd: float
    spot_usd: float
    lr: float
    warmup_steps: int
    min_workers: int
    dtype: str
    market: str
    achieved_flops_per_gpu: float | None = None
    notes: list[str] = field(default_factory=list)
    layouts: list[tuple[Mesh, LayoutCandidate | None, Memory]] = field(default_factory=list)
    """Each mesh weighed: its fastest fitting candidate (None: nothing fits) and its smallest
    footprint (micro-batch 1, checkpointing, ZeRO-3)."""
    fault_tolerance_by_market: dict[str, FaultTolerance] = field(default_factory=dict)
    """The restart path against replica groups, keyed by "on-demand" and "spot"."""
    replica_heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_S

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """The market the config is written for."""
        return self.fault_tolerance_by_market[self.market]

    @property
    def chosen_replica_groups(self) -> ReplicaReliability | None:
        """The replica groups the written config asks for, or None: the restart path."""
        ft = self.fault_tolerance_by_market.get(self.market)
        return ft.best if ft is not None and ft.use_replica_groups else None

    @property
    def runner_up(self) -> LayoutCandidate | None:
        """The fastest fitting candidate of another mesh than the chosen one."""
        others = [c for m, c, _ in self.layouts if c is not None and m != self.chosen.mesh]
        return min(others, key=_choice_key, default=None)

    @property
    def reliability(self) -> Reliability:
        """The market the config is written for."""
        return self.spot if self.market == "spot" else self.on_demand

    def cost_usd(self, spot: bool) -> float:
        """Wall time (compute time / goodput) * GPUs * price."""
        rel, price = (self.spot, self.spot_usd) if spot else (self.on_demand, self.on_demand_usd)
        wall_h = self.time_to_train_s / max(rel.goodput, 1e-9) / HOUR
        return wall_h * self.n_gpus * price


class PlanError(ValueError):
    """Bad planner input; the message says what would work instead."""


def resolve_model(model: str | GPTConfig, seq_len: int | None = None,
                  vocab_size: int | None = None) -> tuple[str, GPTConfig]:
    if isinstance(model, GPTConfig):
        return "custom", model
    return model, preset_config(model, seq_len=seq_len, vocab_size=vocab_size)


def plan_training(inputs: PlanInputs) -> Plan:
    p = inputs
    name, cfg = resolve_model(p.model, p.seq_len, p.vocab_size)
    if p.market not in ("spot", "on-demand"):
        raise PlanError(f"--market={p.market!r} must be spot or on-demand")
    shape = model_shape(cfg)
    gpu = get_gpu(p.gpu, p.hardware)
    net = _network(p, gpu)
    if p.n_gpus < 1:
        raise PlanError(f"--gpus={p.n_gpus} must be at least 1")
    if not 0 < p.efficiency <= 1:
        raise PlanError(f"--efficiency={p.efficiency} must be in (0, 1]")
    if p.replica_groups not in ("auto", "off") and not isinstance(p.replica_groups, int):
        raise PlanError(f"--replica-groups={p.replica_groups!r} must be auto, off or a count")
    if not p.replica_heartbeat_timeout_s >= MIN_HEARTBEAT_S:
        raise PlanError(f"--replica-heartbeat-timeout-s={p.replica_heartbeat_timeout_s} must be "
                        f"at least {MIN_HEARTBEAT_S} (the trainer's config refuses less)")
    G = p.global_batch_size or default_global_batch(shape)
    meshes = _meshes(p, cfg, net, p.n_gpus)
    if G < min(m.dp for m in meshes):
        dp = min(m.dp for m in meshes)
        raise PlanError(f"--global-batch-size={G} gives fewer sequences than the {dp} "
                        f"data-parallel ranks of {p.n_gpus} GPUs: every rank needs a micro-batch; "
                        f"use a global batch >= {dp}")
    tokens = p.tokens or 20.0 * shape.params
    usable = gpu.memory_bytes * (1 - p.memory_margin)

    candidates = _candidates(p, shape, gpu, net, meshes, G)
    fitting = [c for c in candidates if c.memory.total <= usable]
    if not fitting:
        raise PlanError(_what_would_fit(p, name, shape, gpu, net, G))
    chosen = min(fitting, key=_choice_key)
    if p.achieved_flops_per_gpu:  # measured throughput: in the modelled-fastest mesh, the
        # largest micro-batch that fits (then the modelled-faster grad sync and resharding: the
        # measured figure does not say)
        chosen = max((c for c in fitting if c.mesh == chosen.mesh),
                     key=lambda c: (c.micro_batch, not c.activation_checkpointing,
                                    -c.step.step_s, -c.memory.total))
    layouts = []
    for mesh in meshes:
        mine = [c for c in fitting if c.mesh == mesh]
        layouts.append((mesh, min(mine, key=_choice_key, default=None),
                        _mesh_floor_memory(p, shape, mesh)))

    max_mb = {ckpt: max((c.micro_batch for c in fitting if c.activation_checkpointing == ckpt
                         and c.mesh == chosen.mesh), default=0) for ckpt in (False, True)}
    at_mb = {ckpt: memory_per_gpu(shape, p.n_gpus, chosen.micro_batch,
                                  activation_checkpointing=ckpt, dtype=p.dtype,
                                  grad_sync=chosen.grad_sync,
                                  micro_batches_per_rank=chosen.micro_batches_per_rank,
                                  reshard_after_forward=chosen.reshard_after_forward,
                                  context_bytes=p.context_gib * GiB,
                                  fragmentation=p.fragmentation, tp=chosen.tp,
                                  dp_shard=chosen.mesh.dp_shard) for ckpt in (False, True)}

    tokens_per_step = G * cfg.seq_len
    if p.achieved_flops_per_gpu:
        hw_fpt = training_flops_per_token(shape, chosen.activation_checkpointing)
        step_s = time_to_train_s(tokens_per_step, hw_fpt, p.n_gpus, p.achieved_flops_per_gpu)
    else:
        step_s = chosen.step.step_s
    tokens_per_s = tokens_per_step / step_s
    mfu = shape.model_flops_per_token * tokens_per_s / (p.n_gpus * gpu.peak_flops)
    max_steps = math.ceil(tokens / tokens_per_step)

    nodes = net.nodes(p.n_gpus)
    ckpt_bytes = CHECKPOINT_BYTES_PER_PARAM * shape.params
    io_s = ckpt_bytes / (nodes * p.ckpt_gbps * GB)
    write_s = p.ckpt_write_s if p.ckpt_write_s is not None else io_s
    recovery_s = p.restart_s + io_s
    on_demand = reliability(p.node_mtbf_h, nodes, write_s, recovery_s, step_s,
                            p.ckpt_every_steps, max_steps)
    spot = reliability(p.spot_node_mtbf_h, nodes, write_s, recovery_s, step_s,
                       p.ckpt_every_steps, max_steps)
    replica_layouts, not_offered = _replica_layouts(p, shape, gpu, net, G, usable, ckpt_bytes)
    fault_tolerance = {}
    for market, restart, node_mtbf_h in (("on-demand", on_demand, p.node_mtbf_h),
                                         ("spot", spot, p.spot_node_mtbf_h)):
        ft = FaultTolerance(market, restart, tokens_per_s, [], tokens_per_step,
                            list(not_offered), forced=isinstance(p.replica_groups, int))
        ft.replica = sorted((replica_reliability(lay, node_mtbf_h, nodes,
                                                 p.replica_heartbeat_timeout_s, p.restart_s,
                                                 p.ckpt_every_steps, max_steps)
                             for lay in replica_layouts),
                            key=lambda r, ft=ft: (-ft.replica_effective(r), r.layout.n_groups))
        fault_tolerance[market] = ft

    notes = []
    if name != "custom" and shape.params < 10e6:
        notes.append("a model this small is dominated by kernel launches and latency on GPUs; "
                     "the step-time model is optimistic for it")
    if _dtype_bytes(p.dtype) == 4:
        notes.append("float32 matmuls run at TF32/FP32 rates, far below the bf16 peak the step "
                     "time assumes; use the memory figures, not the speed")
    if chosen.mesh.hsdp:
        notes.append(f"{nodes} nodes, HSDP: FSDP's all-gathers and reduce-scatters stay on the "
                     f"intra-node link; only the gradient all-reduce crosses nodes "
                     f"({net.inter_node_gbps:.0f} GB/s per node, shared by its "
                     f"{net.gpus_per_node} GPUs)")
    elif nodes > 1:
        notes.append(f"{nodes} nodes: FSDP's collectives run at the inter-node bandwidth "
                     f"({net.inter_node_gbps:.0f} GB/s per node"
                     + (f", shared by the node's {chosen.tp} data-parallel groups)"
                        if chosen.tp > 1 else ")"))
    kept = next((c for c in candidates if not c.reshard_after_forward and c.mesh == chosen.mesh
                 and (c.micro_batch, c.activation_checkpointing, c.grad_sync)
                 == (chosen.micro_batch, chosen.activation_checkpointing, chosen.grad_sync)), None)
    if chosen.reshard_after_forward and kept is not None and kept.memory.total > usable:
        saving = chosen.step.step_s - kept.step.step_s
        notes.append(f"reshard_after_forward=always (ZeRO-3): keeping every block gathered "
                     f"(never) would need {kept.memory.total / GiB:.1f} GiB per GPU, more than "
                     f"the {usable / GiB:.1f} usable"
                     + (f"; it would save {saving:.3f} s/step" if saving > 0
                        and not p.achieved_flops_per_gpu else ""))
    unwritable = ({"tp"} if chosen.tp > 1 else set()) | ({"hsdp"} if chosen.hsdp else set())
    unwritable -= trainer_parallel_keys()
    if unwritable:
        notes.append(f"this trainer's config has no parallel.{' or parallel.'.join(sorted(unwritable))}"
                     f": a written config cannot ask for {chosen.mesh.label()}; plan with --tp 1 "
                     "--hsdp off for what it runs today")
    if not p.achieved_flops_per_gpu:
        notes += _beyond_tp_and_fsdp(chosen)
    plan = Plan(
        model_name=name, cfg=cfg, shape=shape, gpu=gpu, n_gpus=p.n_gpus, nodes=nodes,
        global_batch_size=G, tokens=tokens, usable_bytes=usable, chosen=chosen,
        max_micro_batch=max_mb, memory_at_chosen=at_mb, step_s=step_s, tokens_per_s=tokens_per_s,
        mfu=mfu, max_steps=max_steps, time_to_train_s=max_steps * step_s, on_demand=on_demand,
        spot=spot,
        on_demand_usd=p.on_demand_usd if p.on_demand_usd is not None else gpu.on_demand_usd,
        spot_usd=p.spot_usd if p.spot_usd is not None else gpu.spot_usd,
        lr=default_lr(shape.params),
        warmup_steps=max(1, min(math.ceil(375e6 / tokens_per_step), max_steps // 10)),
        min_workers=p.min_workers or _min_workers(p, shape, chosen, usable, G, net),
        dtype=p.dtype, market=p.market, achieved_flops_per_gpu=p.achieved_flops_per_gpu,
        notes=notes, layouts=layouts, fault_tolerance_by_market=fault_tolerance,
        replica_heartbeat_timeout_s=p.replica_heartbeat_timeout_s)
    if plan.warmup_steps > max_steps:
        plan.warmup_steps = max_steps
    return plan


def _beyond_tp_and_fsdp(c: LayoutCandidate) -> list[str]:
    """Where FSDP's traffic across nodes, not compute, sets the step, what would: FSDP moves the
    TP rank's part of every weight (and gradient) through each node's NICs every step whatever
    the GPU count, so past this point more GPUs or more TP do not help. Pipeline parallelism
    gives each node only its stage's layers to gather and reduce: 1/pp of that traffic."""
    st = c.step
    if not c.mesh.spans_nodes or c.hsdp or st.exposed_comm_s < 0.25 * st.step_s:
        return []
    pp = next((n for n in (2, 4, 8, 16, 32, 64) if st.comm_s / n <= st.compute_s), 64)
    return [f"FSDP's exposed communication is {st.exposed_comm_s:.1f} s of the {st.step_s:.1f} s "
            f"step ({st.comm_s:.1f} s of collectives per step across nodes, against "
            f"{st.compute_s:.1f} s of compute): more GPUs shrink the compute, not that traffic. "
            f"Pipeline parallelism (not implemented) over {pp} stages would leave each node 1/{pp} "
            f"of the layers to gather and reduce, {st.comm_s / pp:.1f} s per step, under the "
            f"compute, at the cost of a pipeline bubble of (pp - 1) / micro-batches per pipeline"]


def _choice_key(c: LayoutCandidate) -> tuple:
    """Fastest step; ties (one GPU: no communication to save) go to the larger micro-batch, then
    the smaller footprint, then the simpler mesh."""
    return (c.step.step_s, -c.micro_batch, c.memory.total, c.tp, c.hsdp)


# GPT-3 (Brown et al. 2020, table 2.1): batch size in tokens by model size. 0.5M, 1M and 2M are
# 2^19, 2^20 and 2^21 tokens; 175B's 3.2M is 1536 sequences of 2048 (Megatron-LM's run too).
_GPT3_BATCH_TOKENS = [(125e6, 2**19), (350e6, 2**19), (760e6, 2**19), (1.3e9, 2**20),
                      (2.7e9, 2**20), (6.7e9, 2**21), (13e9, 2**21), (175e9, 1536 * 2048)]


def default_global_batch(shape: ModelShape) -> int:
    """GPT-3's batch for the size, in sequences of the model's seq_len: the table row nearest in
    log(params) (the paper's batch grows in steps, so no interpolation); 32 below 10M params."""
    if shape.params < 10e6:
        return 32
    _, batch_tokens = min(_GPT3_BATCH_TOKENS,
                          key=lambda row: abs(math.log(shape.params / row[0])))
    return max(1, round(batch_tokens / shape.cfg.seq_len))


# GPT-3 (Brown et al. 2020, table 2.1): peak learning rate by model size.
_GPT3_LR = [(125e6, 6e-4), (350e6, 3e-4), (760e6, 2.5e-4), (1.3e9, 2e-4), (2.7e9, 1.6e-4),
            (6.7e9, 1.2e-4), (13e9, 1e-4), (175e9, 0.6e-4)]


def default_lr(n_params: float) -> float:
    """GPT-3's learning rate for the size, log-linearly interpolated (clamped at the ends)."""
    pts = _GPT3_LR
    if n_params <= pts[0][0]:
        return pts[0][1]
    for (n0, lr0), (n1, lr1) in zip(pts, pts[1:]):
        if n_params <= n1:
            t = (math.log(n_params) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return float(f"{lr0 + t * (lr1 - lr0):.3g}")
    return pts[-1][1]


def _network(p: PlanInputs, gpu: GPU) -> Network:
    return Network(gpus_per_node=p.gpus_per_node or gpu.gpus_per_node,
                   intra_node_gbps=p.intra_node_gbps or gpu.intra_node_gbps,
                   inter_node_gbps=p.inter_node_gbps or gpu.inter_node_gbps)


def tp_problem(tp: int, cfg: GPTConfig, n_gpus: int, gpus_per_node: int) -> str | None:
    """Why `tp` cannot run this model on these GPUs (one line), or None."""
    if tp not in TP_DEGREES:  # the degrees the step-time model is made for
        return f"--tp={tp} must be one of {', '.join(map(str, TP_DEGREES))}"
    if tp > n_gpus:
        return f"--tp={tp} is more than the {n_gpus} GPUs (--gpus) of the run"
    return (model_problem(tp, n_head=cfg.n_head, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                          flag="--tp", candidates=TP_DEGREES)
            or nodes_problem(tp, [gpus_per_node], flag="--tp", what="GPUs", how="--gpus-per-node")
            or workers_problem(tp, {"--gpus": n_gpus}, flag="--tp"))


def _tp_choices(p: PlanInputs, cfg: GPTConfig, n_gpus: int, gpus_per_node: int) -> list[int]:
    if p.tp is not None:
        problem = tp_problem(p.tp, cfg, n_gpus, gpus_per_node)
        if problem:
            raise PlanError(problem)
        return [p.tp]
    return [t for t in TP_DEGREES if tp_problem(t, cfg, n_gpus, gpus_per_node) is None]


def _meshes(p: PlanInputs, cfg: GPTConfig, net: Network, n_gpus: int) -> list[Mesh]:
    """Every tp x HSDP layout to weigh for n_gpus (forced ones only, when forced)."""
    if p.hsdp not in ("auto", "on", "off"):
        raise PlanError(f"--hsdp={p.hsdp!r} must be auto, on or off")
    gpn = net.gpus_per_node
    spans, whole_nodes = n_gpus > gpn, n_gpus % gpn == 0
    if p.hsdp == "on" and spans and not whole_nodes:
        raise PlanError(f"--hsdp on replicates whole nodes: --gpus={n_gpus} is not a multiple of "
                        f"the {gpn} GPUs per node")
    hsdps = {"off": [False], "on": [True], "auto": [False] + ([True] if spans and whole_nodes
                                                             else [])}[p.hsdp]
    return [make_mesh(n_gpus, tp, h, gpn) for tp in _tp_choices(p, cfg, n_gpus, gpn)
            for h in hsdps]


def _micro_batch_sizes(p: PlanInputs, G: int, dp: int) -> list[int]:
    """Divisors of G (C1) that still give every data-parallel rank at least one micro-batch."""
    if p.micro_batch_size:
        return [p.micro_batch_size] if G // p.micro_batch_size >= dp else []
    return [m for m in range(1, G // dp + 1) if G % m == 0]


def _candidates(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, meshes: list[Mesh],
                G: int) -> list[LayoutCandidate]:
    ckpts = [False, True] if p.activation_checkpointing is None else [p.activation_checkpointing]
    if p.grad_sync not in ("auto", "microbatch", "step"):
        raise PlanError(f"--grad-sync={p.grad_sync!r} must be auto, microbatch or step")
    syncs = ["microbatch", "step"] if p.grad_sync == "auto" else [p.grad_sync]
    reshards = _reshard_choices(p)
    if p.micro_batch_size:  # C1: the micro-batch must divide the global batch (one clear line)
        BatchPlan(G, p.micro_batch_size).check_world_size(min(m.dp for m in meshes))
    out = []
    for mesh in meshes:
        for mb in _micro_batch_sizes(p, G, mesh.dp):
            k = BatchPlan(G, mb).slots(mesh.dp)
            for ckpt, sync, reshard in itertools.product(ckpts, syncs, reshards):
                mem = memory_per_gpu(shape, p.n_gpus, mb, activation_checkpointing=ckpt,
                                     dtype=p.dtype, grad_sync=sync, micro_batches_per_rank=k,
                                     reshard_after_forward=reshard,
                                     context_bytes=p.context_gib * GiB,
                                     fragmentation=p.fragmentation, tp=mesh.tp,
                                     dp_shard=mesh.dp_shard)
                st = step_time(shape, gpu, net, p.n_gpus, mb, k, activation_checkpointing=ckpt,
                               dtype=p.dtype, grad_sync=sync, efficiency=p.efficiency,
                               reshard_after_forward=reshard, tp=mesh.tp, hsdp=mesh.hsdp)
                out.append(LayoutCandidate(mb, ckpt, sync, k, mem, st, reshard, mesh))
    return out


def _reshard_choices(p: PlanInputs) -> list[bool]:
    if p.reshard_after_forward not in ("auto", "always", "never"):
        raise PlanError(f"--reshard-after-forward={p.reshard_after_forward!r} must be auto, "
                        "always or never")
    return {"auto": [True, False], "always": [True], "never": [False]}[p.reshard_after_forward]


def _mesh_floor_memory(p: PlanInputs, shape: ModelShape, mesh: Mesh) -> Memory:
    """A mesh's smallest footprint: micro-batch 1, checkpointing, reduce per micro-batch, and
    ZeRO-3 unless `never` is forced."""
    return memory_per_gpu(shape, mesh.world, 1, activation_checkpointing=True, dtype=p.dtype,
                          reshard_after_forward=p.reshard_after_forward != "never",
                          context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation,
                          tp=mesh.tp, dp_shard=mesh.dp_shard)


def _floor_memory(p: PlanInputs, shape: ModelShape, net: Network, n_gpus: int,
                  hsdp: bool | None = None) -> tuple[Memory, Mesh] | None:
    """The smallest footprint on n_gpus over the tensor-parallel degrees allowed there (more TP
    is always smaller), and its mesh; None if no degree divides n_gpus."""
    on = p.hsdp == "on" if hsdp is None else hsdp
    try:
        tps = _tp_choices(p, shape.cfg, n_gpus, net.gpus_per_node)
    except PlanError:
        return None
    if not tps or (on and n_gpus > net.gpus_per_node and n_gpus % net.gpus_per_node):
        return None
    mesh = make_mesh(n_gpus, max(tps), on, net.gpus_per_node)
    return _mesh_floor_memory(p, shape, mesh), mesh


def _min_workers(p: PlanInputs, shape: ModelShape, c: LayoutCandidate, usable: float,
                 G: int, net: Network) -> int:
    """Fewest workers at which the chosen tp, HSDP, micro-batch, checkpointing, grad sync and
    resharding still fit: the elastic floor (the written config fixes them all, so a smaller group
    runs them too). The group shrinks in whole TP groups, and under HSDP in whole nodes (one
    replica each). Fewer workers means more micro-batches per rank but the same activations per
    micro-batch."""
    step = net.gpus_per_node if c.hsdp else c.tp
    for w in range(step, p.n_gpus + 1, step):
        mesh = make_mesh(w, c.tp, c.hsdp, net.gpus_per_node)
        k = BatchPlan(G, c.micro_batch).slots(mesh.dp)
        mem = memory_per_gpu(shape, w, c.micro_batch,
                             activation_checkpointing=c.activation_checkpointing, dtype=p.dtype,
                             grad_sync=c.grad_sync, micro_batches_per_rank=k,
                             reshard_after_forward=c.reshard_after_forward,
                             context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation,
                             tp=c.tp, dp_shard=mesh.dp_shard)
        if mem.total <= usable:
            return w
    return p.n_gpus


def _what_would_fit(p: PlanInputs, name: str, shape: ModelShape, gpu: GPU, net: Network,
                    G: int) -> str:
    usable = gpu.memory_bytes * (1 - p.memory_margin)
    floor = _floor_memory(p, shape, net, p.n_gpus)
    need, mesh = floor if floor else (_mesh_floor_memory(p, shape, Mesh(1, p.n_gpus)),
                                      Mesh(1, p.n_gpus))
    forced = " and every block kept gathered" if p.reshard_after_forward == "never" else ""
    tp = f", tp={mesh.tp}" if mesh.tp > 1 else ""
    hsdp = ", HSDP" if mesh.hsdp else ""
    head = (f"{name} ({shape.params / 1e9:.2f}B params) does not fit on {p.n_gpus} x {gpu.name} "
            f"even at micro-batch 1 with activation checkpointing{forced}{tp}{hsdp} (needs "
            f"{need.total / GiB:.1f} GiB per GPU, {usable / GiB:.1f} GiB usable)")
    options = []
    if forced and _floor_fits(dataclasses.replace(p, reshard_after_forward="always"), shape, net,
                              p.n_gpus, usable):
        options.append("--reshard-after-forward always (train.reshard_after_forward: always, "
                       "ZeRO-3)")
    if mesh.hsdp and _floor_fits(dataclasses.replace(p, hsdp="off"), shape, net, p.n_gpus,
                                 usable):
        options.append("--hsdp off (HSDP keeps a whole copy of the model state in every node)")
    more = _fewest_gpus(p, shape, net, p.n_gpus, usable)
    if more is not None:
        more_mesh = _floor_memory(p, shape, net, more)[1]
        options.append(f"at least {more} x {gpu.name}"
                       + (f" (tp={more_mesh.tp})" if more_mesh.tp > 1 else "")
                       + (f" (with --global-batch-size >= {more_mesh.dp})"
                          if more_mesh.dp > G else ""))
    for g in sorted(p.hardware.values(), key=lambda g: g.memory_gib):
        if g.memory_gib <= gpu.memory_gib:
            continue
        gnet = Network(p.gpus_per_node or g.gpus_per_node, g.intra_node_gbps,
                       g.inter_node_gbps)
        n = _fewest_gpus(p, shape, gnet, p.n_gpus, g.memory_bytes * (1 - p.memory_margin))
        if n is not None:  # the smallest bigger chip that fits at some count
            options.append(f"{n} x {g.name}")
            break
    if not options:
        top = _floor_memory(p, shape, net, 2**20)
        unsharded = (top[0].total - top[0].sharded_state) if top else need.total
        return (head + f"; no GPU count fits: with every tensor-parallel degree allowed the part "
                f"FSDP cannot shard (gathered blocks, activations, logits) alone needs "
                f"{unsharded / GiB:.1f} GiB; splitting the sequence (context parallelism, not "
                "implemented) or a shorter seq_len would")
    return head + "; use " + " or ".join(options)


def _floor_fits(p: PlanInputs, shape: ModelShape, net: Network, n_gpus: int,
                usable: float) -> bool:
    """Does micro-batch 1 with checkpointing (the smallest footprint) fit on n_gpus?"""
    floor = _floor_memory(p, shape, net, n_gpus)
    return floor is not None and floor[0].total <= usable


def _fewest_gpus(p: PlanInputs, shape: ModelShape, net: Network, start: int,
                 usable: float) -> int | None:
    """Smallest GPU count >= start at which micro-batch 1 with checkpointing fits, if any.

    Counts are searched per tensor-parallel degree in its multiples (memory falls as they grow),
    FSDP over all of them (HSDP's state does not shrink with more nodes)."""
    q = dataclasses.replace(p, hsdp="off")
    best = None
    for tp in _tp_choices(q, shape.cfg, net.gpus_per_node, net.gpus_per_node):
        fits = lambda d, tp=tp: _mesh_floor_memory(
            q, shape, make_mesh(d * tp, tp, False, net.gpus_per_node)).total <= usable
        lo = max(1, -(-start // tp))
        hi = next((d for d in itertools.chain([lo], _doublings(lo)) if fits(d)), None)
        if hi is None:
            continue
        lo = max(lo, hi // 2 + 1) if hi > lo else hi
        while lo < hi:  # binary search the first multiple that fits
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        best = hi * tp if best is None else min(best, hi * tp)
    return best


def _doublings(n: int, limit: int = 2**20):
    while n <= limit:
        n *= 2
        yield n


# ----------------------------------------------------------------------------- config + report


def training_config(plan: Plan) -> dict:
    """The training config this plan recommends (only keys config.py knows)."""
    cfg = plan.cfg
    if plan.model_name in PRESETS and preset_config(plan.model_name, seq_len=cfg.seq_len) == cfg:
        model = {"preset": plan.model_name, "seq_len": cfg.seq_len}
    else:
        model = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                 "seq_len": cfg.seq_len}
    rg = plan.chosen_replica_groups
    # replica groups run the settings that fit a group, in groups of a fixed size
    c = rg.layout.candidate if rg else plan.chosen
    return {
        "model": model,
        "train": {"global_batch_size": plan.global_batch_size, "micro_batch_size": c.micro_batch,
                  "max_steps": plan.max_steps, "lr": plan.lr, "warmup_steps": plan.warmup_steps,
                  "activation_checkpointing": c.activation_checkpointing,
                  "grad_sync": c.grad_sync, "reshard_after_forward": c.reshard_policy,
                  "dtype": "float32" if _dtype_bytes(plan.dtype) == 4 else "bfloat16"},
        "scaling": {"min_workers": plan.n_gpus if rg else plan.min_workers,
                    "max_workers": plan.n_gpus, "use_gpu": True},
        "checkpoint": {"every_steps": rg.every_steps if rg else plan.reliability.every_steps},
        "elastic": ({"replica_groups": rg.layout.n_groups,
                     "replica_heartbeat_timeout_s": plan.replica_heartbeat_timeout_s}
                    if rg else {"replica_groups": "off"}),
    } | _parallel_keys(c)


def trainer_parallel_keys() -> set[str]:
    """The keys of the trainer's `parallel` config section (empty when it has none)."""
    from elastic_gpt.config import Config
    section = next((f for f in dataclasses.fields(Config) if f.name == "parallel"), None)
    if section is None:
        return set()
    return {f.name for f in dataclasses.fields(section.default_factory())}


def _parallel_keys(c: LayoutCandidate) -> dict:
    """parallel.tp and parallel.hsdp as planned (`on`/`off`, not the trainer's `auto`), so the
    trainer runs the plan's mesh; only the keys the trainer's config knows."""
    known = trainer_parallel_keys()
    section = {k: v for k, v in (("tp", c.tp), ("hsdp", "on" if c.hsdp else "off"))
               if k in known}
    return {"parallel": section} if section else {}


def format_report(plan: Plan) -> str:
    c, m, st, cfg = plan.chosen, plan.chosen.memory, plan.chosen.step, plan.cfg
    gib = lambda x: f"{x / GiB:6.2f} GiB"
    tok = cfg.seq_len * plan.global_batch_size
    if plan.achieved_flops_per_gpu:
        step_source = f"at the measured {plan.achieved_flops_per_gpu / 1e12:.0f} TFLOP/s per GPU"
    else:
        step_source = (f"compute {st.compute_s:.3f} s + exposed FSDP comm "
                       f"{st.exposed_comm_s:.3f} s"
                       + (f" + TP comm {st.tp_comm_s:.3f} s" if c.tp > 1 else "")
                       + f" + optimizer {st.optimizer_s:.4f} s")
    tp_part = f"P/{c.tp} on this TP rank, " if c.tp > 1 else ""
    shard_part = (f"/ {c.mesh.dp_shard} in a node (HSDP)" if c.hsdp
                  else f"/ {c.mesh.dp_shard}")
    lines = [
        f"model     {plan.model_name}: {plan.shape.params / 1e6:,.1f}M params, L={cfg.n_layer} "
        f"H={cfg.n_head} d={cfg.n_embd} T={cfg.seq_len} V={cfg.vocab_size}, "
        f"{plan.shape.model_flops_per_token / 1e9:.2f} GFLOP/token",
        f"hardware  {plan.n_gpus} x {plan.gpu.name} on {plan.nodes} node(s), "
        f"{plan.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16 peak, {plan.gpu.memory_gib:.1f} GiB each",
        f"layout    {c.mesh.label()}",
        f"batch     {plan.global_batch_size} seqs x {cfg.seq_len} = {tok:,} tokens/step; "
        f"micro-batch {c.micro_batch}, {c.micro_batches_per_rank} per data-parallel rank per "
        f"step, activation checkpointing {'on' if c.activation_checkpointing else 'off'}, "
        f"grads reduced per {c.grad_sync}, reshard_after_forward={c.reshard_policy}",
        "",
        ("memory per GPU (FSDP2 / ZeRO-3: blocks re-gathered in backward"
         if c.reshard_after_forward else
         "memory per GPU (FSDP2, blocks kept gathered through the step")
        + (f"; tensor parallel over {c.tp}, sequence parallel)" if c.tp > 1 else ")"),
        *(f"  {label:<50s}{value}" for label, value in [
            (f"params+grads+Adam, sharded (16 B x {tp_part}{shard_part})",
             gib(m.sharded_state)),
            ("gathered blocks + root in flight" if c.reshard_after_forward else
             f"all {cfg.n_layer} blocks + root gathered", gib(m.gathered_params)),
            ("unsharded fp32 grads across micro-batches", gib(m.accumulated_grads)),
            ("activations, checkpointing off / on",
             f"{gib(plan.memory_at_chosen[False].activations)} / "
             f"{gib(plan.memory_at_chosen[True].activations)}"),
            ("logits for the loss (12 B x B x T x V" + (f" / {c.tp})" if c.tp > 1 else ")"),
             gib(m.logits)),
            ("CUDA context + fragmentation", gib(m.overhead)),
            ("total", f"{gib(m.total)}  of {plan.usable_bytes / GiB:.1f} GiB usable "
                      f"({plan.gpu.memory_gib:.1f} minus margin)"),
        ]),
        f"  largest micro-batch that fits: {plan.max_micro_batch[False] or 'none'} without, "
        f"{plan.max_micro_batch[True] or 'none'} with activation checkpointing (at most "
        f"global batch / data-parallel ranks = {plan.global_batch_size // c.mesh.dp})",
        "",
        "communication per GPU per step",
        f"  FSDP: all-gather {st.all_gather_bytes / GB:.2f} GB + reduce-scatter "
        f"{st.reduce_scatter_bytes / GB:.2f} GB"
        + (f" + all-reduce across nodes {st.all_reduce_bytes / GB:.2f} GB" if c.hsdp else "")
        + f" = {st.comm_s:.3f} s if serial; {st.exposed_comm_s:.3f} s exposed "
        f"({100 * st.overlapped_fraction:.0f}% overlapped)",
    ]
    if c.tp > 1:
        lines.append(f"  tensor parallel: {st.tp_bytes / GB:.2f} GB on the intra-node link = "
                     f"{st.tp_comm_s:.3f} s, on the critical path (not overlapped)")
    lines += [
        "",
        "throughput",
        f"  step {plan.step_s:.3f} s ({step_source}), "
        f"{plan.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.mfu:.1f}%",
        f"  {plan.tokens / 1e9:.3g}B tokens = {plan.max_steps:,} steps = "
        f"{_duration(plan.time_to_train_s)} of training",
    ]
    if len(plan.layouts) > 1:
        lines += ["", "layouts weighed (the fastest fitting settings of each)"]
        for mesh, best, floor in plan.layouts:
            mark = "*" if mesh == c.mesh else " "
            if best is None and mesh.dp > plan.global_batch_size:
                lines.append(f"  {mark} {mesh.short():<20s} cannot run: {mesh.dp} data-parallel "
                             f"ranks, {plan.global_batch_size} sequences per step")
            elif best is None:
                lines.append(f"  {mark} {mesh.short():<20s} does not fit: needs "
                             f"{floor.total / GiB:.1f} GiB at micro-batch 1 with checkpointing")
            else:
                lines.append(f"  {mark} {mesh.short():<20s} step {best.step.step_s:8.3f} s, "
                             f"{best.memory.total / GiB:5.1f} GiB: {best.settings()}")
        ru = plan.runner_up
        if ru is not None and not plan.achieved_flops_per_gpu:
            lines.append(f"  chosen: {_why(c, ru)}")
    lines += [
        "",
        f"reliability (checkpoint {plan.on_demand.ckpt_write_s:.0f} s blocking, recovery "
        f"{plan.on_demand.recovery_s:.0f} s)",
    ]
    for label, rel in (("on-demand", plan.on_demand), ("spot", plan.spot)):
        lines.append(
            f"  {label:9s} cluster MTBF {_duration(rel.mtbf_s)}; checkpoint every "
            f"{rel.every_steps} steps ({_duration(rel.interval_s)}, Young/Daly "
            f"sqrt(2*delta*MTBF) = {_duration(rel.young_interval_s)}): goodput "
            f"{100 * rel.goodput:.1f}%")
    lines += ["", *_fault_tolerance_lines(plan)]
    lines += [
        "",
        f"cost (prices {PRICES_AS_OF}, $/GPU-hour; wall time = training time / goodput)",
        f"  on-demand ${plan.on_demand_usd:.2f}: ${plan.cost_usd(spot=False):,.0f} over "
        f"{_duration(plan.time_to_train_s / max(plan.on_demand.goodput, 1e-9))}",
        f"  spot      ${plan.spot_usd:.2f}: ${plan.cost_usd(spot=True):,.0f} over "
        f"{_duration(plan.time_to_train_s / max(plan.spot.goodput, 1e-9))}",
        "",
        f"elastic floor: the chosen layout fits down to {plan.min_workers} worker(s)",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _fault_tolerance_lines(plan: Plan) -> list[str]:
    """The restart path and the best replica groups side by side, per market, and which one the
    written config takes."""
    ft = plan.fault_tolerance
    lines = ["fault tolerance: the restart path or replica groups (elastic.replica_groups, "
             "docs/replica-groups.md)"]
    rg = ft.best
    if rg is not None:
        lay = rg.layout
        lines += [
            f"  replica groups N={lay.n_groups}: {lay.n_groups} x {lay.group_gpus} GPUs, each "
            f"{lay.mesh.label()}, {lay.candidate.settings()}, {lay.memory.total / GiB:.1f} GiB "
            "per GPU; step "
            f"{lay.step_s:.3f} s = {lay.in_group_step_s:.3f} s in the group + cross-group "
            f"all-reduce {lay.allreduce_s:.3f} s ({lay.allreduce_bytes / GB:.2f} GB per GPU, not "
            "overlapped)",
            f"  a lost group: the others stall "
            f"{max(plan.replica_heartbeat_timeout_s, COLLECTIVE_TIMEOUT_S):g} s (the larger of "
            f"the heartbeat and the collective timeout) + 1 step (the one in flight, discarded) "
            f"+ {_seconds(lay.heal_s)} healing it "
            f"({lay.heal_bytes / GB:.2f} GB of state per GPU from a peer) = {rg.stall_s:.1f} s; "
            f"it is away {rg.absent_s:.1f} s (restart + checkpoint read) while "
            f"{lay.n_groups - lay.groups_lost} of {lay.n_groups} groups train at "
            f"{100 * lay.degraded_speed:.0f}% speed (step {lay.degraded_step_s:.3f} s)",
            f"  checkpoints only for the fallback (the driver's node, with the Lighthouse, "
            f"lost: the restart path): the leading group writes them in {lay.ckpt_write_s:.1f} s",
        ]
        others = [r for r in ft.replica if r is not rg]
        best = ft.replica_effective(rg)
        if others and best > 0:
            lines.append(f"  also weighed ({ft.market}, effective throughput against N="
                         f"{lay.n_groups}'s): " + ", ".join(
                             f"N={r.layout.n_groups} {ft.replica_effective(r) / best:.2f}x"
                             for r in others))
        elif others:  # no goodput left at any N (stalls longer than the time between losses)
            lines.append(f"  also weighed ({ft.market}): " + ", ".join(
                f"N={r.layout.n_groups}" for r in others) + ", all at goodput 0")
    lines += [f"  not offered: {n}" for n in ft.not_offered]
    lines.append(f"  {'market':9s}  {'mode':15s} {'goodput':>7s} {'tokens/s x goodput':>19s} "
                 f"{'wall time':>11s} {'cost':>12s}  checkpoint every")
    for label in ("on-demand", "spot"):
        m = plan.fault_tolerance_by_market[label]
        price = plan.spot_usd if label == "spot" else plan.on_demand_usd
        rows = [("restart path", m.restart.goodput, m.restart_effective,
                 plan.time_to_train_s, m.restart.every_steps)]
        if m.best is not None:
            b = m.best
            rows.append((f"replica N={b.layout.n_groups}", b.goodput, m.replica_effective(b),
                         plan.max_steps * b.layout.step_s, b.every_steps))
        for i, (mode, g, effective, train_s, every) in enumerate(rows):
            wall = train_s / g if g > 0 else math.inf
            cost = (f"${wall / HOUR * plan.n_gpus * price:,.0f}" if g > 0 else "never ends")
            lines.append(f"  {label if i == 0 else '':9s}  {mode:15s} {100 * g:6.1f}% "
                         f"{effective:19,.0f} {_duration(wall) if g > 0 else '-':>11s} "
                         f"{cost:>12s}  {every} steps")
    lines.append(f"  written config ({ft.market}): {ft.why()}")
    return lines


def _why(chosen: LayoutCandidate, other: LayoutCandidate) -> str:
    """One line: what the chosen layout saves over the runner-up, by where the time goes."""
    a, b = chosen.step, other.step
    parts = [(label, y - x) for label, x, y in (
        ("compute", a.compute_s, b.compute_s),
        ("exposed FSDP comm", a.exposed_comm_s, b.exposed_comm_s),
        ("TP comm", a.tp_comm_s, b.tp_comm_s),
        ("optimizer", a.optimizer_s, b.optimizer_s))]
    parts = [f"{label} {d:+.3f} s" for label, d in parts if abs(d) >= 5e-4]
    return (f"{chosen.mesh.label()}, {b.step_s - a.step_s:.3f} s/step faster than the runner-up "
            f"{other.mesh.label()} ({other.settings()}; runner-up minus chosen: "
            f"{', '.join(parts) or 'equal'})")


def _seconds(s: float) -> str:
    """A short time with the digits that matter (healing takes milliseconds to minutes)."""
    return f"{s:.3f} s" if s < 1 else _duration(s)


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 2 * HOUR:
        return f"{s / 60:.1f} min"
    if s < 2 * DAY:
        return f"{s / HOUR:.1f} h"
    return f"{s / DAY:.1f} days"


def parse_count(text: str) -> float:
    """'300B', '1.5T', '3e11', '20M' -> a number."""
    t = str(text).strip().replace(",", "").replace("_", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    try:
        value = float(t[:-1]) * mult[t[-1].upper()] if t and t[-1].upper() in mult else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 300B, 1.5T, 3e11)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count (e.g. 300B, 1.5T, 3e11)")
    return value


def parse_replica_groups(text: str) -> str | int:
    """'auto', 'off' or a group count of at least 2."""
    t = str(text).strip().lower()
    if t in ("auto", "off"):
        return t
    try:
        n = int(t)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, off or a group count >= 2")
    return n


def heartbeat_timeout(text: str) -> float:
    """A heartbeat timeout the trainer's config accepts: at least MIN_HEARTBEAT_S seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= MIN_HEARTBEAT_S):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= "
                                         f"{MIN_HEARTBEAT_S}")
    return value


# ----------------------------------------------------------------------------- CLI


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="gpt2-124m",
                   help=f"preset: {', '.join(PRESETS)} (default gpt2-124m)")
    m.add_argument("--n-layer", type=positive_int)
    m.add_argument("--n-head", type=positive_int)
    m.add_argument("--n-embd", type=positive_int)
    m.add_argument("--seq-len", type=positive_int)
    m.add_argument("--vocab-size", type=positive_int)
    t = parser.add_argument_group("training")
    t.add_argument("--global-batch-size", type=positive_int,
                   help="sequences per step (default: GPT-3's batch for the size, 0.5M-3.2M "
                   "tokens)")
    t.add_argument("--tokens", type=parse_count,
                   help="token budget, e.g. 300B (default 20 x params)")
    t.add_argument("--micro-batch-size", type=positive_int, help="force one (default: fastest that fits)")
    t.add_argument("--activation-checkpointing", choices=["auto", "on", "off"], default="auto")
    t.add_argument("--grad-sync", choices=["auto", "microbatch", "step"], default="auto")
    t.add_argument("--reshard-after-forward", choices=["auto", "always", "never"],
                   default="auto", help="always: ZeRO-3; never: keep every block gathered for "
                   "the step (one all-gather per block per step); auto: the faster that fits")
    t.add_argument("--tp", type=positive_int, help="tensor-parallel degree, 1, 2, 4 or 8 (default: the "
                   "fastest that fits)")
    t.add_argument("--hsdp", choices=["auto", "on", "off"], default="auto",
                   help="on: FSDP shards within a node and replicates across nodes (default: "
                   "the faster that fits)")
    t.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    h = parser.add_argument_group("hardware")
    h.add_argument("--gpu", default="H100", help=f"one of {', '.join(GPUS)} (default H100)")
    h.add_argument("--gpus", type=positive_int, default=8, help="total GPUs = workers (default 8)")
    h.add_argument("--gpus-per-node", type=positive_int)
    h.add_argument("--intra-node-bw", type=positive_float, help="GB/s, NCCL bus bandwidth in a node")
    h.add_argument("--inter-node-bw", type=positive_float, help="GB/s per node between nodes")
    h.add_argument("--efficiency", type=fraction, default=0.6,
                   help="achieved fraction of peak FLOP/s for matmuls (default 0.6)")
    h.add_argument("--achieved-tflops", type=positive_float,
                   help="measured end-to-end TFLOP/s per GPU; replaces the step-time model")
    h.add_argument("--memory-margin", type=margin, default=0.10)
    h.add_argument("--hardware-file", help="YAML/JSON overriding GPU fields or prices")
    h.add_argument("--on-demand-price", type=non_negative_float, help="$ per GPU-hour")
    h.add_argument("--spot-price", type=non_negative_float, help="$ per GPU-hour")
    r = parser.add_argument_group("reliability")
    r.add_argument("--node-mtbf-hours", type=positive_float, default=6000.0)
    r.add_argument("--spot-node-mtbf-hours", type=positive_float, default=200.0)
    r.add_argument("--ckpt-write-s", type=non_negative_float, help="blocking checkpoint time (default: "
                   "checkpoint size / (nodes x --ckpt-bandwidth))")
    r.add_argument("--ckpt-bandwidth", type=positive_float, default=2.0, help="GB/s per node to storage")
    r.add_argument("--restart-s", type=non_negative_float, default=90.0)
    r.add_argument("--ckpt-every-steps", type=positive_int, help="evaluate this interval instead of "
                   "the Young/Daly one")
    r.add_argument("--market", choices=["spot", "on-demand"], default="spot",
                   help="capacity the written config's checkpoint interval and fault-tolerance "
                   "mode are tuned for")
    r.add_argument("--replica-groups", type=parse_replica_groups, default="auto",
                   help="auto: weigh replica groups (elastic.replica_groups) against the restart "
                   "path and write the better; off: the restart path; N: plan N groups")
    r.add_argument("--replica-heartbeat-timeout-s", type=heartbeat_timeout,
                   default=DEFAULT_HEARTBEAT_S, help="elastic.replica_heartbeat_timeout_s: each "
                   f"lost group stalls the others this long (default {DEFAULT_HEARTBEAT_S:g})")
    o = parser.add_argument_group("output")
    o.add_argument("--min-workers", type=positive_int, help="elastic floor for --write-config")
    o.add_argument("--write-config", metavar="FILE", help="write a ready training config YAML")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")


def inputs_from_args(args) -> PlanInputs:
    model: str | GPTConfig = args.model
    shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")}
    if any(v is not None for v in shape.values()):  # a custom shape on top of the preset's
        model = preset_config(args.model, seq_len=args.seq_len, vocab_size=args.vocab_size,
                              **shape)
    hardware = load_overrides(args.hardware_file) if args.hardware_file else dict(GPUS)
    ckpt = {"auto": None, "on": True, "off": False}[args.activation_checkpointing]
    return PlanInputs(
        model=model, seq_len=args.seq_len, vocab_size=args.vocab_size, gpu=args.gpu,
        n_gpus=args.gpus, global_batch_size=args.global_batch_size, tokens=args.tokens,
        gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_bw,
        inter_node_gbps=args.inter_node_bw, efficiency=args.efficiency,
        achieved_flops_per_gpu=args.achieved_tflops * 1e12 if args.achieved_tflops else None,
        micro_batch_size=args.micro_batch_size, activation_checkpointing=ckpt,
        grad_sync=args.grad_sync, reshard_after_forward=args.reshard_after_forward,
        tp=args.tp, hsdp=args.hsdp, dtype=args.dtype, memory_margin=args.memory_margin,
        on_demand_usd=args.on_demand_price, spot_usd=args.spot_price, hardware=hardware,
        node_mtbf_h=args.node_mtbf_hours, spot_node_mtbf_h=args.spot_node_mtbf_hours,
        ckpt_write_s=args.ckpt_write_s, ckpt_gbps=args.ckpt_bandwidth, restart_s=args.restart_s,
        ckpt_every_steps=args.ckpt_every_steps, market=args.market, min_workers=args.min_workers,
        replica_groups=args.replica_groups,
        replica_heartbeat_timeout_s=args.replica_heartbeat_timeout_s)


def run_from_args(args) -> int:
    # PlanError and config errors are ValueErrors: the CLI prints them as one line, exit 2.
    plan = plan_training(inputs_from_args(args))
    if args.write_config:  # before the report: a path that cannot be written fails alone
        write_output_file(args.write_config, (
            f"# written by `elastic-gpt plan` for {plan.n_gpus} x {plan.gpu.name} "
            f"({plan.market}); add data.path (and checkpoint.path) before training\n"
            + yaml.safe_dump(training_config(plan), sort_keys=False)), "--write-config")
    if args.json:
        print(json.dumps(plan_summary(plan), indent=2))
    else:
        print(format_report(plan))
    if args.write_config:
        print(f"\nwrote {args.write_config}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _fault_tolerance_summary(ft: FaultTolerance) -> dict:
    b = ft.best
    replica = None if b is None else {
        "n_groups": b.layout.n_groups, "group_gpus": b.layout.group_gpus,
        "groups_lost_per_node_failure": b.layout.groups_lost,
        "memory_bytes": b.layout.memory.total, "step_s": b.layout.step_s,
        "in_group_step_s": b.layout.in_group_step_s, "allreduce_s": b.layout.allreduce_s,
        "allreduce_bytes": b.layout.allreduce_bytes, "degraded_step_s": b.layout.degraded_step_s,
        "heal_s": b.layout.heal_s, "stall_s": b.stall_s, "absent_s": b.absent_s,
        "ckpt_write_s": b.layout.ckpt_write_s, "ckpt_every_steps": b.every_steps,
        "goodput": b.goodput, "effective_tokens_per_s": ft.replica_effective(b),
        "weighed": {r.layout.n_groups: ft.replica_effective(r) for r in ft.replica}}
    return {"mode": "replica_groups" if ft.use_replica_groups else "restart",
            "restart": {"goodput": ft.restart.goodput, "step_s":
                        ft.tokens_per_step / ft.restart_tokens_per_s,
                        "effective_tokens_per_s": ft.restart_effective,
                        "ckpt_every_steps": ft.restart.every_steps},
            "replica_groups": replica, "not_offered": ft.not_offered, "why": ft.why()}


def plan_summary(plan: Plan) -> dict:
    c, rg = plan.chosen, plan.chosen_replica_groups
    return {
        "model": plan.model_name, "params": plan.shape.params, "gpu": plan.gpu.name,
        "n_gpus": plan.n_gpus, "nodes": plan.nodes,
        "micro_batch_size": c.micro_batch, "activation_checkpointing": c.activation_checkpointing,
        "grad_sync": c.grad_sync, "reshard_after_forward": c.reshard_policy,
        "tp": c.tp, "hsdp": c.hsdp, "dp_shard": c.mesh.dp_shard,
        "dp_replicate": c.mesh.dp_replicate,
        "memory_bytes": dataclasses.asdict(c.memory)
        | {"total": c.memory.total},
        "max_micro_batch": {"no_ckpt": plan.max_micro_batch[False],
                            "ckpt": plan.max_micro_batch[True]},
        "all_gather_bytes": c.step.all_gather_bytes,
        "reduce_scatter_bytes": c.step.reduce_scatter_bytes,
        "all_reduce_bytes": c.step.all_reduce_bytes, "tp_bytes": c.step.tp_bytes,
        "tp_comm_s": c.step.tp_comm_s, "comm_s": c.step.comm_s, "exposed_comm_s": c.step.exposed_comm_s,
        "step_s": plan.step_s, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu,
        "max_steps": plan.max_steps, "time_to_train_s": plan.time_to_train_s,
        "goodput_on_demand": plan.on_demand.goodput, "goodput_spot": plan.spot.goodput,
        "ckpt_every_steps": plan.reliability.every_steps,
        "replica_groups": rg.layout.n_groups if rg else "off",
        "fault_tolerance": {market: _fault_tolerance_summary(ft)
                            for market, ft in plan.fault_tolerance_by_market.items()},
        "cost_on_demand_usd": plan.cost_usd(spot=False), "cost_spot_usd": plan.cost_usd(spot=True),
        "layouts": [{"tp": m.tp, "hsdp": m.hsdp, "fits": best is not None,
                     "step_s": best.step.step_s if best else None,
                     "memory_bytes": best.memory.total if best else floor.total}
                    for m, best, floor in plan.layouts],
        "config": training_config(plan),
    }

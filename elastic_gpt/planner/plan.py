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

from elastic_gpt.data.order import BatchPlan
from elastic_gpt.hardware import GPU, GPUS, PRICES_AS_OF, GiB, get_gpu, load_overrides
from elastic_gpt.model.gpt import PRESETS, GPTConfig, count_params, flops_per_token, preset_config

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
                               dropout: bool = False) -> float:
    """Activations one transformer layer saves for backward (Korthikanti et al. 2022, section 4.1).

    Their count for 16-bit activations, no tensor parallelism, is s*b*h*(34 + 5*a*s/h) bytes:
    attention 11sbh + 5as^2b, MLP 19sbh, two LayerNorms 4sbh, where 2sbh of the 34 are the 1-byte
    dropout masks and 5as^2b is the score matrix (softmax output 2, its dropout mask 1, dropout
    output 2). Adapted here: flash/SDPA attention stores no s*s scores, only the output (s*b*h, an
    extra tensor because the transpose to (B, T, C) copies it) and a fp32 log-sum-exp per row and
    head (4*a*s*b bytes); without dropout there are no masks.
    """
    s, b, h, a = seq_len, micro_batch, n_embd, n_head
    elems = (1 + 2 + 1  # attention: c_attn input, q and k, v ...
             + 1  # ... and c_proj's input
             + 1 + 4 + 4  # MLP: c_fc input, GELU input, c_proj input
             + 2) * s * b * h  # ln_1 and ln_2 inputs
    total = elems * act_bytes
    if dropout:  # 1-byte masks after attention c_proj and after the MLP
        total += 2 * s * b * h
    if flash:
        total += act_bytes * s * b * h + FP32 * a * s * b  # SDPA output + log-sum-exp
    else:
        total += (5 if dropout else 2) * a * s * s * b  # 2-byte scores (+ mask + dropped copy)
    return total


@dataclass
class Memory:
    """Peak bytes per GPU, by what holds them."""

    sharded_state: float
    """fp32 params + fp32 grads + Adam m, v: 16 bytes/param / N."""
    gathered_params: float
    """Unsharded compute-dtype params (root + current and prefetched block with ZeRO-3; root +
    every block when blocks stay gathered) and one block's unsharded grads + fp32 reduce-scatter
    buffer."""
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
                   flash: bool = True) -> Memory:
    """Peak memory of one FSDP2 rank (one unit per block, then the root).

    reshard_after_forward=True is ZeRO-3: a block's gathered params are freed after its forward
    and gathered again in backward. False (the trainer's `never`) keeps every block gathered from
    the first forward to the last backward of a step: + (L - 2) blocks in the compute dtype.
    """
    cfg, pb = shape.cfg, _dtype_bytes(dtype)
    s, b, h, L = cfg.seq_len, micro_batch, cfg.n_embd, cfg.n_layer
    sharded = OPTIMIZER_BYTES_PER_PARAM * shape.params / n_gpus
    # The root stays gathered through forward and backward (FSDP2 never reshards the root after
    # forward) and its grads (wte is tied, so from the lm_head on) live until the end of backward.
    # Blocks: current + prefetched params (ZeRO-3) or all L of them (kept gathered), plus in
    # backward one block's grads in compute dtype and their fp32 copy in the reduce-scatter buffer.
    held_blocks = min(2, L) if reshard_after_forward else L
    gathered = (shape.root_params * (pb + pb + FP32)
                + shape.block_params * (held_blocks * pb + pb + FP32))
    accumulated = (FP32 * shape.params if grad_sync == "step" and micro_batches_per_rank > 1
                   else 0.0)
    per_layer = activation_bytes_per_layer(s, b, h, cfg.n_head, act_bytes=pb, flash=flash,
                                           dropout=cfg.dropout > 0)
    if activation_checkpointing:
        # Each block keeps only its input; in backward one block at a time is recomputed.
        acts = L * pb * s * b * h + per_layer
    else:
        acts = L * per_layer
    acts += 2 * pb * s * b * h  # ln_f input and output (the lm_head input)
    logits = LOGIT_BYTES * b * s * cfg.vocab_size
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


def ring_bytes(full_bytes: float, n_gpus: int) -> float:
    return (n_gpus - 1) / n_gpus * full_bytes


@dataclass
class StepTime:
    compute_s: float
    """Kernel time at peak * efficiency, recomputation included."""
    comm_s: float
    """All collective time if none of it overlapped compute."""
    exposed_comm_s: float
    """The part of comm_s compute does not hide."""
    optimizer_s: float
    all_gather_bytes: float
    """Per GPU per step (bytes this rank sends; it receives as many)."""
    reduce_scatter_bytes: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.optimizer_s

    @property
    def overlapped_fraction(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s else 1.0


def step_time(shape: ModelShape, gpu: GPU, net: Network, n_gpus: int, micro_batch: int,
              micro_batches_per_rank: int, *, activation_checkpointing: bool,
              dtype: str = "bfloat16", grad_sync: str = "microbatch", efficiency: float = 0.6,
              reshard_after_forward: bool = True) -> StepTime:
    """One optimizer step on the slowest rank (the one with ceil(M / N) micro-batches).

    Overlap (FSDP2's prefetching): the all-gather of block i+1 runs during block i's forward; in
    backward the gather of block i-1 and the reduce-scatter of block i+1 run during block i's
    backward. Exposed per block = max(0, comm - compute); the first gathers (root + block 0) of a
    micro-batch and the last reduce-scatters (block 0 + root) of a synced backward hide under
    nothing. Collectives share one network, so concurrent ones add up.

    reshard_after_forward=True (ZeRO-3): every micro-batch gathers root + L blocks in forward and
    L - 1 blocks again in backward (the last block is not resharded). False (the trainer's
    `never`, which also keeps the weights gathered between micro-batches): root + L blocks are
    gathered once per step, in the first micro-batch's forward, and never in backward.
    """
    cfg, pb, L, k = shape.cfg, _dtype_bytes(dtype), shape.cfg.n_layer, micro_batches_per_rank
    flops_s = gpu.peak_flops * efficiency
    tokens = micro_batch * cfg.seq_len
    fwd_blk = shape.block_fwd_flops_per_token * tokens / flops_s
    bwd_blk = (2 + activation_checkpointing) * fwd_blk
    head = 3 * shape.head_fwd_flops_per_token * tokens / flops_s
    compute_mb = L * (fwd_blk + bwd_blk) + head

    ag_blk = net.collective_s(pb * shape.block_params, n_gpus)
    ag_root = net.collective_s(pb * shape.root_params, n_gpus)
    rs_blk = net.collective_s(FP32 * shape.block_params, n_gpus)
    rs_root = net.collective_s(FP32 * shape.root_params, n_gpus)
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

    # Fused AdamW streams p, g, m, v in and p, m, v out (28 B/param) + the grad-norm read (4 B).
    optimizer_s = 32 * shape.params / n_gpus / (0.7 * gpu.hbm_gbps * GB)
    gather_elems = (n_fwd_gathers * (shape.root_params + L * shape.block_params)
                    + k * regathers * shape.block_params)
    return StepTime(compute_s=k * compute_mb, comm_s=comm_s, exposed_comm_s=exposed_s,
                    optimizer_s=optimizer_s,
                    all_gather_bytes=ring_bytes(pb * gather_elems, n_gpus),
                    reduce_scatter_bytes=n_sync * ring_bytes(FP32 * shape.params, n_gpus))


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
    """Sequences per step. None: ~0.5M tokens (GPT-3 small's batch), 32 below 10M params."""
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
    """Which price/MTBF the written config's checkpoint interval is tuned for: spot or on-demand."""
    min_workers: int | None = None


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

    @property
    def reshard_policy(self) -> str:
        """The value of the trainer's `train.reshard_after_forward` that runs this candidate."""
        return "always" if self.reshard_after_forward else "never"


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
    G = p.global_batch_size or default_global_batch(shape)
    if G < p.n_gpus:
        raise PlanError(f"--global-batch-size={G} gives fewer sequences than --gpus={p.n_gpus}: "
                        f"every worker needs a micro-batch; use a global batch >= {p.n_gpus}")
    tokens = p.tokens or 20.0 * shape.params
    usable = gpu.memory_bytes * (1 - p.memory_margin)

    candidates = _candidates(p, shape, gpu, net, p.n_gpus, G)
    fitting = [c for c in candidates if c.memory.total <= usable]
    if not fitting:
        raise PlanError(_what_would_fit(p, name, shape, gpu, G))
    if p.achieved_flops_per_gpu:  # measured throughput: pick the largest micro-batch that fits
        # (then the modelled-faster grad sync and resharding: the measured figure does not say)
        chosen = max(fitting, key=lambda c: (c.micro_batch, not c.activation_checkpointing,
                                             -c.step.step_s, -c.memory.total))
    else:
        # Ties (one GPU: no communication to save) go to the smaller footprint.
        chosen = min(fitting, key=lambda c: (c.step.step_s, -c.micro_batch, c.memory.total))

    max_mb = {ckpt: max((c.micro_batch for c in fitting if c.activation_checkpointing == ckpt),
                        default=0) for ckpt in (False, True)}
    at_mb = {ckpt: memory_per_gpu(shape, p.n_gpus, chosen.micro_batch,
                                  activation_checkpointing=ckpt, dtype=p.dtype,
                                  grad_sync=chosen.grad_sync,
                                  micro_batches_per_rank=chosen.micro_batches_per_rank,
                                  reshard_after_forward=chosen.reshard_after_forward,
                                  context_bytes=p.context_gib * GiB,
                                  fragmentation=p.fragmentation) for ckpt in (False, True)}

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

    notes = []
    if name != "custom" and shape.params < 10e6:
        notes.append("a model this small is dominated by kernel launches and latency on GPUs; "
                     "the step-time model is optimistic for it")
    if _dtype_bytes(p.dtype) == 4:
        notes.append("float32 matmuls run at TF32/FP32 rates, far below the bf16 peak the step "
                     "time assumes; use the memory figures, not the speed")
    if nodes > 1:
        notes.append(f"{nodes} nodes: collectives run at the inter-node bandwidth "
                     f"({net.bus_gbps(p.n_gpus):.0f} GB/s)")
    kept = next((c for c in candidates if not c.reshard_after_forward
                 and (c.micro_batch, c.activation_checkpointing, c.grad_sync)
                 == (chosen.micro_batch, chosen.activation_checkpointing, chosen.grad_sync)), None)
    if chosen.reshard_after_forward and kept is not None and kept.memory.total > usable:
        saving = chosen.step.step_s - kept.step.step_s
        notes.append(f"reshard_after_forward=always (ZeRO-3): keeping every block gathered "
                     f"(never) would need {kept.memory.total / GiB:.1f} GiB per GPU, more than "
                     f"the {usable / GiB:.1f} usable"
                     + (f"; it would save {saving:.3f} s/step" if saving > 0
                        and not p.achieved_flops_per_gpu else ""))
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
        min_workers=p.min_workers or _min_workers(p, shape, chosen, usable, G), dtype=p.dtype,
        market=p.market, achieved_flops_per_gpu=p.achieved_flops_per_gpu, notes=notes)
    if plan.warmup_steps > max_steps:
        plan.warmup_steps = max_steps
    return plan


def default_global_batch(shape: ModelShape) -> int:
    if shape.params < 10e6:
        return 32
    return max(1, 2**19 // shape.cfg.seq_len)


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


def _micro_batch_sizes(p: PlanInputs, G: int, n_gpus: int) -> list[int]:
    """Divisors of G (C1) that still give every worker at least one micro-batch."""
    if p.micro_batch_size:
        BatchPlan(G, p.micro_batch_size).check_world_size(n_gpus)
        return [p.micro_batch_size]
    return [m for m in range(1, G // n_gpus + 1) if G % m == 0]


def _candidates(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, n_gpus: int,
                G: int) -> list[LayoutCandidate]:
    ckpts = [False, True] if p.activation_checkpointing is None else [p.activation_checkpointing]
    if p.grad_sync not in ("auto", "microbatch", "step"):
        raise PlanError(f"--grad-sync={p.grad_sync!r} must be auto, microbatch or step")
    syncs = ["microbatch", "step"] if p.grad_sync == "auto" else [p.grad_sync]
    reshards = _reshard_choices(p)
    out = []
    for mb in _micro_batch_sizes(p, G, n_gpus):
        k = BatchPlan(G, mb).slots(n_gpus)
        for ckpt, sync, reshard in itertools.product(ckpts, syncs, reshards):
            mem = memory_per_gpu(shape, n_gpus, mb, activation_checkpointing=ckpt, dtype=p.dtype,
                                 grad_sync=sync, micro_batches_per_rank=k,
                                 reshard_after_forward=reshard,
                                 context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation)
            st = step_time(shape, gpu, net, n_gpus, mb, k, activation_checkpointing=ckpt,
                           dtype=p.dtype, grad_sync=sync, efficiency=p.efficiency,
                           reshard_after_forward=reshard)
            out.append(LayoutCandidate(mb, ckpt, sync, k, mem, st, reshard))
    return out


def _reshard_choices(p: PlanInputs) -> list[bool]:
    if p.reshard_after_forward not in ("auto", "always", "never"):
        raise PlanError(f"--reshard-after-forward={p.reshard_after_forward!r} must be auto, "
                        "always or never")
    return {"auto": [True, False], "always": [True], "never": [False]}[p.reshard_after_forward]


def _floor_fits(p: PlanInputs, shape: ModelShape, n_gpus: int, usable: float) -> bool:
    """Does micro-batch 1 with checkpointing (the smallest footprint) fit on n_gpus?"""
    return _floor_memory(p, shape, n_gpus).total <= usable


def _floor_memory(p: PlanInputs, shape: ModelShape, n_gpus: int) -> Memory:
    """Micro-batch 1, checkpointing, reduce per micro-batch, and ZeRO-3 unless `never` is forced."""
    return memory_per_gpu(shape, n_gpus, 1, activation_checkpointing=True, dtype=p.dtype,
                          reshard_after_forward=p.reshard_after_forward != "never",
                          context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation)


def _min_workers(p: PlanInputs, shape: ModelShape, c: LayoutCandidate, usable: float,
                 G: int) -> int:
    """Fewest workers at which the chosen micro-batch, checkpointing, grad sync and resharding
    still fit: the elastic floor (the written config fixes all four, so a smaller group runs them
    too). Fewer workers means more micro-batches per worker but the same activations per
    micro-batch."""
    for w in range(1, p.n_gpus + 1):
        k = BatchPlan(G, c.micro_batch).slots(w)
        mem = memory_per_gpu(shape, w, c.micro_batch,
                             activation_checkpointing=c.activation_checkpointing, dtype=p.dtype,
                             grad_sync=c.grad_sync, micro_batches_per_rank=k,
                             reshard_after_forward=c.reshard_after_forward,
                             context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation)
        if mem.total <= usable:
            return w
    return p.n_gpus


def _what_would_fit(p: PlanInputs, name: str, shape: ModelShape, gpu: GPU, G: int) -> str:
    usable = gpu.memory_bytes * (1 - p.memory_margin)
    need = _floor_memory(p, shape, p.n_gpus)
    forced = " and every block kept gathered" if p.reshard_after_forward == "never" else ""
    head = (f"{name} ({shape.params / 1e9:.2f}B params) does not fit on {p.n_gpus} x {gpu.name} "
            f"even at micro-batch 1 with activation checkpointing{forced} (needs "
            f"{need.total / GiB:.1f} GiB per GPU, {usable / GiB:.1f} GiB usable)")
    options = []
    if forced and _floor_fits(dataclasses.replace(p, reshard_after_forward="always"), shape,
                              p.n_gpus, usable):
        options.append("--reshard-after-forward always (train.reshard_after_forward: always, "
                       "ZeRO-3)")
    more = _fewest_gpus(p, shape, p.n_gpus, usable)
    if more is not None:
        options.append(f"at least {more} x {gpu.name}"
                       + (f" (with --global-batch-size >= {more})" if more > G else ""))
    for g in sorted(p.hardware.values(), key=lambda g: g.memory_gib):
        if g.memory_gib <= gpu.memory_gib:
            continue
        n = _fewest_gpus(p, shape, p.n_gpus, g.memory_bytes * (1 - p.memory_margin))
        if n is not None:  # the smallest bigger chip that fits at some count
            options.append(f"{n} x {g.name}")
            break
    if not options:
        return (head + "; no GPU count fits: the unsharded part (gathered blocks, activations, "
                "logits) alone exceeds every known chip; use a shorter seq_len")
    return head + "; use " + " or ".join(options)


def _fewest_gpus(p: PlanInputs, shape: ModelShape, start: int, usable: float) -> int | None:
    """Smallest GPU count >= start at which micro-batch 1 with checkpointing fits, if any."""
    if _floor_fits(p, shape, start, usable):
        return start
    hi = next((n for n in _doublings(start) if _floor_fits(p, shape, n, usable)), None)
    return None if hi is None else _smallest_fitting(p, shape, hi // 2 + 1, hi, usable)


def _doublings(n: int, limit: int = 2**20):
    while n <= limit:
        n *= 2
        yield n


def _smallest_fitting(p: PlanInputs, shape: ModelShape, lo: int, hi: int, usable: float) -> int:
    while lo < hi:  # memory per GPU falls as GPUs grow: binary search the first that fits
        mid = (lo + hi) // 2
        if _floor_fits(p, shape, mid, usable):
            hi = mid
        else:
            lo = mid + 1
    return hi


# ----------------------------------------------------------------------------- config + report


def training_config(plan: Plan) -> dict:
    """The training config this plan recommends (only keys config.py knows)."""
    cfg = plan.cfg
    if plan.model_name in PRESETS and preset_config(plan.model_name, seq_len=cfg.seq_len) == cfg:
        model = {"preset": plan.model_name, "seq_len": cfg.seq_len}
    else:
        model = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                 "seq_len": cfg.seq_len}
    c = plan.chosen
    return {
        "model": model,
        "train": {"global_batch_size": plan.global_batch_size, "micro_batch_size": c.micro_batch,
                  "max_steps": plan.max_steps, "lr": plan.lr, "warmup_steps": plan.warmup_steps,
                  "activation_checkpointing": c.activation_checkpointing,
                  "grad_sync": c.grad_sync, "reshard_after_forward": c.reshard_policy,
                  "dtype": "float32" if _dtype_bytes(plan.dtype) == 4 else "bfloat16"},
        "scaling": {"min_workers": plan.min_workers, "max_workers": plan.n_gpus, "use_gpu": True},
        "checkpoint": {"every_steps": plan.reliability.every_steps},
    }


def format_report(plan: Plan) -> str:
    c, m, st, cfg = plan.chosen, plan.chosen.memory, plan.chosen.step, plan.cfg
    gib = lambda x: f"{x / GiB:6.2f} GiB"
    tok = cfg.seq_len * plan.global_batch_size
    if plan.achieved_flops_per_gpu:
        step_source = f"at the measured {plan.achieved_flops_per_gpu / 1e12:.0f} TFLOP/s per GPU"
    else:
        step_source = (f"compute {st.compute_s:.3f} s + exposed comm {st.exposed_comm_s:.3f} s "
                       f"+ optimizer {st.optimizer_s:.4f} s")
    lines = [
        f"model     {plan.model_name}: {plan.shape.params / 1e6:,.1f}M params, L={cfg.n_layer} "
        f"H={cfg.n_head} d={cfg.n_embd} T={cfg.seq_len} V={cfg.vocab_size}, "
        f"{plan.shape.model_flops_per_token / 1e9:.2f} GFLOP/token",
        f"hardware  {plan.n_gpus} x {plan.gpu.name} on {plan.nodes} node(s), "
        f"{plan.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16 peak, {plan.gpu.memory_gib:.1f} GiB each",
        f"batch     {plan.global_batch_size} seqs x {cfg.seq_len} = {tok:,} tokens/step; "
        f"micro-batch {c.micro_batch}, {c.micro_batches_per_rank} per worker per step, "
        f"activation checkpointing {'on' if c.activation_checkpointing else 'off'}, "
        f"grads reduced per {c.grad_sync}, reshard_after_forward={c.reshard_policy}",
        "",
        ("memory per GPU (FSDP2 / ZeRO-3: blocks re-gathered in backward)"
         if c.reshard_after_forward else
         "memory per GPU (FSDP2, blocks kept gathered through the step)"),
        *(f"  {label:<50s}{value}" for label, value in [
            (f"params+grads+Adam, sharded (16 B/param / {plan.n_gpus})", gib(m.sharded_state)),
            ("gathered blocks + root in flight" if c.reshard_after_forward else
             f"all {cfg.n_layer} blocks + root gathered", gib(m.gathered_params)),
            ("unsharded fp32 grads across micro-batches", gib(m.accumulated_grads)),
            ("activations, checkpointing off / on",
             f"{gib(plan.memory_at_chosen[False].activations)} / "
             f"{gib(plan.memory_at_chosen[True].activations)}"),
            ("logits for the loss (12 B x B x T x V)", gib(m.logits)),
            ("CUDA context + fragmentation", gib(m.overhead)),
            ("total", f"{gib(m.total)}  of {plan.usable_bytes / GiB:.1f} GiB usable "
                      f"({plan.gpu.memory_gib:.1f} minus margin)"),
        ]),
        f"  largest micro-batch that fits: {plan.max_micro_batch[False] or 'none'} without, "
        f"{plan.max_micro_batch[True] or 'none'} with activation checkpointing (at most "
        f"global batch / GPUs = {plan.global_batch_size // plan.n_gpus})",
        "",
        "communication per GPU per step",
        f"  all-gather {st.all_gather_bytes / GB:.2f} GB + reduce-scatter "
        f"{st.reduce_scatter_bytes / GB:.2f} GB = {st.comm_s:.3f} s if serial; "
        f"{st.exposed_comm_s:.3f} s exposed ({100 * st.overlapped_fraction:.0f}% overlapped)",
        "",
        "throughput",
        f"  step {plan.step_s:.3f} s ({step_source}), "
        f"{plan.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.mfu:.1f}%",
        f"  {plan.tokens / 1e9:.3g}B tokens = {plan.max_steps:,} steps = "
        f"{_duration(plan.time_to_train_s)} of training",
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
    lines += [
        "",
        f"cost (prices {PRICES_AS_OF}, $/GPU-hour; wall time = training time / goodput)",
        f"  on-demand ${plan.on_demand_usd:.2f}: ${plan.cost_usd(spot=False):,.0f} over "
        f"{_duration(plan.time_to_train_s / max(plan.on_demand.goodput, 1e-9))}",
        f"  spot      ${plan.spot_usd:.2f}: ${plan.cost_usd(spot=True):,.0f} over "
        f"{_duration(plan.time_to_train_s / max(plan.spot.goodput, 1e-9))}",
        "",
        f"elastic floor: the chosen micro-batch fits down to {plan.min_workers} worker(s)",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


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
        if t and t[-1].upper() in mult:
            return float(t[:-1]) * mult[t[-1].upper()]
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 300B, 1.5T, 3e11)") from None


# ----------------------------------------------------------------------------- CLI


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="gpt2-124m",
                   help=f"preset: {', '.join(PRESETS)} (default gpt2-124m)")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--n-embd", type=int)
    m.add_argument("--seq-len", type=int)
    m.add_argument("--vocab-size", type=int)
    t = parser.add_argument_group("training")
    t.add_argument("--global-batch-size", type=int,
                   help="sequences per step (default ~0.5M tokens)")
    t.add_argument("--tokens", type=parse_count,
                   help="token budget, e.g. 300B (default 20 x params)")
    t.add_argument("--micro-batch-size", type=int, help="force one (default: fastest that fits)")
    t.add_argument("--activation-checkpointing", choices=["auto", "on", "off"], default="auto")
    t.add_argument("--grad-sync", choices=["auto", "microbatch", "step"], default="auto")
    t.add_argument("--reshard-after-forward", choices=["auto", "always", "never"],
                   default="auto", help="always: ZeRO-3; never: keep every block gathered for "
                   "the step (one all-gather per block per step); auto: the faster that fits")
    t.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    h = parser.add_argument_group("hardware")
    h.add_argument("--gpu", default="H100", help=f"one of {', '.join(GPUS)} (default H100)")
    h.add_argument("--gpus", type=int, default=8, help="total GPUs = workers (default 8)")
    h.add_argument("--gpus-per-node", type=int)
    h.add_argument("--intra-node-bw", type=float, help="GB/s, NCCL bus bandwidth in a node")
    h.add_argument("--inter-node-bw", type=float, help="GB/s per node between nodes")
    h.add_argument("--efficiency", type=float, default=0.6,
                   help="achieved fraction of peak FLOP/s for matmuls (default 0.6)")
    h.add_argument("--achieved-tflops", type=float,
                   help="measured end-to-end TFLOP/s per GPU; replaces the step-time model")
    h.add_argument("--memory-margin", type=float, default=0.10)
    h.add_argument("--hardware-file", help="YAML/JSON overriding GPU fields or prices")
    h.add_argument("--on-demand-price", type=float, help="$ per GPU-hour")
    h.add_argument("--spot-price", type=float, help="$ per GPU-hour")
    r = parser.add_argument_group("reliability")
    r.add_argument("--node-mtbf-hours", type=float, default=6000.0)
    r.add_argument("--spot-node-mtbf-hours", type=float, default=200.0)
    r.add_argument("--ckpt-write-s", type=float, help="blocking checkpoint time (default: "
                   "checkpoint size / (nodes x --ckpt-bandwidth))")
    r.add_argument("--ckpt-bandwidth", type=float, default=2.0, help="GB/s per node to storage")
    r.add_argument("--restart-s", type=float, default=90.0)
    r.add_argument("--ckpt-every-steps", type=int, help="evaluate this interval instead of "
                   "the Young/Daly one")
    r.add_argument("--market", choices=["spot", "on-demand"], default="spot",
                   help="capacity the written config's checkpoint interval is tuned for")
    o = parser.add_argument_group("output")
    o.add_argument("--min-workers", type=int, help="elastic floor for --write-config")
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
        dtype=args.dtype, memory_margin=args.memory_margin,
        on_demand_usd=args.on_demand_price, spot_usd=args.spot_price, hardware=hardware,
        node_mtbf_h=args.node_mtbf_hours, spot_node_mtbf_h=args.spot_node_mtbf_hours,
        ckpt_write_s=args.ckpt_write_s, ckpt_gbps=args.ckpt_bandwidth, restart_s=args.restart_s,
        ckpt_every_steps=args.ckpt_every_steps, market=args.market, min_workers=args.min_workers)


def run_from_args(args) -> int:
    try:
        plan = plan_training(inputs_from_args(args))
    except ValueError as e:  # PlanError and config errors: one readable line, exit 2
        print(f"elastic-gpt plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_summary(plan), indent=2))
    else:
        print(format_report(plan))
    if args.write_config:
        with open(args.write_config, "w") as f:
            f.write(f"# written by `elastic-gpt plan` for {plan.n_gpus} x {plan.gpu.name} "
                    f"({plan.market}); add data.path (and checkpoint.path) before training\n")
            yaml.safe_dump(training_config(plan), f, sort_keys=False)
        print(f"\nwrote {args.write_config}", file=sys.stderr if args.json else sys.stdout)
    return 0


def plan_summary(plan: Plan) -> dict:
    c = plan.chosen
    return {
        "model": plan.model_name, "params": plan.shape.params, "gpu": plan.gpu.name,
        "n_gpus": plan.n_gpus, "nodes": plan.nodes,
        "micro_batch_size": c.micro_batch, "activation_checkpointing": c.activation_checkpointing,
        "grad_sync": c.grad_sync, "reshard_after_forward": c.reshard_policy,
        "memory_bytes": dataclasses.asdict(c.memory)
        | {"total": c.memory.total},
        "max_micro_batch": {"no_ckpt": plan.max_micro_batch[False],
                            "ckpt": plan.max_micro_batch[True]},
        "all_gather_bytes": c.step.all_gather_bytes,
        "reduce_scatter_bytes": c.step.reduce_scatter_bytes,
        "comm_s": c.step.comm_s, "exposed_comm_s": c.step.exposed_comm_s,
        "step_s": plan.step_s, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu,
        "max_steps": plan.max_steps, "time_to_train_s": plan.time_to_train_s,
        "goodput_on_demand": plan.on_demand.goodput, "goodput_spot": plan.spot.goodput,
        "ckpt_every_steps": plan.reliability.every_steps,
        "cost_on_demand_usd": plan.cost_usd(spot=False), "cost_spot_usd": plan.cost_usd(spot=True),
        "config": training_config(plan),
    }

"""What `elastic-gpt plan` takes (`PlanInputs`), its error type, and the units it works in.

The defaults are the planner's assumptions, with their sources next to them where they have
one: the node MTBFs (Llama 3's interruptions on-demand, AWS's spot interruption bands), the
restart time (Ray Train's defaults, docs/design.md); the heartbeat bounds
are the trainer's config's (`elastic.replica_heartbeat_timeout_s`).

Units: bytes, seconds, FLOP/s; GB/s and GiB as hardware.py defines them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_gpt.cost_model.calibration import DEFAULT_CALIBRATION, Calibration, ComputeTerms
from elastic_gpt.cost_model.memory import CONTEXT_GIB, FRAGMENTATION, MEMORY_MARGIN
from elastic_gpt.cost_model.software import Software
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import GPU, GPUS
from elastic_gpt.model.config import ModelConfig, preset_config

HOUR = 3600.0
DAY = 86400.0
# PaLM 540B saw "spikes in the loss roughly 20 times" in its 255k steps (Chowdhery et al. 2022,
# sec. 5.1): a published rate of loss spikes for a run at that scale (planner/reliability.py).
PALM_STEPS_PER_SPIKE = 255_000 / 20


DEFAULT_HEARTBEAT_S = 2.0
"""The trainer's default `elastic.replica_heartbeat_timeout_s`."""
MIN_HEARTBEAT_S = 0.1
"""The smallest heartbeat timeout the trainer's config accepts."""


class PlanError(ValueError):
    """Bad planner input; the message says what would work instead."""


@dataclass
class PlanInputs:
    """Everything `plan_training` takes; the CLI fills it from flags."""

    model: str | ModelConfig = "gpt2-124m"
    """A preset name (of any family) or a full model config."""
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
    efficiency: float | None = None
    """None: the calibrated model (each kernel at what its size reaches, cost_model/kernels.py,
    at the calibration's speed; NCCL's collective latencies); a fraction: every FLOP at that
    fraction of peak, a fixed latency per collective."""
    calibration: Calibration | None = None
    """The speed this software runs the kernel model's kernels at, by GPU family
    (cost_model/calibration.py). None: the default, fitted to published runs; `plan
    --calibration FILE` a measured one (planner/calibration_file.py)."""
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
    pp: int | None = None
    """Pipeline-parallel degree (1 for none). None: the fastest that fits."""
    pp_stages_per_rank: int | None = None
    """Stages per pipeline rank (1: 1F1B). None: the fastest of search.STAGES_PER_RANK."""
    dtype: str = "bfloat16"
    memory_margin: float = MEMORY_MARGIN
    context_gib: float = CONTEXT_GIB
    fragmentation: float = FRAGMENTATION
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
    detect_s: float | None = None
    """How long a failure goes unnoticed. None: the trainer's `elastic.hang_timeout_s`
    (planner/restart_cost.py)."""
    compile_s: float = 0.0
    """Compilation in every restarted process (`train.compile`)."""
    spike_every_steps: float | None = None
    """Mean steps between loss spikes, each rolled back and re-run (planner/reliability.py).
    None or 0: none counted. A rate per step does not carry from one model and batch to another
    (a small model's steps are seconds, not PaLM's), so none is assumed; PaLM 540B's,
    `PALM_STEPS_PER_SPIKE`, is the published one for a run of that scale."""
    storage_gbps: float | None = None
    """The checkpoint storage's sustained bandwidth for all nodes together, GB/s. None: no cap
    beyond nodes x ckpt_gbps."""
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
    software: Software = TRAINER
    """The software whose step is costed (cost_model/software.py): this trainer. The validation
    wing plans published runs of other software through it."""


def compute_terms(p: PlanInputs, gpu: GPU) -> ComputeTerms:
    """The calibration's terms for the plan's GPU."""
    return (p.calibration or DEFAULT_CALIBRATION).for_gpu(gpu).terms


def resolve_model(model: str | ModelConfig, seq_len: int | None = None,
                  vocab_size: int | None = None) -> tuple[str, ModelConfig]:
    if not isinstance(model, str):
        return "custom", model
    return model, preset_config(model, seq_len=seq_len, vocab_size=vocab_size)

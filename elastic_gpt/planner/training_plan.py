"""The plan of one run: `plan_training` puts memory, step time, the layout search, reliability and
replica groups together into a `Plan`, with its notes (where a model is optimistic, what the
written config cannot express, what would be faster).

The global batch and learning rate it recommends by model size are GPT-3's (Brown et al. 2020,
table 2.1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from elastic_gpt.config import ElasticSection
from elastic_gpt.cost_model.calibration import (
    DEFAULT_CALIBRATION,
    Calibration,
    FamilyCalibration,
)
from elastic_gpt.cost_model.memory import CHECKPOINT_BYTES_PER_PARAM, Memory, memory_per_gpu
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.pipeline import pipelined_memory
from elastic_gpt.cost_model.shape import (
    ModelShape,
    dtype_bytes,
    model_shape,
    training_flops_per_token,
)
from elastic_gpt.cost_model.step_time import LayoutCandidate, choice_key, time_to_train_s
from elastic_gpt.hardware import GPU, GiB, get_gpu
from elastic_gpt.model.config import ModelConfig
from elastic_gpt.planner.inputs import (
    DEFAULT_HEARTBEAT_S,
    HOUR,
    MIN_HEARTBEAT_S,
    PlanError,
    PlanInputs,
    resolve_model,
)
from elastic_gpt.planner.reliability import Reliability, reliability
from elastic_gpt.planner.replica_group_model import (
    FaultTolerance,
    ReplicaReliability,
    replica_reliability,
)
from elastic_gpt.planner.restart_cost import RestartCost, checkpoint_io_s
from elastic_gpt.planner.search import (
    forced_batch_problem,
    layout_candidates,
    mesh_choices,
    mesh_floor_memory,
    min_workers,
    replica_layouts,
    what_would_fit,
)


@dataclass
class Plan:
    model_name: str
    cfg: ModelConfig
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
    calibrated_step: bool = False
    """The step time is the calibrated model's (no --efficiency, no --achieved-tflops): read in
    the calibration's spread (report.py)."""
    calibration: Calibration = DEFAULT_CALIBRATION
    """The calibration the step was planned with (when `calibrated_step`)."""
    family_calibration: FamilyCalibration | None = None
    """Its terms for this GPU, and what they rest on."""
    restart_cost: RestartCost | None = None
    """What one restart of the whole run costs, term by term (`recovery_s` of both markets)."""
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
        return min(others, key=choice_key, default=None)

    @property
    def reliability(self) -> Reliability:
        """The market the config is written for."""
        return self.spot if self.market == "spot" else self.on_demand

    def cost_usd(self, spot: bool) -> float:
        """Wall time (compute time / goodput) * GPUs * price; infinite when the run never ends
        (goodput 0: the cluster fails before a restart and a checkpoint are done)."""
        rel, price = (self.spot, self.spot_usd) if spot else (self.on_demand, self.on_demand_usd)
        if rel.goodput <= 0:
            return math.inf
        wall_h = self.time_to_train_s / rel.goodput / HOUR
        return wall_h * self.n_gpus * price


def plan_training(inputs: PlanInputs) -> Plan:
    p = inputs
    name, cfg = resolve_model(p.model, p.seq_len, p.vocab_size)
    if p.market not in ("spot", "on-demand"):
        raise PlanError(f"--market={p.market!r} must be spot or on-demand")
    shape = model_shape(cfg)
    gpu = get_gpu(p.gpu, p.hardware)
    net = network(p, gpu)
    if p.dtype == "float8":
        p = _float8_inputs(p, gpu)
    if p.n_gpus < 1:
        raise PlanError(f"--gpus={p.n_gpus} must be at least 1")
    if p.efficiency is not None and not 0 < p.efficiency <= 1:
        raise PlanError(f"--efficiency={p.efficiency} must be in (0, 1]")
    calibration = p.calibration or DEFAULT_CALIBRATION
    if p.calibration is not None and p.calibration.families and (
            p.efficiency is not None or p.achieved_flops_per_gpu):
        raise PlanError("--calibration and --" + ("efficiency" if p.efficiency is not None
                                                   else "achieved-tflops")
                        + " both set the compute speed: pass one")
    try:
        family_calibration = calibration.for_gpu(gpu)
    except ValueError as e:  # a measured calibration of another GPU
        raise PlanError(str(e)) from None
    if p.replica_groups not in ("auto", "off") and not isinstance(p.replica_groups, int):
        raise PlanError(f"--replica-groups={p.replica_groups!r} must be auto, off or a count")
    if not p.replica_heartbeat_timeout_s >= MIN_HEARTBEAT_S:
        raise PlanError(f"--replica-heartbeat-timeout-s={p.replica_heartbeat_timeout_s} must be "
                        f"at least {MIN_HEARTBEAT_S} (the trainer's config refuses less)")
    G = p.global_batch_size or default_global_batch(shape)
    meshes = mesh_choices(p, cfg, net, p.n_gpus)
    if G < min(m.dp for m in meshes):
        dp = min(m.dp for m in meshes)
        raise PlanError(f"--global-batch-size={G} gives fewer sequences than the {dp} "
                        f"data-parallel ranks of {p.n_gpus} GPUs: every rank needs a micro-batch; "
                        f"use a global batch >= {dp}")
    tokens = p.tokens or 20.0 * shape.params
    usable = gpu.memory_bytes * (1 - p.memory_margin)

    candidates = layout_candidates(p, shape, gpu, net, meshes, G)
    fitting = [c for c in candidates if c.memory.total <= usable]
    if not fitting:
        raise PlanError(forced_batch_problem(p, name, shape, gpu, net, meshes, G, usable, candidates)
                        or what_would_fit(p, name, shape, gpu, net, G))
    chosen = min(fitting, key=choice_key)
    if p.achieved_flops_per_gpu:  # measured throughput: in the modelled-fastest mesh, the
        # largest micro-batch that fits (then the modelled-faster grad sync and resharding: the
        # measured figure does not say)
        chosen = max((c for c in fitting if c.mesh == chosen.mesh),
                     key=lambda c: (c.micro_batch, not c.activation_checkpointing,
                                    -c.step.step_s, -c.memory.total))
    layouts = []
    for mesh in meshes:
        mine = [c for c in fitting if c.mesh == mesh]
        layouts.append((mesh, min(mine, key=choice_key, default=None),
                        mesh_floor_memory(p, shape, mesh)))

    max_mb = {ckpt: max((c.micro_batch for c in fitting if c.activation_checkpointing == ckpt
                         and c.mesh == chosen.mesh), default=0) for ckpt in (False, True)}
    settings = dict(dtype=p.dtype, grad_sync=chosen.grad_sync,
                    micro_batches_per_rank=chosen.micro_batches_per_rank,
                    reshard_after_forward=chosen.reshard_after_forward,
                    context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation,
                    software=p.software)
    at_mb = {ckpt: (pipelined_memory(shape, chosen.mesh, chosen.micro_batch,
                                     chosen.micro_batches_per_rank, activation_checkpointing=ckpt,
                                     **settings) if chosen.mesh.pp > 1 else
                    memory_per_gpu(shape, p.n_gpus, chosen.micro_batch,
                                   activation_checkpointing=ckpt, tp=chosen.tp,
                                   dp_shard=chosen.mesh.dp_shard, **settings))
             for ckpt in (False, True)}

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
    io_s = checkpoint_io_s(ckpt_bytes, nodes, p.ckpt_gbps, p.storage_gbps)
    write_s = p.ckpt_write_s if p.ckpt_write_s is not None else io_s
    restart_cost = RestartCost(
        detect_s=ElasticSection.hang_timeout_s if p.detect_s is None else p.detect_s,
        restart_s=p.restart_s, compile_s=p.compile_s, read_s=io_s)
    recovery_s = restart_cost.total_s
    on_demand, spot = (reliability(node_mtbf_h, nodes, write_s, recovery_s, step_s,
                                   p.ckpt_every_steps, max_steps, p.spike_every_steps, io_s)
                       for node_mtbf_h in (p.node_mtbf_h, p.spot_node_mtbf_h))
    group_layouts, not_offered = replica_layouts(p, shape, gpu, net, G, usable, ckpt_bytes)
    fault_tolerance = {}
    for market, restart, node_mtbf_h in (("on-demand", on_demand, p.node_mtbf_h),
                                         ("spot", spot, p.spot_node_mtbf_h)):
        ft = FaultTolerance(market, restart, tokens_per_s, [], tokens_per_step,
                            list(not_offered), forced=isinstance(p.replica_groups, int))
        ft.replica = sorted((replica_reliability(lay, node_mtbf_h, nodes,
                                                 p.replica_heartbeat_timeout_s,
                                                 p.restart_s + p.compile_s,
                                                 p.ckpt_every_steps, max_steps,
                                                 p.spike_every_steps)
                             for lay in group_layouts),
                            key=lambda r, ft=ft: (-ft.replica_effective(r), r.layout.n_groups))
        fault_tolerance[market] = ft
    chosen_market = fault_tolerance[p.market]
    if chosen_market.restart.goodput <= 0 and not any(r.goodput > 0
                                                       for r in chosen_market.replica):
        rel = chosen_market.restart
        raise PlanError(
            f"on {p.market} capacity this run never ends: its {nodes} nodes fail every "
            f"{rel.mtbf_s:.0f} s (node MTBF / nodes), before a restart ({rel.recovery_s:.0f} s) "
            "and a checkpoint are done, and no replica-group layout keeps any goodput either; "
            "use fewer nodes, " + ("--market on-demand, " if p.market == "spot" else "")
            + "or a longer node MTBF")

    notes = []
    if name != "custom" and shape.params < 10e6:
        notes.append("a model this small is dominated by kernel launches and latency on GPUs; "
                     "the step-time model is optimistic for it")
    if dtype_bytes(p.dtype) == 4:
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
        min_workers=p.min_workers or min_workers(p, shape, chosen, usable, G, net),
        dtype=p.dtype, market=p.market, achieved_flops_per_gpu=p.achieved_flops_per_gpu,
        calibrated_step=p.efficiency is None and not p.achieved_flops_per_gpu,
        calibration=calibration, family_calibration=family_calibration,
        restart_cost=restart_cost,
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
    if not c.mesh.spans_nodes or c.hsdp or c.mesh.pp > 1 or st.exposed_comm_s < 0.25 * st.step_s:
        return []
    pp = next((n for n in (2, 4, 8, 16, 32, 64) if st.comm_s / n <= st.compute_s), 64)
    return [f"FSDP's exposed communication is {st.exposed_comm_s:.1f} s of the {st.step_s:.1f} s "
            f"step ({st.comm_s:.1f} s of collectives per step across nodes, against "
            f"{st.compute_s:.1f} s of compute): more GPUs shrink the compute, not that traffic. "
            f"Pipeline parallelism (--pp) over {pp} stages would leave each node 1/{pp} "
            f"of the layers to gather and reduce, {st.comm_s / pp:.1f} s per step, under the "
            f"compute, at the cost of a pipeline bubble of (pp - 1) / micro-batches per pipeline"]


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


def _float8_inputs(p: PlanInputs, gpu: GPU) -> PlanInputs:
    """`--dtype float8` is the trainer's `train.float8`: it needs float8 tensor cores and runs
    at tp=1 (its float8 linears have no tensor-parallel plan yet, parallel/fsdp.py)."""
    if not gpu.fp8_peak_flops:
        with_fp8 = ", ".join(g.name for g in p.hardware.values() if g.fp8_peak_flops)
        raise PlanError(f"--dtype float8 needs float8 tensor cores ({with_fp8}); {gpu.name} has "
                        "none: use --dtype bfloat16")
    if p.tp not in (None, 1):
        raise PlanError(f"--dtype float8 runs at --tp 1 (the trainer's float8 linears have no "
                        f"tensor-parallel plan yet), not --tp {p.tp}")
    return dataclasses.replace(p, tp=1)


def network(p: PlanInputs, gpu: GPU) -> Network:
    """The network the plan times collectives on: the inputs' figures, else the GPU's."""
    return Network(gpus_per_node=p.gpus_per_node or gpu.gpus_per_node,
                   intra_node_gbps=p.intra_node_gbps or gpu.intra_node_gbps,
                   inter_node_gbps=p.inter_node_gbps or gpu.inter_node_gbps,
                   nccl_latency=p.efficiency is None)


def trainer_parallel_keys() -> set[str]:
    """The keys of the trainer's `parallel` config section (empty when it has none)."""
    from elastic_gpt.config import Config
    section = next((f for f in dataclasses.fields(Config) if f.name == "parallel"), None)
    if section is None:
        return set()
    return {f.name for f in dataclasses.fields(section.default_factory())}

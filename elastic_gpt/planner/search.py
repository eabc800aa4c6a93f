"""The layout search: which tensor-parallel degrees, meshes, micro-batch sizes, checkpointing,
gradient sync and resharding to weigh, how a candidate is chosen, the replica-group layouts, and
what would fit when nothing does.

The tensor-parallel rule is parallel/tp_rules.py's, with the degrees the step-time model is made
for (`TP_DEGREES`). Micro-batch sizes divide the global batch (C1 fixed global batch,
data/order.py's `BatchSplit`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from elastic_gpt.cost_model.memory import CHECKPOINT_BYTES_PER_PARAM, Memory, memory_per_gpu
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.pipeline import (
    pipelined_memory,
    pipelined_step_time,
    rank_shapes,
)
from elastic_gpt.cost_model.shape import ModelShape, training_flops_per_token
from elastic_gpt.cost_model.software import Software
from elastic_gpt.cost_model.step_time import (
    LayoutCandidate,
    choice_key,
    step_time,
    time_to_train_s,
)
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.hardware import GB, GPU, GiB
from elastic_gpt.model.config import ModelConfig
from elastic_gpt.parallel.tp_rules import (
    fsdp_columns_problem,
    model_problem,
    nodes_problem,
    workers_problem,
)
from elastic_gpt.planner.inputs import PlanError, PlanInputs, compute_terms
from elastic_gpt.planner.replica_group_model import (
    ReplicaLayout,
    cross_group_allreduce,
    replica_groups_problem,
)
from elastic_gpt.planner.restart_cost import checkpoint_io_s

TP_DEGREES = (1, 2, 4, 8)
"""Tensor-parallel degrees the planner weighs: a TP group lives inside one node (8 GPUs)."""
PP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
"""Pipeline-parallel degrees the planner weighs (each with STAGES_PER_RANK)."""
STAGES_PER_RANK = (1, 2, 4, 8)
"""1F1B, and interleaved 1F1B with this many stages per rank: more shrinks the bubble (p - 1) /
(v m) and adds point-to-point sends (cost_model/pipeline.py)."""


def pp_problem(pp: int, cfg: ModelConfig, n_gpus: int, tp: int,
               software: Software = TRAINER) -> str | None:
    """Why `pp` pipeline stages cannot run this model on these GPUs at this tp, or None (the
    software's own rules for a cut: `Software.pipeline_cut_problem`)."""
    if pp > cfg.n_layer:
        return (f"--pp={pp} stages need at least one block each, and the model has "
                f"{cfg.n_layer}")
    if n_gpus % (pp * tp):
        return f"--pp={pp} x --tp={tp} does not divide the {n_gpus} GPUs (--gpus) of the run"
    return software.pipeline_cut_problem(cfg, pp)


def _stages_per_rank_fit(cfg: ModelConfig, pp: int, v: int, software: Software) -> bool:
    """Whether pp ranks of v stages each can hold the model: a block per stage at least, and a
    cut the software can make."""
    return v * pp <= cfg.n_layer and software.pipeline_cut_problem(cfg, pp, v) is None


def _pp_choices(p: PlanInputs, cfg: ModelConfig, n_gpus: int, tp: int) -> list[tuple[int, int]]:
    """(pp, stages per rank) to weigh at this tp: 1F1B, and interleaved with each of
    STAGES_PER_RANK the model has the blocks for (a block per stage at least)."""
    degrees = [p.pp] if p.pp is not None else PP_DEGREES
    per_rank = STAGES_PER_RANK if p.pp_stages_per_rank is None else (p.pp_stages_per_rank,)
    out = []
    for pp in degrees:
        if pp_problem(pp, cfg, n_gpus, tp, p.software):
            continue
        if pp == 1:
            out.append((1, 1))
            continue
        out += [(pp, v) for v in per_rank if _stages_per_rank_fit(cfg, pp, v, p.software)]
    return out


def tp_problem(tp: int, cfg: ModelConfig, n_gpus: int, gpus_per_node: int) -> str | None:
    """Why `tp` cannot run this model on these GPUs (one line), or None."""
    if tp not in TP_DEGREES:  # the degrees the step-time model is made for
        return f"--tp={tp} must be one of {', '.join(map(str, TP_DEGREES))}"
    if tp > n_gpus:
        return f"--tp={tp} is more than the {n_gpus} GPUs (--gpus) of the run"
    return (model_problem(tp, n_head=cfg.n_head, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                          n_kv_head=cfg.n_kv_head, ffn_hidden=cfg.ffn_hidden, flag="--tp",
                          candidates=TP_DEGREES)
            or nodes_problem(tp, [gpus_per_node], flag="--tp", what="GPUs", how="--gpus-per-node")
            or workers_problem(tp, {"--gpus": n_gpus}, flag="--tp"))


def _tp_choices(p: PlanInputs, cfg: ModelConfig, n_gpus: int, gpus_per_node: int) -> list[int]:
    if p.tp is not None:
        problem = tp_problem(p.tp, cfg, n_gpus, gpus_per_node)
        if problem:
            raise PlanError(problem)
        return [p.tp]
    return [t for t in TP_DEGREES if tp_problem(t, cfg, n_gpus, gpus_per_node) is None]


def mesh_choices(p: PlanInputs, cfg: ModelConfig, net: Network, n_gpus: int) -> list[Mesh]:
    """Every tp x pp x HSDP layout to weigh for n_gpus (forced ones only, when forced)."""
    if p.hsdp not in ("auto", "on", "off"):
        raise PlanError(f"--hsdp={p.hsdp!r} must be auto, on or off")
    gpn = net.gpus_per_node
    spans, whole_nodes = n_gpus > gpn, n_gpus % gpn == 0
    if p.hsdp == "on" and spans and not whole_nodes:
        raise PlanError(f"--hsdp on replicates whole nodes: --gpus={n_gpus} is not a multiple of "
                        f"the {gpn} GPUs per node")
    hsdps = {"off": [False], "on": [True], "auto": [False] + ([True] if spans and whole_nodes
                                                             else [])}[p.hsdp]
    tps = _tp_choices(p, cfg, n_gpus, gpn)
    if p.pp is not None:
        problems = [pp_problem(p.pp, cfg, n_gpus, tp, p.software) for tp in tps]
        if problems and all(problems):
            raise PlanError(problems[0])
    v = p.pp_stages_per_rank
    if v is not None and p.pp not in (None, 1) and v * p.pp > cfg.n_layer:
        raise PlanError(f"--pp-stages-per-rank={v} x --pp={p.pp} stages need at least one block "
                        f"each, and the model has {cfg.n_layer}")
    cut = (p.software.pipeline_cut_problem(cfg, p.pp, v)
           if v is not None and p.pp not in (None, 1) else None)
    if cut:
        raise PlanError(cut)
    meshes = [p.software.mesh(n_gpus, tp, h, gpn, pp, v) for tp in tps
              for pp, v in _pp_choices(p, cfg, n_gpus, tp)
              for h in hsdps
              # HSDP replicates within a stage: whole nodes of it
              if not (h and pp > 1 and (n_gpus // pp) % gpn)]
    meshes = list(dict.fromkeys(meshes))  # a stage inside one node has no HSDP of its own
    buildable = [m for m in meshes if not _fsdp_problem(m, cfg)]
    if meshes and not buildable:
        raise PlanError(_fsdp_problem(meshes[0], cfg))
    return buildable


def _fsdp_problem(mesh: Mesh, cfg: ModelConfig) -> str | None:
    return fsdp_columns_problem(mesh.tp, mesh.dp_shard, cfg.n_embd,
                                fused_qkv=cfg.family == "gpt2",
                                what=f"tp={mesh.tp} x dp_shard={mesh.dp_shard}")


def _micro_batch_sizes(p: PlanInputs, G: int, dp: int) -> list[int]:
    """Divisors of G (C1 fixed global batch) that still give every data-parallel rank at least one
    micro-batch."""
    if p.micro_batch_size:
        return [p.micro_batch_size] if G // p.micro_batch_size >= dp else []
    return [m for m in range(1, G // dp + 1) if G % m == 0]


def layout_candidates(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, meshes: list[Mesh],
                G: int) -> list[LayoutCandidate]:
    ckpts = [False, True] if p.activation_checkpointing is None else [p.activation_checkpointing]
    if p.grad_sync not in ("auto", "microbatch", "step"):
        raise PlanError(f"--grad-sync={p.grad_sync!r} must be auto, microbatch or step")
    syncs = ["microbatch", "step"] if p.grad_sync == "auto" else [p.grad_sync]
    reshards = _reshard_choices(p)
    if p.micro_batch_size:  # C1 fixed global batch: the micro-batch divides it (one clear line)
        BatchSplit(G, p.micro_batch_size).check_world_size(min(m.dp for m in meshes))
    out = []
    for mesh in meshes:
        if mesh.pp > 1:
            out += _pipelined_candidates(p, shape, gpu, net, mesh, G, ckpts)
            continue
        for mb in _micro_batch_sizes(p, G, mesh.dp):
            k = BatchSplit(G, mb).slots(mesh.dp)
            for ckpt, sync, reshard in itertools.product(ckpts, syncs, reshards):
                mem = memory_per_gpu(shape, p.n_gpus, mb, activation_checkpointing=ckpt,
                                     dtype=p.dtype, grad_sync=sync, micro_batches_per_rank=k,
                                     reshard_after_forward=reshard,
                                     context_bytes=p.context_gib * GiB,
                                     fragmentation=p.fragmentation, tp=mesh.tp,
                                     dp_shard=mesh.dp_shard, software=p.software)
                st = step_time(shape, gpu, net, p.n_gpus, mb, k, activation_checkpointing=ckpt,
                               dtype=p.dtype, grad_sync=sync, efficiency=p.efficiency,
                               calibration=compute_terms(p, gpu),
                               reshard_after_forward=reshard, tp=mesh.tp, hsdp=mesh.hsdp,
                               software=p.software)
                out.append(LayoutCandidate(mb, ckpt, sync, k, mem, st, reshard, mesh))
    return out


def _pipelined_candidates(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, mesh: Mesh,
                          G: int, ckpts: list[bool]) -> list[LayoutCandidate]:
    """A pipeline mesh's candidates: each micro-batch size whose step fills the pipeline (for the
    trainer's schedules at least pp micro-batches per data-parallel rank). Torch's schedules
    keep a stage's weights gathered and sync its gradients once per step (cost_model/pipeline.py
    `KEPT_GATHERED`): the plan says so (`never`, per step) rather than offering settings the
    schedule overrides."""
    out = []
    for mb in _micro_batch_sizes(p, G, mesh.dp):
        k = BatchSplit(G, mb).slots(mesh.dp)
        if p.software.fills_pipeline(mesh, k):
            out += [_pipelined_candidate(p, shape, gpu, net, mesh, mb, k, ckpt) for ckpt in ckpts]
    return out


def _pipelined_memory(p: PlanInputs, shape: ModelShape, mesh: Mesh, mb: int, k: int,
                      ckpt: bool) -> Memory:
    return pipelined_memory(shape, mesh, mb, k, dtype=p.dtype, micro_batches_per_rank=k,
                            activation_checkpointing=ckpt, context_bytes=p.context_gib * GiB,
                            fragmentation=p.fragmentation, software=p.software)


def _pipelined_candidate(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, mesh: Mesh,
                         mb: int, k: int, ckpt: bool) -> LayoutCandidate:
    """A pipeline mesh at micro-batch `mb`, `k` per rank, with the schedules' resharding and
    gradient sync (`KEPT_GATHERED`)."""
    st = pipelined_step_time(shape, gpu, net, mesh, mb, k, dtype=p.dtype,
                             efficiency=p.efficiency, calibration=compute_terms(p, gpu),
                             software=p.software,
                             activation_checkpointing=ckpt)
    return LayoutCandidate(mb, ckpt, "step", k, _pipelined_memory(p, shape, mesh, mb, k, ckpt),
                           st, False, mesh)


def _reshard_choices(p: PlanInputs) -> list[bool]:
    if p.reshard_after_forward not in ("auto", "always", "never"):
        raise PlanError(f"--reshard-after-forward={p.reshard_after_forward!r} must be auto, "
                        "always or never")
    return {"auto": [True, False], "always": [True], "never": [False]}[p.reshard_after_forward]


def mesh_floor_memory(p: PlanInputs, shape: ModelShape, mesh: Mesh) -> Memory:
    """A mesh's smallest footprint: micro-batch 1, checkpointing, reduce per micro-batch (per
    step under pipeline parallelism, with pp micro-batches), and ZeRO-3 unless `never` is
    forced."""
    if mesh.pp > 1:
        return pipelined_memory(shape, mesh, 1, mesh.pp, activation_checkpointing=True,
                                dtype=p.dtype, grad_sync="step", micro_batches_per_rank=mesh.pp,
                                reshard_after_forward=p.reshard_after_forward != "never",
                                context_bytes=p.context_gib * GiB,
                                fragmentation=p.fragmentation, software=p.software)
    return memory_per_gpu(shape, mesh.world, 1, activation_checkpointing=True, dtype=p.dtype,
                          reshard_after_forward=p.reshard_after_forward != "never",
                          context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation,
                          tp=mesh.tp, dp_shard=mesh.dp_shard, software=p.software)


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
    mesh = p.software.mesh(n_gpus, max(tps), on, net.gpus_per_node)
    return mesh_floor_memory(p, shape, mesh), mesh


def min_workers(p: PlanInputs, shape: ModelShape, c: LayoutCandidate, usable: float,
                 G: int, net: Network) -> int:
    """Fewest workers at which the chosen tp, HSDP, micro-batch, checkpointing, grad sync and
    resharding still fit: the elastic floor (the written config fixes them all, so a smaller group
    runs them too). The group shrinks in whole TP groups, and under HSDP in whole nodes (one
    replica each). Fewer workers means more micro-batches per rank but the same activations per
    micro-batch."""
    pp, v = c.mesh.pp, c.mesh.stages_per_rank
    step = (net.gpus_per_node if c.hsdp else c.tp) * pp
    for w in range(step, p.n_gpus + 1, step):
        mesh = p.software.mesh(w, c.tp, c.hsdp, net.gpus_per_node, pp, v)
        k = BatchSplit(G, c.micro_batch).slots(mesh.dp)
        if pp > 1:
            mem = pipelined_memory(shape, mesh, c.micro_batch, k,
                                   activation_checkpointing=c.activation_checkpointing,
                                   dtype=p.dtype, grad_sync=c.grad_sync, micro_batches_per_rank=k,
                                   reshard_after_forward=c.reshard_after_forward,
                                   context_bytes=p.context_gib * GiB,
                                   fragmentation=p.fragmentation, software=p.software)
            if mem.total <= usable:
                return w
            continue
        mem = memory_per_gpu(shape, w, c.micro_batch,
                             activation_checkpointing=c.activation_checkpointing, dtype=p.dtype,
                             grad_sync=c.grad_sync, micro_batches_per_rank=k,
                             reshard_after_forward=c.reshard_after_forward,
                             context_bytes=p.context_gib * GiB, fragmentation=p.fragmentation,
                             tp=c.tp, dp_shard=mesh.dp_shard, software=p.software)
        if mem.total <= usable:
            return w
    return p.n_gpus


def forced_batch_problem(p: PlanInputs, name: str, shape: ModelShape, gpu: GPU, net: Network,
                         meshes: list[Mesh], G: int, usable: float,
                         candidates: list[LayoutCandidate]) -> str | None:
    """When nothing fits only because of a forced --micro-batch-size or --activation-checkpointing
    off: one line naming them and the setting that fits instead. None when the model fits at no
    micro-batch here either (`what_would_fit` then says what would)."""
    forced = ([f"--micro-batch-size {p.micro_batch_size}"] if p.micro_batch_size else []) + (
        ["--activation-checkpointing off"] if p.activation_checkpointing is False else [])
    if not forced or not candidates:
        return None
    freed = dataclasses.replace(p, micro_batch_size=None, activation_checkpointing=None)
    fits = [c for c in layout_candidates(freed, shape, gpu, net, meshes, G)
            if c.memory.total <= usable]
    if not fits:
        return None
    options = []
    if p.micro_batch_size:
        same = [c.micro_batch for c in fits
                if p.activation_checkpointing is None
                or c.activation_checkpointing == p.activation_checkpointing]
        if same:
            options.append(f"--micro-batch-size {max(same)}")
    if p.activation_checkpointing is False and any(
            c.activation_checkpointing and c.micro_batch == (p.micro_batch_size or c.micro_batch)
            for c in fits):
        options.append("--activation-checkpointing on")
    if not options:  # neither alone: both (every fitting layout checkpoints)
        options.append(f"--micro-batch-size {max(c.micro_batch for c in fits)} "
                       "--activation-checkpointing on")
    need = min(c.memory.total for c in candidates)
    return (f"{name} at {' with '.join(forced)} does not fit on {p.n_gpus} x {gpu.name} (needs "
            f"{need / GiB:.1f} GiB per GPU, {usable / GiB:.1f} GiB usable); use "
            + " or ".join(options))


def what_would_fit(p: PlanInputs, name: str, shape: ModelShape, gpu: GPU, net: Network,
                    G: int) -> str:
    usable = gpu.memory_bytes * (1 - p.memory_margin)
    floor = _floor_memory(p, shape, net, p.n_gpus)
    need, mesh = floor if floor else (mesh_floor_memory(p, shape, Mesh(1, p.n_gpus)),
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
        # A forced layout (--hsdp on) may leave no floor mesh to name at that count: the plain one.
        more_floor = _floor_memory(p, shape, net, more)
        more_mesh = more_floor[1] if more_floor else Mesh(1, more)
        options.append(f"at least {more} x {gpu.name}"
                       + (f" (tp={more_mesh.tp})" if more_mesh.tp > 1 else "")
                       + (f" (with --global-batch-size >= {more_mesh.dp})"
                          if more_mesh.dp > G else ""))
    for g in sorted(p.hardware.values(), key=lambda g: g.memory_gib):
        if g.memory_gib <= gpu.memory_gib:
            continue
        gnet = Network(p.gpus_per_node or g.gpus_per_node, g.intra_node_gbps,
                       g.inter_node_gbps, nccl_latency=net.nccl_latency)
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
        def fits(d, tp=tp):
            mesh = p.software.mesh(d * tp, tp, False, net.gpus_per_node)
            return (not _fsdp_problem(mesh, shape.cfg)  # a mesh the trainer can build
                    and mesh_floor_memory(q, shape, mesh).total <= usable)
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


def replica_layouts(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network, G: int,
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
            meshes = mesh_choices(dataclasses.replace(p, n_gpus=g), shape.cfg, net, g)
        except PlanError as e:  # a forced tp or HSDP the group's size cannot take
            if forced:
                raise PlanError(f"--replica-groups={n} gives groups of {g} GPUs: {e}") from None
            continue
        best = _fastest_group_settings(p, shape, gpu, net, meshes, n, lost, G, usable)
        if best is None:
            floors = [mesh_floor_memory(p, shape, m).total for m in meshes]
            too_big.append((n, g, min(floors, default=math.inf)))
            continue
        c, k_away, ar_bytes, ar_s = best
        mesh, steady_s = c.mesh, c.step.step_s
        if p.achieved_flops_per_gpu:
            hw_fpt = training_flops_per_token(shape, c.activation_checkpointing)
            steady_s = time_to_train_s(G * shape.cfg.seq_len, hw_fpt, W,
                                       p.achieved_flops_per_gpu)
            away_s = steady_s * k_away / c.micro_batches_per_rank
        elif mesh.pp > 1:
            away_s = _pipelined_candidate(p, shape, gpu, net, mesh, c.micro_batch, k_away,
                                          c.activation_checkpointing).step.step_s
        else:
            away_s = step_time(shape, gpu, net, g, c.micro_batch, k_away,
                               activation_checkpointing=c.activation_checkpointing,
                               dtype=p.dtype, grad_sync=c.grad_sync, efficiency=p.efficiency,
                               calibration=compute_terms(p, gpu),
                               reshard_after_forward=c.reshard_after_forward, tp=c.tp,
                               hsdp=c.hsdp, software=p.software).step_s
        _, ar_away_s = cross_group_allreduce(_rank_shape(shape, mesh), net, mesh, n - lost,
                                             _syncs(c.grad_sync, k_away), W)
        group_nodes = net.nodes(g)
        # A given --ckpt-write-s is for every node writing its part: one group's nodes write all
        write_s = (p.ckpt_write_s * net.nodes(W) / group_nodes if p.ckpt_write_s is not None
                   else checkpoint_io_s(ckpt_bytes, group_nodes, p.ckpt_gbps, p.storage_gbps))
        read_s = lost * checkpoint_io_s(ckpt_bytes, group_nodes, p.ckpt_gbps, p.storage_gbps)
        heal_bytes = (CHECKPOINT_BYTES_PER_PARAM * _rank_shape(shape, mesh).local_params(mesh.tp)
                      / mesh.dp_shard)
        # the peer's node sends, the new node receives: every GPU's shard through its NICs
        heal_s = (max(heal_bytes / (net.intra_node_gbps * GB),
                      min(g, gpn) * heal_bytes / (net.inter_node_gbps * GB))
                  + net.send_latency_s(across_nodes=True))
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


def _rank_shape(shape: ModelShape, mesh: Mesh) -> ModelShape:
    """What one rank of `mesh` holds: the model, or under pipeline parallelism the largest
    pipeline rank's part (cost_model/pipeline.py `rank_shapes`)."""
    if mesh.pp == 1:
        return shape
    return max(rank_shapes(shape, mesh.pp, mesh.stages_per_rank).values(),
               key=lambda s: s.params)


def _syncs(grad_sync: str, micro_batches: int) -> int:
    """Gradient syncs per step: the cross-group all-reduce hook runs at each."""
    return micro_batches if grad_sync == "microbatch" else 1


def _group_candidates(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network,
                      meshes: list[Mesh], n: int, lost: int, G: int, usable: float):
    """(candidate, micro-batches per rank while `lost` groups are away) for every setting of a
    group of n that fits both in steady state and while they are away."""
    ckpts = [False, True] if p.activation_checkpointing is None else [p.activation_checkpointing]
    syncs = ["microbatch", "step"] if p.grad_sync == "auto" else [p.grad_sync]
    for mesh in meshes:
        for mb in _micro_batch_sizes(p, G, n * mesh.dp):
            k = BatchSplit(G, mb).slots(n * mesh.dp)
            k_away = BatchSplit(G, mb).slots((n - lost) * mesh.dp)
            if mesh.pp > 1:  # every group's pipelines fill at full membership
                for ckpt in ckpts if p.software.fills_pipeline(mesh, k) else []:
                    c = _pipelined_candidate(p, shape, gpu, net, mesh, mb, k, ckpt)
                    away = _pipelined_memory(p, shape, mesh, mb, k_away, ckpt)
                    if c.memory.total <= usable and away.total <= usable:
                        yield c, k_away
                continue
            for ckpt, sync, reshard in itertools.product(ckpts, syncs, _reshard_choices(p)):
                kw = dict(activation_checkpointing=ckpt, dtype=p.dtype, grad_sync=sync,
                          reshard_after_forward=reshard, context_bytes=p.context_gib * GiB,
                          fragmentation=p.fragmentation, tp=mesh.tp, dp_shard=mesh.dp_shard,
                          software=p.software)
                mem = memory_per_gpu(shape, mesh.world, mb, micro_batches_per_rank=k, **kw)
                if mem.total > usable or memory_per_gpu(
                        shape, mesh.world, mb, micro_batches_per_rank=k_away, **kw).total > usable:
                    continue
                st = step_time(shape, gpu, net, mesh.world, mb, k, activation_checkpointing=ckpt,
                               dtype=p.dtype, grad_sync=sync, efficiency=p.efficiency,
                               calibration=compute_terms(p, gpu),
                               reshard_after_forward=reshard, tp=mesh.tp, hsdp=mesh.hsdp,
                               software=p.software)
                yield LayoutCandidate(mb, ckpt, sync, k, mem, st, reshard, mesh), k_away


def _fastest_group_settings(p: PlanInputs, shape: ModelShape, gpu: GPU, net: Network,
                            meshes: list[Mesh], n: int, lost: int, G: int, usable: float
                            ) -> tuple[LayoutCandidate, int, float, float] | None:
    """One group's fastest candidate of n, by its step plus the cross-group all-reduce (grad
    sync per step does it once), that also fits while `lost` groups are away (the survivors then
    run more micro-batches per rank, and with grad sync per step accumulate unsharded grads).
    Returns (candidate, micro-batches per rank while away, all-reduce bytes and seconds per
    step). C1 fixed global batch spans every group's data-parallel ranks: n x the group's."""
    best, best_key = None, None
    for c, k_away in _group_candidates(p, shape, gpu, net, meshes, n, lost, G, usable):
        ar_bytes, ar_s = cross_group_allreduce(_rank_shape(shape, c.mesh), net, c.mesh, n,
                                               _syncs(c.grad_sync, c.micro_batches_per_rank),
                                               p.n_gpus)
        key = (c.step.step_s + ar_s, *choice_key(c)[1:])
        if best_key is None or key < best_key:
            best, best_key = (c, k_away, ar_bytes, ar_s), key
    return best

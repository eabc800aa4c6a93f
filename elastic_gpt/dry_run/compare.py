"""The dry run beside the plan: for each rank simulated (dry_run/rank_step.py), its peak memory
by what holds it and its collectives by mesh dimension, next to what the planner predicts for
that rank of the same layout (cost_model/memory.py, step_time.py, pipeline.py).

Both sides are put in the same four groups of memory: the sharded model state (parameters,
gradients, Adam's moments), the gathered parameters and unsharded gradients (FSDP2's all-gather
and reduce-scatter buffers among them), the activations, and the loss and other temporaries. The
planner's CUDA context and fragmentation have no counterpart in fake tensors: the dry run's peak
plus them is what must fit in the usable memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic_gpt.cost_model.memory import Memory, memory_per_gpu
from elastic_gpt.cost_model.pipeline import KEPT_GATHERED, in_flight, p2p_bytes, rank_shape
from elastic_gpt.cost_model.shape import dtype_bytes
from elastic_gpt.cost_model.step_time import StepTime, step_time
from elastic_gpt.hardware import GiB
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.training_plan import Plan, network

if TYPE_CHECKING:  # the simulation imports torch; comparing its figures needs none
    from elastic_gpt.dry_run.rank_step import RankResult

# The memory tracker's categories (torch's FSDPMemTracker), grouped as the planner counts.
TRACKER_GROUPS = {
    "model state, sharded": ("Sharded Param", "Sharded Grad", "OptState"),
    "gathered params and grads": ("Unsharded Param", "All Gather", "Unsharded Grad",
                                  "Reduce Scatter", "Buffer"),
    "activations": ("Activation", "Inputs"),
    "loss and temporaries": ("Temp",),
}
AGREEMENT = 0.10
"""The planner's allocated memory must be within this of the dry run's peak."""


@dataclass
class MemoryRow:
    what: str
    dry_run: float
    planned: float


@dataclass
class CollectiveRow:
    dim: str
    kind: str
    count: int
    dry_run_bytes: float
    planned_bytes: float | None
    """None: the planner counts this dimension's traffic as a whole (tp), on another row."""
    planned_count: int | None = None


@dataclass
class RankComparison:
    result: RankResult
    memory: list[MemoryRow]
    overhead: float
    """The planner's CUDA context, workspaces and fragmentation."""
    collectives: list[CollectiveRow]

    @property
    def dry_run_total(self) -> float:
        return float(self.result.peak.get("Total", 0))

    @property
    def planned_total(self) -> float:
        return sum(r.planned for r in self.memory)

    @property
    def agreement(self) -> float:
        """The planner's allocated bytes over the dry run's, minus one."""
        return self.planned_total / self.dry_run_total - 1 if self.dry_run_total else 0.0


def compare_rank(plan: Plan, inputs: PlanInputs, result: RankResult) -> RankComparison:
    memory, step = planned_for_rank(plan, inputs, result.coordinate["pp"])
    groups = {name: sum(result.peak.get(k, 0) for k in keys)
              for name, keys in TRACKER_GROUPS.items()}
    planned = {"model state, sharded": memory.sharded_state,
               "gathered params and grads": memory.gathered_params + memory.accumulated_grads,
               "activations": memory.activations, "loss and temporaries": memory.logits}
    rows = [MemoryRow(name, groups[name], planned[name]) for name in TRACKER_GROUPS]
    return RankComparison(result, rows, memory.overhead,
                          _collective_rows(result, step, planned_tp_collectives(
                              plan, inputs, result.coordinate["pp"])))


def planned_tp_collectives(plan: Plan, inputs: PlanInputs, pp_rank: int) -> int:
    """The tensor-parallel collectives the planner counts in one step of a rank of pipeline rank
    `pp_rank`: each micro-batch's, and each gradient sync's (tensor_parallel.py)."""
    c = plan.chosen
    if c.tp <= 1:
        return 0
    shape = (rank_shape(plan.shape, c.mesh.pp, c.mesh.stages_per_rank, pp_rank) if c.mesh.pp > 1
             else plan.shape)
    traffic = inputs.software.tp_traffic(
        shape, c.micro_batch, c.tp, activation_checkpointing=c.activation_checkpointing,
        act_bytes=dtype_bytes(plan.dtype), grad_bytes=4)
    k = c.micro_batches_per_rank
    syncs = 1 if c.grad_sync == "step" else k
    return (k * (traffic.all_gathers + traffic.reduce_scatters + traffic.all_reduces)
            + syncs * traffic.sync_collectives)


def planned_for_rank(plan: Plan, inputs: PlanInputs, pp_rank: int) -> tuple[Memory, StepTime]:
    """The planner's memory and step of the chosen layout on pipeline rank `pp_rank` (every
    rank of an unpipelined layout is the same)."""
    c = plan.chosen
    mesh = c.mesh
    if mesh.pp == 1:
        return c.memory, c.step
    shape = rank_shape(plan.shape, mesh.pp, mesh.stages_per_rank, pp_rank)
    k = c.micro_batches_per_rank
    kw = dict(dtype=plan.dtype, activation_checkpointing=c.activation_checkpointing,
              **KEPT_GATHERED)
    memory = memory_per_gpu(shape, mesh.stage_world, c.micro_batch, tp=mesh.tp,
                            dp_shard=mesh.dp_shard, micro_batches_per_rank=k,
                            in_flight=in_flight(mesh.pp, k, mesh.stages_per_rank, pp_rank),
                            loss="whole" if pp_rank == mesh.pp - 1 else "none",
                            context_bytes=inputs.context_gib * GiB,
                            fragmentation=inputs.fragmentation, software=inputs.software, **kw)
    step = step_time(shape, plan.gpu, network(inputs, plan.gpu), mesh.stage_world,
                     c.micro_batch, k, tp=mesh.tp, hsdp=mesh.hsdp, software=inputs.software,
                     efficiency=inputs.efficiency, **kw)
    sent = p2p_bytes(mesh.pp, k, micro_batch=c.micro_batch, seq_len=plan.cfg.seq_len,
                     n_embd=plan.cfg.n_embd, act_bytes=dtype_bytes(plan.dtype), tp=mesh.tp,
                     stages_per_rank=mesh.stages_per_rank, pp_rank=pp_rank)
    return memory, dataclasses.replace(step, p2p_bytes=sent)


def _collective_rows(result: RankResult, step: StepTime, tp_count: int) -> list[CollectiveRow]:
    planned = {("dp_shard", "all_gather"): step.all_gather_bytes,
               ("dp_shard", "reduce_scatter"): step.reduce_scatter_bytes,
               ("dp_replicate", "all_reduce"): step.all_reduce_bytes,
               ("pp", "send"): step.p2p_bytes}
    tp_total = step.tp_bytes
    rows = []
    for (dim, kind), c in sorted(result.collectives.items()):
        if dim == "tp":
            rows.append(CollectiveRow(dim, kind, c.count, c.bytes, None))
        else:
            rows.append(CollectiveRow(dim, kind, c.count, c.bytes, planned.get((dim, kind))))
    if tp_total:
        tp = [r for r in rows if r.dim == "tp"]
        rows.append(CollectiveRow("tp", "all", sum(r.count for r in tp),
                                  sum(r.dry_run_bytes for r in tp), tp_total, tp_count))
    return rows


def fits(comparison: RankComparison, usable_bytes: float) -> bool:
    """The dry run's peak plus the planner's context and fragmentation, within the usable
    memory."""
    return comparison.dry_run_total + comparison.overhead <= usable_bytes


def gib(x: float) -> str:
    return f"{x / GiB:,.2f}"

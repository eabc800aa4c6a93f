"""The memory-for-speed settings a run leaves on `auto`, resolved from the planner's models.

Three settings trade memory for communication: HSDP (a whole copy of the model state per node,
all-gathers inside nodes only), reducing gradients once per step (unsharded fp32 gradients kept
across micro-batches) and keeping gathered blocks through the step (no re-gather in backward).
Each is faster and each can exhaust a GPU at scale: HSDP on 8-GPU nodes puts 1/8 of the model
state on every GPU, the kept gradients are 4 bytes per parameter of a tensor-parallel rank.

The rule is the planner's (`elastic-gpt plan`): among the settings whose predicted peak
(memory.py) fits the usable memory, the fastest step by step_time.py, ties to the smaller
footprint (`choice_key`). The planner weighs micro-batch, checkpointing and tensor parallelism
too; a run has fixed those in its config, so only these three are left to choose, and a run
given the planner's micro-batch, checkpointing and tp resolves them as the plan did. On a device
the step-time model has no row for (a CPU, an unknown GPU), the fastest is taken to be the one
that communicates least (the order of `LEAST_COMMUNICATION`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from elastic_gpt.cost_model.memory import (
    CONTEXT_GIB,
    FRAGMENTATION,
    MEMORY_MARGIN,
    Memory,
    memory_per_gpu,
)
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.pipeline import pipelined_memory, pipelined_step_time
from elastic_gpt.cost_model.shape import ModelShape
from elastic_gpt.cost_model.step_time import LayoutCandidate, choice_key, step_time
from elastic_gpt.hardware import GPU, GiB


@dataclass(frozen=True)
class MemorySettings:
    hsdp: bool
    grad_sync: str
    """step or microbatch."""
    reshard_after_forward: bool
    """True: ZeRO-3 (`always`); False: blocks kept gathered through the step (`never`)."""
    memory: Memory
    """The predicted peak per worker with these settings."""
    usable_bytes: float
    chosen_by: str
    """How the settings left on auto were chosen, for the setup line and the run's params."""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def params(self) -> dict[str, str]:
        """The resolved settings and the prediction, as a run's params record them."""
        return {"hsdp": "on" if self.hsdp else "off", "grad_sync": self.grad_sync,
                "reshard_after_forward": "always" if self.reshard_after_forward else "never",
                "predicted_memory_gib": f"{self.memory.total / GiB:.2f}",
                "usable_memory_gib": f"{self.usable_bytes / GiB:.2f}",
                "chosen_by": self.chosen_by}


def least_communication(hsdp: bool, grad_sync: str, reshard_after_forward: bool) -> tuple:
    """Sort key without a step-time model: HSDP first (its all-gathers stay inside nodes), then
    one reduce-scatter per step, then one all-gather per block per step."""
    return (not hsdp, grad_sync != "step", reshard_after_forward)


def resolve_memory_settings(shape: ModelShape, *, world_size: int, tp: int,
                            workers_per_node: list[int], micro_batch: int,
                            micro_batches_per_rank: int, activation_checkpointing: bool,
                            dtype: str, device_bytes: float, gpu: GPU | None,
                            hsdp: str = "auto", grad_sync: str = "auto",
                            reshard_after_forward: str = "auto",
                            memory_margin: float = MEMORY_MARGIN,
                            context_bytes: float = CONTEXT_GIB * GiB,
                            fragmentation: float = FRAGMENTATION, pp: int = 1,
                            stages_per_rank: int = 1) -> MemorySettings:
    """Resolve the settings given as `auto` (the others are kept as given) for `world_size`
    workers, `workers_per_node` of them on each node, on devices of `device_bytes` each (the
    smallest of the group's). `gpu`: the device's row for the step-time model, or None.

    Nothing fitting is not an error here (the prediction is an estimate, and an explicit setting
    is the user's call): the smallest footprint is returned with `fits` False, for a warning.

    Under pipeline parallelism (`pp` > 1) the memory and step are a pipeline rank's
    (cost_model/pipeline.py), and gradients are reduced once per step: the schedule's."""
    multi_node = len(workers_per_node) > 1
    even = len(set(workers_per_node)) == 1
    hsdps = {"on": [True], "off": [False],
             "auto": [False, True] if multi_node and even else [False]}[hsdp]
    syncs = ["microbatch", "step"] if grad_sync == "auto" else [grad_sync]
    reshards = {"auto": [True, False], "always": [True], "never": [False]}[reshard_after_forward]
    if pp > 1:  # the schedules' (cost_model/pipeline.py `KEPT_GATHERED`)
        syncs, reshards = ["step"], [False]
    per_node = workers_per_node[0] if even else max(workers_per_node)
    net = Network(per_node, gpu.intra_node_gbps, gpu.inter_node_gbps) if gpu else None
    usable = device_bytes * (1 - memory_margin)
    candidates = []
    for on, sync, reshard in itertools.product(hsdps, syncs, reshards):
        mesh = make_mesh(world_size, tp, on, per_node, pp, stages_per_rank)
        if pp > 1:
            kw = dict(activation_checkpointing=activation_checkpointing, grad_sync=sync,
                      reshard_after_forward=reshard)
            mem = pipelined_memory(shape, mesh, micro_batch, micro_batches_per_rank, dtype=dtype,
                                   micro_batches_per_rank=micro_batches_per_rank,
                                   context_bytes=context_bytes, fragmentation=fragmentation, **kw)
            st = None if net is None else pipelined_step_time(
                shape, gpu, net, mesh, micro_batch, micro_batches_per_rank, dtype=dtype,
                **kw)
            candidates.append(LayoutCandidate(micro_batch, activation_checkpointing, sync,
                                              micro_batches_per_rank, mem, st, reshard, mesh))
            continue
        mem = memory_per_gpu(shape, world_size, micro_batch,
                             activation_checkpointing=activation_checkpointing, dtype=dtype,
                             grad_sync=sync, micro_batches_per_rank=micro_batches_per_rank,
                             reshard_after_forward=reshard, context_bytes=context_bytes,
                             fragmentation=fragmentation, tp=tp, dp_shard=mesh.dp_shard)
        st = None if net is None else step_time(
            shape, gpu, net, world_size, micro_batch, micro_batches_per_rank,
            activation_checkpointing=activation_checkpointing, dtype=dtype, grad_sync=sync,
            reshard_after_forward=reshard, tp=tp, hsdp=on)
        candidates.append(LayoutCandidate(micro_batch, activation_checkpointing, sync,
                                          micro_batches_per_rank, mem, st, reshard, mesh))
    fitting = [c for c in candidates if c.memory.total <= usable]
    if not fitting:
        best = min(candidates, key=lambda c: c.memory.total)
        how = "none fits: the smallest footprint"
    elif net is not None:
        best = min(fitting, key=choice_key)
        how = f"the planner's step time on {gpu.name}"
    else:
        best = min(fitting, key=lambda c: (least_communication(c.hsdp, c.grad_sync,
                                                               c.reshard_after_forward),
                                           c.memory.total))
        how = "the least communication that fits"
    return MemorySettings(best.hsdp, best.grad_sync, best.reshard_after_forward, best.memory,
                          usable, how)

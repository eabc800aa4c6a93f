"""One rank of a full-size run, simulated in this process: the trainer's own layout resolution,
mesh, model build and parallelization, pipeline schedule, optimizer and one step (train/layout.py,
train/model_build.py, train/step.py), on torch's fake process group of the whole world size and
on fake tensors (shapes, no storage). What it measures is what that code allocates and sends on
that rank: the peak of its memory by category (FSDP2's memory tracker) and its collectives by mesh
dimension (count, and bytes by the ring formula the planner uses).

A run on a real cluster differs only in what fake tensors cannot have: values (nothing here is
read back to the host), kernels' workspaces, and the CUDA context and the allocator's
fragmentation, which the planner adds on top (cost_model/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_gpt.config import Config
from elastic_gpt.data.stream import StepBatch
from elastic_gpt.hardware import GPU
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.parallel.mesh import DIM_NAMES
from elastic_gpt.torch_internals import (
    TorchDispatchMode,
    collective_of,
    fake_process_group,
    fake_tensor_patches,
    fake_tensors,
    memory_tracker,
)
from elastic_gpt.train.fault_tolerance import RestartPath
from elastic_gpt.train.layout import RunLayout, resolve_layout
from elastic_gpt.train.model_build import build_parallel_model, materialise
from elastic_gpt.train.optimizer import build_optimizer
from elastic_gpt.train.step import TrainStep


@dataclass
class Collectives:
    count: int = 0
    bytes: float = 0.0
    """Per rank, by the ring formula: (n-1)/n of the whole tensor for an all-gather or a
    reduce-scatter, 2(n-1)/n for an all-reduce, the tensor for a send."""


@dataclass
class RankResult:
    rank: int
    coordinate: dict[str, int]
    """Its place on the mesh, by dimension (pp, dp_replicate, dp_shard, tp)."""
    layout: RunLayout
    peak: dict[str, int]
    """Bytes by the memory tracker's category at the peak, with "Total"."""
    collectives: dict[tuple[str, str], Collectives] = field(default_factory=dict)
    """(mesh dimension, kind) -> what this rank's step ran there."""


def simulate_rank(cfg: Config, gpt_cfg: GPTConfig, gpu: GPU, *, world_size: int,
                  gpus_per_node: int, rank: int) -> RankResult:
    """Rank `rank` of `world_size` GPUs of kind `gpu`, `gpus_per_node` to a node, running one
    step of `cfg` (whose data section is not read: the batch is made of fake tokens)."""
    device = torch.device("cpu")  # fake tensors: the device only names where they would be
    nodes = [f"node{r // gpus_per_node}" for r in range(world_size)]
    with fake_process_group(rank, world_size):
        layout = resolve_layout(cfg, gpt_cfg, world_size=world_size, rank_nodes=nodes,
                                device=device, threads=1, gpu=gpu)
        dims = layout.dims
        dims.build_mesh("cpu")
        built = build_parallel_model(cfg, gpt_cfg, layout, rank=rank)
        batch_rank, batch_degree = dims.dp_rank(rank), dims.dp_degree
        with fake_tensor_patches(), fake_tensors():
            materialise(built.model, device, initialise=False, seed=cfg.train.seed)
            optimizer = build_optimizer(built.model, cfg, fused=True)
            _make_optimizer_state(built.model, optimizer)
            step = TrainStep(cfg, layout, model=built.model, pipeline=built.pipeline,
                             optimizer=optimizer, seq_len=gpt_cfg.seq_len,
                             tp_rank=dims.tp_rank(rank), fault_tolerance=RestartPath())
            step.prepare(batch_degree)
            batch = _fake_batch(layout, gpt_cfg, batch_rank, batch_degree)
            roots = list(built.pipeline.stages) if built.pipeline is not None else [built.model]
            tracker = memory_tracker(roots, optimizer)
            counter = _CollectiveCounter(_group_dims(dims))
            with tracker, counter:
                step.run(batch, 0, batch_rank, batch_degree)
        coordinate = dict(zip(DIM_NAMES, dims.mesh.get_coordinate()))
        return RankResult(rank, coordinate, layout, tracker.peak(), counter.collectives)


def _make_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Adam's moments exist from a run's first step on; the step measured is a steady one."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _fake_batch(layout: RunLayout, gpt_cfg: GPTConfig, batch_rank: int,
                batch_degree: int) -> StepBatch:
    """This rank's slots of the step, as the data stream makes them (C1 fixed global batch):
    its micro-batches, and a zero-weight repeat where it has one fewer than the busiest rank."""
    split = layout.batch_split
    slots = split.slots(batch_degree)
    real = len(split.rank_micro_batches(batch_rank, batch_degree))
    tokens = torch.randint(0, gpt_cfg.vocab_size,
                           (real, split.micro_batch_size, gpt_cfg.seq_len + 1))
    views = [tokens[min(k, real - 1)] for k in range(slots)]
    return StepBatch(0, views, [1.0] * real + [0.0] * (slots - real), 0, tokens)


def _group_dims(dims) -> dict[str, str]:
    """A process group's name -> the mesh dimension (or flattened dims) it is, "world" for the
    default group."""
    mesh = dims.mesh
    out = {dist.group.WORLD.group_name: "world"}
    for name in DIM_NAMES:
        if mesh.size(mesh.mesh_dim_names.index(name)) > 1:
            out[mesh[name].get_group().group_name] = name
    for flat in ("dp_shard_tp", "pp_tp"):
        try:
            out[mesh[flat].get_group().group_name] = flat
        except (KeyError, RuntimeError, ValueError):
            pass
    return out


class _CollectiveCounter(TorchDispatchMode):
    """Every collective the step runs on this rank, by the group's mesh dimension and kind. Ops on
    DTensors are passed to DTensor first, so the collectives it issues on local tensors come back
    through here (as torch's CommDebugMode does)."""

    KINDS = {"all_gather": "all_gather", "allgather": "all_gather",
             "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
             "allreduce": "all_reduce", "send": "send", "broadcast": "broadcast",
             "isend": "send", "batch_p2p": "send"}

    def __init__(self, group_dims: dict[str, str]):
        super().__init__()
        self.group_dims = group_dims
        self.collectives: dict[tuple[str, str], Collectives] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = collective_of(func, args, kwargs, out)
        if found is not None:
            group, size = found
            name = func._overloadpacket.__name__
            kind = next((k for prefix, k in self.KINDS.items() if name.lstrip("_").startswith(prefix)),
                        None)
            if kind is not None and kind != "recv":
                n = dist.get_world_size(group)
                ring = {"all_reduce": 2 * (n - 1) / n, "send": 1.0}.get(kind, (n - 1) / n)
                key = (self.group_dims.get(group.group_name, "other"), kind)
                c = self.collectives.setdefault(key, Collectives())
                c.count += 1
                c.bytes += ring * size
        return out

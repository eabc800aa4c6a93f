"""One attempt's layout, resolved once before anything is built: the mesh (parallel/mesh.py) and
the settings a run leaves on `auto` that trade memory for speed (train/run_memory.py), from the
config, the model's shape, the group's ranks and the nodes they are on, and the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_gpt.config import Config
from elastic_gpt.cost_model.memory_settings import MemorySettings
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.hardware import GPU
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.parallel.fsdp import resolve_dtype
from elastic_gpt.parallel.mesh import ParallelDims
from elastic_gpt.parallel.tp_rules import fsdp_columns_problem
from elastic_gpt.train.run_memory import resolve_run_memory


@dataclass(frozen=True)
class RunLayout:
    world_size: int
    dims: ParallelDims
    memory: MemorySettings
    """The resolved `auto` settings (HSDP, gradient sync, resharding) and the predicted peak."""
    batch_split: BatchSplit
    device: torch.device
    compute_dtype: torch.dtype
    threads: int
    """CPU threads per worker."""


def resolve_layout(cfg: Config, gpt_cfg: GPTConfig, *, world_size: int,
                   rank_nodes: list[str] | None, device: torch.device,
                   threads: int, gpu: GPU | None = None) -> RunLayout:
    """Collective (every rank of the group: the settings come from its smallest device memory).
    A tp the nodes cannot hold is one clear line, and a placement the layout cannot use raises
    `errors.PlacementError` (retried by the controller), both before anything is built. `gpu`:
    resolve the dtype and the memory settings as on this GPU, whatever `device` is (the dry run
    builds on fake tensors what a run on that GPU would)."""
    split = BatchSplit(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    compute_dtype = resolve_dtype(cfg.train.dtype, torch.device("cuda") if gpu else device)
    p = cfg.parallel
    # The layout as configured decides the data-parallel degree, hence each rank's micro-batches,
    # which the memory settings are resolved for; they may then turn HSDP on or off.
    configured = ParallelDims.for_nodes(world_size, tp=p.tp, hsdp=p.hsdp, rank_nodes=rank_nodes,
                                        pp=p.pp)
    memory = resolve_run_memory(
        cfg, gpt_cfg, world_size=world_size, rank_nodes=rank_nodes,
        micro_batch=split.micro_batch_size,
        micro_batches_per_rank=split.slots(configured.dp_degree), device=device,
        compute_dtype=compute_dtype, gpu=gpu)
    dims = ParallelDims.for_nodes(world_size, tp=p.tp, hsdp="on" if memory.hsdp else "off",
                                  rank_nodes=rank_nodes, pp=p.pp)
    problem = fsdp_columns_problem(p.tp, dims.dp_shard, gpt_cfg.n_embd,
                                   fused_qkv=gpt_cfg.family == "gpt2",
                                   what=f"{world_size} workers at parallel.tp={p.tp} "
                                        f"(dp_shard={dims.dp_shard})")
    if problem:  # before anything is built: FSDP2 would refuse it mid-build
        raise ValueError(problem)
    return RunLayout(world_size, dims, memory, split, device, compute_dtype, threads)

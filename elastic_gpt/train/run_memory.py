"""The settings a run leaves on `auto` that trade memory for speed (parallel.hsdp,
train.grad_sync, train.reshard_after_forward), resolved for this group of workers from the
planner's memory and step-time models (cost_model/memory_settings.py) before anything is built.

A run the planner says fits therefore never turns on a setting that the same memory model says
would not fit (HSDP's whole model state per node at 175B, the kept fp32 gradients at tp=8).
"""

from __future__ import annotations

import torch

from elastic_gpt.config import Config
from elastic_gpt.cost_model.memory_settings import MemorySettings, resolve_memory_settings
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.hardware import GPU, gpu_for_device
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.parallel.fsdp import group_device_bytes
from elastic_gpt.parallel.mesh import node_sizes


def resolve_run_memory(cfg: Config, gpt_cfg: GPTConfig, *, world_size: int,
                       rank_nodes: list[str] | None, micro_batch: int,
                       micro_batches_per_rank: int, device: torch.device,
                       compute_dtype: torch.dtype, gpu: GPU | None = None) -> MemorySettings:
    """Collective (every rank of the group, once): the resolved settings, the same on every rank
    (they are computed from the group's smallest device memory). `gpu`: resolve them for this
    GPU's memory instead of the device's (the dry run's, which runs on fake tensors)."""
    nodes = list(rank_nodes) if rank_nodes is not None else ["node"] * world_size
    cuda = gpu is not None or device.type == "cuda"
    if gpu is None and cuda:
        gpu = gpu_for_device(torch.cuda.get_device_name(device))
    device_bytes = gpu.memory_bytes if gpu is not None and device.type != "cuda" \
        else group_device_bytes(device)
    # A CPU worker has no CUDA context and workspaces; what tune's prediction leaves out too.
    host = {} if cuda else {"context_bytes": 0, "fragmentation": 0}
    return resolve_memory_settings(
        model_shape(gpt_cfg), world_size=world_size, tp=cfg.parallel.tp,
        workers_per_node=node_sizes(nodes), micro_batch=micro_batch,
        micro_batches_per_rank=micro_batches_per_rank,
        # Selective checkpointing keeps most of a block's activations: counted as keeping all.
        activation_checkpointing=(cfg.train.activation_checkpointing
                                  and cfg.train.activation_checkpointing_mode == "full"),
        dtype=str(compute_dtype).removeprefix("torch."), device_bytes=device_bytes,
        gpu=gpu, hsdp=cfg.parallel.hsdp, grad_sync=cfg.train.grad_sync,
        reshard_after_forward=cfg.train.reshard_after_forward, pp=cfg.parallel.pp,
        stages_per_rank=cfg.parallel.pp_stages_per_rank, **host)

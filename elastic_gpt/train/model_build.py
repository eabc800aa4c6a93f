"""The model a rank trains, built for its layout: on "meta" (no memory), then tensor parallelism,
activation checkpointing, compile and FSDP2 (parallel/fsdp.py), or, under pipeline parallelism,
this rank's stages each parallelized as a model of its own (parallel/pipeline.py). Nothing is
materialised here: `materialise` allocates this rank's shards on a device and, for a fresh run,
draws their initial values or reads them from a Hugging Face directory (`checkpoint.init_from`);
a resume reads them from its checkpoint instead."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from elastic_gpt.checkpoint.hf_weights import load_hf_weights
from elastic_gpt.config import Config
from elastic_gpt.model.config import ModelConfig
from elastic_gpt.model.families import build_model
from elastic_gpt.parallel.fsdp import init_sharded_weights, parallelize
from elastic_gpt.parallel.pipeline import Pipeline
from elastic_gpt.train.layout import RunLayout


@dataclass
class ParallelModel:
    model: torch.nn.Module
    """The whole model (sharded), or this rank's pipeline stages as one module."""
    pipeline: Pipeline | None
    n_params: int
    """Parameters of the whole model, counted before sharding."""


def build_parallel_model(cfg: Config, gpt_cfg: ModelConfig, layout: RunLayout, *,
                         rank: int) -> ParallelModel:
    """Collective (the mesh's sub-groups are used by the parallelization): this rank's part of
    the model of `gpt_cfg`'s family, parallelized, on "meta"."""
    with torch.device("meta"):
        model = build_model(gpt_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    t, dims = cfg.train, layout.dims
    parallelize_part = functools.partial(
        parallelize, mesh=dims.fsdp_mesh, compute_dtype=layout.compute_dtype,
        activation_checkpointing=t.activation_checkpointing, compile=t.compile,
        checkpointing_mode=t.activation_checkpointing_mode, float8=t.float8,
        async_tp=cfg.parallel.async_tp,
        reshard_after_forward=layout.memory.reshard_after_forward,
        tp_mesh=dims.tp_mesh if dims.tp_enabled else None)
    if dims.pp_enabled:
        p = cfg.parallel
        pipeline = Pipeline(model, dims.mesh, dims.pp_rank(rank), p.pp_stages_per_rank,
                            p.pp_schedule, parallelize_part)
        return ParallelModel(pipeline.model, pipeline, n_params)
    parallelize_part(model)
    return ParallelModel(model, None, n_params)


def materialise(model: torch.nn.Module, device: torch.device, *, initialise: bool,
                seed: int, init_from: str = "") -> float:
    """This rank's shards allocated on `device` and, if `initialise`, drawn from the run's
    seeded initialisation (the same values at any layout) or, with `init_from`, read from that
    Hugging Face directory (each rank its shards' slices); returns the seconds it took."""
    model.to_empty(device=device)
    if not initialise:
        return 0.0
    t0 = time.perf_counter()
    if init_from:
        load_hf_weights(model, init_from)
    else:
        init_sharded_weights(model, seed=seed)
    return time.perf_counter() - t0

"""A pipeline rank's stages for tests and benchmarks without the Trainer: a model cut as the
Trainer cuts it (parallel/pipeline.py), each stage tensor-parallel over the mesh's "tp" dim when
it has more than one rank and FSDP2 over its "dp_shard" dim (fp32), materialised on the CPU
with the seeded init every layout shares."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from elastic_gpt.model.config import ModelConfig
from elastic_gpt.model.families import build_model


def cpu_stages(cfg: ModelConfig, mesh: DeviceMesh, stages_per_rank: int, seed: int = 0) -> list:
    """This rank's stages; `mesh` has dims "pp" and "dp_shard" (and optionally "tp")."""
    from elastic_gpt.parallel.fsdp import apply_fsdp, init_sharded_weights
    from elastic_gpt.parallel.pipeline import split_model
    from elastic_gpt.parallel.tensor import apply_tensor_parallel

    with torch.device("meta"):
        gpt = build_model(cfg)
    stages = split_model(gpt, mesh.get_local_rank("pp"), mesh["pp"].size(), stages_per_rank)
    tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    for stage in stages:
        if tp > 1:
            apply_tensor_parallel(stage, mesh["tp"])
        apply_fsdp(stage, mesh["dp_shard"], torch.float32)
        stage.to_empty(device="cpu")
        init_sharded_weights(stage, seed=seed)
    return stages

"""The named mesh built in a real process group: named, built once, and every communicator of it
opened when it is built."""

from __future__ import annotations

from elastic_gpt.parallel.mesh import ParallelDims
from elastic_gpt.testing.gloo import gloo_group


def test_the_mesh_is_named_and_built_once():
    with gloo_group():
        d = ParallelDims(1, 1, 1)
        mesh = d.build_mesh("cpu")
        assert d.build_mesh("cpu") is mesh and d.mesh is mesh
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
        assert d.fsdp_mesh.mesh_dim_names == ("dp_shard",) and d.tp_mesh.size() == 1
        assert d.pp_mesh.size() == 1 and d.batch_group() is None


def _connect(rank: int, world: int) -> dict:
    import torch

    from elastic_gpt.torch_internals import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_reduce" in func.overloadpacket.__name__ or "allreduce" in str(func):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    d = ParallelDims.for_nodes(world, tp=2, hsdp="on", rank_nodes=["a", "a", "b", "b"])
    with Collectives() as watch:
        d.build_mesh("cpu", connect_on=torch.device("cpu"))
    plain = ParallelDims.for_nodes(world, tp=2, hsdp="on", rank_nodes=["a", "a", "b", "b"])
    plain.build_mesh("cpu")
    return {"connected": d.connected, "collectives": len(watch.seen), "plain": plain.connected}


def test_every_communicator_of_the_mesh_is_opened_when_it_is_built():
    """NCCL opens a communicator at a group's first collective: the Trainer's mesh does it for
    the default group and every dim of more than one rank as it is built (here hsdp 2 x tp 2 on
    four gloo ranks), before anything else touches them."""
    from elastic_gpt.testing.gloo import run_gloo

    for got in run_gloo(_connect, 4):
        assert got["connected"] == ["dp_replicate", "tp"], got
        assert got["collectives"] == 3 and got["plain"] is None, got

"""The private PyTorch APIs that need a process group (gloo ranks): DTensor's strided shards keep
their parts through a matmul, a flattened mesh dimension is registered with its root, and FSDP2's
memory tracker follows an FSDP unit of two modules whose second never runs its forward."""

from __future__ import annotations

import torch

from elastic_gpt.torch_internals import (
    StridedShard,
    flatten_mesh,
    memory_tracker,
)


def changed(what: str) -> str:
    return (f"torch {torch.__version__}: {what}. elastic-gpt uses it through "
            "elastic_gpt/torch_internals.py and is tested with the torch range in pyproject.toml")


def test_strided_shard_splits_parts_and_the_matmul_keeps_it():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from elastic_gpt.testing.gloo import gloo_group

    placement = StridedShard(0, split_factor=3)
    assert (placement.dim, placement.split_factor) == (0, 3), changed("_StridedShard's fields")
    assert placement == StridedShard(0, split_factor=3) and not isinstance(placement, Shard), \
        changed("_StridedShard's equality or its relation to Shard")
    with gloo_group():  # a mesh of one: the placement's bookkeeping, not its communication
        mesh = init_device_mesh("cpu", (1,))
        w = torch.arange(24.0).reshape(6, 4)
        weight = distribute_tensor(w, mesh, [placement])
        assert torch.equal(weight.full_tensor(), w), changed("distribute_tensor(_StridedShard)")
        x = DTensor.from_local(torch.ones(2, 3, 4), mesh, (Replicate(),))
        y = torch.nn.functional.linear(x, weight)
        # parallel/tensor.py's FusedColwiseParallel relies on this to compute q, k, v locally.
        assert y.placements == (StridedShard(2, split_factor=3),), changed(
            f"linear() of a _StridedShard weight gives {y.placements}")


def test_a_flattened_mesh_dim_is_registered_with_its_root():
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.testing.gloo import gloo_group

    with gloo_group():
        root = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
        flat = flatten_mesh(root["b", "c"], "b_c")
        assert flat.mesh_dim_names == ("b_c",) and flat.size() == 1, changed("_flatten()")
        assert root["b_c"].mesh_dim_names == ("b_c",), changed(
            "a flattened dim is found by name on its root mesh")




def test_the_fake_process_group_runs_collectives_that_move_nothing():
    """fake_process_group: one rank of a world of 1,024 in this process; a collective returns at
    once and moves nothing, and the group is gone after the with-block."""
    import torch
    import torch.distributed as dist

    from elastic_gpt.torch_internals import fake_process_group

    with fake_process_group(rank=5, world_size=1024):
        assert (dist.get_rank(), dist.get_world_size()) == (5, 1024)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
    assert not dist.is_initialized()


def test_the_memory_tracker_follows_a_unit_whose_output_layer_runs_no_forward():
    """An untied Llama's final norm and output layer are one FSDP unit; the chunked loss reads the
    output layer's weight without calling it. torch's tracker wraps the unit's backward once per
    module and looks the output layer's record up; the step must be tracked, and the unit's own
    backward be back after the tracker."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.model.config import LlamaConfig
    from elastic_gpt.model.llama import Llama
    from elastic_gpt.parallel.fsdp import apply_fsdp
    from elastic_gpt.testing.gloo import gloo_group

    with gloo_group():
        model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=16,
                                  vocab_size=64))
        apply_fsdp(model, init_device_mesh("cpu", (1,)), torch.float32)
        group = model.lm_head._get_fsdp_state()._fsdp_param_group
        assert group is model.ln_f._get_fsdp_state()._fsdp_param_group, changed(
            "fully_shard of a module list gives them one parameter group")
        own = group.pre_backward, group.post_backward
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randint(0, 64, (2, 16))
        with memory_tracker([model], optimizer) as tracker:
            model(x, targets=x).sum().backward()
        assert tracker.peak()["Total"] > 0
        assert model.lm_head.weight.grad is not None
        assert (group.pre_backward, group.post_backward) == own, changed(
            "the tracker's wrappers of a parameter group are removed on exit")

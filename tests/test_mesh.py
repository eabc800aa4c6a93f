"""The named mesh's arithmetic without processes: which layout a group of ranks on which nodes
gets (tensor-parallel groups inside nodes, HSDP across nodes of equal size), each rank's
data- and tensor-parallel rank, and one clear line, a FatalTrainingError, for a group that
cannot hold the layout. The mesh itself is built once, in a group of one."""

from __future__ import annotations

import pytest

from elastic_gpt.errors import FatalTrainingError
from elastic_gpt.parallel.mesh import ParallelDims, node_sizes
from elastic_gpt.testing.gloo import gloo_group


def dims(world: int, nodes: str | None = None, tp: int = 1, hsdp: str = "auto") -> tuple:
    d = ParallelDims.for_nodes(world, tp=tp, hsdp=hsdp,
                               rank_nodes=nodes.split(",") if nodes else None)
    assert d.world_size == world
    return d.dp_replicate, d.dp_shard, d.tp


@pytest.mark.parametrize("world,nodes,tp,hsdp,expected", [
    (1, None, 1, "auto", (1, 1, 1)),
    (4, None, 1, "auto", (1, 4, 1)),  # one node: FSDP over all, as main does
    (4, None, 2, "auto", (1, 2, 2)),
    (2, None, 2, "auto", (1, 1, 2)),
    (4, "a,a,b,b", 1, "auto", (2, 2, 1)),  # HSDP: shard in a node, replicate across
    (4, "a,a,b,b", 2, "auto", (2, 1, 2)),
    (4, "a,a,b,b", 1, "off", (1, 4, 1)),
    (4, "a,a,a,b", 1, "auto", (1, 4, 1)),  # uneven nodes: auto falls back to plain FSDP
    (6, "a,a,b,b,c,c", 2, "on", (3, 1, 2)),
    (2, "a,a", 1, "on", (1, 2, 1)),  # one node: nothing to replicate across
])
def test_layout_from_world_tp_and_nodes(world, nodes, tp, hsdp, expected):
    assert dims(world, nodes, tp, hsdp) == expected


def test_ranks_of_a_tensor_parallel_group_are_consecutive_and_share_a_data_parallel_rank():
    d = ParallelDims.for_nodes(8, tp=2, hsdp="auto", rank_nodes=["a"] * 4 + ["b"] * 4)
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [d.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert (d.dp_degree, d.hsdp, d.loss_parallel) == (4, True, True)
    assert d.describe() == "dp 4 (HSDP 2 x 2) x tp 2"
    assert ParallelDims(1, 3, 1).describe() == "dp 3 x tp 1"
    assert not ParallelDims(1, 3, 1).loss_parallel


@pytest.mark.parametrize("world,nodes,tp,hsdp,message", [
    (4, "a,a,a,b", 2, "auto",
     "workers per node [3, 1] are not all multiples of parallel.tp=2 (a tensor-parallel group "
     "must stay inside one node)"),
    (2, None, 4, "auto", "parallel.tp=4 is more than the 2 worker(s) of this group"),
    (4, "a,b,a,b", 1, "auto", "the ranks of node a are not consecutive"),
    (4, "a,a,a,b", 1, "on", "parallel.hsdp=on needs the same number of workers on every node, "
     "got [3, 1]"),
])
def test_a_group_that_cannot_hold_the_layout_is_one_fatal_line(world, nodes, tp, hsdp, message):
    with pytest.raises(FatalTrainingError) as e:
        dims(world, nodes, tp, hsdp)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_node_sizes_are_in_rank_order():
    assert node_sizes(["x", "x", "y", "z", "z", "z"]) == [2, 1, 3]


def test_the_mesh_is_named_and_built_once():
    with gloo_group():
        d = ParallelDims(1, 1, 1)
        mesh = d.build_mesh("cpu")
        assert d.build_mesh("cpu") is mesh and d.mesh is mesh
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        assert d.fsdp_mesh.mesh_dim_names == ("dp_shard",) and d.tp_mesh.size() == 1

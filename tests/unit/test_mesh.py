"""The named mesh's arithmetic without processes: which layout a group of ranks on which nodes
gets (tensor-parallel groups inside nodes, HSDP across nodes of equal size), each rank's
data- and tensor-parallel rank, and one clear line for a group that cannot hold the layout: a
FatalTrainingError where no placement could, a retryable PlacementError where the nodes the ranks
landed on could not."""

from __future__ import annotations

import pickle

import pytest

from elastic_gpt.errors import FatalTrainingError, PlacementError, permanent_failure
from elastic_gpt.parallel.mesh import ParallelDims, ParallelLayoutError, node_sizes


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


def test_a_layout_no_placement_can_hold_is_one_fatal_line():
    with pytest.raises(FatalTrainingError) as e:
        dims(2, None, 4, "auto")
    assert "parallel.tp=4 is more than the 2 worker(s) of this group" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("world,nodes,tp,hsdp,message,aligned", [
    (4, "a,a,a,b", 2, "auto",
     "workers per node [3, 1] are not all multiples of parallel.tp=2 (a tensor-parallel group "
     "must stay inside one node)", 2),
    (6, "a,a,a,b,b,b", 2, "auto", "workers per node [3, 3]", 4),
    (4, "a,b,a,b", 1, "auto", "the ranks of node a are not consecutive", 4),
    (4, "a,a,a,b", 1, "on", "parallel.hsdp=on needs the same number of workers on every node, "
     "got [3, 1]", 4),
])
def test_a_placement_that_cannot_hold_the_layout_is_retryable(world, nodes, tp, hsdp, message,
                                                              aligned):
    """Where Ray put the workers, not the config: not fatal (the controller retries it at a
    placement of whole groups, elastic/policies.py), and it says how many workers the nodes held
    in whole tensor-parallel groups, the most the retry asks for."""
    with pytest.raises(PlacementError) as e:
        dims(world, nodes, tp, hsdp)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not isinstance(e.value, FatalTrainingError)
    assert permanent_failure(e.value) is None
    assert e.value.aligned_workers == aligned
    copy = pickle.loads(pickle.dumps(e.value))  # how Ray hands it to the controller
    assert (str(copy), copy.per_node, copy.tp) == (str(e.value), e.value.per_node, e.value.tp)


def test_node_sizes_are_in_rank_order():
    assert node_sizes(["x", "x", "y", "z", "z", "z"]) == [2, 1, 3]


def test_pipeline_stages_are_the_outermost_runs_of_ranks():
    # 8 ranks, pp=2 x dp=2 x tp=2: ranks 0-3 hold the first stage, 4-7 the second.
    d = ParallelDims.for_nodes(8, tp=2, hsdp="off", pp=2)
    assert (d.pp, d.dp_degree, d.tp, d.world_size) == (2, 2, 2, 8)
    assert [d.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [d.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert d.describe() == "dp 2 x tp 2 x pp 2"
    # HSDP replicates across the nodes of one stage: each stage spans nodes a, b (two ranks each).
    hsdp = ParallelDims.for_nodes(8, tp=1, hsdp="auto", pp=2,
                                  rank_nodes=["a", "a", "b", "b", "c", "c", "d", "d"])
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.pp) == (2, 2, 2)
    with pytest.raises(ParallelLayoutError, match="not whole pipelines of parallel.pp=2 x "
                                                  "parallel.tp=2.*multiples of 4"):
        ParallelDims.for_nodes(6, tp=2, hsdp="off", pp=2)



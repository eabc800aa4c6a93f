"""Pipeline parallelism's layout (parallel/pipeline.py, cost_model/pipeline.py): stages balanced by
cost, the planner pacing a pipeline by its busiest rank, and one clear line for a pipeline the
model cannot hold."""

from __future__ import annotations

import itertools

import pytest

from elastic_gpt.cost_model.memory import memory_per_gpu
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.pipeline import (
    KEPT_GATHERED,
    PipelineLayoutError,
    in_flight,
    pipelined_memory,
    pipelined_step_time,
    rank_shapes,
    rank_stages,
    stage_costs,
    stage_layers,
)
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.cost_model.step_time import step_time
from elastic_gpt.hardware import get_gpu
from elastic_gpt.model.config import GPTConfig

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64)


def test_stages_balance_the_blocks_and_the_output_layer():
    # A small vocabulary: the output layer costs little; blocks split evenly.
    assert stage_layers(GPTConfig(n_layer=8, n_head=2, n_embd=64, seq_len=32,
                                  vocab_size=64), 4) == [range(0, 2), range(2, 4), range(4, 6),
                                                         range(6, 8)]
    # GPT-2's vocabulary on a narrow model: the output layer costs ~2 blocks, so the last stage
    # takes fewer blocks.
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50304)
    block, head = stage_costs(cfg)
    layers = stage_layers(cfg, 4)
    assert len(layers[-1]) < min(len(r) for r in layers[:-1])
    assert sum(len(r) for r in layers) == 12 and layers[0].start == 0 and layers[-1].stop == 12
    costs = [len(r) * block + (head if i == 3 else 0) for i, r in enumerate(layers)]
    # No other cut has a cheaper costliest stage (every cut of 12 blocks into 4 runs).
    best = min(max(c[0] * block, (c[1] - c[0]) * block, (c[2] - c[1]) * block,
                   (12 - c[2]) * block + head)
               for c in itertools.combinations(range(1, 12), 3))
    assert max(costs) == best
    assert rank_stages(1, 2, 2) == [1, 3]


def test_the_planner_paces_a_pipeline_by_the_rank_with_the_most_blocks():
    """GPT-3 175B's 96 blocks on 64 stages: the first rank holds one block, the last one and the
    output layer, and the ranks between hold two. The step is a two-block rank's, about twice
    the first rank's compute, and the peak memory is the first two-block rank's (it keeps 33
    micro-batches of two blocks against the first rank's 64 of one). Timing only the first and
    the last rank once planned this pipeline faster than 32 stages of three blocks for the same
    batch."""
    cfg = GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=2048, vocab_size=51200)
    shape = model_shape(cfg)
    parts = rank_shapes(shape, 64)
    assert parts[0].cfg.n_layer == 1 and parts[63].cfg.n_layer == 1
    middle = min(r for r, s in parts.items() if s.cfg.n_layer == 2)
    assert 0 < middle < 63 and max(s.cfg.n_layer for s in parts.values()) == 2
    # only the first and the last rank hold the embedding; only the last the output layer
    assert parts[middle].root_params == 0 and parts[middle].head_fwd_flops_per_token == 0
    assert parts[0].root_params == parts[63].root_params == shape.root_params

    gpu, net, m = get_gpu("A100-80GB"), Network(8, 195, 160), 96
    kw = dict(activation_checkpointing=True)
    mesh = make_mesh(1024, 8, False, 8, 64, 1)
    st = pipelined_step_time(shape, gpu, net, mesh, 1, m, **kw)

    def rank_step(r):
        return step_time(parts[r], gpu, net, mesh.stage_world, 1, m, tp=8, **kw, **KEPT_GATHERED)

    assert st.compute_s == pytest.approx(rank_step(middle).compute_s)
    assert st.compute_s > 1.9 * rank_step(0).compute_s
    # The same batch on 32 stages of 3 blocks: half the micro-batches per pipeline (twice the
    # data-parallel degree), so a rank runs 3 m / 2 blocks' worth (and the last the output
    # layer) against the 2 m of a 64-stage rank: 64 stages are the slower.
    three = pipelined_step_time(shape, gpu, net, make_mesh(1024, 8, False, 8, 32, 1), 1, m // 2,
                                **kw)
    assert 1.1 < st.compute_s / three.compute_s < 4 / 3

    mem = dict(activation_checkpointing=True, micro_batches_per_rank=m, **KEPT_GATHERED)
    peak = pipelined_memory(shape, mesh, 1, m, **mem)
    first_two = memory_per_gpu(parts[middle], mesh.stage_world, 1, tp=8, loss="none",
                               in_flight=in_flight(64, m, 1, pp_rank=middle), **mem)
    first = memory_per_gpu(parts[0], mesh.stage_world, 1, tp=8, loss="none",
                           in_flight=in_flight(64, m, 1), **mem)
    assert peak.total == first_two.total > first.total


def test_a_pipeline_the_model_cannot_hold_is_one_clear_line():
    with pytest.raises(PipelineLayoutError, match="at least one block each.*n_layer is 4"):
        stage_layers(CFG, 5)


# ---- the Trainer's pipelined step ----------------------------------------------------------


# ---- resharding between pipeline and data parallelism through checkpoints ----------------------


# ---- the planner's pipeline terms against what torch's schedules do ---------------------------



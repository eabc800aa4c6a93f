"""Which ranks the dry run simulates: those whose build or step differs from rank 0's."""

from __future__ import annotations

import pytest

from elastic_gpt.dry_run.cli import _ranks, ranks_that_differ
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.training_plan import plan_training


def _plan(model="gpt3-175b", **layout):
    return plan_training(PlanInputs(model=model, gpu="A100-80GB", **layout))


def test_a_pipelined_layout_runs_the_first_rank_the_last_shard_and_the_last_stage():
    plan = _plan(n_gpus=1024, tp=8, pp=16, pp_stages_per_rank=2)
    m = plan.chosen.mesh
    assert (m.pp, m.dp_shard, m.tp) == (16, 8, 8)
    # Rank order is pp-major, tp fastest: the last FSDP shard of stage 0 is (dp_shard - 1) * tp;
    # the first rank of the last stage is (pp - 1) * (world / pp).
    assert ranks_that_differ(plan) == [0, 56, 960]


def test_one_fsdp_shard_and_one_stage_is_rank_0_alone():
    plan = _plan("gpt3-1.3b", n_gpus=2, tp=2)
    assert (plan.chosen.mesh.dp_shard, plan.chosen.mesh.pp) == (1, 1)
    assert ranks_that_differ(plan) == [0]


@pytest.mark.parametrize("text, world, expected", [("0", 8, [0]), ("7,0,7", 8, [0, 7])])
def test_ranks_asked_for_are_run_once_each_in_order(text, world, expected):
    assert _ranks(text, world) == expected


@pytest.mark.parametrize("text", ["8", "-1", "a,b", "", "0,,1"])
def test_ranks_outside_the_world_or_not_numbers_are_one_line(text):
    with pytest.raises(ValueError, match=r"--ranks .* must be comma-separated ranks in \[0, 8\)"):
        _ranks(text, 8)


def test_a_gpt_layout_whose_fsdp_shards_cannot_split_c_attns_columns_is_not_planned():
    """Under tensor parallelism GPT-2's fused c_attn is FSDP-sharded on its n_embd columns, and
    FSDP2 shards that dim only evenly: the 1T model (n_embd 25,600) on 3,072 A100s is not planned
    at tp=8 x dp_shard=24 (the dry run found the trainer refuses to build it), and forcing that
    mesh is one line naming the dims."""
    from elastic_gpt.model.config import GPTConfig
    from elastic_gpt.parallel.tp_rules import fsdp_columns_problem
    from elastic_gpt.planner.inputs import PlanError

    one_t = GPTConfig(n_layer=128, n_head=160, n_embd=25600, seq_len=2048, vocab_size=51200)
    plan = plan_training(PlanInputs(model=one_t, gpu="A100-80GB", n_gpus=3072,
                                    global_batch_size=3072))
    m = plan.chosen.mesh
    assert m.tp == 1 or 25600 % m.dp_shard == 0, m
    with pytest.raises(PlanError, match=r"tp=8 x dp_shard=24: 24 FSDP shards do not divide "
                                        r"n_embd=25600"):
        plan_training(PlanInputs(model=one_t, gpu="A100-80GB", n_gpus=3072, tp=8, pp=16,
                                 hsdp="off", global_batch_size=3072))
    # Separate q, k and v (Llama's) are sharded on their rows: nothing to divide.
    assert fsdp_columns_problem(8, 24, 25600, fused_qkv=False) is None
    assert fsdp_columns_problem(1, 24, 25600, fused_qkv=True) is None

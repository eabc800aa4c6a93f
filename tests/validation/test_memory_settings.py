"""Every plan of a sweep of models, GPUs and cluster sizes resolves the same memory settings at
run time as the planner chose (cost_model/memory_settings.py, train/run_memory.py)."""

from __future__ import annotations

from elastic_gpt.planner.inputs import PlanError, PlanInputs
from elastic_gpt.planner.training_plan import plan_training
from tests.planner_helpers import as_planned, planned_settings


def test_every_plan_of_a_sweep_is_resolved_the_same_at_run_time():
    checked = 0
    for model in ("gpt2-124m", "gpt2-774m", "gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"):
        for gpus in ("A100-80GB", "A100-40GB", "H100", "L4"):
            for n in (1, 8, 16, 64, 256):
                try:
                    plan = plan_training(PlanInputs(model=model, gpu=gpus, n_gpus=n,
                                                    replica_groups="off"))
                except PlanError:
                    continue
                got = as_planned(plan)
                assert (got.hsdp, got.grad_sync, got.reshard_after_forward) == \
                    planned_settings(plan.chosen), (model, gpus, n)
                checked += 1
    assert checked > 80



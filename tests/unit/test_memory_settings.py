"""The settings a run leaves on `auto` that trade memory for speed (parallel.hsdp,
train.grad_sync, train.reshard_after_forward) resolve as the planner chooses them: one memory
model and one rule for both (cost_model/memory_settings.py, train/run_memory.py)."""

from __future__ import annotations

import pytest

from elastic_gpt.cost_model.memory_settings import resolve_memory_settings
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.hardware import GiB
from elastic_gpt.model.config import preset_config
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.training_plan import plan_training
from tests.planner_helpers import as_planned, planned_settings


@pytest.mark.parametrize("model, gpus, n", [("gpt3-175b", "A100-80GB", 64),
                                             ("gpt3-13b", "A100-80GB", 16),
                                             ("gpt3-13b", "H100", 16)])
def test_a_run_resolves_what_the_plan_chose(model, gpus, n):
    plan = plan_training(PlanInputs(model=model, gpu=gpus, n_gpus=n, replica_groups="off"))
    got = as_planned(plan)
    assert (got.hsdp, got.grad_sync, got.reshard_after_forward) == planned_settings(plan.chosen)
    assert got.fits and got.memory.total == pytest.approx(plan.chosen.memory.total)


def test_at_175b_hsdp_and_kept_gradients_are_refused_because_they_do_not_fit():
    """The defaults before: HSDP whenever the group spans nodes of one size, gradients kept
    unsharded across micro-batches. The same memory model says neither fits at 175B."""
    plan = plan_training(PlanInputs(model="gpt3-175b", gpu="A100-80GB", n_gpus=64,
                                    replica_groups="off"))
    assert plan.chosen.micro_batches_per_rank > 1
    resolved = as_planned(plan)
    assert not resolved.hsdp and resolved.grad_sync == "microbatch"
    old_hsdp = as_planned(plan, hsdp="on")
    old_sync = as_planned(plan, grad_sync="step")
    assert not old_hsdp.fits and old_hsdp.memory.total > 4 * resolved.usable_bytes
    assert not old_sync.fits
    # An explicit setting is kept even when it does not fit (a warning at run time, not a refusal).
    assert old_hsdp.hsdp and old_sync.grad_sync == "step"


def test_without_a_step_time_model_the_least_communication_that_fits_wins():
    shape = model_shape(preset_config("gpt2-124m"))
    common = dict(world_size=4, tp=1, workers_per_node=[2, 2], micro_batch=2,
                  micro_batches_per_rank=4, activation_checkpointing=False, dtype="float32",
                  gpu=None)
    roomy = resolve_memory_settings(shape, device_bytes=64 * GiB, **common)
    assert (roomy.hsdp, roomy.grad_sync, roomy.reshard_after_forward) == (True, "step", False)
    assert roomy.chosen_by == "the least communication that fits"
    # Less room: what fits with the most saved communication, not the smallest footprint.
    need = {(h, s, r): resolve_memory_settings(
        shape, device_bytes=1e15, hsdp="on" if h else "off", grad_sync=s,
        reshard_after_forward="always" if r else "never", **common).memory.total
        for h in (True, False) for s in ("step", "microbatch") for r in (True, False)}
    # HSDP with kept gradients no longer fits; HSDP comes first, so it is kept and the gradients
    # are reduced per micro-batch instead.
    budget = (need[(True, "microbatch", False)] + 1) / 0.9
    assert need[(True, "step", False)] > budget * 0.9
    tight = resolve_memory_settings(shape, device_bytes=budget, **common)
    assert (tight.hsdp, tight.grad_sync, tight.reshard_after_forward) == (True, "microbatch",
                                                                          False)
    # Nothing fits: the smallest footprint, marked so the trainer warns.
    none = resolve_memory_settings(shape, device_bytes=1 * GiB, **common)
    assert not none.fits and none.memory.total == min(need.values())
    # HSDP needs nodes of one size.
    uneven = resolve_memory_settings(shape, device_bytes=64 * GiB,
                                     **{**common, "workers_per_node": [3, 1]})
    assert not uneven.hsdp



"""The default calibration against the published runs it rests on (validation/calibration.py,
validation/calibration_runs.py): fitting them again gives the figures the product froze, no run
both fits and checks, every check but two named ones is reproduced within 15% (torchtitan's
included), and no default plan goes above the best MFU a published run of its class reached."""

from __future__ import annotations

import pytest

from elastic_gpt.cost_model.calibration import (
    BEST_PUBLISHED_MFU,
    DEFAULT_CALIBRATION,
    UNCALIBRATED,
)
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.planner.inputs import PlanError, PlanInputs
from elastic_gpt.planner.training_plan import plan_training
from validation.calibration import best_published_mfu, fit_default, residuals
from validation.calibration_runs import (
    ALL_RUNS,
    CHECK,
    FIT,
    MISSES,
    MOSAICML,
    TITAN_H100,
    UNPLANNED_FEATURES,
)


@pytest.fixture(scope="module")
def fitted():
    return fit_default()


@pytest.fixture(scope="module")
def rows(fitted):
    return residuals(fitted)


def test_the_frozen_default_is_what_fitting_the_published_runs_gives(fitted):
    """The product's figures (terms to three decimals, the spread to two, the evidence) are the
    fit's: a change to the cost model that moves them fails here until they are frozen again
    (and a new dated report says so)."""
    assert set(fitted.families) == set(DEFAULT_CALIBRATION.families) == {"H100", "A100", "H200"}
    for family, fc in fitted.families.items():
        frozen = DEFAULT_CALIBRATION.families[family]
        assert (round(fc.terms.backward, 3), round(fc.terms.eager_elementwise, 3)) == (
            frozen.terms.backward, frozen.terms.eager_elementwise), family
        assert fc.evidence == frozen.evidence and fc.scaled_from is frozen.scaled_from is None
    assert tuple(round(x, 2) for x in fitted.spread) == DEFAULT_CALIBRATION.spread
    assert fitted.name == DEFAULT_CALIBRATION.name


def test_no_run_both_fits_and_checks():
    """Each published run is in exactly one of the fit and the check sets of its family; H100's
    terms are fitted on torchtitan's runs only, and each family is checked on runs it was not
    fitted on, MosaicML's among them where they ran on it."""
    for family in FIT:
        assert not set(FIT[family]) & set(CHECK[family])
        assert CHECK[family], family
    every = [r for family in FIT for r in FIT[family] + CHECK[family]]
    assert sorted(every, key=id) == sorted(ALL_RUNS, key=id) and len(set(every)) == len(ALL_RUNS)
    assert all(r.source == TITAN_H100 for r in FIT["H100"])
    assert {r.source for r in CHECK["H100"]} == {TITAN_H100, MOSAICML}
    assert MOSAICML in {r.source for r in CHECK["A100"]}


def test_every_run_is_reproduced_within_15_percent_but_the_two_named_misses(rows):
    """Planned over measured throughput, each run in the layout it ran: the fitted runs and the
    checks within 15%, but two, each on the side its reason says (async TP, which no plan
    writes, planned slower than it ran; MosaicML's 70B on 64 A100-40GB faster). Before the
    calibration the same runs were planned 1.1-1.8x too fast."""
    misses = {}
    for r in rows:
        if r.miss:
            misses[r.run.source, r.run.label] = r.calibrated
        else:
            assert abs(r.calibrated - 1) <= 0.15, (r.family, r.role, r.run.label, r.calibrated)
        assert 1.05 < r.kernel_model < 1.85, (r.run.label, r.kernel_model)
    assert set(misses) == set(MISSES)
    assert misses[TITAN_H100, "70B, FSDP 32 x TP 8, async TP"] < 0.85
    assert misses[MOSAICML, "MPT 70B, 64 x A100-40GB"] > 1.15
    assert (TITAN_H100, "70B, FSDP 32 x TP 8, async TP") in UNPLANNED_FEATURES


def test_torchtitans_published_runs_not_fitted_are_planned_within_15_percent(rows):
    """torchtitan's own checks: Llama 3.1 8B on 128 H100s (eager, compiled, float8), 405B on
    FSDP 8 x TP 8 x PP 8 (1F1B and interleaved), Llama 2 on 64 A100s, 8B on 64 H200s; each
    within 15% (their 70B with async TP is the named miss above)."""
    titan = [r for r in rows if r.role == "check" and r.run.source.startswith("torchtitan")
             and not r.miss]
    assert len(titan) == 3 + 2 + 4 + 1
    assert all(abs(r.calibrated - 1) <= 0.15 for r in titan), [
        (r.run.label, round(r.calibrated, 3)) for r in titan]


def test_the_best_published_mfu_of_each_class_is_the_frozen_one():
    assert best_published_mfu() == BEST_PUBLISHED_MFU


ONE_T = GPTConfig(n_layer=128, n_head=160, n_embd=25600, seq_len=2048, vocab_size=51200)
DEFAULT_PLANS = [(model, gpu, n, {}) for gpu in ("A100-80GB", "A100-40GB", "H100")
                 for model in ("gpt2-350m", "gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b")
                 for n in (8, 64, 1024)] + [
    (ONE_T, "A100-80GB", 3072, dict(global_batch_size=3072)),
    # SC21's 1T at its batch on its network: planned 60.8% uncalibrated, every block recomputed
    (ONE_T, "A100-80GB", 3072, dict(global_batch_size=3072, intra_node_gbps=195,
                                    inter_node_gbps=160))]


def test_no_default_plan_exceeds_the_best_published_mfu_of_its_class():
    """Default plans (bf16, every choice left to the planner) of GPT sizes from 350M to 1T on 8
    to 3,072 A100s and H100s (the 1T also on SC21's network): none plans a higher MFU than a
    published bf16 run of its class (GPU family, every block recomputed or not) reached; the
    kernel model uncalibrated did (GPT-3 175B on 64 A100s at 57.9%, above the 53.2% of the best
    checkpointed A100 run; the 1T on SC21's network planned 60.8% at tp=8 x dp_shard=24, a mesh
    whose FSDP shards cannot split c_attn's 25,600 columns, which the trainer cannot build and the
    planner no longer weighs)."""
    over, planned = [], 0
    for model, gpu, n, kw in DEFAULT_PLANS:
        try:
            plan = plan_training(PlanInputs(model=model, gpu=gpu, n_gpus=n, **kw))
        except PlanError:  # does not fit that many GPUs of that kind
            continue
        planned += 1
        best = BEST_PUBLISHED_MFU[gpu.split("-")[0], plan.chosen.activation_checkpointing]
        if plan.mfu > best.mfu:
            over.append((model, gpu, n, round(plan.mfu, 3), best.mfu))
    assert planned >= 35 and not over, over
    for model, gpu, n, kw in (("gpt3-175b", "A100-80GB", 64, {}),):
        before = plan_training(PlanInputs(model=model, gpu=gpu, n_gpus=n, **kw,
                                          calibration=UNCALIBRATED))
        assert before.chosen.activation_checkpointing and before.mfu > BEST_PUBLISHED_MFU[
            "A100", True].mfu

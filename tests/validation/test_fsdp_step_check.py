"""The report's step-time note prints how far the calibrated model was from the published FSDP
runs of this trainer's kind (elastic_gpt/planner/fsdp_step_check.py, frozen there so that no
report plans those runs again): planned again here from the runs, they must still give the
frozen figures, as printed, or the note would no longer say what the model does."""

from __future__ import annotations

import pytest

from elastic_gpt.planner.fsdp_step_check import (
    EVERY_FAMILY,
    PLANNED_OVER_PUBLISHED,
    planned_over_published,
)
from validation.checks import fsdp_runs_planned_too_fast
from validation.runs import FSDP_RUNS, MOSAICML, TORCHTITAN


def test_the_frozen_families_are_those_the_fsdp_runs_ran_on():
    assert {r.source for r in FSDP_RUNS} == {TORCHTITAN, MOSAICML} and len(FSDP_RUNS) == 19
    assert set(PLANNED_OVER_PUBLISHED) == {r.gpu.split("-")[0] for r in FSDP_RUNS}


@pytest.mark.parametrize("family", [*PLANNED_OVER_PUBLISHED, "L4"])
def test_the_frozen_ratios_are_what_planning_the_published_fsdp_runs_gives(family):
    """Each family's range (the note prints two decimals), and every run's for a family none of
    them ran on (L4)."""
    least, most, same = fsdp_runs_planned_too_fast(family)
    frozen = planned_over_published(family)
    assert (f"{least:.2f}", f"{most:.2f}", same) == (f"{frozen[0]:.2f}", f"{frozen[1]:.2f}",
                                                     frozen[2])
    assert same == (family in PLANNED_OVER_PUBLISHED)
    if not same:
        assert frozen[:2] == EVERY_FAMILY

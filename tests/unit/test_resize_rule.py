"""The grow rule (elastic/resize_rule.py) on plain figures: when a larger group repays its restart
before the next membership change expected, and when it waits; the figures it reads from a run's
goodput ledger; and that the planner's goodput is the same arithmetic, not a copy of it."""

from __future__ import annotations

import math

import pytest

from elastic_gpt.config import ElasticSection
from elastic_gpt.elastic.resize_rule import (
    decide_grow,
    expected_interval_s,
    grow_decision,
    kept_fraction,
    membership_changes,
    observed_s,
    restart_cost_s,
)
from elastic_gpt.planner.inputs import HOUR, PlanInputs
from elastic_gpt.planner.reliability import goodput


def rule(current, target, restart_s, interval_s):
    return grow_decision(current=current, target=target, restart_s=restart_s,
                         interval_s=interval_s)


@pytest.mark.parametrize("current,target,restart_s,interval_s,grow", [
    # 1 -> 3 workers triples the step rate: it pays unless the next change comes within 1.5
    # restarts (M (b - a) > R b: 2M > 3R).
    (1, 3, 12.0, 3600.0, True),
    (1, 3, 12.0, 19.0, True),
    (1, 3, 12.0, 17.0, False),
    # A large run: 64 -> 72 GPUs (+12.5%) with a 5-minute restart needs the next change more
    # than 45 minutes away; a run whose nodes change every 40 minutes waits for more of them...
    (64, 72, 300.0, 2400.0, False),
    (64, 72, 300.0, 2800.0, True),
    # ...and grows once enough have come back: 64 -> 96 pays within 15 minutes.
    (64, 96, 300.0, 1000.0, True),
    (64, 64, 0.0, math.inf, False),  # no more workers: nothing to decide
])
def test_a_grow_is_made_only_when_the_larger_group_repays_its_restart(current, target, restart_s,
                                                                      interval_s, grow):
    decision = rule(current, target, restart_s, interval_s)
    assert decision.grow is grow, decision.detail
    assert "\n" not in decision.detail


def test_the_expected_interval_is_the_runs_own_record_with_the_prior_as_an_hour_of_it():
    prior = 200 * HOUR / 8
    assert expected_interval_s(0.0, 0, prior) == pytest.approx(prior)  # nothing seen: the prior
    assert expected_interval_s(2 * HOUR, 0, prior) == pytest.approx(3 * prior)  # quiet: longer
    one = expected_interval_s(60.0, 1, prior)  # one loss a minute in is no churn yet
    assert one > 50 * 60
    churn = expected_interval_s(10 * HOUR, 30, prior)  # a change every 20 minutes
    assert 20 * 60 < churn < 25 * 60


def _ledger(events, productive_s=100.0, recovery_s=20.0):
    return {"productive_s": productive_s, "lost_s": 4.0, "checkpoint_s": 3.0,
            "recovery_s": recovery_s, "eval_s": 1.0, "events": events}


def test_the_figures_come_from_the_runs_goodput_ledger():
    fresh = _ledger([], recovery_s=9.0)
    assert restart_cost_s(fresh) == 9.0  # before any restart: its own start-up
    assert membership_changes(fresh) == 0 and observed_s(fresh) == 117.0
    events = [{"kind": "resume", "recovery_s": 30.0},  # a resubmitted driver: no change...
              {"kind": "failure", "recovery_s": 14.0},
              {"kind": "replica group lost", "recovery_s": 0.5},  # ...a quorum's wait: no restart
              *({"kind": "resize", "recovery_s": float(r)} for r in (10, 12, 8, 10, 10, 12))]
    ledger = _ledger(events)
    assert membership_changes(ledger) == 8
    assert restart_cost_s(ledger) == pytest.approx((12 + 8 + 10 + 10 + 12) / 5)  # the latest 5


def test_decide_grow_on_a_runs_record():
    quiet = _ledger([{"kind": "failure", "recovery_s": 12.0}])
    prior_s = ElasticSection.node_mtbf_h * HOUR
    grow = decide_grow(ledger=quiet, current=1, target=3, node_mtbf_s=prior_s, nodes=3)
    assert grow.grow and "restart ~12 s" in grow.detail
    # A run whose nodes changed every ~15 s for the last 50 minutes expects the next change in
    # about half a minute: 2 -> 3 workers (+50%) does not repay a 12 s restart in that time,
    # 1 -> 3 (3x) does.
    churn = _ledger([{"kind": "failure", "recovery_s": 12.0}] * 200, productive_s=2900.0)
    wait = decide_grow(ledger=churn, current=2, target=3, node_mtbf_s=prior_s, nodes=3)
    assert not wait.grow and "waiting" in wait.detail
    assert decide_grow(ledger=churn, current=1, target=3, node_mtbf_s=prior_s, nodes=3).grow


def test_the_planner_goodput_is_the_same_arithmetic():
    assert kept_fraction(10.0, 100.0) == pytest.approx(0.9)
    assert kept_fraction(200.0, 100.0) == 0.0 and kept_fraction(5.0, math.inf) == 1.0
    tau, delta, recovery, mtbf = 3600.0, 60.0, 300.0, 40 * HOUR
    assert goodput(tau, delta, recovery, mtbf) == pytest.approx(
        tau / (tau + delta) * kept_fraction(recovery + (tau + delta) / 2, mtbf))
    # The runtime's prior is the planner's spot node MTBF.
    assert ElasticSection.node_mtbf_h == PlanInputs.spot_node_mtbf_h

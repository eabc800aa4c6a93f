"""When a grow pays for itself: the rule the scaling policy applies before it restarts a running
group at a larger size, and the goodput arithmetic it shares with the planner.

Every membership change costs a restart: R seconds in which nothing trains (the just-in-time
checkpoint, the new group's start, the checkpoint read, the first step's set-up). A run whose
changes come every M seconds on average keeps `kept_fraction(R, M)` = 1 - R/M of its throughput.
The planner's goodput (planner/reliability.py) is that fraction with R = recovery plus half a
checkpoint interval of lost work and M = the cluster's MTBF.

A grow from throughput a to b pays R now and runs at b until the next change, expected in M
seconds; not growing runs at a all that time. So over M the grow does b (M - R) against a M: it
pays iff b * kept_fraction(R, M) > a, i.e. M (b - a) > R b. What goes in:

* b / a: the ratio of the workers. The global batch is fixed (C1), so a larger group takes the
  same steps with more data-parallel ranks: at best the step rate scales with the workers. The
  rule takes that best case; it weighs a restart against the time the larger group will have,
  not how well the model scales (the planner and `elastic-gpt tune` say that, and a run's first
  steps at a size, with their set-up, are no measure of it).
* R: the mean recovery of this run's recent restarts (its goodput ledger's events, which travel
  with its progress record); before the first restart, its own start-up.
* M: the mean interval between this run's membership changes, (T + P) / (k + P / M0) after T
  seconds of the run with k changes: the conjugate (gamma) estimate of a Poisson rate whose
  prior is the planner's reliability model, one change per M0 = node MTBF / nodes
  (`elastic.node_mtbf_h`), counted as P = an hour of the run's own record. A run whose nodes come
  and go far more often than assumed has its own figure within the hour; a quiet run's
  expectation grows with the time it has been quiet.

A shrink is never gated: a lost node takes its workers with it. Pure arithmetic on plain values:
no Ray, no clocks; the scaling policy (policies.py) gathers the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_gpt.train.goodput import TOTALS

RECENT_RESTARTS = 5
"""How many of the run's latest restarts its restart cost is averaged over."""
PRIOR_S = 3600.0
"""How much of the run's own record the prior rate counts as (P above)."""
NOT_MEMBERSHIP = ("resume",)
"""Ledger event kinds that are no membership change: a resubmitted driver."""


def kept_fraction(cost_per_change_s: float, mean_interval_s: float) -> float:
    """The fraction of its throughput a run keeps when every change, one per `mean_interval_s`
    on average, costs `cost_per_change_s` without work (first order: no change during a restart).
    Shared by the grow rule and the planner's goodput."""
    if mean_interval_s <= 0:
        return 0.0
    return max(0.0, 1.0 - cost_per_change_s / mean_interval_s)


def expected_interval_s(observed_s: float, changes: int, prior_interval_s: float) -> float:
    """Mean time to the next membership change after `changes` in `observed_s` seconds, with the
    prior, one change per `prior_interval_s`, counted as PRIOR_S seconds of record:
    (T + P) / (k + P / M0)."""
    return (max(0.0, observed_s) + PRIOR_S) / (max(0, changes) + PRIOR_S / prior_interval_s)


@dataclass(frozen=True)
class GrowDecision:
    grow: bool
    detail: str
    """One line with the figures it was decided on (logged, and in the resize's ledger event)."""


def grow_decision(*, current: int, target: int, restart_s: float,
                  interval_s: float) -> GrowDecision:
    """Grow from `current` to `target` workers iff the larger group repays the restart before the
    next expected change: (target / current) * kept_fraction(R, M) > 1 (module docstring)."""
    if target <= current:
        return GrowDecision(False, f"{target} workers are no more than the {current} running")
    pays = target / current * kept_fraction(restart_s, interval_s) > 1.0
    detail = (f"{current} -> {target} workers, restart ~{restart_s:.0f} s, next change expected "
              f"in ~{_duration(interval_s)}: "
              + ("the larger group repays the restart" if pays
                 else "the larger group would not repay the restart; waiting"))
    return GrowDecision(pays, detail)


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    return f"{seconds:.0f} s" if seconds < 5400 else f"{seconds / 3600:.1f} h"


# ---- the figures, from the run's goodput ledger (train/goodput.py, as a dict) -----------------

def restart_cost_s(ledger: dict) -> float:
    """The mean recovery (failure or request to first step) of the run's latest restarts; before
    any, its start-up (the ledger's recovery before its first event)."""
    costs = [e["recovery_s"] for e in ledger.get("events", [])
             if e.get("recovery_s") is not None and not str(e.get("kind")).startswith("replica")]
    if costs:
        recent = costs[-RECENT_RESTARTS:]
        return sum(recent) / len(recent)
    return float(ledger.get("recovery_s", 0.0))


def membership_changes(ledger: dict) -> int:
    """The run's membership changes so far: its restart events, less resubmissions."""
    return sum(1 for e in ledger.get("events", []) if e.get("kind") not in NOT_MEMBERSHIP)


def observed_s(ledger: dict) -> float:
    """The run's wall time so far, as its ledger accounts for it."""
    return sum(float(ledger.get(k, 0.0)) for k in TOTALS)


def decide_grow(*, ledger: dict, current: int, target: int, node_mtbf_s: float,
                nodes: int) -> GrowDecision:
    """The grow rule on a run's own record (its goodput ledger, as rank 0 last published it),
    with the prior node MTBF over the larger group's `nodes` nodes."""
    interval = expected_interval_s(observed_s(ledger), membership_changes(ledger),
                                   node_mtbf_s / max(1, nodes))
    return grow_decision(current=current, target=target, restart_s=restart_cost_s(ledger),
                         interval_s=interval)

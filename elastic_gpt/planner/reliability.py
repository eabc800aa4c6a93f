"""The restart path's goodput: checkpoint every interval, lose the work since the last one and
the restart time at each failure (first-order Young/Daly model; Young 1974 for the interval).

Node failures are independent and exponential: the cluster's MTBF is the node MTBF / nodes.

Loss spikes are the other interruption (train/health.py): each one rolls the run back to the
checkpoint from before the updates it may have come from, re-runs the steps to the detection,
and, blamed on the data, rolls back again: twice the work since the checkpoint (half an interval
on average, plus the suspect updates before the first flagged loss, max(1,
`health.skip_steps_before`), and the `health.spike_steps` it took to see it) and two checkpoint
reads. Counted as the worse case, the
data's (a hardware fault found so costs one of each, and its node's drain is a planned restart
among the failures above). Their rate: `--spike-every-steps` (PaLM 540B's published one is
planner/inputs.py's `PALM_STEPS_PER_SPIKE`). Young's interval counts them (`rollback_mtbf_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_gpt.config import HealthSection
from elastic_gpt.elastic.resize_rule import kept_fraction
from elastic_gpt.planner.inputs import HOUR


def goodput(interval_s: float, ckpt_write_s: float, recovery_s: float, mtbf_s: float) -> float:
    """Fraction of wall time spent on work that is kept (first-order Young/Daly model).

    Each cycle trains for `interval_s` then blocks `ckpt_write_s` writing a checkpoint. Failures
    arrive at rate 1/mtbf_s; each costs `recovery_s` (restart + reload) plus, on average, half a
    cycle of lost work. Useful fraction = tau/(tau+delta) * (1 - (R + (tau+delta)/2) / M): each
    failure is a membership change costing R + (tau+delta)/2 without work, the arithmetic the
    runtime's grow rule uses too (`kept_fraction`, elastic/resize_rule.py).
    """
    tau, delta = interval_s, ckpt_write_s
    if tau <= 0:
        return 0.0
    return tau / (tau + delta) * kept_fraction(recovery_s + (tau + delta) / 2, mtbf_s)


def young_interval_s(ckpt_write_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval that minimises first-order waste, sqrt(2 * delta * MTBF)."""
    return math.sqrt(2.0 * ckpt_write_s * mtbf_s)


def rollback_mtbf_s(mtbf_s: float, spike_every_s: float) -> float:
    """The mean time between rollbacks as the checkpoint interval sees it: a failure re-does the
    work since the checkpoint once, a spike twice (`spike_cost_s`), so Young's interval for both
    is his formula at 1 / (1/MTBF + 2/spike interval)."""
    return 1.0 / (1.0 / mtbf_s + 2.0 / spike_every_s)


def optimal_interval_s(ckpt_write_s: float, recovery_s: float, mtbf_s: float) -> float:
    """The exact maximiser of `goodput`: sqrt(2*delta*(M - R)) - delta (-> Young's when delta,
    R << M)."""
    return max(0.0, math.sqrt(2.0 * ckpt_write_s * max(mtbf_s - recovery_s, 0.0)) - ckpt_write_s)


@dataclass
class Reliability:
    mtbf_s: float
    """Cluster MTBF = per-node MTBF / nodes (independent, exponential node failures)."""
    ckpt_write_s: float
    recovery_s: float
    interval_s: float
    every_steps: int
    goodput: float
    young_interval_s: float
    best_goodput: float
    spike_s: float = 0.0
    """What one loss spike costs (rollback, re-run, rollback), counted in `goodput`."""
    spike_every_s: float = math.inf


def spike_cost_s(interval_s: float, step_s: float, read_s: float,
                 spike_steps: int = HealthSection.spike_steps,
                 suspect_steps: int = max(1, HealthSection.skip_steps_before)) -> float:
    """One spike blamed on the data: the work since the checkpoint done twice (the first run and
    the re-run), and the checkpoint read twice (module docstring)."""
    return 2 * (interval_s / 2 + (suspect_steps + spike_steps) * step_s) + 2 * read_s


def reliability(node_mtbf_h: float, nodes: int, ckpt_write_s: float, recovery_s: float,
                step_s: float, every_steps: int | None = None,
                max_steps: int | None = None, spike_every_steps: float | None = None,
                read_s: float = 0.0) -> Reliability:
    """`spike_every_steps`: the mean steps between loss spikes (None: none counted); `read_s`:
    one checkpoint read."""
    mtbf = node_mtbf_h * HOUR / nodes
    spike_every_s = spike_every_steps * step_s if spike_every_steps else math.inf
    young = young_interval_s(ckpt_write_s, rollback_mtbf_s(mtbf, spike_every_s))
    if every_steps is None:
        every_steps = max(1, round(young / step_s))
        if max_steps is not None:
            every_steps = min(every_steps, max_steps)
    interval = every_steps * step_s
    best = goodput(optimal_interval_s(ckpt_write_s, recovery_s, mtbf), ckpt_write_s, recovery_s,
                   mtbf)
    kept, spike_s = 1.0, 0.0
    if spike_every_steps:
        spike_s = spike_cost_s(interval, step_s, read_s)
        kept = kept_fraction(spike_s, spike_every_s)
    return Reliability(mtbf, ckpt_write_s, recovery_s, interval, every_steps,
                       goodput(interval, ckpt_write_s, recovery_s, mtbf) * kept, young,
                       best * kept, spike_s, spike_every_s)

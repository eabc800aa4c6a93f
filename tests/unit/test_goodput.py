"""The goodput ledger's arithmetic (train/goodput.py): where a run's wall time went, with the time
lost to running below its own healthy pace on a line of its own."""

from __future__ import annotations

import pytest

from elastic_gpt.train.goodput import PACE_MIN_STEPS, PACE_STEPS, SLOW_STEP, GoodputLedger


def _attempt(world_size: int, ledger: GoodputLedger | None = None) -> GoodputLedger:
    """A ledger at an attempt's start (rank 0's), at `world_size`."""
    ledger = ledger or GoodputLedger(_attempt_started=0.0)
    ledger.on_resume(restored_step=0, world_size=world_size, previous=None, cause=None,
                     attempt_started=0.0)
    return ledger


def test_a_healthy_run_counts_no_time_as_slow():
    import random

    rng = random.Random(0)
    ledger = _attempt(2)
    steps = [rng.uniform(0.9, 1.1) for _ in range(300)]  # a healthy step's noise
    for seconds in steps:
        ledger.on_step(seconds)
    assert ledger.slow_s == 0.0
    assert ledger.productive_s == pytest.approx(sum(steps))


def test_a_slowdown_counts_its_time_beyond_the_pace_as_slow_and_the_pace_as_productive():
    ledger = _attempt(2)
    ledger.on_step(10.0)  # the attempt's first step: set-up, neither judged nor the pace
    for _ in range(10):
        ledger.on_step(1.0)
    for _ in range(5):
        ledger.on_step(3.0)  # a straggler holds every step back
    ledger.on_step(1.2)  # below SLOW_STEP x the pace: noise, productive whole
    assert ledger.slow_s == pytest.approx(5 * 2.0)
    assert ledger.productive_s == pytest.approx(10.0 + 10 * 1.0 + 5 * 1.0 + 1.2)
    ledger.on_checkpoint(1.0)
    s = ledger.summary()
    assert s["slow_s"] == 10.0
    assert s["goodput"] == pytest.approx(s["productive_s"] / (s["productive_s"] + 10.0 + 1.0),
                                         abs=1e-4)


def test_a_long_slowdown_never_becomes_the_pace():
    ledger = _attempt(2)
    for _ in range(1 + PACE_STEPS):
        ledger.on_step(1.0)
    for _ in range(5 * PACE_STEPS):
        ledger.on_step(2.0)
    assert ledger.pace_s(2) == 1.0
    assert ledger.slow_s == pytest.approx(5 * PACE_STEPS * 1.0)
    assert len(ledger.pace["2"]) == PACE_STEPS


def test_no_step_is_judged_before_the_size_has_a_pace():
    ledger = _attempt(2)
    for seconds in [10.0] + [1.0] * (PACE_MIN_STEPS - 1) + [5.0]:
        ledger.on_step(seconds)
    assert ledger.slow_s == 0.0 and ledger.pace_s(2) == 1.0  # the 5 s step joined the pace
    ledger.on_step(SLOW_STEP * 1.0 + 1.0)
    assert ledger.slow_s == pytest.approx(SLOW_STEP)


def test_the_pace_is_per_world_size_and_travels_with_the_ledger():
    """A restart at another size learns that size's pace (a smaller group is slower, not slow);
    back at the first size, its pace is the one the run had there, through the checkpoint."""
    ledger = _attempt(2)
    for _ in range(1 + PACE_MIN_STEPS):
        ledger.on_step(1.0)
    smaller = _attempt(1, GoodputLedger.from_dict(ledger.to_dict()))
    for _ in range(1 + PACE_MIN_STEPS + 5):
        smaller.on_step(2.0)
    assert smaller.slow_s == 0.0 and smaller.pace_s(1) == 2.0 and smaller.pace_s(2) == 1.0
    again = _attempt(2, GoodputLedger.from_dict(smaller.to_dict()))
    again.on_step(9.0)  # its first step: set-up
    again.on_step(2.0)  # judged against the pace at W=2 at once
    assert again.slow_s == pytest.approx(1.0)
    assert again.pace_s(2, degraded=True) is None  # fewer replica groups: a pace of its own


def test_a_group_back_behind_its_peers_keeps_the_events_only_it_saw():
    """A replica group that left (found slow, drained) and came back restores a checkpoint its
    peers wrote since: its totals are theirs, and why it left stays in the run's events."""
    mine = _attempt(1)
    mine.events.append({"kind": "straggler", "at": 50.0, "groups": [1]})
    peers = _attempt(1)
    for _ in range(30):
        peers.on_step(1.0)
    back = GoodputLedger.from_dict(peers.to_dict())
    back.on_resume(restored_step=60, world_size=1, attempt_started=100.0,
                   previous={"step": 18, "world_size": 1, "avg_step_s": 1.0, "at": 60.0,
                             "ledger": mine.to_dict()},
                   cause={"kind": "preemption", "reason": "node draining", "at": 61.0})
    assert [e["kind"] for e in back.events] == ["straggler"]
    assert back.productive_s == peers.productive_s and back.lost_steps == 0

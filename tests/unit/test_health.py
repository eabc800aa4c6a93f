"""Training health's pieces in one process: the loss spike detector, the data skips and a stream
that reads past them, the straggler window's arithmetic (a rank named however its slowness is
spread in time, within the documented bound, never for one slow step), and a probe file that
cannot be written (said once, training goes on)."""

from __future__ import annotations

import math

import pytest

from elastic_gpt.data.skips import DataSkips
from elastic_gpt.health.spikes import SpikeDetector

G = 8
SEED = 1234


# ---- the detector and the skips, alone ---------------------------------------------------------

def test_the_detector_flags_a_sustained_rise_and_nothing_else():
    import random

    rng = random.Random(0)
    d = SpikeDetector(window=50, deviations=6, min_rise=0.05, steps=3, min_history=20)
    noisy = [3.0 + rng.gauss(0, 0.05) for _ in range(200)]
    assert all(d.observe(k, v) is None for k, v in enumerate(noisy, 1))
    # Two high losses, then a normal one: absorbed, never part of the window.
    assert d.observe(201, 6.0) is None and d.observe(202, 6.0) is None
    assert d.observe(203, 3.0) is None
    assert max(v for _, v in d.history) < 4
    spike = [d.observe(k, 6.0) for k in (204, 205, 206)]
    assert spike[:2] == [None, None]
    assert (spike[2].first, spike[2].last) == (204, 206)
    # A non-finite loss is a spike at once.
    d.forget_from(204)
    nan = d.observe(204, math.nan)
    assert nan is not None and nan.nonfinite and (nan.first, nan.last) == (204, 204)


def test_skips_move_the_order_by_whole_steps():
    skips = DataSkips().add(40, 2).add(50, 3)
    assert [skips.data_step(t) for t in (39, 40, 41, 49, 50, 51)] == [39, 42, 43, 51, 55, 56]
    assert skips.positions(0, G) == range(40 * G, 42 * G)
    assert skips.positions(1, G) == range(52 * G, 55 * G)  # after the first skip's
    assert DataSkips.from_list(skips.to_list()) == skips
    with pytest.raises(ValueError, match="before the last one"):
        skips.add(45, 1)


def test_a_stream_with_skips_reads_the_later_steps_batches(stdlib_dataset):
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream

    split = BatchSplit(G, 4)

    def fingerprints(skips, start, n):
        with open_step_stream(stdlib_dataset, batch_split=split, rank=0, world_size=1,
                              start_step=start, seed=SEED, prefetch_steps=0,
                              skips=skips) as stream:
            return [(b.step, b.fingerprint) for b in (next(stream) for _ in range(n))]

    plain = dict(fingerprints(DataSkips(), 0, 12))
    skipped = fingerprints(DataSkips().add(3, 4), 2, 4)
    assert skipped == [(2, plain[2]), (3, plain[7]), (4, plain[8]), (5, plain[9])]


# ---- real faults in real training ----------------------------------------------------------------


# ---- the replica groups' copies compared (health/silent_corruption.GroupCopiesCheck) ----------


def test_a_probe_file_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path, capsys):
    """The per-rank probe times' folder under a regular file: one line, no file kept, no error
    (the probe's metrics and events still say what it finds)."""
    import torch

    from elastic_gpt.config import HealthSection
    from elastic_gpt.health.stragglers import StragglerWatch

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    watch = StragglerWatch(HealthSection(), rank=0, world_size=2, device=torch.device("cpu"),
                           record_path=str(blocker / "logs" / "probes.jsonl"))
    assert watch.record_path is None
    watch._record({"step": 10, "probe_s": [0.01, 0.01]})  # nothing more is tried, or said
    said = [line for line in capsys.readouterr().out.splitlines() if "probe" in line]
    assert len(said) == 1 and "not kept" in said[0], said


# ---- the straggler window (health/stragglers.py), alone ------------------------------------------

def named_at(series: list[list[float]], window: int, every: int, slowdown: float = 1.5):
    """(the step, the verdict) at which a rank is first named, from each rank's compute at each
    step (the attempt's first WARMUP_STEPS are not judged), shared every `every` steps as
    StragglerWatch.after_step shares them; (None, None) if never."""
    from elastic_gpt.health.stragglers import WARMUP_STEPS, ComputeWindow, judge

    windows = [ComputeWindow(window) for _ in series]
    for step in range(1, len(series[0]) + 1):
        if step > WARMUP_STEPS:
            for w, seconds in zip(windows, series):
                w.add(seconds[step - 1])
        if step % every == 0:
            figures = [w.figure() for w in windows]
            verdict = judge(figures, slowdown) if all(figures) else None
            if verdict is not None and verdict.slow:
                return step, verdict
    return None, None


def test_a_single_slow_step_is_never_a_straggler_however_slow():
    healthy = [0.1] * 200
    slow_once = [0.1] * 200
    slow_once[57] = 100.0  # a page-fault storm, a checkpoint's contention
    assert named_at([healthy, slow_once, healthy], window=20, every=10) == (None, None)
    assert named_at([healthy, slow_once], window=4, every=1) == (None, None)


def test_healthy_noise_is_never_a_straggler():
    import random

    rng = random.Random(0)
    ranks = [[rng.uniform(0.08, 0.12) for _ in range(2000)] for _ in range(8)]
    assert named_at(ranks, window=20, every=10) == (None, None)


@pytest.mark.parametrize("window,every", [(20, 10), (8, 2), (4, 1), (6, 10)])
@pytest.mark.parametrize("start", [3, 13, 40])
def test_a_steady_slowdown_is_named_within_the_documented_bound(window, every, start):
    """A rank at 1.6x from step `start` + 1 on (past the attempt's first steps, not judged) is
    named by step start + window + every (docs/training-health.md), and not before it is slow."""
    healthy = [0.1] * 300
    slowed = [0.1] * start + [0.16] * (300 - start)
    step, verdict = named_at([healthy, slowed, healthy], window, every)
    assert step is not None and start < step <= start + window + every, step
    # (named as soon as the window's slowed part carries it past the threshold)
    assert verdict.slow == [1] and 1.5 <= verdict.ratios[1] <= 1.6 + 1e-9
    assert verdict.median == pytest.approx(0.1)


@pytest.mark.parametrize("pattern", [
    [0.1, 0.1, 0.6],  # bursts: one step in three waits out a stop
    [0.05, 0.55],  # in and out of a burst every other step
    [0.1, 0.1, 0.1, 0.1, 0.8],  # periodic: one step in five, 8x
], ids=["bursts", "alternating", "periodic"])
def test_slowness_in_bursts_is_named_within_the_same_bound(pattern):
    """The same bound however the slowness is spread in time: the window counts it all (the
    old probe, a few milliseconds every 10 steps, landed between bursts and read healthy)."""
    start, window, every = 20, 20, 10
    healthy = [0.1] * 400
    slowed = [0.1] * start + [pattern[i % len(pattern)] for i in range(400 - start)]
    step, verdict = named_at([healthy, slowed], window, every)
    assert step is not None and start < step <= start + window + every, step
    assert verdict.slow == [1]


def test_a_verdict_needs_two_figures_and_takes_the_lower_median():
    from elastic_gpt.health.stragglers import judge, trimmed_mean, trimmed_steps

    assert judge([0.1], 1.5) is None and judge([0.1, 0.0, 0.0], 1.5) is None
    verdict = judge([0.1, 0.2], 1.5)  # of two, the faster is the median: the slower is named
    assert verdict.median == 0.1 and verdict.slow == [1] and verdict.slowest == 1
    verdict = judge([0.1, 0.0, 0.3, 0.12], 1.5)  # 0: a rank with no figure yet, not judged
    assert verdict.median == 0.12 and verdict.slow == [2] and verdict.ratios[1] == 0.0
    assert trimmed_steps(2) == 1 and trimmed_steps(20) == 2 and trimmed_steps(100) == 10
    assert trimmed_mean([1.0, 9.0, 2.0, 3.0], 1) == 2.0

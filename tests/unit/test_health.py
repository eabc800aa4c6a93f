"""Training health's pieces in one process: the loss spike detector, the data skips and a stream
that reads past them, and a probe file that cannot be written (said once, training goes on)."""

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

"""Detecting a loss spike: the running median and median absolute deviation of the last healthy
losses, and the rule that flags a loss against them (health/recovery.py acts on what is found).

A loss is flagged when it is non-finite, or above the running median of the last
`health.spike_window` healthy losses by `health.spike_deviations` robust standard deviations
(1.4826 x the median absolute deviation, the normal distribution's scale; median and MAD are not
moved by the spike itself, as a mean and standard deviation would be) and by at least
`health.spike_min_rise` of the median. `health.spike_steps` consecutive flagged losses make a
spike; a non-finite one is a spike at once. Flagged losses never enter the window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): the MAD of a normal distribution times this is its sigma


@dataclass(frozen=True)
class Spike:
    """Steps are numbered as everywhere (C5): step k's loss is the one of the batch that made
    the k-th optimizer step, computed on the weights of checkpoint step k - 1."""

    first: int
    """The first flagged step."""
    last: int
    """The step the spike was detected at."""
    losses: dict[int, float]
    """Flagged step -> its loss."""
    median: float
    threshold: float

    @property
    def nonfinite(self) -> bool:
        return any(not math.isfinite(v) for v in self.losses.values())

    def describe(self) -> str:
        what = "non-finite loss" if self.nonfinite else "loss spike"
        steps = f"step {self.first}" if self.first == self.last else \
            f"steps {self.first}-{self.last}"
        worst = max(self.losses.values(), key=lambda v: v if math.isfinite(v) else math.inf)
        return f"{what} at {steps} (loss {worst:.4g}; running median {self.median:.4g}, " \
               f"threshold {self.threshold:.4g})"


class SpikeDetector:
    """Running median and MAD of the last `window` healthy losses (the module docstring)."""

    def __init__(self, window: int, deviations: float, min_rise: float, steps: int,
                 min_history: int):
        self.window, self.deviations, self.min_rise = window, deviations, min_rise
        self.steps, self.min_history = steps, min_history
        self.history: deque[tuple[int, float]] = deque(maxlen=window)
        self.flagged: dict[int, float] = {}

    def threshold(self) -> tuple[float, float]:
        """(median, threshold) of the window; threshold inf before `min_history` losses."""
        if len(self.history) < self.min_history:
            return math.nan, math.inf
        losses = [v for _, v in self.history]
        median = statistics.median(losses)
        mad = statistics.median(abs(v - median) for v in losses)
        rise = max(self.deviations * MAD_TO_SIGMA * mad, self.min_rise * abs(median))
        return median, median + rise

    def observe(self, step: int, loss: float) -> Spike | None:
        median, threshold = self.threshold()
        if not math.isfinite(loss) or loss > threshold:
            self.flagged[step] = loss
            if not math.isfinite(loss) or len(self.flagged) >= self.steps:
                return Spike(min(self.flagged), step, dict(self.flagged), median, threshold)
            return None
        self.flagged.clear()
        self.history.append((step, loss))
        return None

    def forget_from(self, step: int) -> None:
        """A rollback to `step`: the losses from it on will be trained again."""
        kept = [(s, v) for s, v in self.history if s < step]
        self.history.clear()
        self.history.extend(kept)
        self.flagged.clear()

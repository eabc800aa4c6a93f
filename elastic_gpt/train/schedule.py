"""The learning-rate schedule: a pure function of the step, so resuming needs no scheduler state
beyond the step counter (C3 bit-identical resume). Nothing here knows about the optimizer or the
config."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))

"""The exceptions that cross from a worker to the controller, and how the controller treats them.

`FatalTrainingError` and its subclasses are errors that restarting cannot fix: the controller stops
the run at once on these (C6). `ElasticRestart` is the opposite: a planned restart after a
just-in-time checkpoint, retried for free. This module imports nothing, so the Trainer can raise
both without importing Ray.
"""

from __future__ import annotations


class FatalTrainingError(Exception):
    """Base of errors no retry can cure (bad config, wrong checkpoint, diverged loss)."""


class NonFiniteLossError(FatalTrainingError):
    pass


class CheckpointMismatchError(FatalTrainingError, ValueError):
    pass


class ElasticRestart(Exception):
    """Raised by every rank after a just-in-time checkpoint: a planned restart, not a failure."""

    def __init__(self, reason: str, step: int):
        super().__init__(f"planned restart after step {step}: {reason}")
        self.reason, self.step = reason, step

    def __reduce__(self):
        return (ElasticRestart, (self.reason, self.step))


def check_checkpoint_shape(state: dict, gpt_cfg, url: str) -> None:
    """A checkpoint of another model shape cannot be loaded: say which fields differ."""
    saved, want = state.get("model_shape", {}), gpt_cfg.shape()
    diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise CheckpointMismatchError(
            f"checkpoint {url} is for another model shape ({detail}); use the matching "
            "model.* settings or a fresh checkpoint.path")

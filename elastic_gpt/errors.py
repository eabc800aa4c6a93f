"""Errors that restarting cannot fix: the controller stops the run at once on these (C6)."""

from __future__ import annotations


class FatalTrainingError(Exception):
    """Base of errors no retry can cure (bad config, wrong checkpoint, diverged loss)."""


class NonFiniteLossError(FatalTrainingError):
    pass


class CheckpointMismatchError(FatalTrainingError, ValueError):
    pass


def check_checkpoint_shape(state: dict, gpt_cfg, url: str) -> None:
    """A checkpoint of another model shape cannot be loaded: say which fields differ."""
    saved, want = state.get("model_shape", {}), gpt_cfg.shape()
    diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise CheckpointMismatchError(
            f"checkpoint {url} is for another model shape ({detail}); use the matching "
            "model.* settings or a fresh checkpoint.path")

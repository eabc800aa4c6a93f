"""The optimizer a run trains with, built from train.* settings. Its hyper-parameters are never
checkpointed (only its moments are), so this function is what a resumed run's optimizer is."""

from __future__ import annotations

import torch

from elastic_gpt.config import Config


def build_optimizer(model: torch.nn.Module, cfg: Config, fused: bool) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (GPT-2/3 practice: no decay on biases and LayerNorm)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    t = cfg.train
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused)


def nonfinite_flag(*values: torch.Tensor) -> torch.Tensor:
    """1.0 if any of the (scalar) values is NaN or infinite, else 0.0: a float32 tensor on the
    first value's device, the `found_inf` a fused optimizer step reads there."""
    finite = torch.stack([torch.isfinite(v.detach()).reshape(()).to(values[0].device)
                          for v in values]).all()
    return (~finite).to(torch.float32)


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """`optimizer.step()`, applying nothing where `found_inf` (a float32 scalar) is 1.0: the
    parameters, the moments and the step count stay as they were. A fused optimizer decides on
    the device (torch.amp.GradScaler's way in, the `found_inf` attribute its fused kernels read;
    they undo their step count increment themselves), so the step is launched without waiting
    for the host to learn whether the loss was finite. Others read the flag on the host first.

    A skipped first step leaves the state initialised (zero moments, step count 0) where an
    unstepped optimizer has none; the next step starts from zero moments either way."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        if not found_inf.item():
            optimizer.step()
        return
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


class NonfiniteStreak:
    """train.nan_patience: how many committed steps in a row may skip their update for a
    non-finite loss or gradient before the run counts as diverged."""

    def __init__(self, patience: int):
        self.patience, self.count = patience, 0

    def after(self, skipped: bool) -> bool:
        """After a committed step: whether the run has now diverged."""
        self.count = self.count + 1 if skipped else 0
        return self.count > self.patience

    def reset(self) -> None:
        """A rollback: the steps that skipped are undone."""
        self.count = 0

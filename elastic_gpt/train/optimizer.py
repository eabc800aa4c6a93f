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

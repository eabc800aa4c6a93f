"""The device a worker trains on, made current before anything is allocated on it."""

from __future__ import annotations

import os

import torch


def worker_device(assigned: torch.device | None = None) -> torch.device:
    """The device this worker trains on (`tune` measures on the same one), made current:
    `assigned` (under Ray Train, the GPU Ray gave this worker, which is not LOCAL_RANK's where
    Ray does not share CUDA_VISIBLE_DEVICES among a node's workers), else from LOCAL_RANK."""
    if assigned is not None:
        if assigned.type == "cuda":
            torch.cuda.set_device(assigned)
        return assigned
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")

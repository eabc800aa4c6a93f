"""The real Trainer on one GPU over NCCL: it learns, saves asynchronously and resumes.

    python bench/gpu_trainer_check.py [--steps 30] [--json out] [--cpu-dry-run]

A tiny byte-level dataset is made from the standard library's sources; the `mini` job trains on
it at W=1 (bf16 on the GPU, `checkpoint.async_save` on), stopping half way with a committed
checkpoint; a second Trainer resumes from it and trains to the end. Asserted: the resumed
attempt starts from the checkpoint (no weight init), the loss falls, and the last step is
committed and loadable; on the GPU, that the Trainer bound the default group (made without a
device, as Ray Train makes it) to its device. `--cpu-dry-run` runs the same on the CPU over gloo
(make test does, with CUDA hidden), so no GPU minute goes to a Python error.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time

import torch
import torch.distributed as dist
from common import one_rank_group


def _attempt(cfg_args: list[str], device: torch.device) -> tuple[object, list[dict]]:
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import NullMetricSink, Trainer

    class Steps(NullMetricSink):
        def __init__(self):
            self.logged = []

        def log(self, metrics, step):
            self.logged.append({"step": step, **metrics})

    sink = Steps()
    trainer = Trainer(load_config("jobs/configs/mini.yaml", cfg_args), rank=0, world_size=1,
                      mlflow_run_id=None, metrics=sink, device=device)
    trainer.train()
    return trainer, sink.logged


def check(steps: int, device: torch.device, root: str) -> dict:
    from data_pipelines.tokenize_job import prepare_data
    from elastic_gpt.checkpoint.store import CheckpointStore
    from elastic_gpt.tracking import metric_names as mn

    corpus = os.path.join(sysconfig.get_paths()["stdlib"], "json/*.py")
    data = os.path.join(root, "data")
    prepare_data(corpus, data, "bytes", 128, engine="local", progress=False)
    ckpt = os.path.join(root, "ckpt")
    half = steps // 2
    args = [f"data.path={data}", f"checkpoint.path={ckpt}", "eval.samples=0",
            "tracking.enabled=false", f"train.max_steps={steps}", "train.warmup_steps=2",
            f"checkpoint.every_steps={half}", "checkpoint.async_save=true",
            "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1000"]
    t0 = time.perf_counter()
    first, first_log = _attempt([*args, f"run.stop_at_step={half}"], device)
    if device.type == "cuda":  # the mesh's groups were split from the default one's communicator
        assert dist.group.WORLD.bound_device_id == device, dist.group.WORLD.bound_device_id
    store = CheckpointStore(ckpt)
    assert store.latest().step == half, "the first attempt's checkpoint is committed"
    second, second_log = _attempt(args, device)
    assert second.resume_from is not None and second.resume_from.step == half, "resumed"
    assert second.startup["init_s"] == 0, "a resume draws no weights"
    losses = [m[mn.TRAIN_LOSS] for m in first_log + second_log]
    assert [m["step"] for m in first_log + second_log] == list(range(1, steps + 1))
    early, late = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert late < early, f"the loss did not fall: {early:.3f} -> {late:.3f}"
    latest = store.latest()
    assert latest is not None and latest.step == steps, "the last step is committed"
    return {"device": str(device), "steps": steps, "first_loss": losses[0],
            "last_loss": losses[-1], "loss_early": early, "loss_late": late,
            "resumed_at": half, "committed": latest.step, "seconds": time.perf_counter() - t0,
            "tokens_per_s_last": second_log[-1][mn.TRAIN_TOKENS_PER_S],
            "mfu_last": second_log[-1][mn.TRAIN_MFU]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default="bench/gpu_trainer_check.json")
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    # The group made as Ray Train makes it, without a device: the Trainer binds it.
    with one_rank_group(args.cpu_dry_run, "bench/gpu_trainer_check.py", 29534,
                        bind_device=False) as device, \
            tempfile.TemporaryDirectory() as root:
        result = check(args.steps, device, root)
    print(f"[gpu trainer] {result}", flush=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

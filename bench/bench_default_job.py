"""The default job (`jobs/configs/mini.yaml`: 2 Ray Train workers under FSDP2) vs a plain
single-process PyTorch loop of the same model and global batch on the same 2 cores, side by side.

    .venv/bin/python bench/bench_default_job.py [--steps 30]

Needs the default job's dataset (`make data`). Runs the plain loop (2 intra-op threads), then the
job (train.max_steps=--steps, its own checkpoint dir and MLflow store), then the plain loop again,
and reports median steady-state tokens/s of each (the job's from its per-step `step_time_s`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def plain_loop(cfg, steps: int, threads: int) -> float:
    """Median tokens/s of forward/backward over the global batch in micro-batches, clip, AdamW."""
    import torch

    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.order import BatchPlan
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.model.gpt import GPT, token_losses
    from elastic_gpt.train.model_config import model_config_for
    from elastic_gpt.train.optimizer import build_optimizer

    torch.set_num_threads(threads)
    gpt_cfg = model_config_for(cfg, load_manifest(cfg.data.path))
    model = GPT(gpt_cfg)
    opt = build_optimizer(model, cfg, fused=True)
    plan = BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    stream = open_step_stream(cfg.data.path, plan=plan, rank=0, world_size=1, start_step=0,
                              seed=cfg.data.seed)
    batches = [next(stream) for _ in range(steps)]
    stream.close()
    T, G = gpt_cfg.seq_len, plan.global_batch_size
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        for tokens in batch.tokens:
            (token_losses(model(tokens[:, :T]), tokens[:, 1:T + 1]) / (G * T)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return G * T / statistics.median(times[2:])


def default_job(steps: int, root: str) -> float:
    import mlflow

    from elastic_gpt.config import load_config
    from elastic_gpt.elastic.launcher import run_training

    uri = f"sqlite:///{root}/mlflow.db"
    cfg = load_config(os.path.join(ROOT, "jobs/configs/mini.yaml"), [
        f"train.max_steps={steps}", f"checkpoint.path={root}/ckpt", f"tracking.uri={uri}",
        f"run.storage_path={root}/ray", "tracking.log_model=false",
        f"data.path={os.path.join(ROOT, 'data/stdlib')}"])
    summary = run_training(cfg)
    hist = mlflow.MlflowClient(uri).get_metric_history(summary["run_id"], "step_time_s")
    step_times = [m.value for m in sorted(hist, key=lambda m: m.step)][3:]
    from elastic_gpt.data.manifest import load_manifest
    tokens_per_step = cfg.train.global_batch_size * load_manifest(cfg.data.path).seq_len
    return tokens_per_step / statistics.median(step_times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    from elastic_gpt.config import load_config

    cfg = load_config(os.path.join(ROOT, "jobs/configs/mini.yaml"),
                      [f"data.path={os.path.join(ROOT, 'data/stdlib')}"])
    before = plain_loop(cfg, 12, threads=2)
    with tempfile.TemporaryDirectory() as root:
        job = default_job(args.steps, root)
    after = plain_loop(cfg, 12, threads=2)
    plain = statistics.mean([before, after])
    print(f"\nplain single-process loop (2 threads): {before:,.0f} / {after:,.0f} tok/s "
          f"(before / after)")
    print(f"default job, 2 workers x 1 thread, FSDP2 on Ray Train: {job:,.0f} tok/s")
    print(f"ratio default job / plain loop: {job / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

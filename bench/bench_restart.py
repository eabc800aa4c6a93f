"""Restart cost: the time from a worker's start to its first step, fresh and resumed, split into
the weight init, the checkpoint read and the rest. (A node lost under a running group, from the
kill to the first step at W-1 with every part of the restart: bench/bench_node_loss.py.)

    .venv/bin/python bench/bench_restart.py [--preset gpt2-774m] [--workers 2] [--code DIR]
                                            [--json out.json]

W real Trainers over gloo, one process each: a fresh attempt trains one step and commits its
checkpoint; a second attempt resumes from it and trains one more. The init and the read are the
Trainer's own figures (`Trainer.startup`), or for older code that lacks them timed around its calls
(`init_sharded_weights` and `load_sharded`, as elastic_gpt.train.trainer looked them up), the
first step from the Trainer's construction to the
start of its first `train_step`: so the same script times older code too (`--code DIR`: a
checkout of it, first on the path of every process). Figures are rank 0's; the checkpoint goes to
a local folder (its write is not part of either attempt's startup).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from common import ROOT, prepare_dataset

_MINI = os.path.join(ROOT, "jobs", "configs", "mini.yaml")


def _attempt(rank: int, world: int, code: str | None, overrides: list[str]) -> dict:
    if code:
        sys.path.insert(0, code)
    import elastic_gpt.train.trainer as trainer_module
    from elastic_gpt.config import load_config

    cfg = load_config(_MINI, overrides)
    times = {"init_s": 0.0, "checkpoint_read_s": 0.0}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] += time.perf_counter() - t0
        return run

    # Code that reports its own start by part (`Trainer.startup`) is read after the attempt;
    # older code is timed around the calls it made.
    if hasattr(trainer_module, "init_sharded_weights"):
        trainer_module.init_sharded_weights = timed("init_s", trainer_module.init_sharded_weights)
    trainer_module.load_sharded = timed("checkpoint_read_s", trainer_module.load_sharded)
    step = trainer_module.Trainer.train_step

    def first_step(self, batch):
        times.setdefault("to_first_step_s", time.perf_counter() - started)
        return step(self, batch)

    trainer_module.Trainer.train_step = first_step
    started = time.perf_counter()
    trainer = trainer_module.Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    trainer.train()
    own = getattr(trainer, "startup", {})
    times.update({k: own[k] for k in ("init_s", "checkpoint_read_s") if k in own})
    times["rest_s"] = times["to_first_step_s"] - times["init_s"] - times["checkpoint_read_s"]
    times["n_params"] = trainer.n_params
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-774m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--code", help="a checkout of the code to time (default: this one)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.code:  # every process imports the given code first (spawned ranks: PYTHONPATH)
        code = os.path.abspath(args.code)
        sys.path.insert(0, code)
        os.environ["PYTHONPATH"] = os.pathsep.join([code, os.environ.get("PYTHONPATH", "")])
    from elastic_gpt.testing.gloo import run_gloo

    root = tempfile.mkdtemp(prefix="bench-restart-")
    try:
        data = prepare_dataset(os.path.join(tempfile.gettempdir(), "elastic-gpt-bench"))
        base = [f"model.preset={args.preset}", f"data.path={data}", "eval.samples=0",
                f"train.global_batch_size={args.workers}", "train.micro_batch_size=1",
                "train.warmup_steps=1", "train.threads_per_worker=1", "scaling.cpus_per_worker=1",
                "tracking.enabled=false", "checkpoint.async_save=false",
                f"checkpoint.path={root}/ckpt", f"scaling.min_workers={args.workers}",
                f"scaling.max_workers={args.workers}"]
        out = {}
        for name, steps in (("fresh", 1), ("resumed", 2)):
            t0 = time.perf_counter()
            got = run_gloo(_attempt, args.workers, args.code,
                           [*base, f"train.max_steps={steps}"])[0]
            got["attempt_wall_s"] = time.perf_counter() - t0
            out[name] = got
            print(f"{name:8s} first step {got['to_first_step_s']:7.2f} s after start: weight init "
                  f"{got['init_s']:6.2f} s, checkpoint read {got['checkpoint_read_s']:6.2f} s, "
                  f"the rest {got['rest_s']:6.2f} s ({got['n_params'] / 1e6:,.0f}M params, "
                  f"W={args.workers})", flush=True)
        out.update(preset=args.preset, workers=args.workers, code=args.code or ROOT)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

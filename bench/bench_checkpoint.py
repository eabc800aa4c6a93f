"""Checkpoint stall: how long the training loop is blocked per checkpoint, async vs sync.

    .venv/bin/python bench/bench_checkpoint.py [--steps 15] [--every 3] [--json out.json]

The real `Trainer.train()` loop (W=1, FSDP2 over gloo, in this process) runs twice on the same
data: once with `checkpoint.async_save=false`, once with `true`, saving every `--every` steps to
local disk (fsynced, committed, retention on). Blocked = wall time of each `checkpointer.save()`
that saved (sync: the whole save and commit; async: waiting for the previous save + the copy to
CPU), in wall time and in the training thread's CPU time; medians over the periodic saves after the
first (which also sets up the writer, reported apart). The
async background write (DCP write + fsync + commit) is timed too. The dip: median step time of the
steps that ran while an async write was in flight vs the steps that did not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from common import PRESET, median, prepare_dataset

from elastic_gpt.tracking import metric_names as mn

_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "jobs", "configs", "mini.yaml")


def one_run(data: str, root: str, async_save: bool, steps: int, every: int) -> dict:
    from elastic_gpt.checkpoint.checkpointer import AsyncCheckpointer
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import NullMetricSink, Trainer

    ckpt = os.path.join(root, "async" if async_save else "sync")
    shutil.rmtree(ckpt, ignore_errors=True)
    cfg = load_config(_TINY, [
        f"model.preset={PRESET}", f"data.path={data}", "train.global_batch_size=4",
        "train.micro_batch_size=2", f"train.max_steps={steps}", "train.warmup_steps=2",
        "train.log_every=1000", "train.threads_per_worker=1", "scaling.cpus_per_worker=1",
        f"checkpoint.every_steps={every}", "checkpoint.keep=2", f"checkpoint.path={ckpt}",
        f"checkpoint.async_save={str(async_save).lower()}"])
    steps_log: list[dict] = []
    flight = {"at_start": False}

    class StepLog(NullMetricSink):
        def log(self, metrics, step):
            now = saver.in_flight
            steps_log.append({"step": step, "step_time_s": metrics[mn.TRAIN_STEP_TIME_S],
                              "overlapped": flight["at_start"] or now})
            flight["at_start"] = now

    trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None, metrics=StepLog())
    saver = trainer.checkpointer
    blocked, blocked_cpu, writes = [], [], []
    original = saver.save

    def timed_save(step, *, force=False):
        t0, c0 = time.perf_counter(), time.thread_time()
        if not original(step, force=force):
            return False
        blocked.append(time.perf_counter() - t0)
        blocked_cpu.append(time.thread_time() - c0)  # this (the training) thread's CPU only
        flight["at_start"] = saver.in_flight
        if isinstance(saver, AsyncCheckpointer) and len(blocked) > 1:
            writes.append(saver.last_write_s)  # the previous save's background time
        return True

    saver.save = timed_save
    trainer.train()
    if isinstance(saver, AsyncCheckpointer):
        writes.append(saver.last_write_s)
    # Periodic saves only: the first one also creates the writer's process group and allocates
    # the staging buffers (one-time, reported as first_save_s), and the final save at max_steps
    # is waited for by finish().
    periodic = (blocked[:-1] if steps % every == 0 else blocked)[1:]
    periodic_cpu = blocked_cpu[1:1 + len(periodic)]
    body = [s for s in steps_log if s["step"] > 2]  # drop the first two (warm-up) steps
    return {
        "blocked_s": [round(b, 4) for b in blocked], "blocked_median_s": median(periodic),
        "blocked_cpu_s": [round(b, 4) for b in blocked_cpu],
        "blocked_cpu_median_s": median(periodic_cpu), "first_save_s": blocked[0],
        "background_write_s": [round(w, 4) for w in writes],
        "background_write_median_s": median(writes) if writes else None,
        "step_s_overlapped": median(s["step_time_s"] for s in body if s["overlapped"]),
        "step_s_clear": median(s["step_time_s"] for s in body if not s["overlapped"]),
        "n_overlapped": sum(s["overlapped"] for s in body),
        "state_bytes": _dir_bytes(ckpt),
    }


def _dir_bytes(root: str) -> int:
    """Bytes of the newest step directory (one checkpoint)."""
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    d = os.path.join(root, steps[-1])
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def run(steps: int, every: int, work: str) -> dict:
    import torch

    from elastic_gpt.testing.gloo import gloo_group

    data = prepare_dataset(work)
    with gloo_group():
        torch.set_num_threads(1)
        sync = one_run(data, work, False, steps, every)
        asyn = one_run(data, work, True, steps, every)
    out = {"model": f"{PRESET} W=1, G=4, micro=2, local disk, fsync on",
           "sync": sync, "async": asyn,
           "sync_save_s": sync["blocked_median_s"],
           "async_blocked_s": asyn["blocked_median_s"],
           "blocked_fraction": asyn["blocked_median_s"] / sync["blocked_median_s"],
           "blocked_fraction_cpu": asyn["blocked_cpu_median_s"] / sync["blocked_cpu_median_s"],
           "dip": 1 - asyn["step_s_clear"] / asyn["step_s_overlapped"]
           if asyn["n_overlapped"] else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_")
    res = run(args.steps, args.every, work)
    print(json.dumps({k: v for k, v in res.items() if k not in ("sync", "async")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

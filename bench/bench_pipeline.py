"""Pipeline parallelism on CPU: the bytes a step sends between stages against the planner's count,
and the bubble measured against its formula.

    python bench/bench_pipeline.py [--steps 6] [--json out]

For 1F1B and interleaved 1F1B (2 stages per rank) at pp=2 (two gloo processes, one thread
each) and m = 2, 4, 8 micro-batches of one 128-token sequence through an 8-layer, 256-wide GPT:

- bytes: what each rank's schedule sends across stage boundaries in one step (counted where torch's
  schedules send, `torch_internals.pipeline_sends`) over `cost_model.pipeline.p2p_bytes`;
- bubble: the step at pp=2 against the same step's compute in one process (one thread), as
  pp x t_pp / t_1 - 1, beside the formula's (p - 1) / (v m). Measured also holds the send and
  receive time and each stage's overheads, so it is at or above the formula; reported, not a
  target (two processes on shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT

CFG = GPTConfig(n_layer=8, n_head=4, n_embd=256, seq_len=128, vocab_size=512)


def _data(m: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (m, CFG.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))


def one_process(m: int, steps: int) -> float:
    """Median seconds of a step of m micro-batches through the whole model, one thread."""
    torch.set_num_threads(1)
    model = GPT(CFG)
    model.init_weights(0)
    data, T = _data(m), CFG.seq_len
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        for k in range(m):
            (model(data[k:k + 1, :T], targets=data[k:k + 1, 1:]) / (m * T)).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _pipelined(rank: int, world: int, schedule: str, per_rank: int, m: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.parallel.pipeline import build_schedule, run_step, summed_loss
    from elastic_gpt.testing.pipeline_stages import cpu_stages
    from elastic_gpt.torch_internals import pipeline_sends

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp_shard"))
    stages = cpu_stages(CFG, mesh, per_rank)
    sched = build_schedule(stages, mesh["pp"].get_group(), torch.device("cpu"), m,
                           summed_loss(1.0 / (m * CFG.seq_len)), schedule)
    data, T = _data(m), CFG.seq_len
    times, sent = [], 0
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with pipeline_sends() as sends:
            run_step(sched, stages, data[:, :T], data[:, 1:])
        times.append(time.perf_counter() - t0)
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        if i == steps:
            sent = sum(b for _, b in sends)
    return {"step_s": statistics.median(times[1:]), "sent": sent}


def main() -> None:
    from elastic_gpt.cost_model.pipeline import bubble_fraction, p2p_bytes
    from elastic_gpt.testing.gloo import run_gloo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="bench/pipeline_results.json")
    args = ap.parse_args()
    pp, rows = 2, []
    for m in (2, 4, 8):
        t1 = one_process(m, args.steps)
        for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
            ranks = run_gloo(_pipelined, pp, schedule, v, m, args.steps)
            t_pp = max(r["step_s"] for r in ranks)
            predicted = [p2p_bytes(pp, m, micro_batch=1, seq_len=CFG.seq_len, n_embd=CFG.n_embd,
                                   act_bytes=4, stages_per_rank=v, pp_rank=k) for k in range(pp)]
            row = {"schedule": schedule, "stages_per_rank": v, "micro_batches": m,
                   "sent_bytes": [r["sent"] for r in ranks], "predicted_bytes": predicted,
                   "bytes_ratio": [r["sent"] / p for r, p in zip(ranks, predicted)],
                   "one_process_s": t1, "pipelined_s": t_pp,
                   "measured_bubble": pp * t_pp / t1 - 1,
                   "formula_bubble": bubble_fraction(pp, m, v)}
            rows.append(row)
            print(f"[pipeline] {schedule:16s} m={m}: sent/predicted "
                  f"{', '.join(f'{x:.3f}' for x in row['bytes_ratio'])}; bubble measured "
                  f"{row['measured_bubble']:.2f} vs formula {row['formula_bubble']:.2f} "
                  f"(step {t_pp * 1e3:.0f} ms at pp={pp}, {t1 * 1e3:.0f} ms in one process)",
                  flush=True)
    with open(args.json, "w") as f:
        json.dump({"model": vars(CFG), "pp": pp, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Trainer overhead, data-parallel scaling and MFU, measured side by side in one run.

    .venv/bin/python bench/bench_trainer.py [--repeats 2] [--steps 10] [--json out.json]

`--part scaling` runs W=1 and W=2 of the real Trainer in plain processes over gloo (no Ray: the
trainer's own data-parallel efficiency), and two plain loops side by side vs one (the ceiling
this machine's shared memory and caches leave for 2 workers).

`--part ab --set KEY=VALUE [--rounds 4] [--world 2]` alternates the Trainer with the default
config (A) and with the overrides (B) in one sitting: the effect of one setting, e.g.
`--set train.reshard_after_forward=always`.

`--part ray` (the default): each repeat runs, back to back on the same cores:
  plain   (before and after the two Ray runs) a single-process PyTorch loop: the same GPT,
          batch, micro-batches, AdamW param groups,
          grad clipping and thread count, batches read into memory before the clock starts
  W=1     elastic-gpt through `run_training` (Ray Train, FSDP2 at W=1 over gloo, the real data
          stream, MLflow logging), 1 worker x 1 thread
  W=2     the same, 2 workers x 1 thread (same global batch: each worker does half the micro-batches)

What a step time includes. plain: forward/backward of every micro-batch, clip, AdamW step,
zero_grad. Trainer: the figure it reports per step (`step_time_s`: waiting for the batch,
forward/backward, FSDP collectives, clip, the metrics all-reduce and its host sync, AdamW), and as
a cross-check the wall time between consecutive step records (MLflow timestamps), which adds
everything else the loop does per step (metrics dict, logging enqueue). Startup (Ray, worker
group, model build) and the final checkpoint are excluded: only steps >= --warmup count, and the
figure is the median over those steps. Ratios are taken within a repeat, then the median over
repeats is reported (absolute times drift with the machine's load between repeats).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

from common import PRESET, median, prepare_dataset

from elastic_gpt.tracking import metric_names as mn

G, MB = 8, 2  # 8 seqs * 256 tokens = 2,048 tokens per step; 4 micro-batches at W=1, 2 at W=2


def plain_loop(data: str, steps: int, threads: int, warmup: int) -> list[float]:
    """Step times of the plain loop; returns those after `warmup`."""
    import torch

    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.model.config import preset_config
    from elastic_gpt.model.gpt import GPT, token_losses

    torch.set_num_threads(threads)
    manifest = load_manifest(data)
    cfg = preset_config(PRESET, vocab_size=256, seq_len=manifest.seq_len)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    stream = open_step_stream(data, batch_split=BatchSplit(G, MB), rank=0, world_size=1, start_step=0,
                              seed=1234)
    batches = [next(stream).tokens for _ in range(steps)]
    stream.close()
    T = cfg.seq_len
    times = []
    for micro in batches:
        t0 = time.perf_counter()
        for tokens in micro:
            loss = token_losses(model(tokens[:, :T]), tokens[:, 1:T + 1]) / (G * T)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def interleaved(data: str, rounds: int, per_round: int) -> dict:
    """The trainer's step vs the plain loop's, alternating in one process (same noise for both).

    Trainer side: `Trainer.train_step` exactly as the loop calls it (FSDP2 at W=1 over a gloo
    group, the real prefetching data stream, the metrics all-reduce and host sync, AdamW on
    DTensors), plus `next(stream)`. Both wall time and process CPU time (all threads: the data
    prefetch thread counts against the trainer) per step; CPU time is what other load on a
    2-core machine does not distort.
    """
    from elastic_gpt.testing.gloo import gloo_group

    with gloo_group():
        return _interleaved(data, rounds, per_round)


def _interleaved(data: str, rounds: int, per_round: int) -> dict:
    import torch

    from elastic_gpt.config import load_config
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.model.config import preset_config
    from elastic_gpt.model.gpt import GPT, token_losses
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config(_TINY, [
        f"model.preset={PRESET}", f"data.path={data}", f"train.global_batch_size={G}",
        f"train.micro_batch_size={MB}", "train.max_steps=1000", "train.threads_per_worker=1",
        "scaling.cpus_per_worker=1", "checkpoint.path=/nonexistent-unused"])
    trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None)
    stream = open_step_stream(data, batch_split=trainer.batch_split, rank=0, world_size=1, start_step=0,
                              seed=cfg.data.seed)
    model = GPT(preset_config(PRESET, vocab_size=256, seq_len=256))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    T = 256

    def plain_step(batch):
        for tokens in batch.tokens:
            (token_losses(model(tokens[:, :T]), tokens[:, 1:T + 1]) / (G * T)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def trainer_step():
        batch = next(stream)
        trainer.train_step(batch)
        trainer.step += 1

    plain_batches = open_step_stream(data, batch_split=trainer.batch_split, rank=0, world_size=1,
                                     start_step=0, seed=cfg.data.seed)
    out = {"plain_wall": [], "plain_cpu": [], "trainer_wall": [], "trainer_cpu": []}
    try:
        for r in range(rounds + 1):  # round 0 warms both up and is dropped
            for name, fn in (("plain", lambda: plain_step(next(plain_batches))),
                             ("trainer", trainer_step)):
                for _ in range(per_round):
                    w0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    if r:
                        out[f"{name}_wall"].append(time.perf_counter() - w0)
                        out[f"{name}_cpu"].append(time.process_time() - c0)
    finally:
        stream.close()
        plain_batches.close()
    m = {k: median(v) for k, v in out.items()}
    return {"steps": {k: [round(x, 4) for x in v] for k, v in out.items()},
            **{f"{k}_s": v for k, v in m.items()},
            "overhead_ratio_cpu": m["plain_cpu"] / m["trainer_cpu"],
            "overhead_ratio_wall": m["plain_wall"] / m["trainer_wall"]}


def _scaling_worker(rank: int, world: int, data: str, steps: int, warmup: int, mode: str,
                    overrides: list[str]) -> dict:
    """One rank of the in-process scaling part: the real Trainer over the gloo group of `world`
    processes (mode "trainer"), or the plain loop alone in its process (mode "plain", which leaves
    the group unused); its step times."""
    import torch
    torch.set_num_threads(1)
    if mode == "plain":
        return {"wall": plain_loop(data, steps, 1, warmup)}
    from elastic_gpt.config import load_config
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer
    cfg = load_config(_TINY, [
        f"model.preset={PRESET}", f"data.path={data}", f"train.global_batch_size={G}",
        f"train.micro_batch_size={MB}", "train.max_steps=1000", "train.threads_per_worker=1",
        "scaling.cpus_per_worker=1", "scaling.min_workers=1", f"scaling.max_workers={world}",
        "checkpoint.path=/nonexistent-unused", *overrides])
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    stream = open_step_stream(data, batch_split=trainer.batch_split, rank=trainer.dp_rank,
                              world_size=trainer.dp_degree, start_step=0, seed=cfg.data.seed)
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step(next(stream))
        trainer.step += 1
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    stream.close()
    return {"wall": wall[warmup:], "cpu": cpu[warmup:], "setup": trainer.setup_line()}


def _spawn(world: int, data: str, steps: int, warmup: int, mode: str,
           overrides: list[str]) -> list[dict]:
    """Run `_scaling_worker` in `world` fresh processes; each rank's step times."""
    from elastic_gpt.testing.gloo import run_gloo
    return run_gloo(_scaling_worker, world, data, steps, warmup, mode, list(overrides))


def scaling_inprocess(data: str, repeats: int, steps: int, warmup: int,
                      overrides: list[str] = ()) -> dict:
    """W=2 vs W=1 with the real Trainer in plain processes (no Ray), and the machine's own ceiling:
    two plain loops side by side vs one. Repeats alternate W=1 and W=2, so load drift hits both."""
    rows = []
    for r in range(repeats):
        row = {}
        for name, world, mode in (("w1", 1, "trainer"), ("w2", 2, "trainer"),
                                  ("plain1", 1, "plain"), ("plain2", 2, "plain")):
            per_rank = _spawn(world, data, steps, warmup, mode, overrides)
            row[f"{name}_step_s"] = max(median(p["wall"]) for p in per_rank)
            if mode == "trainer":
                row[f"{name}_cpu_s"] = median(per_rank[0]["cpu"])
                row["setup_" + name] = per_rank[0]["setup"]
        # Tokens/s ratios: W=2 does the same global batch per step as W=1. Two plain loops each do
        # a full step, so their aggregate throughput is 2 / step time.
        row["scaling_ratio"] = row["w1_step_s"] / row["w2_step_s"]
        row["ceiling_ratio"] = 2 * row["plain1_step_s"] / row["plain2_step_s"]
        print(f"[bench_trainer] scaling repeat {r + 1}/{repeats}: " + ", ".join(
            f"{k}={v:.3g}" for k, v in row.items() if not k.startswith("setup")), flush=True)
        rows.append(row)
    keys = [k for k in rows[0] if not k.startswith("setup")]
    m = {k: median(row[k] for row in rows) for k in keys}
    return {"repeats": rows, **m, "setup_w2": rows[0]["setup_w2"],
            "w1_tokens_per_s": G * 256 / m["w1_step_s"],
            "w2_tokens_per_s": G * 256 / m["w2_step_s"]}


def ab_inprocess(data: str, rounds: int, steps: int, warmup: int, world: int,
                 overrides: list[str]) -> dict:
    """The Trainer at W=`world` with the default config (A) and with `overrides` (B), alternating
    `rounds` times in one sitting, so the machine's drift hits both sides alike."""
    runs: dict[str, dict[str, list[float]]] = {"a": {"wall": [], "cpu": []},
                                                "b": {"wall": [], "cpu": []}}
    for r in range(rounds):
        for side, extra in (("a", []), ("b", overrides)):
            per_rank = _spawn(world, data, steps, warmup, "trainer", extra)
            runs[side]["wall"].append(max(median(p["wall"]) for p in per_rank))
            runs[side]["cpu"].append(median(per_rank[0]["cpu"]))
        print(f"[bench_trainer] A/B round {r + 1}/{rounds}: A {runs['a']['wall'][-1]:.3f} s, "
              f"B {runs['b']['wall'][-1]:.3f} s per step", flush=True)
    m = {f"{side}_{k}_s": median(v) for side, d in runs.items() for k, v in d.items()}
    return {"world": world, "b_overrides": overrides, "runs": runs, **m,
            "b_vs_a_tokens_per_s": m["a_wall_s"] / m["b_wall_s"]}


def trainer_run(data: str, root: str, name: str, workers: int, steps: int, warmup: int) -> dict:
    """One elastic-gpt run; per-step reported step time and wall time between step records."""
    import mlflow

    from elastic_gpt.config import load_config
    from elastic_gpt.elastic.launcher import run_training

    uri = f"sqlite:///{root}/mlflow.db"
    cfg = load_config(_TINY, [
        f"model.preset={PRESET}", f"data.path={data}", f"train.global_batch_size={G}",
        f"train.micro_batch_size={MB}", f"train.max_steps={steps}", "train.warmup_steps=2",
        "train.lr=1e-3", "train.log_every=1000", "train.threads_per_worker=1",
        f"scaling.min_workers={workers}", f"scaling.max_workers={workers}",
        "scaling.cpus_per_worker=1", f"checkpoint.every_steps={steps}",
        f"checkpoint.path={root}/ckpt-{name}", f"run.name={name}", f"tracking.uri={uri}",
        f"run.storage_path={root}/ray", "elastic.max_failures_per_hour=0"])
    summary = run_training(cfg)
    client = mlflow.MlflowClient(uri)
    hist = sorted(client.get_metric_history(summary["run_id"], mn.TRAIN_STEP_TIME_S),
                  key=lambda m: m.step)
    reported = [m.value for m in hist if m.step > warmup]  # step k: after k steps
    stamps = [m.timestamp / 1000 for m in hist]
    wall = [b - a for i, (a, b) in enumerate(zip(stamps, stamps[1:])) if i + 1 >= warmup]
    return {"reported": reported, "wall": wall, "steps": len(hist)}


_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "jobs", "configs", "mini.yaml")


def run(repeats: int, steps: int, warmup: int, work: str) -> dict:
    import ray

    from elastic_gpt.config import load_config
    from elastic_gpt.elastic.launcher import connect_ray
    from elastic_gpt.model.config import flops_per_token, preset_config

    data = prepare_dataset(work)
    tokens_per_step = G * 256
    fpt = flops_per_token(preset_config(PRESET, vocab_size=256, seq_len=256))
    os.environ.setdefault("ELASTIC_GPT_OBJECT_STORE_BYTES", str(100 << 20))
    connect_ray(load_config(_TINY, [f"data.path={data}"]))  # one local cluster for every run
    rows = []
    try:
        for r in range(repeats):
            peak1 = _peak(1)
            # The plain loop brackets the Ray runs (before and after), so a load change on the
            # machine during the repeat moves both sides of the ratio alike.
            before = plain_loop(data, steps, 1, warmup)
            w1 = trainer_run(data, work, f"w1-{r}-{int(time.time())}", 1, steps, warmup)
            w2 = trainer_run(data, work, f"w2-{r}-{int(time.time())}", 2, steps, warmup)
            after = plain_loop(data, steps, 1, warmup)
            plain = median(before + after)
            peak2 = _peak(2)
            row = {
                "plain_step_s": plain, "plain_before_s": median(before),
                "plain_after_s": median(after), "w1_step_s": median(w1["reported"]),
                "w1_wall_s": median(w1["wall"]), "w2_step_s": median(w2["reported"]),
                "w2_wall_s": median(w2["wall"]), "peak_1thread_flops": peak1,
                "peak_2thread_flops": peak2,
            }
            row["overhead_ratio"] = row["plain_step_s"] / row["w1_step_s"]
            row["overhead_ratio_wall"] = row["plain_step_s"] / row["w1_wall_s"]
            row["scaling_ratio"] = row["w1_step_s"] / row["w2_step_s"]
            row["scaling_ratio_wall"] = row["w1_wall_s"] / row["w2_wall_s"]
            print(f"[bench_trainer] repeat {r + 1}/{repeats}: " + ", ".join(
                f"{k}={v:.3g}" for k, v in row.items()), flush=True)
            rows.append(row)
    finally:
        ray.shutdown()
    m = {k: median(row[k] for row in rows) for k in rows[0]}
    return {
        "model": f"{PRESET} (6x384, byte vocab 256, seq 256, 10.7M params), G={G}, micro={MB}",
        "flops_per_token": fpt,
        "repeats": rows,
        "plain_tokens_per_s": tokens_per_step / m["plain_step_s"],
        "w1_tokens_per_s": tokens_per_step / m["w1_step_s"],
        "w2_tokens_per_s": tokens_per_step / m["w2_step_s"],
        "overhead_ratio": m["overhead_ratio"], "overhead_ratio_wall": m["overhead_ratio_wall"],
        "scaling_ratio": m["scaling_ratio"], "scaling_ratio_wall": m["scaling_ratio_wall"],
        "peak_1thread_flops": m["peak_1thread_flops"], "peak_2thread_flops": m["peak_2thread_flops"],
        "mfu_plain": tokens_per_step / m["plain_step_s"] * fpt / m["peak_1thread_flops"],
        "mfu_w1": tokens_per_step / m["w1_step_s"] * fpt / m["peak_1thread_flops"],
        "mfu_w2": tokens_per_step / m["w2_step_s"] * fpt / m["peak_2thread_flops"],
    }


def _peak(threads: int) -> float:
    """Fresh (uncached) matmul peak of `threads` threads: median of 3 best-of-0.3 s measurements,
    taken next to the runs it normalises (the figure moves with the machine's load)."""
    from elastic_gpt.train import throughput
    vals = []
    for _ in range(3):
        throughput._cpu_peak_cache.pop(threads, None)
        vals.append(throughput.measure_cpu_matmul_flops(threads))
    throughput._cpu_peak_cache.pop(threads, None)
    return median(vals)


def cpu_time_matmul_peak(n: int = 512, reps: int = 20) -> float:
    """1-thread fp32 GEMM FLOPs per CPU second (best of `reps` blocks): the same shape as
    `throughput.measure_cpu_matmul_flops`, but timed in CPU time like the interleaved step figures,
    so other processes' load does not deflate it."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = 0.0
    for _ in range(reps):
        c0 = time.process_time()
        for _ in range(8):
            a @ b
        best = max(best, 8 * 2 * n**3 / max(time.process_time() - c0, 1e-9))
    return best


def _fpt() -> int:
    from elastic_gpt.model.config import flops_per_token, preset_config
    return flops_per_token(preset_config(PRESET, vocab_size=256, seq_len=256))


def _write_json(path: str | None, res: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["interleaved", "scaling", "ab", "ray"], default="ray")
    ap.add_argument("--world", type=int, default=2, help="ab: workers")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved: alternations")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded at the start of each run")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="scaling, ab: a config override for the trainer runs, e.g. "
                         "train.reshard_after_forward=always (repeatable)")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_trainer_")
    if args.part == "interleaved":
        res = interleaved(prepare_dataset(work), args.rounds, 2)
        peak_cpu, peak_wall = cpu_time_matmul_peak(), _peak(1)
        res.update(peak_1thread_cpu_time_flops=peak_cpu, peak_1thread_wall_flops=peak_wall,
                   mfu_plain_cpu=G * 256 / res["plain_cpu_s"] * _fpt() / peak_cpu,
                   mfu_trainer_cpu=G * 256 / res["trainer_cpu_s"] * _fpt() / peak_cpu)
        print({k: v for k, v in res.items() if k != "steps"})
        return _write_json(args.json, res)
    if args.part == "ab":
        if not args.set:
            ap.error("--part ab needs --set KEY=VALUE (the B side)")
        res = ab_inprocess(prepare_dataset(work), args.rounds, args.steps, args.warmup,
                           args.world, args.set)
        print(f"A (defaults) {res['a_wall_s']:.3f} s/step, B ({' '.join(args.set)}) "
              f"{res['b_wall_s']:.3f} s/step: B/A tokens/s {res['b_vs_a_tokens_per_s']:.3f}")
        return _write_json(args.json, res)
    if args.part == "scaling":
        res = scaling_inprocess(prepare_dataset(work), args.repeats, args.steps, args.warmup,
                                args.set)
        print(f"scaling_ratio {res['scaling_ratio']:.3f} (machine ceiling "
              f"{res['ceiling_ratio']:.3f}); {res['setup_w2']}")
        return _write_json(args.json, res)
    res = run(args.repeats, args.steps, args.warmup, work)
    for k in ("overhead_ratio", "overhead_ratio_wall", "scaling_ratio", "scaling_ratio_wall",
              "mfu_plain", "mfu_w1", "mfu_w2"):
        print(f"{k:22s} {res[k]:.3f}" if not math.isnan(res[k]) else f"{k:22s} nan")
    _write_json(args.json, res)


if __name__ == "__main__":
    main()

"""MFU and tokens/s on one NVIDIA GPU: the trainer's own GPU path, model by model.

    python bench/gpu_mfu.py [--models gpt2-124m,gpt2-350m,gpt3-1.3b] [--steps 20] [--json out]

Exactly the pieces the trainer uses on a GPU: the model built on "meta" and sharded with
`parallelize` (FSDP2 on a world-size-1 NCCL group, bf16 params / fp32 reduce, each block
`torch.compile`d inside its `fully_shard`), SDPA attention (flash kernels in bf16), fused AdamW
from `build_optimizer`, autocast to bf16, the summed cross-entropy the trainer computes
without tensor parallelism (`GPT.forward` with targets: the chunked loss).
Batches are random token ids already on the GPU (the data pipeline has its own benchmark).
MFU = tokens/s x model FLOPs per token (`flops_per_token`: 6N + 12 L d T) / the chip's dense
bf16 peak (elastic_gpt/hardware.py's table, which the trainer's MFU reads too). Timed: --steps
steps after --warmup steps (compile happens there), with CUDA synchronisation only at the ends of
the window, then as many again reading each step's loss on the host (the trainer's one host read
per step). Also: the environment, the chip's measured bf16 GEMM rate (MFU's practical ceiling),
the planner's predicted memory beside the measured peak, the --float8-models in float8, one step
of each bf16 model profiled into its parts (bench/gpu_profile.py), and first of all the
tensor-parallel path compiled on a one-rank mesh, checked against the plain model. The compiler
is reset before each model. `--cpu-dry-run` runs it all on the CPU (make test does, with
CUDA hidden: tests/unit/test_gpu_path.py).

`--calibration FILE` also writes the runs as a measured calibration of the planner
(elastic_gpt/planner/calibration_file.py; `elastic-gpt plan --calibration FILE`): each model's
throughput with the trainer's host read per step, on the planner's row for this chip (or
`--gpu`), and prints the terms the planner fits to it beside the default's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from common import one_rank_group
from gpu_profile import step_breakdown, tp_compile_smoke

# micro-batch x seq_len per model: sized for one 80-141 GB GPU without activation checkpointing.
DEFAULT_BATCH = {"gpt2-124m": 32, "gpt2-350m": 16, "gpt3-1.3b": 8, "gpt2-774m": 16, "small": 64}


def gemm_ceiling(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """The bf16 GEMM rate this chip reaches (FLOP/s): the practical ceiling under the datasheet
    peak that MFU is measured against."""
    if device.type != "cuda":
        n, reps = 256, 2
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    return env


def bench_model(name: str, batch: int, steps: int, warmup: int, compile: bool, ac: bool,
                device: torch.device, float8: bool = False, profile: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.config import load_config
    from elastic_gpt.cost_model.memory import memory_per_gpu
    from elastic_gpt.cost_model.memory_settings import resolve_memory_settings
    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.hardware import gpu_for_device
    from elastic_gpt.model.config import flops_per_token, preset_config
    from elastic_gpt.model.gpt import GPT
    from elastic_gpt.parallel.fsdp import device_memory_bytes, init_sharded_weights, parallelize
    from elastic_gpt.train.optimizer import build_optimizer
    from elastic_gpt.train.throughput import peak_flops

    cuda = device.type == "cuda"
    cfg = preset_config(name)  # GPT-2 vocab padded to 50304, the preset's seq_len
    with torch.device("meta"):
        model = GPT(cfg)
    # What the trainer's default (train.reshard_after_forward=auto) resolves to on this device.
    reshard = resolve_memory_settings(
        model_shape(cfg), world_size=1, tp=1, workers_per_node=[1], micro_batch=batch,
        micro_batches_per_rank=1, activation_checkpointing=ac, dtype="bfloat16",
        device_bytes=device_memory_bytes(device),
        gpu=gpu_for_device(torch.cuda.get_device_name(device)) if cuda else None,
    ).reshard_after_forward
    torch.compiler.reset()  # each model compiles from scratch, as a fresh trainer would
    parallelize(model, init_device_mesh(device.type, (1,)), compute_dtype=torch.bfloat16,
                activation_checkpointing=ac, compile=compile, reshard_after_forward=reshard,
                float8=float8)
    model.to_empty(device=device)
    init_sharded_weights(model, seed=0)
    run_cfg = load_config(None, ["data.path=unused"])
    opt = build_optimizer(model, run_cfg, fused=cuda)
    T, V = cfg.seq_len, cfg.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, V, (4, batch, T + 1), device=device, generator=gen)

    def step(i: int, host_sync: bool = False) -> torch.Tensor:
        x = data[i % 4]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x[:, :T], targets=x[:, 1:]) / (batch * T)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)  # as the trainer
        opt.step()
        opt.zero_grad(set_to_none=True)
        if host_sync:  # the trainer reads its step's figures on the host once per step
            loss.item()
        return loss.detach()

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step(i) for i in range(steps)]  # no host sync inside the window
    sync()
    dt = time.perf_counter() - t0
    tokens_per_s = steps * batch * T / dt
    # The same compiled model again, reading each step's loss on the host as the trainer does:
    # what the host's launch time costs where the GPU waits for it.
    t0 = time.perf_counter()
    for i in range(steps):
        step(i, host_sync=True)
    sync()
    synced_tokens_per_s = steps * batch * T / (time.perf_counter() - t0)
    breakdown = step_breakdown(lambda: step(0, host_sync=True), device) if profile else None
    fpt = flops_per_token(cfg)
    peak = peak_flops(device, torch.get_num_threads())
    predicted = memory_per_gpu(model_shape(cfg), 1, batch, activation_checkpointing=ac,
                               dtype="bfloat16", reshard_after_forward=reshard).total
    return {
        "model": name, "params": sum(p.numel() for p in model.parameters()),
        "batch": batch, "seq_len": T, "step_s": dt / steps, "tokens_per_s": tokens_per_s,
        "model_tflops": tokens_per_s * fpt / 1e12, "peak_tflops": peak / 1e12,
        "mfu": tokens_per_s * fpt / peak, "warmup_s": warm_s,
        "host_sync_tokens_per_s": synced_tokens_per_s,
        "host_sync_mfu": synced_tokens_per_s * fpt / peak,
        "max_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
        "predicted_mem_gb": predicted / 1e9,
        "last_loss": float(losses[-1]), "compile": compile, "activation_checkpointing": ac,
        "reshard_after_forward": reshard, "float8": float8, "profile": breakdown,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-124m,gpt2-350m,gpt3-1.3b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--float8-models", default="gpt3-1.3b",
                    help="models also run with train.float8 (H100/H200 class)")
    ap.add_argument("--json", default="bench/gpu_results.json")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the same code on CPU with gloo (checks the script, not a figure)")
    ap.add_argument("--calibration", metavar="FILE",
                    help="also write the runs as a measured calibration for `elastic-gpt plan "
                    "--calibration FILE`")
    ap.add_argument("--gpu", help="the planner's GPU row the calibration is for (default: the "
                    "row of the chip torch reports)")
    args = ap.parse_args()
    with one_rank_group(args.cpu_dry_run, "bench/gpu_mfu.py", 29533) as device:
        run(args, device)


def run(args, device: torch.device) -> None:
    out = {"environment": environment(device), "results": []}
    out["gemm_ceiling_tflops"] = gemm_ceiling(device) / 1e12
    print(f"[gpu] {out['environment']}; bf16 GEMM ceiling {out['gemm_ceiling_tflops']:.0f} "
          "TFLOP/s", flush=True)
    # First the tensor-parallel path, compiled, on a mesh of one rank: equal to the plain model.
    out["tp_compile_smoke"] = smoke = tp_compile_smoke(device, compile=not args.no_compile)
    print(f"[gpu] tensor-parallel path on a one-rank mesh (compile={smoke['compile']}): losses "
          f"{[round(v, 4) for v in smoke['tp']['losses']]} vs plain "
          f"{[round(v, 4) for v in smoke['plain']['losses']]}: "
          f"{'equal' if smoke['equal'] else 'NOT EQUAL'}", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    if not smoke["equal"]:
        sys.exit("bench/gpu_mfu.py: the tensor-parallel path's losses differ from the plain one's")
    row = calibration_row(args, out["environment"]["device"], device)
    # Each model in bf16 (one step of each profiled); 1.3b also in float8.
    runs = [(m, False) for m in args.models.split(",")]
    runs += [(m, True) for m in args.models.split(",") if m in args.float8_models.split(",")]
    for name, float8 in runs:
        batch = 2 if args.cpu_dry_run else DEFAULT_BATCH.get(name, 8)
        while True:
            try:
                r = bench_model(name, batch, args.steps, args.warmup,
                                compile=not args.no_compile, ac=False, device=device,
                                float8=float8, profile=not float8)
                break
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                if batch == 1:
                    raise
                batch //= 2  # the figure is still meaningful with a smaller batch
                print(f"[gpu] {name}: out of memory, retrying with batch {batch}", flush=True)
        r["mfu_of_ceiling"] = r["model_tflops"] / out["gemm_ceiling_tflops"]
        print(f"[gpu] {name}{' float8' if float8 else ''}: {r['tokens_per_s']:,.0f} tok/s "
              f"({r['host_sync_tokens_per_s']:,.0f} with a host read per step), "
              f"{r['model_tflops']:.0f} TFLOP/s, MFU {r['mfu']:.1%} ({r['mfu_of_ceiling']:.1%} "
              f"of the GEMM ceiling; batch {r['batch']}x{r['seq_len']}, "
              f"{r['step_s'] * 1e3:.0f} ms/step, {r['max_mem_gb']:.0f} GB, planner "
              f"{r['predicted_mem_gb']:.0f} GB, warmup {r['warmup_s']:.0f} s)", flush=True)
        if r["profile"]:
            p = r["profile"]
            print(f"[gpu] {name} one step: {p['busy_of_wall']:.0%} of its wall time busy; "
                  + ", ".join(f"{k} {v:.0%}" for k, v in sorted(p["share"].items(),
                                                                key=lambda kv: -kv[1])),
                  flush=True)
        out["results"].append(r)
        with open(args.json, "w") as f:  # partial results survive a timeout
            json.dump(out, f, indent=1)
        if row:  # so does the calibration of the runs so far
            write_measured_calibration(args.calibration, row, out)
    if row and args.cpu_dry_run:  # CPU figures on a GPU's row: the planner refuses to fit them
        print(f"[gpu] calibration {args.calibration} written (a dry run's CPU figures: not one "
              "to plan with)", flush=True)
    elif row:
        report_calibration(args.calibration, row)


def measured_run(r: dict):
    """One result as a run the planner can calibrate on: one GPU, FSDP2 on a world of one, no
    recomputation, the trainer's host read per step."""
    from elastic_gpt.model.config import preset_config
    from elastic_gpt.planner.calibration_fit import MeasuredRun, ModelSpec

    cfg = preset_config(r["model"], seq_len=r["seq_len"])
    model = ModelSpec(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                      seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    return MeasuredRun(
        f"{r['model']}{' float8' if r['float8'] else ''}, micro-batch {r['batch']}", model,
        "", 1, r["batch"], r["host_sync_tokens_per_s"],
        recompute=1.0 if r["activation_checkpointing"] else 0.0,
        dtype="float8" if r["float8"] else "bfloat16", eager=not r["compile"],
        reshard_after_forward=bool(r["reshard_after_forward"]))


def calibration_row(args, device_name: str, device: torch.device) -> str | None:
    """The planner's GPU row a --calibration is written for, or None (none asked for, or the
    chip has no row and no --gpu names one: said once, and the benchmark goes on)."""
    from elastic_gpt.hardware import get_gpu, gpu_for_device

    if not args.calibration:
        return None
    if args.gpu:
        return get_gpu(args.gpu).name
    gpu = gpu_for_device(device_name) if device.type == "cuda" else None
    if gpu is None:
        print(f"[gpu] no calibration written: {device_name} has no row in the planner's GPU "
              "table; pass --gpu NAME to say which row it is for", flush=True)
        return None
    return gpu.name


def write_measured_calibration(path: str, row: str, out: dict) -> None:
    import datetime

    from elastic_gpt.planner.calibration_file import calibration_document, write_calibration

    runs = [measured_run(r) for r in out["results"]]
    write_calibration(path, calibration_document(
        row, runs, written_by="bench/gpu_mfu.py", environment=out["environment"],
        date=datetime.date.today().isoformat()))


def report_calibration(path: str, row: str) -> None:
    """What the planner fits to the file just written, beside the default's terms."""
    from elastic_gpt.cost_model.calibration import DEFAULT_CALIBRATION
    from elastic_gpt.hardware import GPUS, get_gpu
    from elastic_gpt.planner.calibration_file import CalibrationFileError, load_calibration

    try:
        cal = load_calibration(path, dict(GPUS))
    except CalibrationFileError as e:  # the figures above stand; say why the planner won't fit
        print(f"[gpu] {e}", flush=True)
        return
    (family, fc), = cal.families.items()
    default = DEFAULT_CALIBRATION.for_gpu(get_gpu(row))
    print(f"[gpu] calibration {path}: {family} backward at {fc.terms.backward:.3f} of the kernel "
          f"model (the default's: {default.terms.backward:.3f}), its runs {cal.spread[0]:.2f}-"
          f"{cal.spread[1]:.2f}x its plans; `elastic-gpt plan --gpu {row} --calibration "
          f"{path}` plans with it", flush=True)

if __name__ == "__main__":
    main()

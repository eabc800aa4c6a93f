"""`elastic-gpt plan`: memory, communication, step time, goodput and cost of a run, before renting it.

Every model here is first-order arithmetic with its assumptions stated next to it (and in
docs/planner.md). Shapes and FLOPs come from model/gpt.py; GPU figures from hardware.py.

Units: bytes, seconds, FLOP/s; GB/s = 1e9 bytes/s; GiB = 2**30 bytes (GPU memory is reported so).
"""

# The docstring above is `elastic-gpt plan --help`'s description (elastic_gpt/cli.py reads it).

from __future__ import annotations

import argparse
import json
import math
import sys

import yaml

from elastic_gpt.arguments import (
    fraction,
    margin,
    non_negative_float,
    positive_float,
    positive_int,
    write_output_file,
)
from elastic_gpt.hardware import GPUS, load_overrides
from elastic_gpt.model.config import PRESETS, ModelConfig, preset_config
from elastic_gpt.planner.calibration_file import load_calibration
from elastic_gpt.planner.inputs import DEFAULT_HEARTBEAT_S, MIN_HEARTBEAT_S, PALM_STEPS_PER_SPIKE, PlanInputs
from elastic_gpt.planner.report import format_report, plan_summary, training_config
from elastic_gpt.planner.training_plan import Plan, plan_training


def parse_count(text: str) -> float:
    """'300B', '1.5T', '3e11', '20M' -> a number."""
    t = str(text).strip().replace(",", "").replace("_", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    try:
        value = float(t[:-1]) * mult[t[-1].upper()] if t and t[-1].upper() in mult else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 300B, 1.5T, 3e11)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count (e.g. 300B, 1.5T, 3e11)")
    return value


def parse_replica_groups(text: str) -> str | int:
    """'auto', 'off' or a group count of at least 2."""
    t = str(text).strip().lower()
    if t in ("auto", "off"):
        return t
    try:
        n = int(t)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, off or a group count >= 2")
    return n


def heartbeat_timeout(text: str) -> float:
    """A heartbeat timeout the trainer's config accepts: at least MIN_HEARTBEAT_S seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= MIN_HEARTBEAT_S):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= "
                                         f"{MIN_HEARTBEAT_S}")
    return value


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="gpt2-124m",
                   help=f"preset: {', '.join(PRESETS)} (default gpt2-124m)")
    m.add_argument("--n-layer", type=positive_int)
    m.add_argument("--n-head", type=positive_int)
    m.add_argument("--n-embd", type=positive_int)
    m.add_argument("--seq-len", type=positive_int)
    m.add_argument("--vocab-size", type=positive_int)
    t = parser.add_argument_group("training")
    t.add_argument("--global-batch-size", type=positive_int,
                   help="sequences per step (default: GPT-3's batch for the size, 0.5M-3.2M "
                   "tokens)")
    t.add_argument("--tokens", type=parse_count,
                   help="token budget, e.g. 300B (default 20 x params)")
    t.add_argument("--micro-batch-size", type=positive_int, help="force one (default: fastest that fits)")
    t.add_argument("--activation-checkpointing", choices=["auto", "on", "off"], default="auto")
    t.add_argument("--grad-sync", choices=["auto", "microbatch", "step"], default="auto")
    t.add_argument("--reshard-after-forward", choices=["auto", "always", "never"],
                   default="auto", help="always: ZeRO-3; never: keep every block gathered for "
                   "the step (one all-gather per block per step); auto: the faster that fits")
    t.add_argument("--tp", type=positive_int, help="tensor-parallel degree, 1, 2, 4 or 8 (default: the "
                   "fastest that fits)")
    t.add_argument("--pp", type=positive_int, help="pipeline-parallel degree (1: none; default: "
                   "the fastest that fits)")
    t.add_argument("--pp-stages-per-rank", type=positive_int,
                   help="pipeline stages per rank: 1 for 1F1B, more for interleaved 1F1B "
                   "(default: the fastest)")
    t.add_argument("--hsdp", choices=["auto", "on", "off"], default="auto",
                   help="on: FSDP shards within a node and replicates across nodes (default: "
                   "the faster that fits)")
    t.add_argument("--dtype", choices=["bfloat16", "float8", "float32"], default="bfloat16",
                   help="float8: the blocks' matmuls in float8 (train.float8, H100-class GPUs)")
    h = parser.add_argument_group("hardware")
    h.add_argument("--gpu", default="H100", help=f"one of {', '.join(GPUS)} (default H100)")
    h.add_argument("--gpus", type=positive_int, default=8, help="total GPUs = workers (default 8)")
    h.add_argument("--gpus-per-node", type=positive_int)
    h.add_argument("--intra-node-bw", type=positive_float, help="GB/s, NCCL bus bandwidth in a node")
    h.add_argument("--inter-node-bw", type=positive_float, help="GB/s per node between nodes")
    h.add_argument("--efficiency", type=efficiency_arg,
                   help="a fraction of peak FLOP/s to run every FLOP at (with a fixed latency "
                   "per collective) instead of the calibrated model (default `kernels`: each "
                   "kernel at what its size reaches, NCCL's collective latencies; "
                   "docs/planner.md)")
    h.add_argument("--achieved-tflops", type=positive_float,
                   help="measured end-to-end TFLOP/s per GPU; replaces the step-time model")
    h.add_argument("--calibration", metavar="FILE",
                   help="a measured calibration (JSON, written by bench/gpu.sh or `elastic-gpt "
                   "tune --write-calibration`) replacing the default one fitted to published "
                   "runs (docs/planner.md)")
    h.add_argument("--memory-margin", type=margin, default=0.10)
    h.add_argument("--hardware-file", help="YAML/JSON overriding GPU fields or prices")
    h.add_argument("--on-demand-price", type=non_negative_float, help="$ per GPU-hour")
    h.add_argument("--spot-price", type=non_negative_float, help="$ per GPU-hour")
    r = parser.add_argument_group("reliability")
    r.add_argument("--node-mtbf-hours", type=positive_float, default=6000.0)
    r.add_argument("--spot-node-mtbf-hours", type=positive_float, default=200.0)
    r.add_argument("--ckpt-write-s", type=non_negative_float, help="blocking checkpoint time (default: "
                   "checkpoint size / (nodes x --ckpt-bandwidth))")
    r.add_argument("--ckpt-bandwidth", type=positive_float, default=2.0, help="GB/s per node to storage")
    r.add_argument("--restart-s", type=non_negative_float, default=90.0,
                   help="Ray Train's stop and start of the group after a failure (default 90)")
    r.add_argument("--detect-s", type=non_negative_float,
                   help="how long a failure goes unnoticed (default: elastic.hang_timeout_s, "
                   "the bound on a hung rank)")
    r.add_argument("--compile-s", type=non_negative_float, default=0.0,
                   help="compilation in every restarted process, with train.compile (default 0)")
    r.add_argument("--spike-every-steps", type=non_negative_float, default=0.0,
                   help="mean steps between loss spikes, each rolled back, re-run and skipped "
                   "(default 0: none; PaLM 540B saw ~20 in 255k steps: "
                   f"{PALM_STEPS_PER_SPIKE:.0f})")
    r.add_argument("--storage-bandwidth", type=positive_float,
                   help="GB/s the checkpoint storage sustains for all nodes together (default: "
                   "no cap beyond nodes x --ckpt-bandwidth)")
    r.add_argument("--ckpt-every-steps", type=positive_int, help="evaluate this interval instead of "
                   "the Young/Daly one")
    r.add_argument("--market", choices=["spot", "on-demand"], default="spot",
                   help="capacity the written config's checkpoint interval and fault-tolerance "
                   "mode are tuned for")
    r.add_argument("--replica-groups", type=parse_replica_groups, default="auto",
                   help="auto: weigh replica groups (elastic.replica_groups) against the restart "
                   "path and write the better; off: the restart path; N: plan N groups")
    r.add_argument("--replica-heartbeat-timeout-s", type=heartbeat_timeout,
                   default=DEFAULT_HEARTBEAT_S, help="elastic.replica_heartbeat_timeout_s: each "
                   f"lost group stalls the others this long (default {DEFAULT_HEARTBEAT_S:g})")
    o = parser.add_argument_group("output")
    o.add_argument("--min-workers", type=positive_int, help="elastic floor for --write-config")
    o.add_argument("--write-config", metavar="FILE", help="write a ready training config YAML")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")


def efficiency_arg(text: str) -> float | None:
    """--efficiency: a fraction of peak, or `kernels` (None: the calibrated model)."""
    return None if text == "kernels" else fraction(text)


def inputs_from_args(args) -> PlanInputs:
    model: str | ModelConfig = args.model
    shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")}
    if any(v is not None for v in shape.values()):  # a custom shape on top of the preset's
        model = preset_config(args.model, seq_len=args.seq_len, vocab_size=args.vocab_size,
                              **shape)
    hardware = load_overrides(args.hardware_file) if args.hardware_file else dict(GPUS)
    calibration = load_calibration(args.calibration, hardware) if args.calibration else None
    ckpt = {"auto": None, "on": True, "off": False}[args.activation_checkpointing]
    return PlanInputs(
        model=model, seq_len=args.seq_len, vocab_size=args.vocab_size, gpu=args.gpu,
        n_gpus=args.gpus, global_batch_size=args.global_batch_size, tokens=args.tokens,
        gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_bw,
        inter_node_gbps=args.inter_node_bw, efficiency=args.efficiency,

        achieved_flops_per_gpu=args.achieved_tflops * 1e12 if args.achieved_tflops else None,
        micro_batch_size=args.micro_batch_size, activation_checkpointing=ckpt,
        grad_sync=args.grad_sync, reshard_after_forward=args.reshard_after_forward,
        tp=args.tp, pp=args.pp,
        pp_stages_per_rank=args.pp_stages_per_rank, hsdp=args.hsdp, dtype=args.dtype,
        memory_margin=args.memory_margin,
        on_demand_usd=args.on_demand_price, spot_usd=args.spot_price, hardware=hardware,
        node_mtbf_h=args.node_mtbf_hours, spot_node_mtbf_h=args.spot_node_mtbf_hours,
        ckpt_write_s=args.ckpt_write_s, ckpt_gbps=args.ckpt_bandwidth, restart_s=args.restart_s,
        detect_s=args.detect_s, compile_s=args.compile_s, storage_gbps=args.storage_bandwidth,
        spike_every_steps=args.spike_every_steps,
        ckpt_every_steps=args.ckpt_every_steps, market=args.market, min_workers=args.min_workers,
        replica_groups=args.replica_groups,
        replica_heartbeat_timeout_s=args.replica_heartbeat_timeout_s, calibration=calibration)


def run_from_args(args) -> int:
    # PlanError and config errors are ValueErrors: the CLI prints them as one line, exit 2.
    plan = plan_from_args(args, inputs_from_args(args))
    if args.json:
        print(json.dumps(plan_summary(plan), indent=2))
    else:
        print(format_report(plan))
    if args.write_config:
        print(f"\nwrote {args.write_config}", file=sys.stderr if args.json else sys.stdout)
    return 0


def plan_from_args(args, inputs: PlanInputs) -> Plan:
    """The plan, and its config written when --write-config asks (before any report: a path
    that cannot be written fails alone)."""
    plan = plan_training(inputs)
    if args.write_config:
        write_output_file(args.write_config, (
            f"# written by `elastic-gpt plan` for {plan.n_gpus} x {plan.gpu.name} "
            f"({plan.market}); add data.path (and checkpoint.path) before training\n"
            + yaml.safe_dump(training_config(plan), sort_keys=False)), "--write-config")
    return plan

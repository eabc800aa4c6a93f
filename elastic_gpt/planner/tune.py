"""`elastic-gpt tune`: measure tensor parallelism x pipeline parallelism x HSDP x micro-batch
size x activation checkpointing x torch.compile on the cluster's own workers, then write the
fastest config that fits in memory with a margin.

One Ray Train job (the config's worker count, tracking off, no checkpoints written) whose workers
loop over the candidates: each builds a fresh Trainer (the trainer's own mesh, pipeline stages and
TP + FSDP model, from parallel.tp / parallel.pp / parallel.hsdp and the ranks' Ray node ids), runs
1-2 warm-up steps and then --steps timed steps on the real data stream, and measures its peak
memory per worker. Pipelines (--pp) are measured only when asked for, at micro-batch sizes whose
step gives every data-parallel rank at least pp micro-batches. A candidate that runs out of memory
is recorded as "does not fit"; one whose tp the workers' node layout cannot hold is recorded as
refused. compile is only tried on CUDA (on CPU compiling costs minutes, so it is skipped and the
output says so). A worker lost mid-measurement (its node gone, its process killed) costs one
re-measurement on a fresh group, not the tune.
"""

# The docstring above is `elastic-gpt tune --help`'s description (elastic_gpt/cli.py reads it).

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict

import yaml

from elastic_gpt.config import Config, load_config, resolve_paths
from elastic_gpt.console import first_line, say
from elastic_gpt.errors import FailureBudgetSpent
from elastic_gpt.hardware import GiB, get_gpu
from elastic_gpt.planner.tune_candidates import (
    TrainSettings,
    candidate_list,
    pp_choices,
    pp_schedule,
    predicted_bytes,
    tp_choices,
    what_would_fit,
)
from elastic_gpt.planner.tune_worker import TABLE_FILE, MiB, tune_loop_per_worker

TUNE_RETRIES = 1  # fresh worker groups after one is lost mid-measurement


def format_table(rows: list[dict], predicted: list[float], winner: dict | None) -> str:
    """One line per candidate; 'planner MiB' is memory.memory_per_gpu for what the row ran (its tp
    and FSDP shard degree included), or for a pipeline (pp > 1; "2x2": 2 stages per rank)
    pipeline.pipelined_memory's most loaded pipeline rank."""
    head = (f"{'tp':>2} {'pp':>3} {'hsdp':>4} {'micro-batch':>11} {'ckpt':>4} {'compile':>7} "
            f"{'s/step':>8} {'tokens/s':>10} {'peak MiB':>9} {'planner MiB':>11}  result")
    lines = [head, "-" * len(head)]
    for row, pred in zip(rows, predicted):
        if row.get("refused"):
            result = f"refused ({row['refused']})"
        elif row.get("skipped") or row["oom"]:
            result = "does not fit" + (f" ({row['skipped']})" if row.get("skipped") else " (OOM)")
        elif row["error"]:
            result = f"failed: {row['error']}"
        else:
            result = "fits" if row["fits"] else "over budget"
        if row is winner:
            result += "  <- fastest that fits"
        step = f"{row['step_s']:.3f}" if row["step_s"] else "-"
        tps = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else "-"
        peak = f"{row['peak_bytes'] / MiB:,.1f}" if row["peak_bytes"] else "-"
        ckpt = "on" if row["activation_checkpointing"] else "off"
        hsdp = "on" if row.get("hsdp") else "off"
        pp = settings_of(row).pipeline
        lines.append(f"{row.get('tp', 1):>2} {pp:>3} {hsdp:>4} {row['micro_batch']:>11} {ckpt:>4}"
                     f" {'on' if row['compile'] else 'off':>7} {step:>8} {tps:>10} {peak:>9} "
                     f"{pred / MiB:>11,.1f}  {result}")
    return "\n".join(lines)


def pick_winner(rows: list[dict]) -> dict | None:
    """The fastest that fits; ties go to the larger micro-batch, then the simpler layout (the
    smaller tp, then no pipeline or the shorter one, then no HSDP)."""
    fitting = [r for r in rows if r["fits"]]
    return min(fitting, key=lambda r: (r["step_s"], -r["micro_batch"], r.get("tp", 1),
                                       r.get("pp", 1), r.get("stages_per_rank", 1),
                                       bool(r.get("hsdp")))) if fitting else None


def settings_of(row: dict) -> TrainSettings:
    return TrainSettings(row["micro_batch"], row["activation_checkpointing"], row["compile"],
                         row.get("tp", 1), bool(row.get("hsdp")), row.get("pp", 1),
                         row.get("stages_per_rank", 1))


def tuned_config_dict(config_path: str, overrides: list[str], winner: dict,
                      spans_nodes: bool = False) -> tuple[dict, list[str]]:
    """The input YAML with the overrides applied and the winner's train.* and parallel.* keys;
    and a note for each other key it had to change. parallel.hsdp is the winner's where the
    workers spanned nodes; measured on one node (where HSDP is plain FSDP) it stays as given.
    A pipelined winner writes parallel.pp, its pp_schedule and pp_stages_per_rank; one without a
    pipeline resets them where the input had them. scaling.min/max_workers become multiples of the
    winner's pp x tp (config validation: workers come in whole pipelines of tensor-parallel
    groups), and under a pipeline the ceiling comes down to where a step still gives every
    data-parallel rank pp micro-batches."""
    from elastic_gpt.data.order import BatchSplit

    with open(config_path) as f:
        raw = yaml.safe_load(f) or {}
    for item in overrides:
        key, _, value = item.partition("=")
        section, _, name = key.strip().partition(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(value) if value.strip() else ""
    train = raw.setdefault("train", {})
    train["micro_batch_size"] = winner["micro_batch"]
    train["activation_checkpointing"] = winner["activation_checkpointing"]
    train["compile"] = winner["compile"]
    tp, pp = winner.get("tp", 1), winner.get("pp", 1)
    stages = winner.get("stages_per_rank", 1)
    parallel = raw.setdefault("parallel", {})
    parallel["tp"] = tp
    if spans_nodes:
        parallel["hsdp"] = "on" if winner.get("hsdp") else "off"
    else:
        parallel.setdefault("hsdp", "auto")
    if pp > 1 or {"pp", "pp_schedule", "pp_stages_per_rank"} & set(parallel):
        parallel.update(pp=pp, pp_schedule=pp_schedule(stages), pp_stages_per_rank=stages)
    notes = []
    scaling = raw.setdefault("scaling", {})
    defaults = Config().scaling
    low = int(scaling.get("min_workers", defaults.min_workers))
    high = int(scaling.get("max_workers", defaults.max_workers))
    unit = tp * pp
    what = f"parallel.tp={tp}" if pp == 1 else f"parallel.pp x parallel.tp = {unit}"
    # The floor up, the ceiling down (never below one group), the floor no higher than the ceiling.
    new_high = max(unit, high // unit * unit)
    split = BatchSplit(int(train.get("global_batch_size", Config().train.global_batch_size)),
                       winner["micro_batch"])
    while new_high > unit and split.slots(new_high // unit) < pp:
        new_high -= unit
    new_low = min(max(unit, -(-low // unit) * unit), new_high)
    for key, old, new in (("min_workers", low, new_low), ("max_workers", high, new_high)):
        if old != new:
            scaling[key] = new
            why = f"a multiple of {what}"
            if key == "max_workers" and new < high // unit * unit:
                why += f", at which a step still gives every pipeline {pp} micro-batches"
            notes.append(f"scaling.{key}={old} -> {new} ({why})")
    return raw, notes


def run_tune(args) -> int:
    import ray
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.data.mixture import load_training_manifest
    from elastic_gpt.elastic.launcher import connect_ray
    from elastic_gpt.elastic.worker_group_job import use_gpu, worker_env
    from elastic_gpt.model.config import count_params
    from elastic_gpt.parallel.fsdp import reshard_label, resolve_dtype
    from elastic_gpt.train.model_config import model_config_for

    cfg = load_config(args.config, args.overrides)
    if args.steps < 1:
        raise ValueError(f"--steps={args.steps} must be at least 1")
    if not 0 <= args.memory_margin < 1:
        raise ValueError(f"--memory-margin={args.memory_margin} must be in [0, 1)")
    gpu_name = args.gpu or cfg.scaling.accelerator_type
    chip = get_gpu(gpu_name) if gpu_name else None  # an unknown name: a ValueError listing them
    budget = args.memory_budget_gib * GiB if args.memory_budget_gib else None
    if budget is not None and budget <= 0:
        raise ValueError(f"--memory-budget-gib={args.memory_budget_gib} must be positive")
    cfg.tracking.enabled = False
    resolve_paths(cfg)
    manifest = load_training_manifest(cfg.data)
    gpt_cfg = model_config_for(cfg, manifest)
    world = args.workers or cfg.scaling.max_workers
    G = cfg.train.global_batch_size
    mbs = _int_list("--micro-batch-sizes", args.micro_batch_sizes)
    tps = tp_choices(world, gpt_cfg.n_head, gpt_cfg.seq_len, _int_list("--tp", args.tp),
                     n_kv_head=gpt_cfg.n_kv_head, ffn_hidden=gpt_cfg.ffn_hidden)
    if G < world // max(tps):
        raise ValueError(f"train.global_batch_size={G} gives fewer sequences than the "
                         f"{world // max(tps)} data-parallel ranks of {world} workers at tp "
                         f"{max(tps)}")
    pps, stages = pp_choices(
        args.pp if args.pp == "auto" else _int_list("--pp", args.pp), world=world, tps=tps,
        n_layer=gpt_cfg.n_layer, global_batch=G,
        stages_per_rank=_int_list("--pp-stages-per-rank", args.pp_stages_per_rank),
        micro_batch_sizes=mbs)
    layouts = dict(tps=tps, pps=pps, stages_per_rank=stages)

    if args.write_calibration and chip is None:
        raise ValueError("--write-calibration needs the workers' GPU row: pass --gpu NAME or set "
                         "scaling.accelerator_type")
    started = connect_ray(cfg)
    try:
        gpu = use_gpu(cfg)
        if args.write_calibration and not gpu:
            raise ValueError("--write-calibration calibrates a GPU, and these workers have none "
                             "(scaling.use_gpu): tune on GPU workers, or drop --write-calibration")
        device = "cuda" if gpu else "cpu"
        dtype = str(resolve_dtype(cfg.train.dtype, torch.device(device))).removeprefix("torch.")
        cands = candidate_list(G, world, mbs, cuda=gpu, n_layer=gpt_cfg.n_layer, **layouts)
        shape = model_shape(gpt_cfg)
        # The planner first: a model that cannot fit even at micro-batch 1 with checkpointing is
        # refused before any worker starts, with what would fit instead.
        if chip is not None or budget is not None:
            usable_chip = chip if gpu else None
            line = what_would_fit(gpt_cfg, world, G, budget or chip.memory_bytes,
                                  args.memory_margin, dtype, usable_chip,
                                  cfg.train.reshard_after_forward, **layouts)
            if line:
                raise ValueError(line)
        say(f"[elastic-gpt tune] {count_params(gpt_cfg)['total'] / 1e6:.2f}M params, "
            f"G={G} x T={gpt_cfg.seq_len}, {world} {device.upper()} worker(s), {dtype}: "
            f"{len(cands)} candidates at tp {','.join(map(str, tps))}"
            + (f", pp {','.join(map(str, pps))}" if pps != [1] else "")
            + (f" ({','.join(map(str, stages))} stage(s) per rank)" if stages != [1] else "")
            + (" (and each with HSDP if the workers span nodes evenly)"
               if args.hsdp == "auto" else "")
            + f", {args.steps} timed step(s) each")
        if not gpu:
            say("[elastic-gpt tune] torch.compile not tried: no CUDA on the workers "
                "(compiling on CPU costs minutes)")
        s = cfg.scaling
        resources = {"CPU": s.cpus_per_worker, **({"GPU": 1} if gpu else {})}
        env = {**worker_env(), "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
        trainer = TorchTrainer(
            tune_loop_per_worker,
            train_loop_config={
                "config": cfg.to_dict(), "candidates": [asdict(c) for c in cands],
                "hsdp": args.hsdp,
                "steps": args.steps, "memory_margin": args.memory_margin,
                "budget_bytes": budget or (chip.memory_bytes if chip and gpu else None),
                "seq_len": gpt_cfg.seq_len, "n_params": count_params(gpt_cfg)["total"]},
            scaling_config=ScalingConfig(num_workers=world, use_gpu=gpu,
                                         resources_per_worker=resources,
                                         accelerator_type=s.accelerator_type),
            run_config=RunConfig(name=f"tune-{cfg.run.name}-{int(time.time())}",
                                 storage_path=cfg.run.storage_path,
                                 # A measurement holds no state worth keeping: a lost worker
                                 # (a spot node reclaimed, a process killed) re-measures every
                                 # candidate on a fresh group, once; a candidate that kills
                                 # its worker every time still fails the tune.
                                 failure_config=FailureConfig(max_failures=TUNE_RETRIES),
                                 worker_runtime_env={"env_vars": env}),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=300))
        try:
            result = trainer.fit()
        except TrainingFailedError as e:  # every retry spent: the cause is in Ray's log above
            raise FailureBudgetSpent(
                f"tune lost a worker {TUNE_RETRIES + 1} time(s) and measured nothing "
                f"({first_line(e)}); see the error above, then run the same command again") \
                from e
    finally:
        if started:
            ray.shutdown()
    with result.checkpoint.as_directory() as d, open(os.path.join(d, TABLE_FILE)) as f:
        out = json.load(f)
    rows = out["rows"]
    predicted = [predicted_bytes(shape, world, G, settings_of(r), dtype, gpu,
                                 grad_sync=r["grad_sync"],
                                 reshard_after_forward=r["reshard_after_forward"],
                                 dp_shard=r.get("dp_shard"), dp_replicate=r.get("dp_replicate"))
                 for r in rows]
    winner = pick_winner(rows)
    method = next((r["method"] for r in rows if r["method"]), "")
    budget_b = rows[0]["budget_bytes"]
    # auto resolves per layout (train/run_memory.py), so it can differ from row to row
    ran = {r["reshard_after_forward"] for r in rows}
    policy = (reshard_label(ran.pop(), cfg.train.reshard_after_forward) if len(ran) == 1
              else f"{cfg.train.reshard_after_forward} (per row)")
    syncs = {r["grad_sync"] for r in rows}
    grad_sync = (syncs.pop() + (" (auto)" if cfg.train.grad_sync == "auto" else "")
                 if len(syncs) == 1 else f"{cfg.train.grad_sync} (per row)")
    spans_nodes = len(set(out["rank_nodes"])) > 1
    print(f"\nmemory: {method}; budget {budget_b / GiB:.2f} GiB per worker, "
          f"{args.memory_margin:.0%} kept free; the trainer ran reshard_after_forward={policy}, "
          f"grad_sync={grad_sync}\n")
    print(format_table(rows, predicted, winner))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "predicted_bytes": predicted, "winner": winner,
                       "memory_method": method, "world_size": world, "device": device,
                       "grad_sync": grad_sync, "tp_choices": tps, "pp_choices": pps,
                       "stages_per_rank_choices": stages,
                       "rank_nodes": out["rank_nodes"], "reshard_after_forward": policy},
                      f, indent=1)
    if args.write_calibration:
        write_tune_calibration(args.write_calibration, rows, chip, gpt_cfg, cfg, world,
                               len(set(out["rank_nodes"])))
    if winner is None:
        usable = budget_b * (1 - args.memory_margin)
        measured = [r for r in rows if r["held_bytes"] and not r["oom"]]
        least = (f" (the smallest measured: {min(r['held_bytes'] for r in measured) / GiB:.2f} "
                 "GiB)" if measured else "")
        line = what_would_fit(gpt_cfg, world, G, budget_b, args.memory_margin, dtype,
                              chip if gpu else None, cfg.train.reshard_after_forward,
                              **layouts)
        raise ValueError(f"no candidate fits in {usable / GiB:.2f} GiB per worker{least}; "
                         + (line or "use more workers (a smaller shard each) or workers with "
                                    "more memory"))
    label = settings_of(winner).label
    print(f"\nfastest that fits: {label} ({winner['tokens_per_s']:,.0f} tokens/s)")
    if args.write_config:
        tuned, notes = tuned_config_dict(args.config, args.overrides, winner, spans_nodes)
        for note in notes:
            print(f"written config: {note}")
        with open(args.write_config, "w") as f:
            f.write(f"# tuned by `elastic-gpt tune` on {world} {device.upper()} worker(s): "
                    f"{winner['tokens_per_s']:,.0f} tokens/s, peak "
                    f"{winner['peak_bytes'] / MiB:,.1f} MiB per worker\n")
            yaml.safe_dump(tuned, f, sort_keys=False)
        load_config(args.write_config)  # what we wrote must load
        print(f"wrote {args.write_config}")
    return 0


def write_tune_calibration(path: str, rows: list[dict], chip, gpt_cfg, cfg: Config,
                           world: int, nodes: int) -> None:
    """Every candidate that ran, as a measured calibration of the planner for this GPU
    (planner/calibration_file.py): its layout, the trainer's recomputation (selective
    checkpointing recomputes only elementwise ops: counted as none), its tokens per second per
    worker; the network is the GPU row's, the workers per node as they were placed."""
    import datetime
    import math

    from elastic_gpt.planner.calibration_file import calibration_document, write_calibration
    from elastic_gpt.planner.calibration_fit import MeasuredRun, ModelSpec

    full = cfg.train.activation_checkpointing_mode == "full"
    model = ModelSpec(n_layer=gpt_cfg.n_layer, n_embd=gpt_cfg.n_embd, n_head=gpt_cfg.n_head,
                      seq_len=gpt_cfg.seq_len, vocab_size=gpt_cfg.vocab_size)
    G, runs = cfg.train.global_batch_size, []
    for r in rows:
        if not r["step_s"] or r["oom"] or r["error"] or r.get("refused") or r.get("skipped"):
            continue
        s = settings_of(r)
        dp = world // (s.tp * s.pp)
        runs.append(MeasuredRun(
            s.label, model, chip.name, world, s.micro_batch, r["tokens_per_s"] / world,
            micro_batches_per_rank=math.ceil(G / s.micro_batch / dp), tp=s.tp, pp=s.pp,
            pp_stages_per_rank=s.stages_per_rank, hsdp=s.hsdp,
            recompute=1.0 if s.activation_checkpointing and full else 0.0,
            dtype="float8" if cfg.train.float8 else "bfloat16", eager=not s.compile,
            reshard_after_forward=bool(r["reshard_after_forward"]),
            grad_sync="step" if s.pp > 1 else r["grad_sync"],
            network=(world // nodes, chip.intra_node_gbps, chip.inter_node_gbps)))
    if not runs:
        raise ValueError(f"--write-calibration {path}: no candidate ran to the end, so there is "
                         "nothing to calibrate on")
    write_calibration(path, calibration_document(
        chip.name, runs, written_by="elastic-gpt tune", date=datetime.date.today().isoformat()))
    print(f"wrote {path} ({len(runs)} measured run(s); `elastic-gpt plan --gpu {chip.name} "
          f"--calibration {path}`)")


# ---- CLI -----------------------------------------------------------------------------------------


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config, e.g. jobs/configs/mini.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. scaling.max_workers=4")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per candidate, after 1 warm-up step (2 with compile)")
    parser.add_argument("--micro-batch-sizes", metavar="1,2,4",
                        help="candidates (default: every divisor of the global batch that leaves "
                             "each worker a micro-batch)")
    parser.add_argument("--memory-margin", type=float, default=0.10,
                        help="fraction of the memory budget kept free (default 0.1)")
    parser.add_argument("--memory-budget-gib", type=float,
                        help="memory per worker (default: the GPU's memory, or on CPU the "
                             "node's RAM / workers on the node)")
    parser.add_argument("--gpu", help="GPU type for the planner's pre-check (default "
                                      "scaling.accelerator_type), e.g. H100")
    parser.add_argument("--workers", type=int, help="workers to tune on (default "
                                                    "scaling.max_workers)")
    parser.add_argument("--tp", metavar="1,2",
                        help="tensor-parallel degrees to measure (default: every divisor of the "
                             "workers that divides model.n_head and the sequence length; a tp "
                             "the workers of a node cannot hold is reported as refused)")
    parser.add_argument("--pp", metavar="1,2",
                        help="pipeline-parallel degrees to measure (default 1: no pipeline; "
                             "auto: every divisor of the workers that leaves each stage a block "
                             "and lets a step fill the pipeline). A pipeline is measured with "
                             "every --tp that makes whole pipelines of pp x tp workers, at the "
                             "micro-batch sizes that give every data-parallel rank at least pp "
                             "micro-batches per step")
    parser.add_argument("--pp-stages-per-rank", metavar="1,2",
                        help="stages per pipeline rank for the --pp degrees above 1 (default 1: "
                             "the 1F1B schedule; more: interleaved 1F1B), where the model has a "
                             "block for every stage")
    parser.add_argument("--hsdp", choices=("auto", "on", "off"), default="auto",
                        help="auto (default): measure each candidate with and without HSDP "
                             "where the workers (of one pipeline stage, with --pp) span nodes "
                             "with the same count on each; on/off: only that")
    parser.add_argument("--write-config", metavar="OUT.yaml",
                        help="write the input config with the winner's train.* and "
                             "parallel.tp/hsdp keys (and parallel.pp/pp_schedule/"
                             "pp_stages_per_rank for a pipeline)")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--write-calibration", metavar="FILE",
                        help="also write every candidate measured as the planner's calibration "
                             "of this GPU (`elastic-gpt plan --calibration FILE`; GPU workers)")


def _int_list(flag: str, text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers, e.g. 1,2") from None


def run_from_args(args) -> int:
    # Bad input or nothing fits raise ValueError: the CLI prints it as one line, exit 2.
    return run_tune(args)

"""`elastic-gpt dry-run`: the real trainer's build and one step at full scale, on one CPU.

For the layout `plan` chooses for the whole world (replica groups are not simulated), or a
training config's (`--config`), on `--gpus` GPUs of kind `--gpu`: each rank that differs (the
first, one with the smallest FSDP shards, the first of the last pipeline stage) is run in this
process on torch's fake process group of the whole world size and on fake tensors: the trainer's
own layout resolution, mesh, parallelization, pipeline schedule, optimizer and step. It prints
each rank's peak memory by what holds it and its collectives by mesh dimension beside the
planner's, and exits 0 when every rank builds and fits, 2 with one line when a layout cannot
build or does not fit. Nothing is read from storage and no GPU is needed; a rank of GPT-3 175B
takes minutes on 2 cores.
"""

# The docstring above is `elastic-gpt dry-run --help`'s description (elastic_gpt/cli.py reads it).

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from elastic_gpt.dry_run.compare import (
    AGREEMENT,
    RankComparison,
    compare_rank,
    fits,
    gib,
)
from elastic_gpt.model.config import preset_config
from elastic_gpt.planner.cli import add_cli_arguments as add_plan_arguments
from elastic_gpt.planner.cli import inputs_from_args, plan_from_args
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.report import format_report as format_plan
from elastic_gpt.planner.report import plan_summary, training_config
from elastic_gpt.planner.training_plan import Plan, plan_training


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    d = parser.add_argument_group("dry run")
    d.add_argument("--config", help="a training config YAML to dry-run (its model, batch and "
                   "layout) instead of the layout plan chooses for --model")
    d.add_argument("--ranks", help="comma-separated ranks to run (default: each that differs)")


@dataclasses.dataclass
class _Sizes:
    """What the model's shape takes from a dataset, given instead (no data is read)."""
    seq_len: int
    vocab_size: int

    def check_model(self, vocab_size: int) -> None:
        pass


def run_from_args(args) -> int:
    _refuse_float8(args.dtype)
    inputs, cfg = _inputs_and_config(args)
    plan = plan_training(inputs)
    ranks = _ranks(args.ranks, plan.n_gpus) if args.ranks else ranks_that_differ(plan)
    comparisons = dry_run_ranks(plan, inputs, cfg, ranks)
    print(json.dumps(summary(plan, comparisons), indent=2) if args.json
          else format_report(plan, comparisons))
    _refuse_what_does_not_fit(plan, comparisons)
    return 0


def plan_and_dry_run(args) -> int:
    """`elastic-gpt plan --dry-run`: the plan's report, then the dry run of the layout it chose,
    each rank that differs (with --json, one object: {"plan": ..., "dry_run": ...})."""
    _refuse_float8(args.dtype)
    inputs = inputs_from_args(args)
    plan = plan_from_args(args, inputs)
    if not args.json:  # the plan first: the dry run of a large model takes minutes
        print(format_plan(plan) + "\n", flush=True)
    comparisons = dry_run_ranks(plan, inputs, None, ranks_that_differ(plan))
    print(json.dumps({"plan": plan_summary(plan), "dry_run": summary(plan, comparisons)},
                     indent=2) if args.json else format_report(plan, comparisons))
    _refuse_what_does_not_fit(plan, comparisons)
    return 0


def _refuse_float8(dtype: str) -> None:
    if dtype == "float8":
        raise ValueError("--dtype float8: the dry run runs bf16 linears (torchao's float8 ones "
                         "need a GPU to trace); dry-run the layout with --dtype bfloat16")


def _refuse_what_does_not_fit(plan: Plan, comparisons: list[RankComparison]) -> None:
    too_big = [c for c in comparisons if not fits(c, plan.usable_bytes)]
    if too_big:
        c = too_big[0]
        raise ValueError(
            f"rank {c.result.rank} does not fit: it peaks at {gib(c.dry_run_total)} GiB "
            f"+ {gib(c.overhead)} GiB of CUDA context and fragmentation, over the "
            f"{gib(plan.usable_bytes)} GiB usable on a {plan.gpu.name}; lower the micro-batch, "
            "turn on activation checkpointing, or raise --tp or --pp")


def dry_run_ranks(plan: Plan, inputs: PlanInputs, cfg, ranks: list[int]) -> list[RankComparison]:
    """Each rank in a process of its own, about as many at once as there are CPUs: torch keeps
    process groups, meshes and DTensor's sharding caches per process, and a second fake world in
    one process would meet the first's. `cfg` None: the config the plan writes."""
    from elastic_gpt.train.model_config import model_config_for

    if cfg is None:
        cfg = _config_of(plan)
    gpt_cfg = model_config_for(cfg, _Sizes(plan.cfg.seq_len, plan.cfg.vocab_size))
    # One more than the CPUs: the three ranks that differ on two cores finish together, where
    # two at a time leave the third to run alone on one core after them.
    workers = max(1, min(len(ranks), (os.cpu_count() or 1) + 1))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as threads:
        pending = [(rank, threads.submit(
            _in_a_process_of_its_own, _simulate_rank_reporting, cfg, gpt_cfg, plan.gpu,
            world_size=plan.n_gpus, rank=rank,
            gpus_per_node=inputs.gpus_per_node or plan.gpu.gpus_per_node)) for rank in ranks]
        comparisons = []
        for rank, outcome in pending:
            result, error = outcome.result()
            if error is not None:
                kind, text = error
                # A layout the trainer refuses is the user's to change (one line, exit 2);
                # anything else is a bug, reported with the rank's own traceback.
                raise ValueError(text) if kind == "ValueError" else RuntimeError(
                    f"rank {rank} failed in its dry run:\n{text}")
            result.seconds = time.perf_counter() - t0  # wall time until this rank was done
            comparisons.append(compare_rank(plan, inputs, result))
    return comparisons


def _in_a_process_of_its_own(fn, *args, **kwargs):
    """fn in a fresh process, its result back. An executor, not a Pool: a process that dies (out
    of memory, a crash in torch) is an error here, where a Pool would wait for it forever; and
    one executor per call, not one of several tasks per worker: a worker that exits after its
    task can lose its result."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def _simulate_rank_reporting(*args, **kwargs):
    """simulate_rank in the rank's process, its failure sent back as text: torch's exceptions
    can hold what does not pickle."""
    import traceback

    from elastic_gpt.dry_run.rank_step import simulate_rank
    try:
        return simulate_rank(*args, **kwargs), None
    except ValueError as e:
        return None, ("ValueError", str(e))
    except Exception:
        return None, ("bug", traceback.format_exc())


def ranks_that_differ(plan: Plan) -> list[int]:
    """Rank 0 (the first pipeline stage, the first shard of every dimension), the last FSDP
    shard of the first stage (uneven shards are smaller at the end), and the first rank of the
    last pipeline stage (the output layer and the loss)."""
    mesh = plan.chosen.mesh
    per_stage = plan.n_gpus // mesh.pp
    ranks = [0]
    if mesh.dp_shard > 1:
        ranks.append((mesh.dp_shard - 1) * mesh.tp)
    if mesh.pp > 1:
        ranks.append((mesh.pp - 1) * per_stage)
    return sorted(set(ranks))


def _ranks(text: str, world_size: int) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or any(not 0 <= r < world_size for r in ranks):
        raise ValueError(f"--ranks {text} must be comma-separated ranks in [0, {world_size}); "
                         "leave it out to run each rank that differs")
    return sorted(set(ranks))


def _inputs_and_config(args):
    """The plan's inputs, and the config to run: --config's (its model, batch and layout on
    --gpu x --gpus), or None to run the config the plan writes."""
    inputs = inputs_from_args(args)
    if not args.config:
        return inputs, None
    from elastic_gpt.config import load_config

    cfg = load_config(args.config, ["data.path=dry-run", "train.compile=false",
                                    f"scaling.min_workers={args.gpus}",
                                    f"scaling.max_workers={args.gpus}"])
    t, p, m = cfg.train, cfg.parallel, cfg.model
    shape = _model_of(cfg)
    # The preset's name where the config keeps its shape (the report names it), else the shape:
    # a family, its keys (model.n_kv_head, ...) or a Hugging Face directory's.
    model = shape if shape != preset_config(m.preset, seq_len=shape.seq_len,
                                            vocab_size=shape.vocab_size) else m.preset
    inputs = dataclasses.replace(
        inputs, model=model, seq_len=shape.seq_len, vocab_size=shape.vocab_size,
        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
        activation_checkpointing=t.activation_checkpointing, tp=p.tp, pp=p.pp,
        pp_stages_per_rank=p.pp_stages_per_rank, hsdp=p.hsdp, grad_sync=t.grad_sync,
        reshard_after_forward=t.reshard_after_forward,
        dtype="float32" if t.dtype == "float32" else "bfloat16", replica_groups="off")
    return inputs, cfg


def _model_of(cfg):
    """The model the trainer builds for `cfg`, its family and family keys included
    (train/model_config.py), with the preset's context and vocabulary where the config leaves
    them to a dataset (none is read)."""
    from elastic_gpt.train.model_config import model_config_for

    m = cfg.model
    default = preset_config(m.preset, family=m.family)
    return model_config_for(cfg, _Sizes(m.seq_len or default.seq_len,
                                        m.vocab_size or default.vocab_size))


def _config_of(plan: Plan):
    """The config `plan --write-config` writes for this plan, as the trainer loads it."""
    from elastic_gpt.config import config_from_dict, validate

    # The layout run and compared is the plan's chosen one for the whole world, the restart
    # path's: a plan that would write replica groups writes each group's settings instead
    # (another micro-batch and pipeline schedule on a group's share of the GPUs).
    written = training_config(dataclasses.replace(plan, fault_tolerance_by_market={}))
    written["train"]["compile"] = False  # nothing to compile on fake tensors
    written["data"] = {"path": "dry-run"}  # not read
    cfg = config_from_dict(written)
    validate(cfg)
    return cfg


def summary(plan: Plan, comparisons: list[RankComparison]) -> dict:
    return {
        "model": plan.model_name, "gpu": plan.gpu.name, "gpus": plan.n_gpus,
        "layout": dataclasses.asdict(plan.chosen.mesh), "micro_batch": plan.chosen.micro_batch,
        "usable_gib": plan.usable_bytes / 2**30,
        "ranks": [{
            "rank": c.result.rank, "coordinate": c.result.coordinate,
            "seconds": round(getattr(c.result, "seconds", 0.0), 1),
            "memory_gib": {r.what: {"dry_run": r.dry_run / 2**30, "planner": r.planned / 2**30}
                           for r in c.memory},
            "tracker_peak_gib": {k: v / 2**30 for k, v in c.result.peak.items()},
            "total_gib": {"dry_run": c.dry_run_total / 2**30,
                          "planner": c.planned_total / 2**30},
            "planner_over_dry_run": c.agreement, "within": abs(c.agreement) <= AGREEMENT,
            "overhead_gib": c.overhead / 2**30, "fits": fits(c, plan.usable_bytes),
            "collectives": [{"dim": r.dim, "kind": r.kind, "count": r.count,
                             "planner_count": r.planned_count,
                             "dry_run_bytes": r.dry_run_bytes, "planner_bytes": r.planned_bytes}
                            for r in c.collectives]}
            for c in comparisons]}


def format_report(plan: Plan, comparisons: list[RankComparison]) -> str:
    c0 = plan.chosen
    lines = [f"dry run   {plan.model_name} on {plan.n_gpus} x {plan.gpu.name}: {c0.mesh.label()},"
             f" {c0.settings()}"]
    for c in comparisons:
        r = c.result
        where = ", ".join(f"{k} {v}" for k, v in r.coordinate.items())
        lines += ["", f"rank {r.rank} ({where}): built and stepped in "
                      f"{getattr(r, 'seconds', 0.0):.0f} s",
                  f"  {'memory at the peak (GiB)':34s} {'dry run':>9s} {'planner':>9s}"]
        lines += [f"    {m.what:32s} {gib(m.dry_run):>9s} {gib(m.planned):>9s}" for m in c.memory]
        verdict = "within" if abs(c.agreement) <= AGREEMENT else "OUTSIDE"
        lines += [f"    {'total, allocated':32s} {gib(c.dry_run_total):>9s} "
                  f"{gib(c.planned_total):>9s}  planner {c.agreement:+.1%} ({verdict} "
                  f"{AGREEMENT:.0%})",
                  f"    {'+ CUDA context, fragmentation':32s} {'':>9s} {gib(c.overhead):>9s}",
                  f"    {'usable':32s} {gib(plan.usable_bytes):>9s}   "
                  + ("fits" if fits(c, plan.usable_bytes) else "DOES NOT FIT"),
                  f"  {'collectives per step':34s} {'count':>7s} {'planner':>7s} "
                  f"{'GB dry run':>11s} {'GB planner':>11s}"]
        for row in c.collectives:
            planned = "" if row.planned_bytes is None else f"{row.planned_bytes / 1e9:,.3f}"
            count = "" if row.planned_count is None else str(row.planned_count)
            lines.append(f"    {row.dim + ' ' + row.kind:32s} {row.count:>7d} {count:>7s} "
                         f"{row.dry_run_bytes / 1e9:>11,.3f} {planned:>11s}")
    return "\n".join(lines)

"""The plan as a reader gets it: the text report, the JSON summary (`--json`) and the training
config it recommends (`--write-config`, only keys config.py knows).

Prices are hardware.py's, as of `PRICES_AS_OF`.
"""

from __future__ import annotations

import dataclasses
import math

from elastic_gpt.cost_model.calibration import PublishedMFU, best_published_mfu
from elastic_gpt.cost_model.memory import LOGIT_BYTES
from elastic_gpt.cost_model.shape import dtype_bytes
from elastic_gpt.cost_model.step_time import LayoutCandidate
from elastic_gpt.hardware import GB, PRICES_AS_OF, GiB
from elastic_gpt.model.config import PRESETS, preset_config
from elastic_gpt.planner.inputs import DAY, HOUR
from elastic_gpt.planner.replica_group_model import COLLECTIVE_TIMEOUT_S, FaultTolerance
from elastic_gpt.planner.training_plan import Plan, trainer_parallel_keys


def training_config(plan: Plan) -> dict:
    """The training config this plan recommends (only keys config.py knows)."""
    cfg = plan.cfg
    if plan.model_name in PRESETS and preset_config(plan.model_name, seq_len=cfg.seq_len) == cfg:
        model = {"preset": plan.model_name, "seq_len": cfg.seq_len}
    else:
        model = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                 "seq_len": cfg.seq_len} | _family_keys(plan)
    rg = plan.chosen_replica_groups
    # replica groups run the settings that fit a group, in groups of a fixed size
    c = rg.layout.candidate if rg else plan.chosen
    return {
        "model": model,
        "train": {"global_batch_size": plan.global_batch_size, "micro_batch_size": c.micro_batch,
                  "max_steps": plan.max_steps, "lr": plan.lr, "warmup_steps": plan.warmup_steps,
                  "activation_checkpointing": c.activation_checkpointing,
                  "grad_sync": c.grad_sync, "reshard_after_forward": c.reshard_policy,
                  "dtype": "float32" if dtype_bytes(plan.dtype) == 4 else "bfloat16"}
        | ({"float8": True, "compile": True} if plan.dtype == "float8" else {}),
        "scaling": {"min_workers": plan.n_gpus if rg else plan.min_workers,
                    "max_workers": plan.n_gpus, "use_gpu": True},
        "checkpoint": checkpoint_cadence(rg.interval_s if rg else plan.reliability.interval_s),
        # The restart path's grow rule expects membership changes at this market's rate until
        # the run has its own record (replica groups are of a fixed size: they never grow).
        "elastic": ({"replica_groups": rg.layout.n_groups,
                     "replica_heartbeat_timeout_s": plan.replica_heartbeat_timeout_s}
                    if rg else {"replica_groups": "off", "node_mtbf_h": round(
                        plan.reliability.mtbf_s * plan.nodes / HOUR, 3)}),
    } | _parallel_keys(c)


def _family_keys(plan: Plan) -> dict:
    """model.family and the shape keys only that family has (model.n_kv_head, ...), in
    config.py's names; none for GPT-2, whose shape (the default family's) has no family key."""
    from elastic_gpt.config import FAMILY_KEYS

    cfg, shape = plan.cfg, plan.cfg.shape()
    if "family" not in shape:
        return {}
    out = {"family": cfg.family}
    if plan.model_name in PRESETS:  # what the keys below leave to it (a RoPE factor, ...)
        out["preset"] = plan.model_name
    for key, field in FAMILY_KEYS.items():
        if field in shape:
            out[key] = shape[field] if key != "rope_scaling" else shape[field] is not None
    return out


def checkpoint_cadence(interval_s: float) -> dict:
    """The plan's checkpoint interval (Young/Daly's, or --ckpt-every-steps, at the planned step
    time) as checkpoint.every_minutes, with the step cadence off: the interval then holds when
    steps run slower or faster than planned (another network, a resize, a slow node), where a
    count of steps would drift with them."""
    return {"every_steps": 0, "every_minutes": float(f"{interval_s / 60:.3g}")}


def _parallel_keys(c: LayoutCandidate) -> dict:
    """parallel.tp and parallel.hsdp as planned (`on`/`off`, not the trainer's `auto`), so the
    trainer runs the plan's mesh; only the keys the trainer's config knows."""
    known = trainer_parallel_keys()
    pairs = [("tp", c.tp), ("hsdp", "on" if c.hsdp else "off")]
    if c.mesh.pp > 1:
        pairs += [("pp", c.mesh.pp), ("pp_schedule", c.mesh.schedule),
                  ("pp_stages_per_rank", c.mesh.stages_per_rank)]
    section = {k: v for k, v in pairs if k in known}
    return {"parallel": section} if section else {}


def format_report(plan: Plan) -> str:
    c, m, st, cfg = plan.chosen, plan.chosen.memory, plan.chosen.step, plan.cfg
    gib = lambda x: f"{x / GiB:6.2f} GiB"
    tok = cfg.seq_len * plan.global_batch_size
    if plan.achieved_flops_per_gpu:
        step_source = f"at the measured {plan.achieved_flops_per_gpu / 1e12:.0f} TFLOP/s per GPU"
    else:
        step_source = (f"compute {st.compute_s:.3f} s + exposed FSDP comm "
                       f"{st.exposed_comm_s:.3f} s"
                       + (f" + TP comm {st.tp_comm_s:.3f} s" if c.tp > 1 else "")
                       + (f" + pipeline bubble {st.bubble_s:.3f} s + point-to-point "
                          f"{st.p2p_s:.3f} s" if c.mesh.pp > 1 else "")
                       + f" + optimizer {st.optimizer_s:.4f} s")
    tp_part = f"P/{c.tp} on this TP rank, " if c.tp > 1 else ""
    shard_part = (f"/ {c.mesh.dp_shard} in a node (HSDP)" if c.hsdp
                  else f"/ {c.mesh.dp_shard}")
    memory_head = ("memory per GPU (FSDP2 / ZeRO-3: blocks re-gathered in backward"
                   if c.reshard_after_forward else
                   "memory per GPU (FSDP2, blocks kept gathered through the step")
    state_rows = [(f"params+grads+Adam, sharded (16 B x {tp_part}{shard_part})",
                   gib(m.sharded_state)),
                  ("gathered blocks + root in flight" if c.reshard_after_forward else
                   f"all {cfg.n_layer} blocks + root gathered", gib(m.gathered_params)),
                  ("unsharded fp32 grads across micro-batches", gib(m.accumulated_grads))]
    dp_line = (f"  FSDP: all-gather {st.all_gather_bytes / GB:.2f} GB + reduce-scatter "
               f"{st.reduce_scatter_bytes / GB:.2f} GB"
               + (f" + all-reduce across nodes {st.all_reduce_bytes / GB:.2f} GB"
                  if c.hsdp else "")
               + f" = {st.comm_s:.3f} s if serial; {st.exposed_comm_s:.3f} s exposed "
               f"({100 * st.overlapped_fraction:.0f}% overlapped)")
    lines = [
        f"model     {plan.model_name}: {plan.shape.params / 1e6:,.1f}M params, {cfg.describe()}, "
        f"{plan.shape.model_flops_per_token / 1e9:.2f} GFLOP/token",
        f"hardware  {plan.n_gpus} x {plan.gpu.name} on {plan.nodes} node(s), "
        f"{plan.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16 peak, {plan.gpu.memory_gib:.1f} GiB each",
        f"compute   {calibration_line(plan)}",
        f"layout    {c.mesh.label()}",
        f"batch     {plan.global_batch_size} seqs x {cfg.seq_len} = {tok:,} tokens/step; "
        f"micro-batch {c.micro_batch}, {c.micro_batches_per_rank} per data-parallel rank per "
        f"step, activation checkpointing {'on' if c.activation_checkpointing else 'off'}, "
        f"grads reduced per {c.grad_sync}, reshard_after_forward={c.reshard_policy}",
        "",
        memory_head
        + (f"; tensor parallel over {c.tp}, sequence parallel)" if c.tp > 1 else ")"),
        *(f"  {label:<50s}{value}" for label, value in [
            *state_rows,
            ("activations, checkpointing off / on",
             f"{gib(plan.memory_at_chosen[False].activations)} / "
             f"{gib(plan.memory_at_chosen[True].activations)}"),
            (f"logits for the loss ({LOGIT_BYTES} B x B x T x V / {c.tp})"
             if c.tp > 1 or c.mesh.pp > 1 else
             "logits for the loss (their gradient, and one chunk)", gib(m.logits)),
            ("CUDA context + fragmentation", gib(m.overhead)),
            ("total", f"{gib(m.total)}  of {plan.usable_bytes / GiB:.1f} GiB usable "
                      f"({plan.gpu.memory_gib:.1f} minus margin)"),
        ]),
        f"  largest micro-batch that fits: {plan.max_micro_batch[False] or 'none'} without, "
        f"{plan.max_micro_batch[True] or 'none'} with activation checkpointing (at most "
        f"global batch / data-parallel ranks = {plan.global_batch_size // c.mesh.dp})",
        "",
        "communication per GPU per step",
        dp_line,
    ]
    if c.tp > 1:
        lines.append(f"  tensor parallel: {st.tp_bytes / GB:.2f} GB on the intra-node link = "
                     f"{st.tp_comm_s:.3f} s, on the critical path (not overlapped)")
    if c.mesh.pp > 1:
        lines.append(f"  pipeline: {st.p2p_bytes / GB:.3f} GB of hidden states and their "
                     f"gradients sent = {st.p2p_s:.3f} s; bubble {st.bubble_s:.3f} s ((pp - 1) / "
                     f"(stages per rank x micro-batches) of the compute); the step and the "
                     f"memory are the fullest rank's: the first (pp micro-batches in flight), one "
                     f"with more blocks than the first, or the last (the output layer and loss)")
    lines += [
        "",
        "throughput",
        f"  step {plan.step_s:.3f} s ({step_source}), "
        f"{plan.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.mfu:.1f}%",
        f"  {plan.tokens / 1e9:.3g}B tokens = {plan.max_steps:,} steps = "
        f"{_duration(plan.time_to_train_s)} of training",
        *_range_lines(plan),
    ]
    if len(plan.layouts) > 1:
        lines += ["", "layouts weighed (the fastest fitting settings of each)"]
        for mesh, best, floor in plan.layouts:
            mark = "*" if mesh == c.mesh else " "
            if best is None and mesh.dp > plan.global_batch_size:
                lines.append(f"  {mark} {mesh.short():<20s} cannot run: {mesh.dp} data-parallel "
                             f"ranks, {plan.global_batch_size} sequences per step")
            elif best is None:
                lines.append(f"  {mark} {mesh.short():<20s} does not fit: needs "
                             f"{floor.total / GiB:.1f} GiB at micro-batch 1 with checkpointing")
            else:
                lines.append(f"  {mark} {mesh.short():<20s} step {best.step.step_s:8.3f} s, "
                             f"{best.memory.total / GiB:5.1f} GiB: {best.settings()}")
        ru = plan.runner_up
        if ru is not None and not plan.achieved_flops_per_gpu:
            lines.append(f"  chosen: {_why(c, ru)}")
    lines += [
        "",
        f"reliability (checkpoint {plan.on_demand.ckpt_write_s:.0f} s blocking, recovery "
        f"{plan.on_demand.recovery_s:.0f} s"
        + (f": {plan.restart_cost.breakdown()}" if plan.restart_cost else "") + ")",
    ]
    for label, rel in (("on-demand", plan.on_demand), ("spot", plan.spot)):
        lines.append(
            f"  {label:9s} cluster MTBF {_duration(rel.mtbf_s)}; checkpoint every "
            f"{rel.every_steps} steps ({_duration(rel.interval_s)}, Young/Daly "
            f"sqrt(2*delta*MTBF{', a spike counted twice' if rel.spike_s else ''}) = "
            f"{_duration(rel.young_interval_s)}): goodput "
            f"{100 * rel.goodput:.1f}%")
    rel = plan.on_demand
    if rel.spike_s:
        lines.append(f"  loss spikes: one every {_duration(rel.spike_every_s)}, each "
                     f"{_duration(rel.spike_s)} to roll back, re-run and skip: counted above "
                     "(replica groups roll back together, from their rarer checkpoints)")
    lines += ["", *_fault_tolerance_lines(plan)]
    lines += [
        "",
        f"cost (prices {PRICES_AS_OF}, $/GPU-hour; wall time = training time / goodput)",
        *(_cost_line(plan, label, spot) for label, spot in (("on-demand", False),
                                                            ("spot", True))),
        "",
        f"elastic floor: the chosen layout fits down to {plan.min_workers} worker(s)",
    ]
    lines += [f"note: {n}" for n in plan.notes + _calibration_notes(plan)]
    return "\n".join(lines)


def calibration_line(plan: Plan) -> str:
    """What the step's compute speed rests on: the calibration's name and its terms for this
    GPU, or what replaced it."""
    if plan.achieved_flops_per_gpu:
        return (f"the measured {plan.achieved_flops_per_gpu / 1e12:.0f} TFLOP/s per GPU "
                "(--achieved-tflops); no calibration")
    if not plan.calibrated_step:
        return "every FLOP at one fraction of peak (--efficiency); no calibration"
    fc = plan.family_calibration
    if fc is None or not plan.calibration.families:
        return f"calibration {plan.calibration.name}"
    scaled = (f"; no run measured on {fc.family}: {fc.scaled_from}'s terms, the family nearest "
              "it by datasheet (peak FLOP/s and HBM bandwidth)" if fc.scaled_from else "")
    compiled = "compiled" if plan.dtype == "float8" else "eager"
    return (f"calibration {plan.calibration.name}\n          {fc.family}: {fc.terms.describe()} "
            f"({fc.evidence}{scaled}); this plan's blocks run {compiled}, as its written config "
            "has them")


def plan_ranges(plan: Plan) -> dict | None:
    """The step, throughput, MFU, time and cost as the calibration's spread puts them: each
    published run it was fitted and checked on ran between `least` and `most` times the
    throughput the calibrated model plans for it. None: no calibrated step, or no spread."""
    spread = plan.calibration.spread if plan.calibrated_step else None
    if not spread:
        return None
    lo, hi = spread
    return {"spread": [lo, hi], "step_s": [plan.step_s / hi, plan.step_s / lo],
            "tokens_per_s": [plan.tokens_per_s * lo, plan.tokens_per_s * hi],
            "mfu": [plan.mfu * lo, plan.mfu * hi],
            "time_to_train_s": [plan.time_to_train_s / hi, plan.time_to_train_s / lo],
            # first order: the goodput and the checkpoint interval barely move with the step
            "cost_on_demand_usd": [plan.cost_usd(spot=False) / hi, plan.cost_usd(spot=False) / lo],
            "cost_spot_usd": [plan.cost_usd(spot=True) / hi, plan.cost_usd(spot=True) / lo]}


def class_best_mfu(plan: Plan) -> PublishedMFU | None:
    """The best MFU a published bf16 run of the plan's class (GPU family, every block
    recomputed or not) reached."""
    if plan.dtype != "bfloat16":
        return None
    return best_published_mfu(plan.gpu, plan.chosen.activation_checkpointing)


def _range_lines(plan: Plan) -> list[str]:
    r = plan_ranges(plan)
    if r is None:
        return []
    span = lambda k, f, sep="-": f"{f(r[k][0])}{sep}{f(r[k][1])}"  # noqa: E731
    money = lambda x: "never ends" if math.isinf(x) else f"${x:,.0f}"  # noqa: E731
    lines = [f"  range: the runs this calibration rests on ran {r['spread'][0]:.2f}-"
             f"{r['spread'][1]:.2f}x the throughput it plans for them, so: step "
             f"{span('step_s', lambda x: f'{x:.3f}')} s, MFU "
             f"{span('mfu', lambda x: f'{100 * x:.1f}')}%, "
             f"{span('time_to_train_s', _duration, ' to ')} of training, on demand "
             f"{span('cost_on_demand_usd', money, ' to ')}, on spot "
             f"{span('cost_spot_usd', money, ' to ')}"]
    best = class_best_mfu(plan)
    recompute = "every block recomputed" if plan.chosen.activation_checkpointing else \
        "without full recomputation"
    if best is not None:
        lines.append(f"  best published MFU of this class ({plan.gpu.name.split('-')[0]}, "
                     f"bf16, {recompute}): {100 * best.mfu:.1f}% ({best.run})")
    elif plan.dtype == "bfloat16":
        lines.append(f"  best published MFU of this class: none published for "
                     f"{plan.gpu.name.split('-')[0]} in bf16 {recompute}")
    return lines


def _calibration_notes(plan: Plan) -> list[str]:
    """Where the calibrated plan is above what any published run of its class reached."""
    best = class_best_mfu(plan) if plan.calibrated_step else None
    if best is None or plan.mfu <= best.mfu:
        return []
    return [f"the planned MFU ({100 * plan.mfu:.1f}%) is above the best published for its class "
            f"({100 * best.mfu:.1f}%, {best.run}): read the step as optimistic, and measure it "
            "(`elastic-gpt tune`, or bench/gpu.sh's calibration with --calibration)"]


def _cost_line(plan: Plan, label: str, spot: bool) -> str:
    rel, price = (plan.spot, plan.spot_usd) if spot else (plan.on_demand, plan.on_demand_usd)
    head = f"  {label:9s} ${price:.2f}: "
    if rel.goodput <= 0:
        return (head + f"never ends: the cluster fails every {_duration(rel.mtbf_s)}, before a "
                f"restart ({_duration(rel.recovery_s)}) and a checkpoint interval are done "
                "(goodput 0); " + ("use --market on-demand, fewer nodes, or replica groups"
                                   if spot else "use fewer nodes or replica groups"))
    return (head + f"${plan.cost_usd(spot=spot):,.0f} over "
            f"{_duration(plan.time_to_train_s / rel.goodput)}")


def _fault_tolerance_lines(plan: Plan) -> list[str]:
    """The restart path and the best replica groups side by side, per market, and which one the
    written config takes."""
    ft = plan.fault_tolerance
    lines = ["fault tolerance: the restart path or replica groups (elastic.replica_groups, "
             "docs/replica-groups.md)"]
    rg = ft.best
    if rg is not None:
        lay = rg.layout
        lines += [
            f"  replica groups N={lay.n_groups}: {lay.n_groups} x {lay.group_gpus} GPUs, each "
            f"{lay.mesh.label()}, {lay.candidate.settings()}, {lay.memory.total / GiB:.1f} GiB "
            "per GPU; step "
            f"{lay.step_s:.3f} s = {lay.in_group_step_s:.3f} s in the group + cross-group "
            f"all-reduce {lay.allreduce_s:.3f} s ({lay.allreduce_bytes / GB:.2f} GB per GPU, not "
            "overlapped)",
            f"  a lost group: the others stall "
            f"{max(plan.replica_heartbeat_timeout_s, COLLECTIVE_TIMEOUT_S):g} s (the larger of "
            f"the heartbeat and the collective timeout) + 1 step (the one in flight, discarded) "
            f"+ {_seconds(lay.heal_s)} healing it "
            f"({lay.heal_bytes / GB:.2f} GB of state per GPU from a peer) = {rg.stall_s:.1f} s; "
            f"it is away {rg.absent_s:.1f} s (restart + checkpoint read) while "
            f"{lay.n_groups - lay.groups_lost} of {lay.n_groups} groups train at "
            f"{100 * lay.degraded_speed:.0f}% speed (step {lay.degraded_step_s:.3f} s)",
            f"  checkpoints only for the fallback (the driver's node, with the Lighthouse, "
            f"lost: the restart path): the leading group writes them in {lay.ckpt_write_s:.1f} s",
        ]
        others = [r for r in ft.replica if r is not rg]
        best = ft.replica_effective(rg)
        if others and best > 0:
            lines.append(f"  also weighed ({ft.market}, effective throughput against N="
                         f"{lay.n_groups}'s): " + ", ".join(
                             f"N={r.layout.n_groups} {ft.replica_effective(r) / best:.2f}x"
                             for r in others))
        elif others:  # no goodput left at any N (stalls longer than the time between losses)
            lines.append(f"  also weighed ({ft.market}): " + ", ".join(
                f"N={r.layout.n_groups}" for r in others) + ", all at goodput 0")
    lines += [f"  not offered: {n}" for n in ft.not_offered]
    lines.append(f"  {'market':9s}  {'mode':15s} {'goodput':>7s} {'tokens/s x goodput':>19s} "
                 f"{'wall time':>11s} {'cost':>12s}  checkpoint every")
    for label in ("on-demand", "spot"):
        m = plan.fault_tolerance_by_market[label]
        price = plan.spot_usd if label == "spot" else plan.on_demand_usd
        rows = [("restart path", m.restart.goodput, m.restart_effective,
                 plan.time_to_train_s, m.restart.every_steps)]
        if m.best is not None:
            b = m.best
            rows.append((f"replica N={b.layout.n_groups}", b.goodput, m.replica_effective(b),
                         plan.max_steps * b.layout.step_s, b.every_steps))
        for i, (mode, g, effective, train_s, every) in enumerate(rows):
            wall = train_s / g if g > 0 else math.inf
            cost = (f"${wall / HOUR * plan.n_gpus * price:,.0f}" if g > 0 else "never ends")
            lines.append(f"  {label if i == 0 else '':9s}  {mode:15s} {100 * g:6.1f}% "
                         f"{effective:19,.0f} {_duration(wall) if g > 0 else '-':>11s} "
                         f"{cost:>12s}  {every} steps")
    lines.append(f"  written config ({ft.market}): {ft.why()}")
    return lines


def _why(chosen: LayoutCandidate, other: LayoutCandidate) -> str:
    """One line: what the chosen layout saves over the runner-up, by where the time goes."""
    a, b = chosen.step, other.step
    parts = [(label, y - x) for label, x, y in (
        ("compute", a.compute_s, b.compute_s),
        ("exposed FSDP comm", a.exposed_comm_s, b.exposed_comm_s),
        ("TP comm", a.tp_comm_s, b.tp_comm_s),
        ("optimizer", a.optimizer_s, b.optimizer_s))]
    parts = [f"{label} {d:+.3f} s" for label, d in parts if abs(d) >= 5e-4]
    return (f"{chosen.mesh.label()}, {b.step_s - a.step_s:.3f} s/step faster than the runner-up "
            f"{other.mesh.label()} ({other.settings()}; runner-up minus chosen: "
            f"{', '.join(parts) or 'equal'})")


def _seconds(s: float) -> str:
    """A short time with the digits that matter (healing takes milliseconds to minutes)."""
    return f"{s:.3f} s" if s < 1 else _duration(s)


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 2 * HOUR:
        return f"{s / 60:.1f} min"
    if s < 2 * DAY:
        return f"{s / HOUR:.1f} h"
    return f"{s / DAY:.1f} days"


def _fault_tolerance_summary(ft: FaultTolerance) -> dict:
    b = ft.best
    replica = None if b is None else {
        "n_groups": b.layout.n_groups, "group_gpus": b.layout.group_gpus,
        "groups_lost_per_node_failure": b.layout.groups_lost,
        "memory_bytes": b.layout.memory.total, "step_s": b.layout.step_s,
        "in_group_step_s": b.layout.in_group_step_s, "allreduce_s": b.layout.allreduce_s,
        "allreduce_bytes": b.layout.allreduce_bytes, "degraded_step_s": b.layout.degraded_step_s,
        "heal_s": b.layout.heal_s, "stall_s": b.stall_s, "absent_s": b.absent_s,
        "ckpt_write_s": b.layout.ckpt_write_s, "ckpt_every_steps": b.every_steps,
        "goodput": b.goodput, "effective_tokens_per_s": ft.replica_effective(b),
        "weighed": {r.layout.n_groups: ft.replica_effective(r) for r in ft.replica}}
    return {"mode": "replica_groups" if ft.use_replica_groups else "restart",
            "restart": {"goodput": ft.restart.goodput, "step_s":
                        ft.tokens_per_step / ft.restart_tokens_per_s,
                        "effective_tokens_per_s": ft.restart_effective,
                        "ckpt_every_steps": ft.restart.every_steps},
            "replica_groups": replica, "not_offered": ft.not_offered, "why": ft.why()}


def plan_summary(plan: Plan) -> dict:
    c, rg = plan.chosen, plan.chosen_replica_groups
    return {
        "model": plan.model_name, "params": plan.shape.params, "gpu": plan.gpu.name,
        "n_gpus": plan.n_gpus, "nodes": plan.nodes,
        "micro_batch_size": c.micro_batch, "activation_checkpointing": c.activation_checkpointing,
        "grad_sync": c.grad_sync, "reshard_after_forward": c.reshard_policy,
        "tp": c.tp, "hsdp": c.hsdp, "dp_shard": c.mesh.dp_shard,
        "dp_replicate": c.mesh.dp_replicate, "pp": c.mesh.pp,
        "pp_stages_per_rank": c.mesh.stages_per_rank, "bubble_s": c.step.bubble_s,
        "p2p_bytes": c.step.p2p_bytes, "p2p_s": c.step.p2p_s,
        "memory_bytes": dataclasses.asdict(c.memory)
        | {"total": c.memory.total},
        "max_micro_batch": {"no_ckpt": plan.max_micro_batch[False],
                            "ckpt": plan.max_micro_batch[True]},
        "all_gather_bytes": c.step.all_gather_bytes,
        "reduce_scatter_bytes": c.step.reduce_scatter_bytes,
        "all_reduce_bytes": c.step.all_reduce_bytes, "tp_bytes": c.step.tp_bytes,
        "tp_comm_s": c.step.tp_comm_s, "comm_s": c.step.comm_s, "exposed_comm_s": c.step.exposed_comm_s,
        "step_s": plan.step_s, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu,
        "max_steps": plan.max_steps, "time_to_train_s": plan.time_to_train_s,
        "goodput_on_demand": plan.on_demand.goodput, "goodput_spot": plan.spot.goodput,
        "ckpt_every_steps": plan.reliability.every_steps,
        # The blocking checkpoint write: with step_s, what a warning before a scheduler's end
        # must leave time for (elastic/slurm.py's lead).
        "ckpt_write_s": plan.reliability.ckpt_write_s,
        "replica_groups": rg.layout.n_groups if rg else "off",
        "fault_tolerance": {market: _fault_tolerance_summary(ft)
                            for market, ft in plan.fault_tolerance_by_market.items()},
        # JSON has no infinity: a run that never ends has no cost
        **{f"cost_{m}_usd": (None if math.isinf(cost) else cost) for m, cost in (
            ("on_demand", plan.cost_usd(spot=False)), ("spot", plan.cost_usd(spot=True)))},
        "layouts": [{"tp": m.tp, "hsdp": m.hsdp, "pp": m.pp,
                     "pp_stages_per_rank": m.stages_per_rank, "fits": best is not None,
                     "step_s": best.step.step_s if best else None,
                     "memory_bytes": best.memory.total if best else floor.total}
                    for m, best, floor in plan.layouts],
        "config": training_config(plan),
        "calibration": calibration_summary(plan),
    }


def calibration_summary(plan: Plan) -> dict:
    """The calibration the plan names, its terms for this GPU and the ranges it implies."""
    fc = plan.family_calibration if plan.calibrated_step else None
    best = class_best_mfu(plan)
    return {"name": calibration_line(plan) if fc is None else plan.calibration.name,
            "family": fc.family if fc else None,
            "terms": dataclasses.asdict(fc.terms) if fc else None,
            "evidence": fc.evidence if fc else None,
            "scaled_from": fc.scaled_from if fc else None,
            "ranges": plan_ranges(plan),
            "best_published_mfu": {"mfu": best.mfu, "run": best.run} if best else None}

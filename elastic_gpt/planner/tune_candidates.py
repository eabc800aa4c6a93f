"""What `elastic-gpt tune` measures, decided before any worker starts: the candidates (tensor
parallelism x micro-batch size x activation checkpointing x torch.compile, and HSDP once the
workers' nodes are known), and the planner's memory figures for them: the prediction next to
each measurement and the pre-check that refuses a model no candidate can fit.

The tensor-parallel rule is parallel/tp_rules.py's; the memory model is memory.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.hardware import GPU, GPUS, GiB
from elastic_gpt.parallel.tp_rules import model_problem, workers_problem


@dataclass(frozen=True)
class TrainSettings:
    """One candidate of `elastic-gpt tune`: the train.* and parallel.* settings one measurement
    runs with. hsdp: FSDP2 shards within a node and replicates across nodes (parallel.hsdp=on)."""
    micro_batch: int
    activation_checkpointing: bool
    compile: bool
    tp: int = 1
    hsdp: bool = False

    @property
    def label(self) -> str:
        return (f"tp={self.tp}{' hsdp' if self.hsdp else ''} mb={self.micro_batch} "
                f"ckpt={'on' if self.activation_checkpointing else 'off'} "
                f"compile={'on' if self.compile else 'off'}")


def tp_problem(tp: int, world: int, n_head: int, seq_len: int) -> str | None:
    """Why tensor-parallel degree `tp` cannot run this model on `world` workers (one line), or
    None: `tp_rules`, as config validation and the mesh apply them; whether the workers of every
    node are a multiple of tp is only known on the workers (`layout_for_nodes`)."""
    return (model_problem(tp, n_head=n_head, seq_len=seq_len, flag="--tp",
                          candidates=range(1, world + 1))
            or workers_problem(tp, {"--workers": world}, flag="--tp"))


def tp_choices(world: int, n_head: int, seq_len: int, requested: list[int] | None) -> list[int]:
    """The tensor-parallel degrees to measure: `requested` (each checked, one line for the first
    that cannot run), or every divisor of the worker count that divides n_head and the sequence
    length (a superset of what `elastic-gpt plan` weighs, tp in {1, 2, 4, 8})."""
    if requested:
        for t in requested:
            problem = tp_problem(t, world, n_head, seq_len)
            if problem:
                raise ValueError(problem)
        return sorted(set(requested))
    return [t for t in range(1, world + 1) if tp_problem(t, world, n_head, seq_len) is None]


def candidate_list(global_batch: int, world: int, micro_batch_sizes: list[int] | None,
                   cuda: bool, tps: list[int] = (1,)) -> list[TrainSettings]:
    """Per tensor-parallel degree, the micro-batch sizes that divide the global batch (C1 fixed
    global batch) and leave every data-parallel rank (world / tp of them) >= 1 micro-batch, times
    checkpointing off/on, times compile off/on where it is worth trying (CUDA). HSDP variants are
    added on the workers, which know the node layout (`layout_for_nodes`)."""
    def usable(tp: int) -> list[int]:
        return [m for m in range(1, global_batch // (world // tp) + 1) if global_batch % m == 0]

    per_tp = {tp: usable(tp) for tp in tps}
    if micro_batch_sizes:
        widest = per_tp[max(tps)]  # the fewest data-parallel ranks: the most micro-batch sizes
        bad = [m for m in micro_batch_sizes if m not in widest]
        if bad:
            raise ValueError(f"--micro-batch-sizes {','.join(map(str, bad))} cannot be used with "
                             f"train.global_batch_size={global_batch} on {world} worker(s) at tp "
                             f"{','.join(map(str, tps))}: a micro-batch must divide the global "
                             f"batch and leave every data-parallel rank one; usable: "
                             f"{','.join(map(str, widest))}")
        per_tp = {tp: [m for m in sorted(set(micro_batch_sizes)) if m in ok]
                  for tp, ok in per_tp.items()}
    compiles = [False, True] if cuda else [False]
    return [TrainSettings(m, ckpt, comp, tp) for tp in tps
            for m in per_tp[tp] for ckpt in (False, True) for comp in compiles]


def layout_for_nodes(cands: list[TrainSettings], rank_nodes: list[str], hsdp: str
                     ) -> list[tuple[TrainSettings, object | None, str | None]]:
    """The candidates as the workers' node layout allows: (candidate, its ParallelDims, None), or
    (candidate, None, why it is refused) where a node's workers are not a multiple of its tp.
    hsdp auto adds an HSDP variant of each candidate when the workers span nodes with the same
    count on each (on one node HSDP is plain FSDP); on / off measure only that."""
    from elastic_gpt.errors import PlacementError
    from elastic_gpt.parallel.mesh import ParallelDims, ParallelLayoutError, node_sizes

    per_node = node_sizes(rank_nodes)
    spans_evenly = len(per_node) > 1 and len(set(per_node)) == 1
    choices = {"auto": [False, True] if spans_evenly else [False], "off": [False],
               "on": [True] if len(per_node) > 1 else [False]}[hsdp]
    out, seen = [], set()
    for cand in cands:
        for h in choices:
            c = TrainSettings(cand.micro_batch, cand.activation_checkpointing, cand.compile,
                              cand.tp, h)
            if c in seen:
                continue
            seen.add(c)
            if any(n % c.tp for n in per_node):
                out.append((c, None, f"tp={c.tp} does not divide the workers per node "
                                     f"{per_node}"))
                continue
            try:
                dims = ParallelDims.for_nodes(len(rank_nodes), tp=c.tp,
                                              hsdp="on" if h else "off", rank_nodes=rank_nodes)
            except (ParallelLayoutError, PlacementError) as e:
                out.append((c, None, str(e).split(";")[0]))
                continue
            out.append((c, dims, None))
    return out


def predicted_bytes(shape, world: int, G: int, cand: TrainSettings, dtype: str, cuda: bool, *,
                    grad_sync: str, reshard_after_forward: bool,
                    dp_shard: int | None = None) -> float:
    """The planner's figure for a candidate as the Trainer runs it: its tp, the FSDP shard degree
    its mesh had (dp_shard; None: every data-parallel rank, as without HSDP), the run's
    train.grad_sync and the reshard_after_forward its Trainer resolved (CPU: no CUDA context, no
    fragmentation)."""
    from elastic_gpt.cost_model.memory import memory_per_gpu
    from elastic_gpt.data.order import BatchSplit
    k = BatchSplit(G, cand.micro_batch).slots(world // cand.tp)
    extra = {} if cuda else {"context_bytes": 0, "fragmentation": 0}
    return memory_per_gpu(shape, world, cand.micro_batch,
                          activation_checkpointing=cand.activation_checkpointing, dtype=dtype,
                          grad_sync=grad_sync, micro_batches_per_rank=k,
                          reshard_after_forward=reshard_after_forward, tp=cand.tp,
                          dp_shard=dp_shard, **extra).total


def what_would_fit(gpt_cfg, world: int, G: int, budget_bytes: float, margin: float, dtype: str,
                   gpu: GPU | None, reshard_after_forward: str = "auto",
                   tps: list[int] = (1,)) -> str | None:
    """None if the planner says micro-batch 1 with checkpointing fits at one of the tensor-parallel
    degrees `tps` tune will measure; else one line naming what would (more workers, a bigger chip
    or more memory per worker). reshard_after_forward is the run's train setting: `never` keeps
    every block gathered, so the floor is higher."""
    from elastic_gpt.cost_model.memory import memory_per_gpu, model_shape
    from elastic_gpt.planner.inputs import PlanError, PlanInputs
    from elastic_gpt.planner.search import tp_problem as plan_tp_problem
    from elastic_gpt.planner.training_plan import plan_training
    if gpu is not None:  # a GPU of the table, or its memory replaced by --memory-budget-gib
        chip = gpu if budget_bytes == gpu.memory_bytes else GPU(
            f"{gpu.name}@{budget_bytes / GiB:g}GiB", gpu.peak_flops, budget_bytes / GiB,
            gpu.hbm_gbps, gpu.intra_node_gbps, gpu.inter_node_gbps, gpu.gpus_per_node,
            gpu.on_demand_usd, gpu.spot_usd)
        table, extra = {**GPUS, chip.name: chip}, {}
    else:  # CPU workers: fp32, no CUDA context; only more workers or more memory help. A
        # "node" of the size of the largest tp, so the planner lets its TP groups exist.
        chip = GPU("CPU-worker", 1e12, budget_bytes / GiB, 20, 10, 10, max(tps), 0, 0)
        table, extra = {chip.name: chip}, {"context_gib": 0.0, "fragmentation": 0.0}
    # Each tp tune measures, as the planner sees it (a tp it would not weigh, e.g. 3: its own
    # search); the largest last, so a refusal names the smallest footprint.
    forced = [t for t in sorted(tps)
              if plan_tp_problem(t, gpt_cfg, world, chip.gpus_per_node) is None] or [None]
    line = ""
    for t in forced:
        try:
            plan_training(PlanInputs(model=gpt_cfg, gpu=chip.name, n_gpus=world,
                                     global_batch_size=G, dtype=dtype, memory_margin=margin,
                                     hardware=table, reshard_after_forward=reshard_after_forward,
                                     # tune measures no pipeline: the plan must not count on one
                                     tp=t, pp=1, **extra))
            return None
        except PlanError as e:
            line = str(e)
    if gpu is None:
        need = min(memory_per_gpu(model_shape(gpt_cfg), world, 1, activation_checkpointing=True,
                                  dtype=dtype, context_bytes=0, fragmentation=0,
                                  reshard_after_forward=reshard_after_forward != "never",
                                  tp=t).total for t in tps)
        line += f"; or give each worker at least {need / (1 - margin) / GiB:.3g} GiB"
    return line

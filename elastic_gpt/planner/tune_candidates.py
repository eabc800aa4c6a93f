"""What `elastic-gpt tune` measures, decided before any worker starts: the candidates (tensor
parallelism x pipeline parallelism x micro-batch size x activation checkpointing x torch.compile,
and HSDP once the workers' nodes are known), and the planner's memory figures for them: the
prediction next to each measurement and the pre-check that refuses a model no candidate can fit.

The tensor-parallel rule is parallel/tp_rules.py's; the pipeline's are config validation's (whole
pipelines of pp x tp workers, a block per stage, a step of at least pp micro-batches per
data-parallel rank); the memory model is memory.py's, and cost_model/pipeline.py's for a pipeline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_gpt.hardware import GPU, GPUS, GiB
from elastic_gpt.parallel.tp_rules import model_problem, workers_problem


def pp_schedule(stages_per_rank: int) -> str:
    """The parallel.pp_schedule tune runs a pipeline with: 1F1B for one stage per rank,
    interleaved 1F1B for more (the two the planner weighs, cost_model/step_time.py's
    `Mesh.schedule`)."""
    return "1f1b" if stages_per_rank == 1 else "interleaved_1f1b"


@dataclass(frozen=True)
class TrainSettings:
    """One candidate of `elastic-gpt tune`: the train.* and parallel.* settings one measurement
    runs with. hsdp: FSDP2 shards within a node and replicates across nodes (parallel.hsdp=on).
    pp: pipeline stages' ranks (parallel.pp), each holding stages_per_rank stages
    (parallel.pp_stages_per_rank; the schedule is `pp_schedule`'s)."""
    micro_batch: int
    activation_checkpointing: bool
    compile: bool
    tp: int = 1
    hsdp: bool = False
    pp: int = 1
    stages_per_rank: int = 1

    @property
    def pipeline(self) -> str:
        """pp as the table shows it: 2 for pp=2 (1F1B), 2x2 with 2 stages per rank."""
        return f"{self.pp}" + (f"x{self.stages_per_rank}" if self.stages_per_rank > 1 else "")

    @property
    def label(self) -> str:
        pp = f" pp={self.pipeline}" if self.pp > 1 else ""
        return (f"tp={self.tp}{pp}{' hsdp' if self.hsdp else ''} mb={self.micro_batch} "
                f"ckpt={'on' if self.activation_checkpointing else 'off'} "
                f"compile={'on' if self.compile else 'off'}")


def tp_problem(tp: int, world: int, n_head: int, seq_len: int, n_kv_head: int | None = None,
               ffn_hidden: int | None = None) -> str | None:
    """Why tensor-parallel degree `tp` cannot run this model on `world` workers (one line), or
    None: `tp_rules`, as config validation and the mesh apply them; whether the workers of every
    node are a multiple of tp is only known on the workers (`layout_for_nodes`)."""
    return (model_problem(tp, n_head=n_head, seq_len=seq_len, n_kv_head=n_kv_head,
                          ffn_hidden=ffn_hidden, flag="--tp", candidates=range(1, world + 1))
            or workers_problem(tp, {"--workers": world}, flag="--tp"))


def tp_choices(world: int, n_head: int, seq_len: int, requested: list[int] | None, *,
               n_kv_head: int | None = None, ffn_hidden: int | None = None) -> list[int]:
    """The tensor-parallel degrees to measure: `requested` (each checked, one line for the first
    that cannot run), or every divisor of the worker count that divides the heads (query and
    key/value), the MLP width and the sequence length (a superset of what `elastic-gpt plan`
    weighs, tp in {1, 2, 4, 8})."""
    sizes = dict(n_kv_head=n_kv_head, ffn_hidden=ffn_hidden)
    if requested:
        for t in requested:
            problem = tp_problem(t, world, n_head, seq_len, **sizes)
            if problem:
                raise ValueError(problem)
        return sorted(set(requested))
    return [t for t in range(1, world + 1)
            if tp_problem(t, world, n_head, seq_len, **sizes) is None]


def _pp_check(pp: int, *, world: int, tps: list[int], n_layer: int, global_batch: int,
              stages_per_rank: list[int], micro_batch_sizes: list[int] | None) -> str | None:
    if pp < 1:
        return f"--pp={pp} must be at least 1"
    if pp == 1:
        return None
    fits = [t for t in tps if world % (t * pp) == 0]
    if not fits:
        return (f"the {world} worker(s) (--workers, default scaling.max_workers) are not whole "
                f"pipelines of --pp={pp} x --tp={'/'.join(map(str, tps))} ranks")
    v = min(stages_per_rank)
    if pp * v > n_layer:
        stages = f"--pp={pp}" + (f" x --pp-stages-per-rank={v}" if v > 1 else "")
        return (f"{stages} stages need at least one block each, and model.n_layer={n_layer}")
    # A step must fill the pipeline: >= pp micro-batches per data-parallel rank (config
    # validation's rule); the smallest micro-batch gives the most, the fewest dp ranks too.
    mb = min(micro_batch_sizes) if micro_batch_sizes else 1
    dp = world // (max(fits) * pp)
    slots = -(-(global_batch // mb) // dp)
    if slots < pp:
        fix = f"raise train.global_batch_size to at least {pp * dp * mb}"
        if micro_batch_sizes and mb > 1:
            fix += " or give --micro-batch-sizes a smaller one"
        return (f"--pp={pp} needs a step of at least {pp} micro-batches per data-parallel rank "
                f"(one per stage), and train.global_batch_size={global_batch} at micro-batch "
                f"{mb} gives each of the {dp} data-parallel rank(s) {slots}; {fix}")
    return None


def pp_problem(pp: int, *, world: int, tps: list[int], n_layer: int, global_batch: int,
               stages_per_rank: list[int] = (1,), micro_batch_sizes: list[int] | None = None
               ) -> str | None:
    """Why pipeline-parallel degree `pp` cannot be measured on `world` workers at any of the
    tensor-parallel degrees `tps` (one line, with the degrees that can), or None: workers come in
    whole pipelines of pp x tp, every stage needs a block (pp x the fewest stages per rank <=
    n_layer), and a step must give each data-parallel rank at least pp micro-batches (config
    validation's `_check_pipeline`)."""
    kw = dict(world=world, tps=tps, n_layer=n_layer, global_batch=global_batch,
              stages_per_rank=stages_per_rank, micro_batch_sizes=micro_batch_sizes)
    problem = _pp_check(pp, **kw)
    if problem is None:
        return None
    ok = [p for p in range(1, world + 1) if world % p == 0 and _pp_check(p, **kw) is None]
    return f"{problem}; use --pp in {{{', '.join(map(str, ok))}}}"


def pp_choices(requested: list[int] | str | None, *, world: int, tps: list[int], n_layer: int,
               global_batch: int, stages_per_rank: list[int] | None = None,
               micro_batch_sizes: list[int] | None = None) -> tuple[list[int], list[int]]:
    """The pipeline-parallel degrees and stages per rank to measure. `requested` None: pp=1 only
    (the default: no pipeline); "auto": every divisor of the workers `pp_problem` allows (1
    included); a list: those, each checked (one line for the first that cannot run).
    Stages per rank (default 1: 1F1B) apply to the degrees above 1."""
    stages = sorted(set(stages_per_rank or [1]))
    bad = [v for v in stages if v < 1]
    if bad:
        raise ValueError(f"--pp-stages-per-rank={bad[0]} must be at least 1 (1: 1F1B, more: "
                         "interleaved 1F1B)")
    kw = dict(world=world, tps=tps, n_layer=n_layer, global_batch=global_batch,
              stages_per_rank=stages, micro_batch_sizes=micro_batch_sizes)
    if requested == "auto":
        pps = [p for p in range(1, world + 1) if world % p == 0 and pp_problem(p, **kw) is None]
    else:
        pps = sorted(set(requested or [1]))
        for p in pps:
            problem = pp_problem(p, **kw)
            if problem:
                raise ValueError(problem)
    if stages != [1] and max(pps) == 1:
        raise ValueError(f"--pp-stages-per-rank {','.join(map(str, stages))} applies to "
                         "pipelines, and only --pp 1 is measured; add a --pp degree above 1")
    return pps, stages


def candidate_list(global_batch: int, world: int, micro_batch_sizes: list[int] | None,
                   cuda: bool, tps: list[int] = (1,), pps: list[int] = (1,),
                   stages_per_rank: list[int] = (1,), n_layer: int | None = None
                   ) -> list[TrainSettings]:
    """Per layout (tensor-parallel degree x pipeline degree x stages per rank, where the workers
    are whole pipelines of pp x tp and every stage gets a block of the n_layer), the micro-batch
    sizes that divide the global batch (C1 fixed global batch) and leave every data-parallel rank
    (world / (tp x pp) of them) >= 1 micro-batch, and under a pipeline >= pp of them (a step that
    fills it); times checkpointing off/on, times compile off/on where it is worth trying (CUDA).
    HSDP variants are added on the workers, which know the node layout (`layout_for_nodes`)."""
    from elastic_gpt.data.order import BatchSplit

    def usable(tp: int, pp: int) -> list[int]:
        dp = world // (tp * pp)
        return [m for m in range(1, global_batch // dp + 1)
                if global_batch % m == 0 and BatchSplit(global_batch, m).slots(dp) >= pp]

    layouts = [(tp, pp, v) for tp in tps for pp in pps
               for v in (stages_per_rank if pp > 1 else [1])
               if world % (tp * pp) == 0 and (n_layer is None or pp * v <= n_layer)]
    per_layout = {(tp, pp, v): usable(tp, pp) for tp, pp, v in layouts}
    if micro_batch_sizes:
        anywhere = sorted({m for ok in per_layout.values() for m in ok})
        bad = [m for m in micro_batch_sizes if m not in anywhere]
        if bad:
            at = f"tp {','.join(map(str, tps))}" + (
                f" and pp {','.join(map(str, pps))}" if list(pps) != [1] else "")
            raise ValueError(f"--micro-batch-sizes {','.join(map(str, bad))} cannot be used with "
                             f"train.global_batch_size={global_batch} on {world} worker(s) at "
                             f"{at}: a micro-batch must divide the global batch and leave every "
                             f"data-parallel rank one"
                             + (" (a pipeline: pp of them)" if max(pps) > 1 else "")
                             + f"; usable: {','.join(map(str, anywhere))}")
        per_layout = {key: [m for m in sorted(set(micro_batch_sizes)) if m in ok]
                      for key, ok in per_layout.items()}
    compiles = [False, True] if cuda else [False]
    return [TrainSettings(m, ckpt, comp, tp, False, pp, v) for (tp, pp, v) in layouts
            for m in per_layout[(tp, pp, v)] for ckpt in (False, True) for comp in compiles]


def layout_for_nodes(cands: list[TrainSettings], rank_nodes: list[str], hsdp: str
                     ) -> list[tuple[TrainSettings, object | None, str | None]]:
    """The candidates as the workers' node layout allows: (candidate, its ParallelDims, None), or
    (candidate, None, why it is refused) where a node's workers are not a multiple of its tp.
    hsdp auto adds an HSDP variant of each candidate when the ranks of one of its pipeline stages
    (all of them without a pipeline) span nodes with the same count on each: HSDP replicates
    across the nodes of a stage (`ParallelDims.for_nodes`), so a stage inside one node has no HSDP
    of its own and is not measured twice; on / off measure only that."""
    from elastic_gpt.errors import PlacementError
    from elastic_gpt.parallel.mesh import ParallelDims, ParallelLayoutError, node_sizes

    per_node = node_sizes(rank_nodes)
    out, seen = [], set()
    for cand in cands:
        stage = node_sizes(rank_nodes[:len(rank_nodes) // cand.pp])
        spans_evenly = len(stage) > 1 and len(set(stage)) == 1
        choices = {"auto": [False, True] if spans_evenly else [False], "off": [False],
                   "on": [True] if len(stage) > 1 else [False]}[hsdp]
        for h in choices:
            c = dataclasses.replace(cand, hsdp=h)
            if c in seen:
                continue
            seen.add(c)
            if any(n % c.tp for n in per_node):
                out.append((c, None, f"tp={c.tp} does not divide the workers per node "
                                     f"{per_node}"))
                continue
            try:
                dims = ParallelDims.for_nodes(len(rank_nodes), tp=c.tp,
                                              hsdp="on" if h else "off", rank_nodes=rank_nodes,
                                              pp=c.pp)
            except (ParallelLayoutError, PlacementError) as e:
                out.append((c, None, str(e).split(";")[0]))
                continue
            out.append((c, dims, None))
    return out


def predicted_bytes(shape, world: int, G: int, cand: TrainSettings, dtype: str, cuda: bool, *,
                    grad_sync: str, reshard_after_forward: bool,
                    dp_shard: int | None = None, dp_replicate: int | None = None) -> float:
    """The planner's figure for a candidate as the Trainer runs it: its tp, the FSDP shard degree
    its mesh had (dp_shard; None: every data-parallel rank, as without HSDP), the run's
    train.grad_sync and the reshard_after_forward its Trainer resolved (CPU: no CUDA context, no
    fragmentation). A pipeline (pp > 1) is `pipelined_memory`: the most any pipeline rank holds
    (the first keeps the most micro-batches in flight, the last the loss on whole logits), with
    the schedules' resharding and gradient sync (cost_model/pipeline.py's `KEPT_GATHERED`, what
    its Trainer resolves too) on the mesh of one stage (dp_replicate x dp_shard x tp ranks)."""
    from elastic_gpt.cost_model.memory import memory_per_gpu
    from elastic_gpt.data.order import BatchSplit
    dp = world // (cand.tp * cand.pp)
    k = BatchSplit(G, cand.micro_batch).slots(dp)
    extra = {} if cuda else {"context_bytes": 0, "fragmentation": 0}
    if cand.pp > 1:
        from elastic_gpt.cost_model.mesh import Mesh
        from elastic_gpt.cost_model.pipeline import pipelined_memory
        replicate = dp_replicate or 1
        mesh = Mesh(cand.tp, dp_shard or dp // replicate, replicate, False, cand.pp,
                    cand.stages_per_rank)
        return pipelined_memory(shape, mesh, cand.micro_batch, k,
                                activation_checkpointing=cand.activation_checkpointing,
                                dtype=dtype, micro_batches_per_rank=k, **extra).total
    return memory_per_gpu(shape, world, cand.micro_batch,
                          activation_checkpointing=cand.activation_checkpointing, dtype=dtype,
                          grad_sync=grad_sync, micro_batches_per_rank=k,
                          reshard_after_forward=reshard_after_forward, tp=cand.tp,
                          dp_shard=dp_shard, **extra).total


def what_would_fit(gpt_cfg, world: int, G: int, budget_bytes: float, margin: float, dtype: str,
                   gpu: GPU | None, reshard_after_forward: str = "auto",
                   tps: list[int] = (1,), pps: list[int] = (1,),
                   stages_per_rank: list[int] = (1,)) -> str | None:
    """None if the planner says micro-batch 1 with checkpointing fits at one of the layouts tune
    will measure (tensor-parallel degrees `tps` x pipeline degrees `pps`, a pipeline with each of
    `stages_per_rank`, where the workers are whole pipelines and every stage gets a block); else
    one line naming what would (more workers, a bigger chip or more memory per worker).
    reshard_after_forward is the run's train setting: `never` keeps every block gathered, so the
    floor is higher (a pipeline keeps its stages gathered whatever it says)."""
    from elastic_gpt.cost_model.memory import memory_per_gpu
    from elastic_gpt.cost_model.mesh import Mesh
    from elastic_gpt.cost_model.pipeline import pipelined_memory
    from elastic_gpt.cost_model.shape import model_shape
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.planner.inputs import PlanError, PlanInputs
    from elastic_gpt.planner.search import pp_problem as plan_pp_problem
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
    # Each layout tune measures, as the planner sees it (a tp it would not weigh, e.g. 3: its own
    # search), tp and pp forced; the largest tp last, so a refusal names the smallest footprint.
    layouts = [(t, p, v) for t in sorted(tps) for p in sorted(pps)
               for v in (sorted(stages_per_rank) if p > 1 else [1])
               if world % (t * p) == 0 and p * v <= gpt_cfg.n_layer]
    forced = [(t, p, v) for t, p, v in layouts
              if plan_tp_problem(t, gpt_cfg, world, chip.gpus_per_node) is None
              and plan_pp_problem(p, gpt_cfg, world, t) is None] or [(None, 1, 1)]
    line = ""
    for t, p, v in forced:
        try:
            plan_training(PlanInputs(model=gpt_cfg, gpu=chip.name, n_gpus=world,
                                     global_batch_size=G, dtype=dtype, memory_margin=margin,
                                     hardware=table, reshard_after_forward=reshard_after_forward,
                                     # the pipelines tune measures, or none: the plan must not
                                     # count on another
                                     tp=t, pp=p, pp_stages_per_rank=v if p > 1 else None,
                                     **extra))
            return None
        except PlanError as e:
            line = str(e)
    if gpu is None:
        def floor(t: int, p: int, v: int) -> float:
            if p == 1:
                return memory_per_gpu(model_shape(gpt_cfg), world, 1,
                                      activation_checkpointing=True, dtype=dtype,
                                      context_bytes=0, fragmentation=0,
                                      reshard_after_forward=reshard_after_forward != "never",
                                      tp=t).total
            dp = world // (t * p)
            k = BatchSplit(G, 1).slots(dp)
            return pipelined_memory(model_shape(gpt_cfg), Mesh(t, dp, 1, False, p, v), 1, k,
                                    activation_checkpointing=True, dtype=dtype,
                                    micro_batches_per_rank=k, context_bytes=0,
                                    fragmentation=0).total
        need = min(floor(*lay) for lay in layouts)
        line += f"; or give each worker at least {need / (1 - margin) / GiB:.3g} GiB"
    return line

"""`elastic-gpt tune`: measure tensor parallelism x HSDP x micro-batch size x activation
checkpointing x torch.compile on the cluster's own workers, then write the fastest config that fits
in memory with a margin.

One Ray Train job (the config's worker count, tracking off, no checkpoints written) whose workers
loop over the candidates: each builds a fresh Trainer (the trainer's own mesh and TP + FSDP model,
from parallel.tp / parallel.hsdp and the ranks' Ray node ids), runs 1-2 warm-up steps and then
--steps timed steps on the real data stream, and measures its peak memory per worker. A candidate
that runs out of memory is recorded as "does not fit"; one whose tp the workers' node layout cannot
hold is recorded as refused. compile is only tried on CUDA (on CPU compiling costs minutes, so it
is skipped and the output says so).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import yaml

from elastic_gpt.config import Config, load_config, resolve_paths
from elastic_gpt.console import say
from elastic_gpt.hardware import GPU, GPUS, GiB, get_gpu
from elastic_gpt.parallel.tp_rules import model_problem, workers_problem

MiB = 1 << 20
TABLE_FILE = "tune_table.json"


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
    """Per tensor-parallel degree, the micro-batch sizes that divide the global batch (C1) and
    leave every data-parallel rank (world / tp of them) >= 1 micro-batch, times checkpointing
    off/on, times compile off/on where it is worth trying (CUDA). HSDP variants are added on the
    workers, which know the node layout (`layout_for_nodes`)."""
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
            except ParallelLayoutError as e:
                out.append((c, None, str(e).split(";")[0]))
                continue
            out.append((c, dims, None))
    return out


# ---- peak memory of one candidate ------------------------------------------------------------


class PeakMemory:
    """Peak memory one candidate adds to a worker process.

    CUDA: torch.cuda.max_memory_reserved (what the caching allocator took, fragmentation
    included) with the peak reset and the cache emptied before the candidate.
    CPU: the process's peak resident set (the kernel's VmHWM, reset through /proc/self/clear_refs)
    minus the resident set just before the candidate. Workers run with a fixed
    MALLOC_MMAP_THRESHOLD_ so freed tensors go back to the kernel and the baseline is honest.
    Falls back to a thread sampling the RSS every millisecond where clear_refs is not writable.
    """

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled = 0

    @property
    def method(self) -> str:
        if self.cuda:
            return "torch.cuda.max_memory_reserved per candidate (peak reset before each)"
        if _hwm_resettable():
            return ("peak RSS above the process's RSS before the candidate (VmHWM reset via "
                    "/proc/self/clear_refs)")
        return "peak RSS above the process's RSS before the candidate (sampled every 1 ms)"

    def start(self) -> None:
        import torch
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_reserved(self.device)
            return
        _malloc_trim()
        self.baseline = _rss()
        if _hwm_resettable():
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return
        self._stop.clear()
        self._sampled = self.baseline
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, _rss())

    def peak(self) -> int:
        """Bytes above the baseline at the peak since start()."""
        import torch
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_reserved(self.device) - self.baseline
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            return max(0, max(self._sampled, _rss()) - self.baseline)
        return max(0, _hwm() - self.baseline)


def _psutil():
    """psutil, which this project gets from Ray's bundled copy: on sys.path once ray is imported
    (tune's workers have; a process that only builds Trainers, like bench_planner's, has not)."""
    try:
        import psutil
    except ImportError:
        import ray  # noqa: F401
        psutil = __import__("psutil")
    return psutil


def _rss() -> int:
    return _psutil().Process().memory_info().rss


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _rss()


def _hwm_resettable() -> bool:
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def memory_budget(device, local_world_size: int) -> tuple[int, int]:
    """(bytes a worker may use, bytes already used by others) on this worker's device.
    CUDA: the GPU's memory; what the CUDA context, NCCL and other processes hold is counted
    against it. CPU: the node's RAM shared by the workers on that node."""
    if device.type == "cuda":
        import torch
        free, total = torch.cuda.mem_get_info(device)
        return total, (total - free) - torch.cuda.memory_reserved(device)
    return _psutil().virtual_memory().total // max(1, local_world_size), _rss()


def _is_oom(e: BaseException) -> bool:
    import torch
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(e).lower()
    return "out of memory" in text or "can't allocate memory" in text


# ---- the worker side ---------------------------------------------------------------------------


def measure(cfg: Config, cand: TrainSettings, *, rank: int, world: int, steps: int,
            rank_nodes: list[str] | None = None) -> dict:
    """Build a fresh Trainer for `cand` (its mesh from parallel.tp / parallel.hsdp and the ranks'
    nodes, as the trainer's worker does), run warm-up + timed steps; this rank's figures."""
    import torch

    from elastic_gpt.data.order import BatchPlan
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.parallel.mesh import ParallelDims
    from elastic_gpt.train.trainer import Trainer, _device

    c = copy.deepcopy(cfg)
    c.train.micro_batch_size = cand.micro_batch
    c.train.activation_checkpointing = cand.activation_checkpointing
    c.train.compile = cand.compile
    c.parallel.tp = cand.tp
    c.parallel.hsdp = "on" if cand.hsdp else "off"
    warmup = 2 if cand.compile else 1
    device = _device()
    # Batches are read before the baseline: the measured peak is the trainer's, not the reader's.
    # The ranks of one tensor-parallel group read the same micro-batches (C2 is over the
    # data-parallel rank); the layout and its rank arithmetic are the Trainer's (ParallelDims).
    dims = ParallelDims.for_nodes(world, tp=cand.tp, hsdp=c.parallel.hsdp, rank_nodes=rank_nodes)
    from elastic_gpt.data.mixture import open_training_data
    stream = open_step_stream(open_training_data(c.data),
                              plan=BatchPlan(c.train.global_batch_size, cand.micro_batch),
                              rank=dims.dp_rank(rank), world_size=dims.dp_degree, start_step=0,
                              seed=c.data.seed,
                              shuffle_window=c.data.shuffle_window, prefetch_steps=1)
    try:
        batches = [next(stream) for _ in range(warmup + steps)]
    finally:
        stream.close()
    mem = PeakMemory(device)
    mem.start()
    times, oom, error = [], False, None
    trainer = None
    try:
        trainer = Trainer(c, rank=rank, world_size=world, mlflow_run_id=None,
                          rank_nodes=rank_nodes)
        for i, batch in enumerate(batches):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            trainer.train_step(batch)  # ends in an all-reduce + .item(): the ranks are in step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - recorded per candidate, the loop goes on
        if _is_oom(e):
            oom = True
        else:
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    peak = mem.peak()
    # What the Trainer resolved for train.reshard_after_forward (auto: by its size against the
    # device's memory): the planner's prediction for this row must assume the same.
    resharded = trainer.reshard_after_forward if trainer is not None else None
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times) if times else None, "peak_bytes": peak,
            "baseline_bytes": mem.baseline, "oom": oom, "error": error, "method": mem.method,
            "reshard_after_forward": resharded, "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard}


def warm_up_process(cfg: Config, cand: TrainSettings, *, rank: int, world: int,
                    rank_nodes: list[str] | None = None) -> None:
    measure(cfg, TrainSettings(1, cand.activation_checkpointing, False, cand.tp, cand.hsdp),
            rank=rank, world=world, steps=1, rank_nodes=rank_nodes)


def agree(row: dict, device) -> dict:
    """Combine the ranks' figures: the slowest step, the largest peak, anyone's failure.
    Every rank allocates the same shapes (data parallel), so an OOM normally hits all of them at
    the same point and they all arrive here; a lone OOM inside a collective would instead stall
    the others until the process group's timeout."""
    import torch
    import torch.distributed as dist
    reshard = {None: -1.0, False: 0.0, True: 1.0}[row.get("reshard_after_forward")]
    t = torch.tensor([row["step_s"] or 0.0, row["peak_bytes"], row["baseline_bytes"],
                      float(row["oom"]), float(row["error"] is not None),
                      float(row["step_s"] is None), reshard], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, row["error"])
    failed = t[3].item() > 0 or t[4].item() > 0 or t[5].item() > 0
    return {"step_s": None if failed else t[0].item(), "peak_bytes": int(t[1].item()),
            "baseline_bytes": int(t[2].item()), "oom": t[3].item() > 0,
            "error": next((e for e in errors if e), None), "method": row["method"],
            "reshard_after_forward": None if t[6].item() < 0 else t[6].item() > 0}


def tune_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: every rank runs every candidate; all report the same table."""
    import ray
    import ray.train
    import torch.distributed as dist

    from elastic_gpt.config import config_from_dict
    from elastic_gpt.parallel.fsdp import resolve_dtype, resolve_reshard_after_forward
    from elastic_gpt.train.trainer import _device

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = config_from_dict(loop_config["config"])
    device = _device()
    budget, others = memory_budget(device, ctx.get_local_world_size())
    if loop_config.get("budget_bytes"):
        budget = int(loop_config["budget_bytes"])
    margin = loop_config["memory_margin"]
    # Which node each rank is on, by Ray node id as the trainer's worker does (Ray Train's
    # local/node ranks go by IP, equal for every node of a one-machine cluster): tensor-parallel
    # groups stay inside a node, HSDP replicates across nodes.
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    layouts = layout_for_nodes([TrainSettings(**c) for c in loop_config["candidates"]], nodes,
                               loop_config["hsdp"])
    G, T = cfg.train.global_batch_size, loop_config["seq_len"]
    dtype = resolve_dtype(cfg.train.dtype, device)

    def trainer_reshards(tp: int) -> bool:
        # The Trainer's own rule with its own inputs (what FSDP gathers on a rank is its
        # tensor-parallel shard): known even for rows where no Trainer could be built (the
        # planner predicts those rows with it).
        return resolve_reshard_after_forward(cfg.train.reshard_after_forward,
                                             loop_config["n_params"] // tp, dtype, device)

    # One untimed pass per layout and checkpointing setting first: thread pools, kernels, gloo
    # buffers, DTensor's sharding-propagation caches and checkpointing's recompute path are
    # allocated once per process, and would otherwise be counted in the first such candidate's
    # peak.
    warmed = set()
    for cand, dims, _ in layouts:
        key = (cand.tp, cand.hsdp, cand.activation_checkpointing)
        if dims is not None and key not in warmed:
            warmed.add(key)
            warm_up_process(cfg, cand, rank=rank, world=world, rank_nodes=nodes)
    rows: list[dict] = []
    for i, (cand, dims, refused) in enumerate(layouts):
        # A candidate needs at least the memory of a smaller micro-batch with the same settings.
        smaller_oom = next((r for r in rows if r["oom"] and r["micro_batch"] < cand.micro_batch
                            and r["activation_checkpointing"] == cand.activation_checkpointing
                            and r["compile"] == cand.compile and r["tp"] == cand.tp
                            and r["hsdp"] == cand.hsdp), None)
        if refused or smaller_oom:
            row = {"step_s": None, "peak_bytes": 0, "baseline_bytes": 0, "oom": not refused,
                   "error": None, "method": "", "reshard_after_forward": None,
                   "dp_replicate": None, "dp_shard": None}
            if refused:
                row["refused"] = refused
            else:
                row["skipped"] = f"mb={smaller_oom['micro_batch']} already ran out of memory"
            if dims is not None:
                row.update(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard)
        else:
            measured = measure(cfg, cand, rank=rank, world=world, steps=loop_config["steps"],
                               rank_nodes=nodes)
            row = agree(measured, device)
            row.update(dp_replicate=measured["dp_replicate"], dp_shard=measured["dp_shard"])
        row.update(asdict(cand))
        if row["reshard_after_forward"] is None:
            row["reshard_after_forward"] = trainer_reshards(cand.tp)
        row["tokens_per_s"] = G * T / row["step_s"] if row["step_s"] else None
        # What the worker holds at the candidate's peak, against its share of the device.
        held = row["peak_bytes"] + (row["baseline_bytes"] if device.type == "cpu" else others)
        row["held_bytes"] = held
        row["budget_bytes"] = budget
        row["fits"] = (row["step_s"] is not None and not row["oom"]
                       and held <= budget * (1 - margin))
        rows.append(row)
        if rank == 0:
            say(f"[elastic-gpt tune] {i + 1}/{len(layouts)} {cand.label}: "
                + _row_summary(row))
    # Ray Train V2 keeps reported metrics only with a checkpoint: the table travels as one
    # (through run.storage_path, so it reaches the driver from any node); no model state is saved.
    table = {"rows": rows, "device": device.type, "world_size": world,
             "reshard_after_forward": trainer_reshards(1), "rank_nodes": nodes}
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            with open(os.path.join(d, TABLE_FILE), "w") as f:
                json.dump(table, f)
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"candidates": len(rows)}, checkpoint=checkpoint)


def _row_summary(row: dict) -> str:
    if row.get("refused"):
        return f"refused ({row['refused']})"
    if row.get("skipped"):
        return f"does not fit ({row['skipped']})"
    if row["oom"]:
        return "does not fit (out of memory)"
    if row["error"]:
        return f"failed: {row['error']}"
    fit = "fits" if row["fits"] else "over the memory budget"
    return (f"{row['step_s']:.3f} s/step, {row['tokens_per_s']:,.0f} tokens/s, peak "
            f"{row['peak_bytes'] / MiB:,.1f} MiB per worker, {fit}")


# ---- the driver side -----------------------------------------------------------------------------


def predicted_bytes(shape, world: int, G: int, cand: TrainSettings, dtype: str, cuda: bool, *,
                    grad_sync: str, reshard_after_forward: bool,
                    dp_shard: int | None = None) -> float:
    """The planner's figure for a candidate as the Trainer runs it: its tp, the FSDP shard degree
    its mesh had (dp_shard; None: every data-parallel rank, as without HSDP), the run's
    train.grad_sync and the reshard_after_forward its Trainer resolved (CPU: no CUDA context, no
    fragmentation)."""
    from elastic_gpt.data.order import BatchPlan
    from elastic_gpt.planner.plan import memory_per_gpu
    k = BatchPlan(G, cand.micro_batch).slots(world // cand.tp)
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
    from elastic_gpt.planner.plan import (
        PlanError,
        PlanInputs,
        memory_per_gpu,
        model_shape,
        plan_training,
    )
    from elastic_gpt.planner.plan import tp_problem as plan_tp_problem
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
                                     tp=t, **extra))
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


def format_table(rows: list[dict], predicted: list[float], winner: dict | None) -> str:
    """One line per candidate; 'planner MiB' is plan.memory_per_gpu for what the row ran (its tp
    and FSDP shard degree included)."""
    head = (f"{'tp':>2} {'hsdp':>4} {'micro-batch':>11} {'ckpt':>4} {'compile':>7} "
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
        lines.append(f"{row.get('tp', 1):>2} {hsdp:>4} {row['micro_batch']:>11} {ckpt:>4}"
                     f" {'on' if row['compile'] else 'off':>7} {step:>8} {tps:>10} {peak:>9} "
                     f"{pred / MiB:>11,.1f}  {result}")
    return "\n".join(lines)


def pick_winner(rows: list[dict]) -> dict | None:
    """The fastest that fits; ties go to the larger micro-batch, then the simpler layout."""
    fitting = [r for r in rows if r["fits"]]
    return min(fitting, key=lambda r: (r["step_s"], -r["micro_batch"], r.get("tp", 1),
                                       bool(r.get("hsdp")))) if fitting else None


def settings_of(row: dict) -> TrainSettings:
    return TrainSettings(row["micro_batch"], row["activation_checkpointing"], row["compile"],
                         row.get("tp", 1), bool(row.get("hsdp")))


def tuned_config_dict(config_path: str, overrides: list[str], winner: dict,
                      spans_nodes: bool = False) -> tuple[dict, list[str]]:
    """The input YAML with the overrides applied and the winner's train.* and parallel.* keys;
    and a note for each other key it had to change. parallel.hsdp is the winner's where the
    workers spanned nodes; measured on one node (where HSDP is plain FSDP) it stays as given.
    scaling.min/max_workers become multiples of the winner's tp (config validation: workers come
    in whole tensor-parallel groups)."""
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
    tp = winner.get("tp", 1)
    parallel = raw.setdefault("parallel", {})
    parallel["tp"] = tp
    if spans_nodes:
        parallel["hsdp"] = "on" if winner.get("hsdp") else "off"
    else:
        parallel.setdefault("hsdp", "auto")
    notes = []
    scaling = raw.setdefault("scaling", {})
    defaults = Config().scaling
    low = int(scaling.get("min_workers", defaults.min_workers))
    high = int(scaling.get("max_workers", defaults.max_workers))
    # The floor up, the ceiling down (never below one group), the floor no higher than the ceiling.
    new_high = max(tp, high // tp * tp)
    new_low = min(max(tp, -(-low // tp) * tp), new_high)
    for key, old, new in (("min_workers", low, new_low), ("max_workers", high, new_high)):
        if old != new:
            scaling[key] = new
            notes.append(f"scaling.{key}={old} -> {new} (a multiple of parallel.tp={tp})")
    return raw, notes


def run_tune(args) -> int:
    import ray
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic_gpt.data.mixture import load_training_manifest
    from elastic_gpt.elastic.launcher import _worker_env, connect_ray, use_gpu
    from elastic_gpt.model.gpt import count_params
    from elastic_gpt.parallel.fsdp import reshard_label, resolve_dtype
    from elastic_gpt.planner.plan import model_shape
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
    tps = tp_choices(world, gpt_cfg.n_head, gpt_cfg.seq_len, _int_list("--tp", args.tp))
    if G < world // max(tps):
        raise ValueError(f"train.global_batch_size={G} gives fewer sequences than the "
                         f"{world // max(tps)} data-parallel ranks of {world} workers at tp "
                         f"{max(tps)}")

    started = connect_ray(cfg)
    try:
        gpu = use_gpu(cfg)
        device = "cuda" if gpu else "cpu"
        dtype = str(resolve_dtype(cfg.train.dtype, torch.device(device))).removeprefix("torch.")
        cands = candidate_list(G, world, mbs, cuda=gpu, tps=tps)
        shape = model_shape(gpt_cfg)
        # The planner first: a model that cannot fit even at micro-batch 1 with checkpointing is
        # refused before any worker starts, with what would fit instead.
        if chip is not None or budget is not None:
            usable_chip = chip if gpu else None
            line = what_would_fit(gpt_cfg, world, G, budget or chip.memory_bytes,
                                  args.memory_margin, dtype, usable_chip,
                                  cfg.train.reshard_after_forward, tps=tps)
            if line:
                raise ValueError(line)
        say(f"[elastic-gpt tune] {count_params(gpt_cfg)['total'] / 1e6:.2f}M params, "
            f"G={G} x T={gpt_cfg.seq_len}, {world} {device.upper()} worker(s), {dtype}: "
            f"{len(cands)} candidates at tp {','.join(map(str, tps))}"
            + (" (and each with HSDP if the workers span nodes evenly)"
               if args.hsdp == "auto" else "")
            + f", {args.steps} timed step(s) each")
        if not gpu:
            say("[elastic-gpt tune] torch.compile not tried: no CUDA on the workers "
                "(compiling on CPU costs minutes)")
        s = cfg.scaling
        resources = {"CPU": s.cpus_per_worker, **({"GPU": 1} if gpu else {})}
        env = {**_worker_env(), "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
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
                                 failure_config=FailureConfig(max_failures=0),
                                 worker_runtime_env={"env_vars": env}),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=300))
        result = trainer.fit()
    finally:
        if started:
            ray.shutdown()
    with result.checkpoint.as_directory() as d, open(os.path.join(d, TABLE_FILE)) as f:
        out = json.load(f)
    rows = out["rows"]
    grad_sync = cfg.train.grad_sync
    predicted = [predicted_bytes(shape, world, G, settings_of(r), dtype, gpu,
                                 grad_sync=grad_sync,
                                 reshard_after_forward=r["reshard_after_forward"],
                                 dp_shard=r.get("dp_shard"))
                 for r in rows]
    winner = pick_winner(rows)
    method = next((r["method"] for r in rows if r["method"]), "")
    budget_b = rows[0]["budget_bytes"]
    # auto resolves by what one rank gathers (its tensor-parallel shard), so it can differ by tp
    ran = {r["reshard_after_forward"] for r in rows}
    policy = (reshard_label(ran.pop(), cfg.train.reshard_after_forward) if len(ran) == 1
              else f"{cfg.train.reshard_after_forward} (per row, by tp)")
    spans_nodes = len(set(out["rank_nodes"])) > 1
    print(f"\nmemory: {method}; budget {budget_b / GiB:.2f} GiB per worker, "
          f"{args.memory_margin:.0%} kept free; the trainer ran reshard_after_forward={policy}, "
          f"grad_sync={grad_sync}\n")
    print(format_table(rows, predicted, winner))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "predicted_bytes": predicted, "winner": winner,
                       "memory_method": method, "world_size": world, "device": device,
                       "grad_sync": grad_sync, "tp_choices": tps,
                       "rank_nodes": out["rank_nodes"],
                       "reshard_after_forward": out["reshard_after_forward"]}, f, indent=1)
    if winner is None:
        usable = budget_b * (1 - args.memory_margin)
        measured = [r for r in rows if r["held_bytes"] and not r["oom"]]
        least = (f" (the smallest measured: {min(r['held_bytes'] for r in measured) / GiB:.2f} "
                 "GiB)" if measured else "")
        line = what_would_fit(gpt_cfg, world, G, budget_b, args.memory_margin, dtype,
                              chip if gpu else None, cfg.train.reshard_after_forward, tps=tps)
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
    parser.add_argument("--hsdp", choices=("auto", "on", "off"), default="auto",
                        help="auto (default): measure each candidate with and without HSDP "
                             "where the workers span nodes with the same count on each; on/off: "
                             "only that")
    parser.add_argument("--write-config", metavar="OUT.yaml",
                        help="write the input config with the winner's train.* and "
                             "parallel.tp/hsdp keys")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")


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

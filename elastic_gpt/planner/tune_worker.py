"""What each Ray Train worker of `elastic-gpt tune` runs: every candidate on a fresh Trainer,
its step time and its peak memory (`PeakMemory`), agreed across the ranks into one table.

The table travels back to the driver as a Ray Train checkpoint (`TABLE_FILE`).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict

from elastic_gpt.config import Config
from elastic_gpt.console import say
from elastic_gpt.planner.tune_candidates import TrainSettings, layout_for_nodes, pp_schedule

MiB = 1 << 20
TABLE_FILE = "tune_table.json"


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
    """Build a fresh Trainer for `cand` (its mesh from parallel.tp / parallel.hsdp / parallel.pp
    and the ranks' nodes, as the trainer's worker does), run warm-up + timed steps; this rank's
    figures."""
    import torch

    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.parallel.mesh import ParallelDims
    from elastic_gpt.train.device import worker_device
    from elastic_gpt.train.trainer import Trainer

    c = candidate_config(cfg, cand)
    warmup = 2 if cand.compile else 1
    device = worker_device()
    # Batches are read before the baseline: the measured peak is the trainer's, not the reader's.
    # The ranks of one tensor-parallel group and of one pipeline (its stages) read the same
    # micro-batches (C2 data order is over the data-parallel rank): the ranks the Trainer's
    # `ParallelDims.batch_group` broadcasts one read to, here each reading them itself; the
    # layout and its rank arithmetic are the Trainer's (ParallelDims).
    dims = ParallelDims.for_nodes(world, tp=cand.tp, hsdp=c.parallel.hsdp, rank_nodes=rank_nodes,
                                  pp=cand.pp)
    from elastic_gpt.data.mixture import open_training_data
    stream = open_step_stream(open_training_data(c.data),
                              batch_split=BatchSplit(c.train.global_batch_size, cand.micro_batch),
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
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times) if times else None, "peak_bytes": peak,
            "baseline_bytes": mem.baseline, "oom": oom, "error": error, "method": mem.method,
            "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard}


def candidate_config(cfg: Config, cand: TrainSettings) -> Config:
    c = copy.deepcopy(cfg)
    c.train.micro_batch_size = cand.micro_batch
    c.train.activation_checkpointing = cand.activation_checkpointing
    c.train.compile = cand.compile
    c.parallel.tp = cand.tp
    c.parallel.hsdp = "on" if cand.hsdp else "off"
    c.parallel.pp = cand.pp
    c.parallel.pp_schedule = pp_schedule(cand.stages_per_rank)
    c.parallel.pp_stages_per_rank = cand.stages_per_rank
    return c


def trainer_resolves(cfg: Config, cand: TrainSettings, *, world: int, device,
                     rank_nodes: list[str]) -> dict:
    """Collective: the train.grad_sync and train.reshard_after_forward a Trainer of this
    candidate resolves (train/run_memory.py, the same call), known even for rows where no Trainer
    could be built; the planner's prediction for the row assumes them."""
    from elastic_gpt.data.mixture import open_training_data
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.parallel.fsdp import resolve_dtype
    from elastic_gpt.train.model_config import model_config_for
    from elastic_gpt.train.run_memory import resolve_run_memory
    c = candidate_config(cfg, cand)
    split = BatchSplit(c.train.global_batch_size, cand.micro_batch)
    settings = resolve_run_memory(
        c, model_config_for(c, open_training_data(c.data).manifest), world_size=world,
        rank_nodes=rank_nodes, micro_batch=cand.micro_batch,
        micro_batches_per_rank=split.slots(world // (cand.tp * cand.pp)), device=device,
        compute_dtype=resolve_dtype(c.train.dtype, device))
    return {"grad_sync": settings.grad_sync,
            "reshard_after_forward": settings.reshard_after_forward}


def warm_up_process(cfg: Config, cand: TrainSettings, *, rank: int, world: int,
                    rank_nodes: list[str] | None = None) -> None:
    # Micro-batch 1 gives the most micro-batches per step: it fills any pipeline a larger one does.
    measure(cfg, dataclasses.replace(cand, micro_batch=1, compile=False),
            rank=rank, world=world, steps=1, rank_nodes=rank_nodes)


def agree(row: dict, device) -> dict:
    """Combine the ranks' figures: the slowest step, the largest peak, anyone's failure.
    Every rank of a stage allocates the same shapes (data parallel), so an OOM normally hits all
    of them at the same point and they all arrive here; a lone OOM inside a collective (or one
    pipeline stage's, whose ranks hold more than the others) would instead stall the others until
    the process group's timeout."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([row["step_s"] or 0.0, row["peak_bytes"], row["baseline_bytes"],
                      float(row["oom"]), float(row["error"] is not None),
                      float(row["step_s"] is None)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, row["error"])
    failed = t[3].item() > 0 or t[4].item() > 0 or t[5].item() > 0
    return {"step_s": None if failed else t[0].item(), "peak_bytes": int(t[1].item()),
            "baseline_bytes": int(t[2].item()), "oom": t[3].item() > 0,
            "error": next((e for e in errors if e), None), "method": row["method"]}


def tune_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: every rank runs every candidate; all report the same table."""
    import ray
    import ray.train
    import torch.distributed as dist

    from elastic_gpt.config import config_from_dict
    from elastic_gpt.train.device import worker_device

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = config_from_dict(loop_config["config"])
    device = worker_device()
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

    # One untimed pass per layout and checkpointing setting first: thread pools, kernels, gloo
    # buffers, DTensor's sharding-propagation caches and checkpointing's recompute path are
    # allocated once per process, and would otherwise be counted in the first such candidate's
    # peak.
    warmed = set()
    for cand, dims, _ in layouts:
        key = (cand.tp, cand.pp, cand.stages_per_rank, cand.hsdp, cand.activation_checkpointing)
        if dims is not None and key not in warmed:
            warmed.add(key)
            warm_up_process(cfg, cand, rank=rank, world=world, rank_nodes=nodes)
    rows: list[dict] = []
    for i, (cand, dims, refused) in enumerate(layouts):
        # A candidate needs at least the memory of a smaller micro-batch with the same settings.
        smaller_oom = next((r for r in rows if r["oom"] and r["micro_batch"] < cand.micro_batch
                            and _same_but_micro_batch(r, cand)), None)
        if refused or smaller_oom:
            row = {"step_s": None, "peak_bytes": 0, "baseline_bytes": 0, "oom": not refused,
                   "error": None, "method": "", "dp_replicate": None, "dp_shard": None}
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
        row.update(trainer_resolves(cfg, cand, world=world, device=device, rank_nodes=nodes))
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
    table = {"rows": rows, "device": device.type, "world_size": world, "rank_nodes": nodes}
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            with open(os.path.join(d, TABLE_FILE), "w") as f:
                json.dump(table, f)
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"candidates": len(rows)}, checkpoint=checkpoint)


def _same_but_micro_batch(row: dict, cand: TrainSettings) -> bool:
    mine = asdict(cand)
    return all(row[k] == v for k, v in mine.items() if k != "micro_batch")


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

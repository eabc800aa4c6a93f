"""The Ray Train worker entry point: what runs in each worker process of an elastic job.

It turns Ray's view of the worker (rank, world size, node) into the Trainer's collaborators, rank
0's cluster membership, its MLflow metric logger and the fault-tolerance mode (the restart path,
or this worker's replica group: C7 all-or-nothing step), runs the Trainer, and reports to Ray
Train when it returns. The Trainer itself knows nothing of Ray: what it needs from the cluster is
made here.
"""

from __future__ import annotations

import time

import ray
import ray.train
import ray.train.torch
import torch.distributed as dist

from elastic_gpt.config import Config, config_from_dict
from elastic_gpt.elastic.membership import PLACEMENT_GROUP, RunRecords, WorkerMembership, best_effort
from elastic_gpt.errors import permanent_failure
from elastic_gpt.health.faults import NoFaults
from elastic_gpt.tracking.metric_logger import MetricLogger
from elastic_gpt.train.collaborators import Membership, MetricSink, NullMembership, NullMetricSink
from elastic_gpt.train.fault_tolerance import FaultTolerance, ReplicaGroupPath, RestartPath
from elastic_gpt.train.trainer import Trainer


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: everything a worker needs arrives in `loop_config` by value."""
    entered_at = time.time()
    ctx = ray.train.get_context()
    cfg = config_from_dict(loop_config["config"])
    run_id = loop_config.get("mlflow_run_id")
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # Every rank says which node it is on: rank 0 watches those nodes for drains, and the
    # Trainer keeps tensor-parallel groups inside them.
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    # Only rank 0 logs metrics, and only a tracked run has an MLflow run to log them to.
    logger = MetricLogger(cfg.tracking.uri, run_id) if rank == 0 and run_id else None
    metrics: MetricSink = logger or NullMetricSink()
    # With replica groups (elastic/replica_group_driver.py) `run_key` is the group's own: a drain
    # makes only this group leave (and come back when capacity does), its failures are its own.
    replica = loop_config.get("replica_group")
    membership: Membership = (WorkerMembership(loop_config["run_key"], nodes, world)
                              if rank == 0 else NullMembership())
    fault_tolerance: FaultTolerance = RestartPath()
    if replica is not None:
        groups = _replica_groups(replica, rank, world, cfg)
        if logger is not None:
            # Each step's metrics once (C5 one MLflow run): from the group leading its quorum,
            # or the one leading after it when it is lost before it stored them.
            metrics = groups.metric_sink(logger)
        fault_tolerance = groups
        if rank == 0:
            _note_placement_group(loop_config["run_key"])
    # The layout groups ranks by these node ids, not by Ray Train's local/node ranks, which Ray
    # derives from node IPs (all equal on a one-machine test cluster). A placement the layout
    # cannot use raises PlacementError on every rank while the Trainer is made, which the
    # controller retries: before rank 0's membership reads why the previous attempt ended,
    # which the retry's ledger event still needs.
    # The device is the one Ray assigned this worker: where Ray does not share a node's
    # CUDA_VISIBLE_DEVICES among its workers, LOCAL_RANK would name another worker's GPU.
    # A test's injected hardware faults come in the loop config (testing/hardware_faults.py).
    faults = loop_config.get("faults") or NoFaults()
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=run_id, metrics=metrics,
                      membership=membership, rank_nodes=nodes, fault_tolerance=fault_tolerance,
                      device=ray.train.torch.get_device(), faults=faults.for_rank(rank))
    # The attempt's start as the cluster saw it, beside the Trainer's own parts: reported with
    # its first step (train/metrics.py `startup_breakdown`).
    trainer.startup.update(built_s=time.time() - trainer.started, entered_at=entered_at)
    if rank == 0:
        trainer.startup.update(_group_start(loop_config["run_key"]))
    try:
        summary = trainer.train()
    except Exception as e:
        # Classified here, where the error's chain of causes is whole (Ray pickles only the
        # exception itself to the controller): a permanent one stops the run after this attempt.
        fatal = permanent_failure(e, checkpoint_hint=_newest_checkpoint_hint(cfg))
        if fatal is not None and fatal is not e:
            raise fatal from e
        raise
    finally:
        membership.close()
        metrics.close()
    ray.train.report({"step": summary["step"]})  # the ledger travels in the checkpoints


def _group_start(run_key: str) -> dict[str, float]:
    """When the scaling policy sized this group (`planned_at`, elastic/policies.py) and how long
    Ray took to place it (`placement_s`: its placement group's creation, as the GCS timed it),
    where known."""
    from ray.util import get_current_placement_group
    from ray.util.placement_group import placement_group_table

    out = {}
    planned = best_effort(RunRecords(run_key).get, "group_start") or {}
    if planned.get("at"):
        out["planned_at"] = float(planned["at"])
    pg = get_current_placement_group()
    table = (best_effort(placement_group_table, pg) or {}) if pg is not None else {}
    stats = table.get("stats") or {}
    if stats.get("end_to_end_creation_latency_ms"):
        out["placement_s"] = stats["end_to_end_creation_latency_ms"] / 1e3
    return out


def _replica_groups(spec: dict, rank: int, world: int, cfg: Config) -> ReplicaGroupPath:
    """This worker's place in its replica group (the loop config's `replica_group`: which group,
    the Lighthouse, where torchft's detail goes, the diagnostics of elastic/replica_group_driver.py)."""
    from elastic_gpt.parallel.replicate import ReplicaGroup, detail_log_path

    log_dir = spec.get("log_dir")
    return ReplicaGroupPath(ReplicaGroup(
        lighthouse=spec["lighthouse"], group=spec["group"], group_rank=rank, group_size=world,
        groups=cfg.elastic.replica_groups, timeout_s=cfg.elastic.hang_timeout_s,
        collective_timeout_s=min(cfg.elastic.replica_collective_timeout_s,
                                 cfg.elastic.hang_timeout_s),
        record_dir=spec.get("record_dir"), state_hash=bool(spec.get("state_hash")),
        log_path=detail_log_path(log_dir, spec["group"], rank) if log_dir else None))


def _note_placement_group(run_key: str) -> None:
    """Publish this group's placement group, which the driver removes when it stops the group's
    run for a fallback (a dead controller's outlives it)."""
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is not None:
        best_effort(RunRecords(run_key).put, PLACEMENT_GROUP, {"id": pg.id.hex()})


def _newest_checkpoint_hint(cfg) -> str:
    """', and step N at URL is intact': what a user needs to hear when a save failed."""
    from elastic_gpt.checkpoint.store import CheckpointStore
    try:
        latest = CheckpointStore(cfg.checkpoint.path).latest()
    except Exception:
        return ""
    return f", and the checkpoint of step {latest.step} at {latest.url} is intact" if latest else ""

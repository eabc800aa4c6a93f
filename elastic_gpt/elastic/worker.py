"""The Ray Train worker entry point: what runs in each worker process of an elastic job.

It turns Ray's view of the worker (rank, world size, node) into the Trainer's collaborators, rank
0's cluster membership and its MLflow metric logger, runs the Trainer, and reports to Ray Train
when it returns. The Trainer itself knows nothing of Ray: what it needs from the cluster is made
here.
"""

from __future__ import annotations

import ray
import ray.train
import torch.distributed as dist

from elastic_gpt.config import config_from_dict
from elastic_gpt.elastic.membership import WorkerMembership
from elastic_gpt.errors import permanent_failure
from elastic_gpt.tracking.metric_logger import MetricLogger
from elastic_gpt.train.trainer import Membership, MetricSink, NullMembership, NullMetricSink, Trainer


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: everything a worker needs arrives in `loop_config` by value."""
    ctx = ray.train.get_context()
    cfg = config_from_dict(loop_config["config"])
    run_id = loop_config.get("mlflow_run_id")
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # Only rank 0 logs metrics, and only a tracked run has an MLflow run to log them to.
    metrics: MetricSink = (MetricLogger(cfg.tracking.uri, run_id) if rank == 0 and run_id
                           else NullMetricSink())
    # Every rank says which node it is on: rank 0 watches those nodes for drains, and the
    # Trainer keeps tensor-parallel groups inside them.
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    # With replica groups (elastic/replica_groups.py) `run_key` is the group's own: a drain
    # makes only this group leave (and come back when capacity does), its failures are its own.
    replica = loop_config.get("replica_group")
    membership: Membership = (WorkerMembership(loop_config["run_key"], nodes, world)
                              if rank == 0 else NullMembership())
    replication = None
    if replica is not None:
        from elastic_gpt.elastic.replica_groups import member_of, note_placement_group
        replication, metrics = member_of(replica, rank, world, metrics, cfg)
        if rank == 0:
            note_placement_group(loop_config["run_key"])
    # The layout groups ranks by these node ids, not by Ray Train's local/node ranks, which Ray
    # derives from node IPs (all equal on a one-machine test cluster).
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=run_id, metrics=metrics,
                      membership=membership, rank_nodes=nodes, replication=replication)
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


def _newest_checkpoint_hint(cfg) -> str:
    """', and step N at URL is intact': what a user needs to hear when a save failed."""
    from elastic_gpt.checkpoint.store import CheckpointStore
    try:
        latest = CheckpointStore(cfg.checkpoint.path).latest()
    except Exception:
        return ""
    return f", and the checkpoint of step {latest.step} at {latest.url} is intact" if latest else ""

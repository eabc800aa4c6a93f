"""Driver side of `elastic.replica_groups: N` (C7, docs/replica-groups.md).

One torchft Lighthouse, held by a Ray actor on the driver's node, and one public-API Ray Train
run (`TorchTrainer`) per replica group, each driven from a Ray task on the driver's node. Ray
restarts only a failed group's run (its `FailureConfig`); the other groups keep stepping, and the
restarted group heals from a live peer (`elastic_gpt/parallel/replicate.py`). Ray 2.60's own
`TorchftConfig` is not used: it supports groups of exactly one worker (no FSDP inside a group)
and its example deadlocked here (a `ray.train.report` barrier against torchft's quorum rule).

Worker side: `member_of` gives the Trainer its `ReplicaGroup` and a metric sink that logs only
while the group leads the quorum, so the one MLflow run gets each step once (C5).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import ray

from elastic_gpt.config import Config
from elastic_gpt.console import say

RECORD_DIR_ENV = "ELASTIC_GPT_REPLICA_RECORDS"
"""Diagnostics for tests and bench: a folder where every rank appends its step attempts."""
STATE_HASH_ENV = "ELASTIC_GPT_REPLICA_STATE_HASH"
"""With RECORD_DIR_ENV: also a hash of each rank's state shards at every step (costs a pass)."""


def group_size(cfg: Config) -> int:
    """Workers per replica group: scaling.max_workers / N, in whole tensor-parallel groups."""
    n, s, tp = cfg.elastic.replica_groups, cfg.scaling, cfg.parallel.tp
    if s.max_workers % n or (s.max_workers // n) % tp:
        raise ValueError(
            f"elastic.replica_groups={n} must divide scaling.max_workers={s.max_workers} into "
            f"groups of a multiple of parallel.tp={tp} workers; e.g. scaling.max_workers="
            f"{n * tp * max(1, s.max_workers // (n * tp))}")
    return s.max_workers // n


def replica_group_factory(cfg: Config):
    """`make(run_id)` -> a job whose `fit()` runs every group to the end, like the factory of
    `launcher.build_trainer_factory` (checks first, before an MLflow run exists)."""
    from elastic_gpt.elastic.launcher import _worker_env, use_gpu
    from elastic_gpt.parallel.replicate import import_torchft

    import_torchft()  # the missing-extra error now, on the driver, not in every worker
    size = group_size(cfg)
    gpu = use_gpu(cfg)

    def make(run_id: str | None) -> ReplicaGroupsJob:
        return ReplicaGroupsJob(cfg, run_id, size, gpu, _worker_env())
    return make


@dataclass
class ReplicaGroupsJob:
    cfg: Config
    run_id: str | None
    size: int
    gpu: bool
    env: dict
    metrics: dict = field(default_factory=dict)

    def fit(self) -> ReplicaGroupsJob:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg, n = self.cfg, self.cfg.elastic.replica_groups
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        heartbeat_ms = int(cfg.elastic.replica_heartbeat_timeout_s * 1000)
        lighthouse = Lighthouse.options(scheduling_strategy=here).remote(heartbeat_ms)
        address = ray.get(lighthouse.address.remote())
        say(f"[elastic-gpt] replica groups: {n} x {self.size} worker(s), torchft Lighthouse at "
            f"{address} (heartbeat timeout {cfg.elastic.replica_heartbeat_timeout_s:g} s)")
        env = {**self.env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
        diagnostics = {"record_dir": os.environ.get(RECORD_DIR_ENV),
                       "state_hash": os.environ.get(STATE_HASH_ENV) == "1"}
        runs = [run_group.options(scheduling_strategy=here, runtime_env={"env_vars": env}).remote(
                    cfg.to_dict(), self.run_id, g, address, self.size, self.gpu, diagnostics)
                for g in range(n)]
        try:
            outcomes = ray.get(runs)
        finally:
            ray.kill(lighthouse)
        finished = [o for o in outcomes if o.get("error") is None]
        say(f"[elastic-gpt] replica groups: {len(finished)} of {n} finished")
        if not finished:  # a group that ran out of restarts is fine while another one finished
            raise outcomes[0]["error"]
        self.metrics = finished[0].get("metrics") or {}
        return self


@ray.remote(num_cpus=0)
class Lighthouse:
    """torchft's Lighthouse: forms each step's quorum of replica groups. A group whose
    heartbeats stop for `heartbeat_ms` drops out of the next quorum; that is the survivors' stall
    per lost group. Joiners are waited for at most twice that."""

    def __init__(self, heartbeat_ms: int):
        from torchft.coordination import LighthouseServer
        self.server = LighthouseServer(bind="[::]:0", min_replicas=1,
                                       join_timeout_ms=2 * heartbeat_ms,
                                       heartbeat_timeout_ms=heartbeat_ms)

    def address(self) -> str:
        return self.server.address()


@ray.remote(num_cpus=0, max_retries=0)
def run_group(config: dict, run_id: str | None, group: int, lighthouse: str, size: int,
              gpu: bool, diagnostics: dict) -> dict:
    """Group `group`'s own Ray Train run; Ray restarts its workers after a failure, up to the
    failure budget, while the other groups' runs go on."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from elastic_gpt.config import config_from_dict
    from elastic_gpt.elastic.launcher import _worker_env, run_key
    from elastic_gpt.elastic.worker import train_loop_per_worker

    cfg = config_from_dict(config)
    s = cfg.scaling
    resources = {"CPU": s.cpus_per_worker, **({"GPU": 1} if gpu else {})}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": config, "mlflow_run_id": run_id, "run_key": run_key(cfg),
                           "replica_group": {"group": group, "lighthouse": lighthouse,
                                             **diagnostics}},
        scaling_config=ScalingConfig(num_workers=size, use_gpu=gpu, resources_per_worker=resources,
                                     accelerator_type=s.accelerator_type),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=600),
        run_config=RunConfig(
            name=f"{cfg.run.name}-g{group}-{int(time.time())}", storage_path=cfg.run.storage_path,
            failure_config=FailureConfig(max_failures=max(1, int(cfg.elastic.max_failures_per_hour))),
            worker_runtime_env={"env_vars": _worker_env()}))
    try:
        result = trainer.fit()
    except Exception as e:  # returned, not raised: one group's end is not the run's
        return {"group": group, "error": e}
    return {"group": group, "error": result.error, "metrics": dict(result.metrics or {})}


# ---- worker side ---------------------------------------------------------------------------


class LeaderMetrics:
    """Logs a step's metrics only from the group leading its quorum (each step once in the one
    MLflow run), with the number of live groups."""

    def __init__(self, sink, replication):
        self.sink, self.replication = sink, replication

    def log(self, metrics: dict, step: int) -> None:
        if self.replication.leads:
            self.sink.log({**metrics, "replica_groups_live": self.replication.live_groups}, step)

    def flush(self, timeout_s: float) -> bool:
        return self.sink.flush(timeout_s)

    def close(self) -> None:
        self.sink.close()


def member_of(spec: dict, rank: int, world: int, metrics, cfg: Config):
    """This worker's ReplicaGroup (from the loop config's `replica_group`) and its metric sink."""
    from elastic_gpt.parallel.replicate import ReplicaGroup

    replication = ReplicaGroup(
        lighthouse=spec["lighthouse"], group=spec["group"], group_rank=rank, group_size=world,
        timeout_s=max(15.0, 5 * cfg.elastic.replica_heartbeat_timeout_s),
        record_dir=spec.get("record_dir"), state_hash=bool(spec.get("state_hash")))
    return replication, LeaderMetrics(metrics, replication)

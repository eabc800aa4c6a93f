"""Driver side of `elastic.replica_groups: N` (C7 all-or-nothing step, docs/replica-groups.md).

One Lighthouse (torchft's protocol, `lighthouse.py`), held by a Ray actor on the driver's node, and
one Ray Train run per replica group, each driven from a Ray task on the driver's node. Each group's
run is an `ElasticTorchTrainer` of a fixed size with the run's own policies: Ray restarts only that
group after a failure (charged to its sliding-hour budget), for free after a drain (the group
leaves at a step boundary, elastic/membership.py), and waits for live capacity rather than a
placement group that cannot be placed. The other groups keep stepping; the restarted group heals
from a live peer (`elastic_gpt/parallel/replicate.py`). Ray 2.60's own `TorchftConfig` is not used:
it supports groups of exactly one worker (no FSDP inside a group) and its example deadlocked here
(a `ray.train.report` barrier against torchft's quorum rule).

**Fallback.** Without a Lighthouse no group can form a quorum, and with every group gone there is
no peer to heal from: in both cases the driver stops what is left and starts a new Lighthouse and
every group again, which restore the newest committed checkpoint (still written, C4 atomic commit):
the restart path. Each fallback is charged to the same sliding-hour budget.

Each group's Ray Train job is built as the restart path's is (`worker_group_job.py`). Worker side
(`worker.py`): the Trainer's fault-tolerance mode is `train/fault_tolerance.ReplicaGroupPath`, and its
metric sink logs a step from the group leading its quorum, or from the group leading after it
when that one is lost before it stored it, so the one MLflow run gets each step once (C5 one
MLflow run). torchft's own per-step detail goes to a file per worker (`config.run_log_dir`), not to
the console.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import ray

from elastic_gpt.config import Config, run_log_dir
from elastic_gpt.console import last_line, say
from elastic_gpt.elastic.membership import PLACEMENT_GROUP, RunRecords, best_effort
from elastic_gpt.elastic.worker_group_job import (
    budget_spent_line,
    fatal_cause,
    job_factory,
    run_key,
    tune_ray_train_env,
    use_gpu,
    worker_env,
)
from elastic_gpt.errors import FailureBudgetSpent
from elastic_gpt.parallel.tp_rules import workers_problem

RECORD_DIR_ENV = "ELASTIC_GPT_REPLICA_RECORDS"
"""Diagnostics for tests and bench: a folder where every rank appends its step attempts."""
STATE_HASH_ENV = "ELASTIC_GPT_REPLICA_STATE_HASH"
"""With RECORD_DIR_ENV: also a hash of each rank's state shards at every step (costs a pass)."""
FAILURE_WINDOW_S = 3600.0


def group_size(cfg: Config) -> int:
    """Workers per replica group: scaling.max_workers / N, in whole pipelines of tensor-parallel
    groups (parallel.pp x parallel.tp workers each)."""
    n, s = cfg.elastic.replica_groups, cfg.scaling
    unit = cfg.parallel.tp * cfg.parallel.pp
    if s.max_workers % n or workers_problem(unit, {"workers per group": s.max_workers // n}):
        what = (f"parallel.tp={cfg.parallel.tp}" if cfg.parallel.pp == 1 else
                f"parallel.pp x parallel.tp = {unit}")
        raise ValueError(
            f"elastic.replica_groups={n} must divide scaling.max_workers={s.max_workers} into "
            f"groups of a multiple of {what} workers; e.g. scaling.max_workers="
            f"{n * unit * max(1, s.max_workers // (n * unit))}")
    return s.max_workers // n


def group_run_key(key: str, group: int) -> str:
    """Each group's own GCS records (its failures, drains, progress): `membership.RunRecords`."""
    return f"{key}/g{group}"


def replica_group_factory(cfg: Config):
    """`make(run_id)` -> a job whose `fit()` runs every group to the end, like the factory of
    `launcher.build_trainer_factory` (checks first, before an MLflow run exists)."""
    from elastic_gpt.elastic.ray_internals import check_ray_internals

    size = group_size(cfg)  # preflight has checked it, and that torchft is installed
    gpu = use_gpu(cfg)
    check_ray_internals()  # each group's run is an ElasticTorchTrainer
    tune_ray_train_env(cfg)
    # The group runs' controllers read RAY_TRAIN_* from their driver, the run_group task. A
    # hung worker answers no process-group shutdown either: wait for it no longer than for a
    # collective (Ray Train's default is 30 s).
    env = {**worker_env(), **{k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")},
           "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": str(int(min(
               30, max(1, cfg.elastic.hang_timeout_s))))}

    def make(run_id: str | None) -> ReplicaGroupsJob:
        return ReplicaGroupsJob(cfg, run_id, size, gpu, env)
    return make


@dataclass
class ReplicaGroupsJob:
    cfg: Config
    run_id: str | None
    size: int
    gpu: bool
    env: dict
    metrics: dict = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    """Every group's ledger events at the end (`groups_events`): the checkpoint has the leading
    group's, which lacks what only another group saw."""
    fallbacks: list[float] = field(default_factory=list)
    """When each fallback to the restart path happened (the sliding-hour budget)."""

    def fit(self) -> ReplicaGroupsJob:
        from elastic_gpt.parallel.replicate import detail_log_path

        say("[elastic-gpt] replica groups: torchft's detail (quorums, commits, heals) goes to "
            f"{detail_log_path(run_log_dir(self.cfg), '<G>', '<R>')} on each worker's node "
            "(group G, rank R)")
        while True:
            outcome = self._attempt()
            if outcome.finished:
                self.metrics = outcome.metrics
                self.events = groups_events(self.cfg)
                return self
            if outcome.fatal:
                raise outcome.error
            now = time.monotonic()
            self.fallbacks = [t for t in self.fallbacks if now - t <= FAILURE_WINDOW_S] + [now]
            budget = self.cfg.elastic.max_failures_per_hour
            if len(self.fallbacks) > budget:
                raise FailureBudgetSpent(budget_spent_line(
                    self.cfg, f"the replica groups fell back to the restart path "
                    f"({outcome.reason})", outcome.error))
            self._record_fallback(outcome.reason)
            say(f"[elastic-gpt] replica groups: {outcome.reason}; falling back to the restart "
                "path: a new Lighthouse, every group restored from the newest checkpoint")

    def _attempt(self) -> _Outcome:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg, n = self.cfg, self.cfg.elastic.replica_groups
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        heartbeat_ms = int(cfg.elastic.replica_heartbeat_timeout_s * 1000)
        lighthouse = Lighthouse.options(scheduling_strategy=here).remote(
            heartbeat_ms, n, os.environ.get(RECORD_DIR_ENV))
        address = ray.get(lighthouse.address.remote())
        lighthouse_alive = lighthouse.wait_stopped.remote()  # fails when the actor dies
        if os.environ.get(RECORD_DIR_ENV):  # the fault tests kill it by this pid
            _append_record(os.environ[RECORD_DIR_ENV], event="lighthouse", address=address,
                           pid=ray.get(lighthouse.pid.remote()))
        say(f"[elastic-gpt] replica groups: {n} x {self.size} worker(s), Lighthouse at "
            f"{address} (heartbeat timeout {cfg.elastic.replica_heartbeat_timeout_s:g} s)")
        spec = {"log_dir": run_log_dir(cfg), "record_dir": os.environ.get(RECORD_DIR_ENV),
                "state_hash": os.environ.get(STATE_HASH_ENV) == "1"}
        runs = {run_group.options(scheduling_strategy=here,
                                  runtime_env={"env_vars": self.env}).remote(
                    cfg.to_dict(), self.run_id, g, address, self.size, self.gpu, spec): g
                for g in range(n)}
        outcomes: dict[int, dict] = {}
        try:
            while len(outcomes) < n:
                ready, _ = ray.wait([lighthouse_alive, *[r for r, g in runs.items()
                                                         if g not in outcomes]], num_returns=1)
                if ready[0] == lighthouse_alive:
                    return _Outcome(False, reason=_lighthouse_end(lighthouse_alive))
                outcome = ray.get(ready[0])
                outcomes[outcome["group"]] = outcome
                if outcome.get("error") is not None and _is_fatal(outcome["error"]):
                    return _Outcome(False, reason=f"group {outcome['group']} failed",
                                    error=outcome["error"], fatal=True)
                if outcome.get("error") is None:
                    continue
                say(f"[elastic-gpt] replica groups: group {outcome['group']} ended after "
                    f"spending its restarts: {last_line(outcome['error'])[:200]}")
            finished = [o for o in outcomes.values() if o.get("error") is None]
            say(f"[elastic-gpt] replica groups: {len(finished)} of {n} finished")
            if finished:  # a group that ran out of restarts is fine while another one finished
                return _Outcome(True, metrics=finished[0].get("metrics") or {})
            return _Outcome(False, reason="every replica group was lost",
                            error=next(iter(outcomes.values()))["error"])
        finally:
            left = [ref for ref, g in runs.items() if g not in outcomes]
            for ref in left:  # a group's run owns its controller, and so its workers
                ray.cancel(ref, force=True)
            ray.wait(left, num_returns=len(left), timeout=30)
            # A dead controller's placement group outlives it: Ray Train's detached cleaner
            # frees it only where the State API answers, and the next attempt needs its room.
            for g in {runs[ref] for ref in left}:
                _remove_group_placement_group(self.cfg, g)
            ray.kill(lighthouse)

    def _record_fallback(self, reason: str) -> None:
        """Tell every group's next attempt why it restarts (the goodput ledger's event, C5 one
        MLflow run). An uncommitted step folder the stopped groups left is never resumed from (C4
        atomic commit); checkpoint retention removes it at the next commit."""
        for g in range(self.cfg.elastic.replica_groups):
            best_effort(RunRecords(group_run_key(run_key(self.cfg), g)).put, "last_failure",
                        {"kind": "failure", "at": time.time(), "error": reason})


def groups_events(cfg: Config) -> list[dict]:
    """The union of the events in every group's last published ledger (membership.RunRecords)."""
    from elastic_gpt.train.goodput import merge_events

    ledgers = [(best_effort(RunRecords(group_run_key(run_key(cfg), g)).get, "progress") or {})
               .get("ledger") or {} for g in range(cfg.elastic.replica_groups)]
    return merge_events(*[ledger.get("events") or [] for ledger in ledgers])


@dataclass
class _Outcome:
    finished: bool
    reason: str = ""
    error: BaseException | None = None
    fatal: bool = False
    """The error is permanent (`worker_group_job.fatal_cause`): no fallback."""
    metrics: dict = field(default_factory=dict)


def _remove_group_placement_group(cfg: Config, group: int) -> None:
    """The placement group the group's rank 0 published (worker.py), which outlives a dead
    controller."""
    from ray.util import remove_placement_group
    from ray.util.placement_group import PlacementGroup, placement_group_table

    records = RunRecords(group_run_key(run_key(cfg), group))
    rec = best_effort(records.get, PLACEMENT_GROUP)
    if not rec:
        return
    pg = PlacementGroup(ray.PlacementGroupID.from_hex(rec["id"]))
    if placement_group_table(pg).get("state") not in (None, "REMOVED"):
        remove_placement_group(pg)
    best_effort(records.delete, PLACEMENT_GROUP)


def _append_record(folder: str, **record) -> None:
    import json
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "driver.jsonl"), "a") as f:
        f.write(json.dumps({"t": round(time.time(), 4), "group": None, **record}) + "\n")


def _is_fatal(error: BaseException) -> bool:
    return fatal_cause(error) is not None


def _lighthouse_end(ref) -> str:
    try:
        ray.get(ref)
    except Exception as e:
        return f"the Lighthouse was lost ({type(e).__name__})"
    return "the Lighthouse stopped"


@ray.remote(num_cpus=0, max_concurrency=4)
class Lighthouse:
    """The groups' Lighthouse (`elastic/lighthouse.py`: torchft's quorum service, told when a group
    is gone): forms each step's quorum of replica groups. A group drops out of the next quorum at
    once when it leaves (a drain, the end, an error in it) or its manager's process is gone (a
    probe is refused); a group that falls silent otherwise (a hung process, a node off the
    network) after `heartbeat_ms`. Joiners are waited for at most twice that."""

    # A quorum that waits for a lost group's heartbeat to time out is formed at the next tick
    # after it (no request arrives to trigger it): torchft's default tick adds up to a tenth of
    # a second to every such stall; this one is cheap (a few groups to look at).
    QUORUM_TICK_MS = 10

    def __init__(self, heartbeat_ms: int, groups: int, record_dir: str | None = None):
        from elastic_gpt.elastic.lighthouse import LighthouseServer

        def note(departure) -> None:
            if record_dir:
                _append_record(record_dir, event="departure", replica=departure.replica_id,
                               why=departure.why, at=departure.at, waited_s=departure.waited_s)
        self.server = LighthouseServer(min_replicas=1, join_timeout_ms=2 * heartbeat_ms,
                                       quorum_tick_ms=self.QUORUM_TICK_MS,
                                       heartbeat_timeout_ms=heartbeat_ms, on_departure=note,
                                       # a waiting quorum call, heartbeats and a leave per group
                                       max_workers=16 + 4 * groups)

    def address(self) -> str:
        return self.server.address()

    def pid(self) -> int:
        return os.getpid()

    def wait_stopped(self) -> None:
        """Returns never while the server runs: the driver watches this call to learn at once
        that the actor (and its server) died."""
        while True:
            time.sleep(3600)


@ray.remote(num_cpus=0, max_retries=0)
def run_group(config: dict, run_id: str | None, group: int, lighthouse: str, size: int,
              gpu: bool, spec: dict) -> dict:
    """Group `group`'s own Ray Train run; Ray restarts its workers after a failure (within the
    group's budget) or a drain, while the other groups' runs go on. `spec`: where its workers
    keep torchft's detail, and the diagnostics of the tests (RECORD_DIR_ENV, STATE_HASH_ENV)."""
    from elastic_gpt.config import config_from_dict

    cfg = config_from_dict(config)
    key = group_run_key(run_key(cfg), group)
    job = job_factory(cfg, gpu=gpu, num_workers=size, key=key,
                      name=f"{cfg.run.name}-g{group}-{int(time.time())}")
    trainer = job({"config": config, "mlflow_run_id": run_id, "run_key": key,
                   "replica_group": {"group": group, "lighthouse": lighthouse, **spec}})
    try:
        result = trainer.fit()
    except Exception as e:  # returned, not raised: one group's end is not the run's
        return {"group": group, "error": e}
    return {"group": group, "error": result.error, "metrics": dict(result.metrics or {})}

"""Elastic membership on top of Ray Train V2's controller: the only module that touches Ray Train
internals (pinned to ray 2.60.*; `check_ray_internals()` fails loudly if their shape changes).

How a membership change plays out:

* **Node lost / worker killed.** The controller sees the worker errors, `ElasticFailurePolicy`
  charges the sliding-hour budget and retries, and `LiveCapacityScalingPolicy` sizes the new group
  from live GCS state (alive, non-draining nodes and their free resources), so no placement group
  is ever sized to capacity that is gone. Workers resume from the newest committed checkpoint.
* **Capacity gained.** The scaling policy sees more room than the group uses and posts a resize
  request; rank 0's `MembershipWatcher` picks it up, all ranks agree at the next step boundary (a
  flag in the per-step all-reduce), write a just-in-time checkpoint and raise `ElasticRestart`,
  which the failure policy retries for free at the new size. No step is lost.
* **Node draining** (spot notice turned into a drain by `preemption.py`, or KubeRay/autoscaler
  drains). The watcher sees the drain of a node hosting a rank and does the same: checkpoint at the
  next step boundary, restart without that node. At most the step in flight is re-done.
* **Unfixable errors** (`FatalTrainingError`: bad config, checkpoint of another shape, NaN beyond
  patience) stop the run at once with the real error.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass

import ray

from elastic_gpt.errors import FatalTrainingError

log = logging.getLogger("elastic_gpt.elastic.controller")

KV_NAMESPACE = "elastic_gpt"
RESIZE_STABLE_S = 1.0  # extra capacity must persist this long before we restart to use it
POLL_S = 0.25


class ElasticRestart(Exception):
    """Raised by every rank after a just-in-time checkpoint: a planned restart, not a failure."""

    def __init__(self, reason: str, step: int):
        super().__init__(f"planned restart after step {step}: {reason}")
        self.reason, self.step = reason, step

    def __reduce__(self):
        return (ElasticRestart, (self.reason, self.step))


# ---- live cluster state (GCS) --------------------------------------------------------------------

def live_capacity(resources_per_worker: dict[str, float], held: dict[str, int] | None = None,
                  exclude: set[str] = frozenset()) -> dict[str, int]:
    """Workers that fit per node now: alive, not draining, free resources plus what our own
    current group holds there (`held`: node id -> workers). Read from the GCS, never cached.

    Nodes that hosted our group are also probed directly: right after a node is lost, its
    workers' errors reach the controller before the GCS's health checks declare it dead, and a
    group sized with it would wait out the placement timeout."""
    from ray._private.state import state

    draining = set(state.get_draining_nodes())
    totals = state.total_resources_per_node()  # alive nodes only
    available = state.available_resources_per_node()
    held = held or {}
    lost = unreachable_nodes(set(held) & set(totals))
    out = {}
    for node, total in totals.items():
        if node in draining or node in exclude or node in lost:
            continue
        free = dict(available.get(node, {}))
        fits = min(int((free.get(r, 0.0) + held.get(node, 0) * need) // need)
                   for r, need in resources_per_worker.items() if need > 0)
        cap = min(int(total.get(r, 0.0) // need) for r, need in resources_per_worker.items()
                  if need > 0)
        out[node] = max(0, min(fits, cap))
    return out


def unreachable_nodes(node_ids: set[str], timeout_s: float = 0.5) -> set[str]:
    """Nodes whose raylet does not accept a TCP connection: dead, whatever the GCS says yet."""
    import socket

    from ray._private.state import state

    if not node_ids:
        return set()
    lost = set()
    for info in state.node_table():
        if info["NodeID"] not in node_ids or not info["Alive"]:
            continue
        try:
            with socket.create_connection((info["NodeManagerAddress"], info["NodeManagerPort"]),
                                          timeout=timeout_s):
                pass
        except OSError:
            lost.add(info["NodeID"])
    return lost


def kv_key(run_key: str, what: str) -> bytes:
    return f"{run_key}/{what}".encode()


def kv_put(run_key: str, what: str, value: dict) -> None:
    from ray.experimental import internal_kv
    internal_kv._internal_kv_put(kv_key(run_key, what), json.dumps(value).encode(),
                                 overwrite=True, namespace=KV_NAMESPACE)


def kv_get(run_key: str, what: str) -> dict | None:
    from ray.experimental import internal_kv
    raw = internal_kv._internal_kv_get(kv_key(run_key, what), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None


def kv_del(run_key: str, what: str) -> None:
    from ray.experimental import internal_kv
    internal_kv._internal_kv_del(kv_key(run_key, what), namespace=KV_NAMESPACE)


# ---- worker side ---------------------------------------------------------------------------------

class WorkerMembership:
    """Rank 0's link to the cluster. A background thread polls the GCS (two reads per poll, off
    the training thread): is a node hosting one of our ranks draining, or has the controller asked
    for a resize? It also publishes this attempt's progress, which the next attempt reads to count
    the work a failure cost (goodput ledger)."""

    def __init__(self, run_key: str, rank_nodes: list[str], world_size: int,
                 poll_s: float = POLL_S):
        self.run_key, self.rank_nodes, self.world_size = run_key, rank_nodes, world_size
        self.reason: str | None = None
        self.previous = _safe(kv_get, run_key, "progress")  # the attempt before this one
        self.cause = _consume_cause(run_key)
        self._progress: dict | None = None
        self._published: dict | None = None
        self._avg_step_s = 0.0
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._thread.start()

    def publish(self, step: int, step_time_s: float, ledger: dict) -> None:
        a = 0.2  # moving average of the step time: the cost of a step that must be re-done
        self._avg_step_s = step_time_s if not self._avg_step_s else \
            (1 - a) * self._avg_step_s + a * step_time_s
        self._progress = {"step": step, "world_size": self.world_size, "at": time.time(),
                          "avg_step_s": self._avg_step_s, "ledger": ledger}

    def record_restart(self, reason: str, step: int) -> None:
        kind = reason.split(":", 1)[0] if reason.startswith(("preemption", "resize")) else "resize"
        self._flush()
        _safe(kv_put, self.run_key, "last_restart",
              {"kind": kind, "reason": reason, "step": step, "at": time.time()})

    def _flush(self) -> None:
        if self._progress is not None and self._progress is not self._published:
            _safe(kv_put, self.run_key, "progress", self._progress)
            self._published = self._progress

    def _run(self) -> None:
        from ray._private.state import state
        while not self._stop.wait(self._poll_s):
            self._flush()
            if self.reason:
                continue
            try:
                draining = state.get_draining_nodes()
                ours = sorted({n for n in self.rank_nodes if n in draining})
                if ours:
                    deadline = draining[ours[0]]
                    self.reason = (f"preemption: node {ours[0][:12]} is draining"
                                   + (f" (deadline in {deadline / 1000 - time.time():.0f}s)"
                                      if deadline else ""))
                    continue
                req = kv_get(self.run_key, "resize")
                if req and req.get("target") and req["target"] != self.world_size:
                    self.reason = f"resize: {self.world_size} -> {req['target']} workers"
            except Exception as e:  # a GCS blip must not kill training
                log.debug("membership poll failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._flush()


def _consume_cause(run_key: str) -> dict | None:
    """Why the previous attempt ended (a planned restart or a failure), read once."""
    found = []
    for what, kind in (("last_restart", None), ("last_failure", "failure")):
        rec = _safe(kv_get, run_key, what)
        if rec:
            found.append({"kind": kind or rec.get("kind"), **rec} if kind else rec)
            _safe(kv_del, run_key, what)
    return max(found, key=lambda r: r.get("at", 0)) if found else None


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        log.debug("GCS KV %s failed: %s", fn.__name__, e)
        return None


# ---- controller side: Ray Train policies ---------------------------------------------------------

def _internals():
    from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
    from ray.train.v2._internal.execution.scaling_policy import (
        NoopDecision,
        ResizeDecision,
        ScalingPolicy,
    )
    return FailureDecision, FailurePolicy, NoopDecision, ResizeDecision, ScalingPolicy


@dataclass
class SharedState:
    """What the two policies share inside the controller actor."""

    last_group_nodes: dict[str, int]
    last_group_pg: object | None = None


def make_policies(scaling_config, failure_config, run_key: str, max_failures_per_hour: float):
    FailureDecision, FailurePolicy, NoopDecision, ResizeDecision, ScalingPolicy = _internals()
    shared = SharedState(last_group_nodes={})

    class LiveCapacityScalingPolicy(ScalingPolicy):
        """Sizes the group from live GCS state instead of the autoscaling coordinator's reserved
        view, which still counts dead nodes (the 60 s placement-group wait Ray's default hits)."""

        def _get_num_workers_for_resource_request(self) -> int:
            return self.scaling_config.max_workers  # ask the autoscaler for the full size

        def _fit(self) -> int:
            # Until the controller removes the old group's placement group, its bundles still
            # hold resources on the surviving nodes: count them as ours, or a group that lost a
            # node would see no room for its own replacement.
            held = {}
            if shared.last_group_pg is not None and not _pg_removed(shared.last_group_pg):
                held = shared.last_group_nodes
            per_node = live_capacity(self.scaling_config._resources_per_worker_not_none, held)
            return min(sum(per_node.values()), self.scaling_config.max_workers)

        def make_decision_for_non_running_worker_group(self):
            self._maybe_send_resource_request()
            kv_del(run_key, "resize")
            n = self._fit()
            if n < self.scaling_config.min_workers:
                now = time.monotonic()
                if now - getattr(self, "_warned_at", -1e9) > 30:
                    self._warned_at = now
                    log.warning("elastic-gpt: live capacity fits %d worker(s), fewer than "
                                "scaling.min_workers=%d; waiting for nodes (or lower "
                                "min_workers)", n, self.scaling_config.min_workers)
                time.sleep(POLL_S)  # the controller loop calls again at once: don't spin
                return NoopDecision()
            log.info("elastic-gpt: starting %d workers (live capacity)", n)
            return ResizeDecision(num_workers=n,
                                  resources_per_worker=self.scaling_config._resources_per_worker_not_none)

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            self._maybe_send_resource_request()
            nodes = collections.Counter(w.metadata.node_id for w in worker_group_state.workers)
            shared.last_group_nodes = dict(nodes)
            shared.last_group_pg = worker_group_state.placement_group_handle.placement_group
            current = worker_group_state.num_workers
            if current >= self.scaling_config.max_workers:
                return NoopDecision()
            now = time.monotonic()
            fit = self._fit()
            if fit > current:
                first = getattr(self, "_more_since", None) or now
                self._more_since = first
                if now - first >= RESIZE_STABLE_S and not kv_get(run_key, "resize"):
                    log.info("elastic-gpt: capacity for %d workers (running %d): asking the "
                             "workers to checkpoint and restart", fit, current)
                    kv_put(run_key, "resize", {"target": fit, "at": time.time()})
            else:
                self._more_since = None
            return NoopDecision()

    class ElasticFailurePolicy(FailurePolicy):
        """Planned restarts are free; unfixable errors stop at once; the rest is charged to a
        sliding one-hour window instead of Ray's never-resetting counter."""

        def __init__(self, failure_config):
            super().__init__(failure_config)
            self.window: collections.deque[float] = collections.deque()

        def make_decision(self, training_failed_error):
            causes = list(getattr(training_failed_error, "worker_failures", {}).values())
            if causes and all(isinstance(c, ElasticRestart) for c in causes):
                log.info("elastic-gpt: %s", causes[0])
                return FailureDecision.RETRY
            fatal = [c for c in causes if isinstance(c, FatalTrainingError)]
            if fatal:
                log.error("elastic-gpt: unrecoverable error, stopping: %s", fatal[0])
                return FailureDecision.RAISE
            now = time.monotonic()
            self.window.append(now)
            while self.window and now - self.window[0] > 3600:
                self.window.popleft()
            if len(self.window) > max_failures_per_hour:
                log.error("elastic-gpt: %d failures in the last hour exceed "
                          "elastic.max_failures_per_hour=%s; stopping", len(self.window),
                          max_failures_per_hour)
                return FailureDecision.RAISE
            _safe(kv_put, run_key, "last_failure",
                  {"kind": "failure", "at": time.time(), "error": _short(training_failed_error)})
            log.warning("elastic-gpt: failure %d in the last hour (budget %s); restarting from "
                        "the newest checkpoint", len(self.window), max_failures_per_hour)
            return FailureDecision.RETRY

    return LiveCapacityScalingPolicy(scaling_config), ElasticFailurePolicy(failure_config)


def _short(error: Exception) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return " | ".join(lines[:3])[:300]


def _pg_removed(pg) -> bool:
    try:
        from ray.util.placement_group import placement_group_table
        return placement_group_table(pg).get("state") == "REMOVED"
    except Exception:
        return True


def elastic_trainer_class():
    """TorchTrainer whose controller gets our two policies (the one hook into Ray Train)."""
    from ray.train.torch import TorchTrainer

    class ElasticTorchTrainer(TorchTrainer):
        run_key: str = ""
        max_failures_per_hour: float = 10.0

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            scaling, failure = make_policies(self.scaling_config, self.run_config.failure_config,
                                             self.run_key, self.max_failures_per_hour)
            controller_init_kwargs["scaling_policy"] = scaling
            controller_init_kwargs["failure_policy"] = failure
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return ElasticTorchTrainer


def check_ray_internals() -> None:
    """Fail loudly if the Ray Train internals this module relies on changed shape."""
    import inspect

    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    FailureDecision, FailurePolicy, NoopDecision, ResizeDecision, ScalingPolicy = _internals()
    problems = []
    if not hasattr(DataParallelTrainer, "_initialize_and_run_controller"):
        problems.append("DataParallelTrainer._initialize_and_run_controller is gone")
    params = inspect.signature(TrainController.__init__).parameters
    for name in ("scaling_policy", "failure_policy"):
        if name not in params:
            problems.append(f"TrainController.__init__ has no {name} argument")
    for cls, methods in [(ScalingPolicy, ("make_decision_for_non_running_worker_group",
                                          "make_decision_for_running_worker_group",
                                          "_get_num_workers_for_resource_request",
                                          "_maybe_send_resource_request")),
                         (FailurePolicy, ("make_decision",))]:
        for m in methods:
            if not hasattr(cls, m):
                problems.append(f"{cls.__name__}.{m} is gone")
    if {"RETRY", "RAISE"} - {d.name for d in FailureDecision}:
        problems.append("FailureDecision lost RETRY/RAISE")
    if "num_workers" not in inspect.signature(ResizeDecision).parameters:
        problems.append("ResizeDecision(num_workers=...) changed")
    if "node_id" not in {f for f in ActorMetadata.__dataclass_fields__}:
        problems.append("ActorMetadata.node_id is gone")
    if not {"workers", "placement_group_handle"} <= set(WorkerGroupState.__dataclass_fields__):
        problems.append("WorkerGroupState fields changed")
    from ray._private.state import state
    for m in ("get_draining_nodes", "total_resources_per_node", "available_resources_per_node"):
        if not hasattr(state, m):
            problems.append(f"ray._private.state.state.{m} is gone")
    if problems:
        raise RuntimeError(f"ray {ray.__version__}: Ray Train internals changed: "
                           + "; ".join(problems) + ". elastic-gpt pins ray==2.60.*")

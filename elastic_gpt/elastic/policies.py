"""The two Ray Train controller policies of an elastic run.

`LiveCapacityScalingPolicy` decides how many workers a new group gets (and when a running group
should grow); `ElasticFailurePolicy` decides whether a failed attempt is retried. Both run inside
Ray Train's controller actor, which unpickles them by reference to this module, and both reach the
workers through the run's `RunRecords` in the GCS (the resize request, the failure record).

Their base classes live in Ray's private modules; `ray_internals` hands them out, so importing this
module loads Ray Train. Only the trainer's controller hook (controller.py) and tests import it.
"""

from __future__ import annotations

import collections
import logging
import math
import time

from elastic_gpt.elastic.membership import POLL_S, RunRecords, best_effort, live_capacity
from elastic_gpt.elastic.ray_internals import (
    FailureDecision,
    FailurePolicy,
    NoopDecision,
    ResizeDecision,
    ScalingPolicy,
    resources_per_worker,
)
from elastic_gpt.errors import ElasticRestart, FatalTrainingError

log = logging.getLogger(__name__)

RESIZE_STABLE_S = 1.0  # extra capacity must persist this long before we restart to use it
WARN_EVERY_S = 30.0  # how often "capacity below min_workers" is repeated while waiting
FAILURE_WINDOW_S = 3600.0  # the budget counts failures over the last hour


class LiveCapacityScalingPolicy(ScalingPolicy):
    """Sizes the group from live GCS state instead of the autoscaling coordinator's reserved
    view, which still counts dead nodes (the 60 s placement-group wait Ray's default hits), in
    whole tensor-parallel groups per node (`group_size`): `tp` and `hsdp` are parallel.*."""

    def __init__(self, scaling_config, records: RunRecords, tp: int = 1, hsdp: str = "auto"):
        super().__init__(scaling_config)
        self.records = records
        self.tp, self.hsdp = tp, hsdp
        # The running group as last seen (workers per node, its placement group): see _fit.
        self.last_group_nodes: dict[str, int] = {}
        self.last_group_pg = None
        self.more_room_since: float | None = None  # when live capacity first exceeded the group
        self.warned_at = -math.inf  # last "fewer than min_workers" warning

    def _get_num_workers_for_resource_request(self) -> int:
        return self.scaling_config.max_workers  # ask the autoscaler for the full size

    def _fit(self) -> int:
        # Until the controller removes the old group's placement group, its bundles still hold
        # resources on the surviving nodes: count them as ours, or a group that lost a node would
        # see no room for its own replacement.
        # Where its bundles are now, not where its workers were: Ray re-places the bundles of a
        # dead node elsewhere, onto the very capacity a replacement node brings.
        held = {}
        if self.last_group_pg is not None and not _pg_removed(self.last_group_pg):
            held = _pg_nodes(self.last_group_pg) or self.last_group_nodes
        per_node = live_capacity(resources_per_worker(self.scaling_config), held)
        return group_size(per_node, self.scaling_config.max_workers, self.tp, self.hsdp)

    def make_decision_for_non_running_worker_group(self):
        self._maybe_send_resource_request()
        self.records.delete("resize")
        self._release_group_that_lost_a_node()
        n = self._fit()
        if n < self.scaling_config.min_workers:
            now = time.monotonic()
            if now - self.warned_at > WARN_EVERY_S:
                self.warned_at = now
                log.warning("elastic-gpt: live capacity fits %d worker(s), fewer than "
                            "scaling.min_workers=%d; waiting for nodes (or lower "
                            "min_workers)", n, self.scaling_config.min_workers)
            time.sleep(POLL_S)  # the controller loop calls again at once: don't spin
            return NoopDecision()
        log.info("elastic-gpt: starting %d workers (live capacity)", n)
        return ResizeDecision(num_workers=n,
                              resources_per_worker=resources_per_worker(self.scaling_config))

    def _release_group_that_lost_a_node(self) -> None:
        """Remove the failed group's placement group once a node of it is dead. The controller
        keeps it until the next group starts, and meanwhile the GCS re-places the lost bundles
        in a busy loop (Ray 2.60: a whole core of the head node until capacity returns, which on
        a small cluster is the survivors' CPU); the group is restarted whole either way."""
        pg = self.last_group_pg
        if pg is not None and _pg_state(pg) == "RESCHEDULING":
            from ray.util import remove_placement_group
            log.info("elastic-gpt: the failed group lost a node; releasing its placement group")
            best_effort(remove_placement_group, pg)
            self.last_group_pg, self.last_group_nodes = None, {}

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._maybe_send_resource_request()
        nodes = collections.Counter(w.metadata.node_id for w in worker_group_state.workers)
        self.last_group_nodes = dict(nodes)
        self.last_group_pg = worker_group_state.placement_group_handle.placement_group
        current = worker_group_state.num_workers
        if current >= self.scaling_config.max_workers:
            return NoopDecision()
        now = time.monotonic()
        fit = self._fit()
        if fit > current:
            if self.more_room_since is None:
                self.more_room_since = now
            if now - self.more_room_since >= RESIZE_STABLE_S and not self.records.get("resize"):
                log.info("elastic-gpt: capacity for %d workers (running %d): asking the "
                         "workers to checkpoint and restart", fit, current)
                self.records.put("resize", {"target": fit, "at": time.time()})
        else:
            self.more_room_since = None
        return NoopDecision()


def group_size(per_node: dict[str, int], max_workers: int, tp: int = 1, hsdp: str = "auto") -> int:
    """Workers a group gets from the workers that fit on each node now: whole tensor-parallel
    groups per node (a group never spans nodes), at most max_workers (a multiple of tp). Under
    hsdp=on, whole replicas too: the same number of workers on every node used, the most
    workers any such choice gives. (Which node a worker lands on is Ray's placement: a node
    left with a part of a group makes the Trainer stop with one line, parallel/mesh.py.)"""
    usable = sorted((n // tp * tp for n in per_node.values()), reverse=True)
    if hsdp != "on":
        return min(sum(usable), max_workers // tp * tp)
    best = 0
    for nodes, per in enumerate(usable, 1):  # the `nodes` fullest nodes, `per` workers each
        if per:
            best = max(best, min(nodes, max_workers // per) * per)
    return best


class ElasticFailurePolicy(FailurePolicy):
    """Planned restarts are free; unfixable errors stop at once; the rest is charged to a
    sliding one-hour window instead of Ray's never-resetting counter.

    `clock` is the monotonic clock the window is measured with (tests pass their own)."""

    def __init__(self, failure_config, records: RunRecords, max_failures_per_hour: float,
                 clock=time.monotonic):
        super().__init__(failure_config)
        self.records = records
        self.max_failures_per_hour = max_failures_per_hour
        self.clock = clock
        self.window: collections.deque[float] = collections.deque()  # times of recent failures

    def make_decision(self, training_failed_error):
        causes = list(getattr(training_failed_error, "worker_failures", {}).values())
        if causes and all(isinstance(c, ElasticRestart) for c in causes):
            log.info("elastic-gpt: %s", causes[0])
            return FailureDecision.RETRY
        fatal = [c for c in causes if isinstance(c, FatalTrainingError)]
        if fatal:
            log.error("elastic-gpt: unrecoverable error, stopping: %s", fatal[0])
            return FailureDecision.RAISE
        now = self.clock()
        self.window.append(now)
        while self.window and now - self.window[0] > FAILURE_WINDOW_S:
            self.window.popleft()
        if len(self.window) > self.max_failures_per_hour:
            log.error("elastic-gpt: %d failures in the last hour exceed "
                      "elastic.max_failures_per_hour=%s; stopping", len(self.window),
                      self.max_failures_per_hour)
            return FailureDecision.RAISE
        best_effort(self.records.put, "last_failure",
                    {"kind": "failure", "at": time.time(), "error": _short(training_failed_error)})
        log.warning("elastic-gpt: failure %d in the last hour (budget %s); restarting from "
                    "the newest checkpoint", len(self.window), self.max_failures_per_hour)
        return FailureDecision.RETRY


def _short(error: Exception) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return " | ".join(lines[:3])[:300]


def _pg_nodes(pg) -> dict[str, int]:
    """Bundles of placement group `pg` per node they are placed on now ({} if unknown)."""
    try:
        from ray.util.placement_group import placement_group_table
        placed = placement_group_table(pg).get("bundles_to_node_id") or {}
    except Exception:
        return {}
    return dict(collections.Counter(n for n in placed.values() if n))


def _pg_state(pg) -> str:
    """CREATED, RESCHEDULING (a node of it died), REMOVED, ... ("REMOVED" if unknown)."""
    try:
        from ray.util.placement_group import placement_group_table
        return placement_group_table(pg).get("state") or "REMOVED"
    except Exception:
        return "REMOVED"


def _pg_removed(pg) -> bool:
    return _pg_state(pg) == "REMOVED"

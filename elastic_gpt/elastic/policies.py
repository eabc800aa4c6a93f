"""The two Ray Train controller policies of an elastic run.

`LiveCapacityScalingPolicy` decides how many workers a new group gets and on which nodes (and
when a running group should grow); `ElasticFailurePolicy` decides whether a failed attempt is
retried. Both run inside Ray Train's controller actor, which unpickles them by reference to this
module, and both reach the workers through the run's `RunRecords` in the GCS (the resize request,
the failure record, a placement the layout could not use).

Their base classes live in Ray's private modules; `ray_internals` hands them out, so importing this
module loads Ray Train. Only the trainer's controller hook (controller.py) and tests import it.
"""

from __future__ import annotations

import collections
import copy
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
    node_id_label,
    pending_launches,
    resources_per_worker,
)
from elastic_gpt.elastic.resize_rule import decide_grow
from elastic_gpt.errors import ElasticRestart, FatalTrainingError, PlacementError

log = logging.getLogger(__name__)

WARN_EVERY_S = 30.0  # how often "capacity below min_workers" is repeated while waiting
FAILURE_WINDOW_S = 3600.0  # the budget counts failures over the last hour


class LiveCapacityScalingPolicy(ScalingPolicy):
    """Sizes and places each new group from live GCS state instead of the autoscaling
    coordinator's reserved view, which still counts dead nodes (the 60 s placement-group wait
    Ray's default hits): whole tensor-parallel groups per node, each worker pinned to its node
    (`group_plan`; `tp` and `hsdp` are parallel.*). Grows a running group as soon as there is
    more room, unless the autoscaler reports more launches coming (then it gathers them, for at
    most `grow_settle_s`: `gather_arrivals`), and only when the larger group repays its restart
    before the next membership change expected (elastic/resize_rule.py; `node_mtbf_h` is its
    prior)."""

    def __init__(self, scaling_config, records: RunRecords, tp: int = 1, hsdp: str = "auto",
                 grow_settle_s: float = 0.0, node_mtbf_h: float = math.inf, pp: int = 1):
        super().__init__(scaling_config)
        self.records = records
        self.tp, self.hsdp, self.pp = tp, hsdp, pp
        self.grow_settle_s, self.node_mtbf_h = grow_settle_s, node_mtbf_h
        # The run's own ScalingConfig in the controller, whose per-worker label selectors Ray
        # Train places each new group with (after_controller_start).
        self.placed_config = None
        self.placement_cap: int | None = None  # after a bad placement: at most this many workers
        # The running group as last seen (workers per node, its placement group): see _plan.
        self.last_group_nodes: dict[str, int] = {}
        self.last_group_pg = None
        self.more_room_since: float | None = None  # when live capacity first exceeded the group
        self.gathering: int | None = None  # launches reported coming when last said (logged once)
        self.waiting_for: int | None = None  # a grow the rule said does not pay (logged once)
        self.warned_at = -math.inf  # last "fewer than min_workers" warning

    def after_controller_start(self, train_run_context):
        super().after_controller_start(train_run_context)
        self.placed_config = train_run_context.scaling_config
        if self.placed_config is self.scaling_config:
            # Our resource requests to the autoscaler must not carry one group's node pins.
            self.scaling_config = copy.copy(self.scaling_config)

    def _get_num_workers_for_resource_request(self) -> int:
        return self.scaling_config.max_workers  # ask the autoscaler for the full size

    def _plan(self) -> dict[str, int]:
        # Until the controller removes the old group's placement group, its bundles still hold
        # resources on the surviving nodes: count them as ours, or a group that lost a node would
        # see no room for its own replacement.
        # Where its bundles are now, not where its workers were: Ray re-places the bundles of a
        # dead node elsewhere, onto the very capacity a replacement node brings.
        held = {}
        if self.last_group_pg is not None and not _pg_removed(self.last_group_pg):
            held = _pg_nodes(self.last_group_pg) or self.last_group_nodes
        per_node = live_capacity(resources_per_worker(self.scaling_config), held)
        most = self.scaling_config.max_workers
        if self.placement_cap is not None:
            most = min(most, self.placement_cap)
        return group_plan(per_node, most, self.tp, self.hsdp, self.pp)

    def _place(self, plan: dict[str, int]) -> None:
        """Pin each worker of the next group to its node in `plan` where the layout needs whole
        groups per node (tensor parallelism, hsdp=on). Ray Train's default PACK placement is
        best effort over identical bundles: given nodes with room 3 and 2 for 4 workers it puts
        3 on one node, splitting a tensor-parallel group of 2. Elsewhere any split serves, and
        PACK is left to place the group:
        pins taken from a view of free room that other groups share (replica groups start side
        by side) can name the same node for two groups, and one then waits out the start
        timeout where PACK would have put it on the other node."""
        if self.placed_config is not None and (self.tp > 1 or self.hsdp == "on"):
            label = node_id_label()
            self.placed_config.label_selector = [
                {label: node} for node, workers in plan.items() for _ in range(workers)]

    def make_decision_for_non_running_worker_group(self):
        self._maybe_send_resource_request()
        self.records.delete("resize")
        self._release_group_that_lost_a_node()
        self._take_placement_cap()
        plan = self._plan()
        n = sum(plan.values())
        if n < self.scaling_config.min_workers:
            now = time.monotonic()
            if now - self.warned_at > WARN_EVERY_S:
                self.warned_at = now
                log.warning("elastic-gpt: live capacity fits %d worker(s), fewer than "
                            "scaling.min_workers=%d; waiting for nodes (or lower "
                            "min_workers)", n, self.scaling_config.min_workers)
            time.sleep(POLL_S)  # the controller loop calls again at once: don't spin
            return NoopDecision()
        self._place(plan)
        log.info("elastic-gpt: starting %d workers (live capacity; per node %s)", n,
                 sorted(plan.values(), reverse=True))
        # When this group was sized: the start of its placement in the attempt's breakdown.
        best_effort(self.records.put, "group_start", {"at": time.time(), "workers": n})
        return ResizeDecision(num_workers=n,
                              resources_per_worker=resources_per_worker(self.scaling_config))

    def _take_placement_cap(self) -> None:
        """After a placement the layout could not use (the failure policy's record), ask for no
        more than its nodes held in whole tensor-parallel groups (at least min_workers)."""
        record = best_effort(self.records.get, "placement")
        if record:
            best_effort(self.records.delete, "placement")
            self.placement_cap = max(int(record["aligned_workers"]),
                                     self.scaling_config.min_workers)

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
        self.placement_cap = None  # the group runs: its placement held
        current = worker_group_state.num_workers
        if current >= self.scaling_config.max_workers:
            return NoopDecision()
        now = time.monotonic()
        plan = self._plan()
        fit = sum(plan.values())
        if fit <= current:
            self.more_room_since, self.waiting_for, self.gathering = None, None, None
            return NoopDecision()
        if self.more_room_since is None:
            self.more_room_since = now
        if self.records.get("resize"):
            return NoopDecision()
        coming = 0 if fit >= self.scaling_config.max_workers else \
            best_effort(pending_launches) or 0
        if gather_arrivals(coming, now - self.more_room_since, self.grow_settle_s):
            if self.gathering != coming:
                self.gathering = coming
                log.info("elastic-gpt: capacity for %d workers (running %d), and the autoscaler "
                         "reports %d launch(es) coming: gathering them for at most %g s", fit,
                         current, coming, self.grow_settle_s)
            return NoopDecision()
        progress = best_effort(self.records.get, "progress") or {}
        decision = decide_grow(ledger=progress.get("ledger") or {}, current=current, target=fit,
                               node_mtbf_s=self.node_mtbf_h * 3600.0, nodes=len(plan))
        if not decision.grow:
            if self.waiting_for != fit:
                self.waiting_for = fit
                log.warning("elastic-gpt: not growing yet: %s", decision.detail)
            return NoopDecision()
        log.info("elastic-gpt: %s; asking the workers to checkpoint and restart", decision.detail)
        self.records.put("resize", {"target": fit, "at": time.time(), "why": decision.detail})
        return NoopDecision()


def gather_arrivals(coming: int, waited_s: float, most_s: float) -> bool:
    """Whether a grow waits for more nodes: the autoscaler reports `coming` launches in flight
    (a cloud's batch of instances registers with Ray over tens of seconds, and each arrival
    would otherwise cost its own restart), for at most `most_s` since more room first appeared.
    With none coming it grows at once: a single returning node waits for nothing."""
    return coming > 0 and waited_s < most_s


def group_plan(per_node: dict[str, int], max_workers: int, tp: int = 1,
               hsdp: str = "auto", pp: int = 1) -> dict[str, int]:
    """Workers per node for a new group, from the workers that fit on each node now: whole
    tensor-parallel groups per node (a group never spans nodes), the nodes with the most room
    first (as few nodes as can hold it, as Ray's PACK would), at most max_workers, in whole
    pipelines of pp x tp (the stages of a pipeline may span nodes). Under hsdp=on, whole
    replicas too: the same number of workers on every node used, the most workers any such
    choice gives. Nodes that get no worker are left out."""
    unit = pp * tp
    room = sorted(((n // tp * tp, node) for node, n in per_node.items()),
                  key=lambda r: (-r[0], r[1]))
    if hsdp != "on":
        plan, left = {}, max_workers // unit * unit
        for usable, node in room:
            if min(usable, left) > 0:
                plan[node] = min(usable, left)
                left -= plan[node]
        # Whole pipelines: what does not make one comes off the emptiest nodes used.
        extra = sum(plan.values()) % unit
        for node in reversed(list(plan)):
            cut = min(extra, plan[node])
            plan[node] -= cut
            extra -= cut
        return {node: n for node, n in plan.items() if n}
    best: dict[str, int] = {}
    for nodes, (per, _) in enumerate(room, 1):  # the `nodes` fullest nodes, `per` workers each
        used = min(nodes, max_workers // per) if per else 0
        while used and used * per % unit:
            used -= 1
        if used * per > sum(best.values()):
            best = {node: per for _, node in room[:used]}
    return best


class ElasticFailurePolicy(FailurePolicy):
    """Planned restarts and placements the layout could not use are free; unfixable errors stop
    at once; the rest is charged to a sliding one-hour window instead of Ray's never-resetting
    counter.

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
        placement = [c for c in causes if isinstance(c, PlacementError)]
        if placement and all(isinstance(c, (PlacementError, ElasticRestart)) for c in causes):
            # Where Ray put the workers, not a fault of the run: retried for free, no larger
            # than the nodes held in whole tensor-parallel groups (the scaling policy reads it).
            error = placement[0]
            log.warning("elastic-gpt: %s; restarting with whole tensor-parallel groups per "
                        "node", error)
            best_effort(self.records.put, "placement",
                        {"aligned_workers": error.aligned_workers, "per_node": error.per_node,
                         "at": time.time()})
            best_effort(self.records.put, "last_restart",
                        {"kind": "placement", "reason": f"placement: {_short(error)}",
                         "at": time.time()})
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

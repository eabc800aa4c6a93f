"""Cluster membership as an elastic run sees it, read live from the GCS and never cached:

* `RunRecords`: the run's records in the GCS key-value store (rank 0's progress, the controller's
  resize request, why the previous attempt ended), shared by the workers and the controller.
* `live_capacity`: how many workers fit per node now (the scaling policy sizes groups with it).
* `WorkerMembership`: rank 0's background watcher that turns a drain or a resize request into a
  planned restart at the next step boundary.

Ray is reached only through `ray_internals`, and importing this module imports no Ray. It knows
nothing about Ray Train's controller (policies.py) or the training loop.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time

from elastic_gpt.elastic import ray_internals

log = logging.getLogger(__name__)

KV_NAMESPACE = "elastic_gpt"
POLL_S = 0.25
STOP_RECORDS = ("last_restart", "last_failure")
"""`RunRecords`' records of why an attempt ended (read from outside the run by elastic/slurm.py)."""
PLACEMENT_GROUP = "placement_group"
"""`RunRecords`' record of a replica group's current placement group."""


def best_effort(fn, *args):
    """`fn(*args)`, or None if the GCS call failed: a GCS blip must not kill training."""
    try:
        return fn(*args)
    except Exception as e:
        log.debug("GCS KV %s failed: %s", getattr(fn, "__name__", fn), e)
        return None


class RunRecords:
    """One run's JSON records in the GCS key-value store, under `<run_key>/<what>`:

    progress         rank 0's newest step, world size and ledger (the next attempt counts lost
                     work)
    resize           the controller's request to restart at another size
    last_restart     why the previous attempt ended, if it was a planned restart
    last_failure     the same for a failure
    group_start      when the scaling policy sized the newest group (its attempt's start-up
                     breakdown)
    placement_group  a replica group's placement group, published by its rank 0: the driver
                     removes it when it stops the group's run for a fallback (replica_group_driver.py)
    """

    def __init__(self, run_key: str):
        self.run_key = run_key

    def _key(self, what: str) -> bytes:
        return f"{self.run_key}/{what}".encode()

    def put(self, what: str, value: dict) -> None:
        ray_internals.kv_put(self._key(what), json.dumps(value).encode(), KV_NAMESPACE)

    def get(self, what: str) -> dict | None:
        raw = ray_internals.kv_get(self._key(what), KV_NAMESPACE)
        return json.loads(raw) if raw else None

    def delete(self, what: str) -> None:
        ray_internals.kv_del(self._key(what), KV_NAMESPACE)

    def consume_cause(self) -> dict | None:
        """Why the previous attempt ended (a planned restart or a failure), read once."""
        found = []
        for what, kind in (("last_restart", None), ("last_failure", "failure")):
            rec = best_effort(self.get, what)
            if rec:
                found.append({"kind": kind or rec.get("kind"), **rec} if kind else rec)
                best_effort(self.delete, what)
        return max(found, key=lambda r: r.get("at", 0)) if found else None


# ---- live cluster state --------------------------------------------------------------------------

def live_capacity(resources_per_worker: dict[str, float], held: dict[str, int] | None = None,
                  exclude: set[str] = frozenset()) -> dict[str, int]:
    """Workers that fit per node now: alive, not draining, free resources plus what our own
    current group holds there (`held`: node id -> workers). Read from the GCS, never cached.

    Nodes that hosted our group are also probed directly: right after a node is lost, its
    workers' errors reach the controller before the GCS's health checks declare it dead, and a
    group sized with it would wait out the placement timeout."""
    draining = set(ray_internals.draining_nodes())
    totals = ray_internals.total_resources_per_node()  # alive nodes only
    available = ray_internals.available_resources_per_node()
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
    if not node_ids:
        return set()
    lost = set()
    for node, raylet in ray_internals.alive_nodes().items():
        if node not in node_ids:
            continue
        try:
            with socket.create_connection((raylet.host, raylet.port), timeout=timeout_s):
                pass
        except OSError:
            lost.add(node)
    return lost


# ---- worker side ---------------------------------------------------------------------------------

class WorkerMembership:
    """Rank 0's link to the cluster. A background thread polls the GCS (two reads per poll, off
    the training thread): is a node hosting one of our ranks draining, or has the controller asked
    for a resize? It also publishes this attempt's progress, which the next attempt reads to count
    the work a failure cost (goodput ledger)."""

    def __init__(self, run_key: str, rank_nodes: list[str], world_size: int,
                 poll_s: float = POLL_S):
        self.records = RunRecords(run_key)
        self.rank_nodes, self.world_size = rank_nodes, world_size
        self.reason: str | None = None
        self.previous = best_effort(self.records.get, "progress")  # the attempt before this one
        self._progress: dict | None = None
        self._published: dict | None = None
        self._avg_step_s = 0.0
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._thread.start()

    @functools.cached_property
    def cause(self) -> dict | None:
        """Why the previous attempt ended, consumed when the Trainer first asks (after its
        layout was found placeable: a retried placement leaves it to the attempt that runs)."""
        return self.records.consume_cause()

    def publish(self, step: int, step_time_s: float | None, ledger: dict) -> None:
        """This attempt's progress after `step` (None: restored, no step taken yet: published
        at once, so an attempt that dies before its first step hands on what it restored, and
        the steps lost before it are not counted again)."""
        a = 0.2  # moving average of the step time: the cost of a step that must be re-done
        if step_time_s is None:
            self._avg_step_s = self._avg_step_s or (self.previous or {}).get("avg_step_s", 0.0)
        else:
            self._avg_step_s = step_time_s if not self._avg_step_s else \
                (1 - a) * self._avg_step_s + a * step_time_s
        self._progress = {"step": step, "world_size": self.world_size, "at": time.time(),
                          "avg_step_s": self._avg_step_s, "ledger": ledger}
        if step_time_s is None:
            self._flush()

    def record_restart(self, reason: str, step: int) -> None:
        kind = reason.split(":", 1)[0] if reason.startswith(("preemption", "resize")) else "resize"
        self._flush()
        best_effort(self.records.put, "last_restart",
                    {"kind": kind, "reason": reason, "step": step, "at": time.time()})

    def drain_node(self, node_id: str, reason: str) -> None:
        """A node found faulty (health/recovery.py): drained as a preemption is, so this group
        checkpoints and restarts without it (the poll below sees the drain) and the autoscaler
        replaces it."""
        from elastic_gpt.elastic.preemption import drain_node

        if not best_effort(drain_node, node_id, None, "preemption", f"elastic-gpt: {reason}"):
            log.warning("could not drain node %s (%s)", node_id, reason)

    def _flush(self) -> None:
        if self._progress is not None and self._progress is not self._published:
            best_effort(self.records.put, "progress", self._progress)
            self._published = self._progress

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._flush()
            if self.reason:
                continue
            try:
                draining = ray_internals.draining_nodes()
                ours = sorted({n for n in self.rank_nodes if n in draining})
                if ours:
                    deadline = draining[ours[0]]
                    self.reason = (f"preemption: node {ours[0][:12]} is draining"
                                   + (f" (deadline in {deadline / 1000 - time.time():.0f}s)"
                                      if deadline else ""))
                    continue
                req = self.records.get("resize")
                if req and req.get("target") and req["target"] != self.world_size:
                    # With the grow rule's figures when the policy gave them (the event's detail).
                    why = req.get("why") or f"{self.world_size} -> {req['target']} workers"
                    self.reason = f"resize: {why}"
            except Exception as e:  # a GCS blip must not kill training
                log.debug("membership poll failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._flush()

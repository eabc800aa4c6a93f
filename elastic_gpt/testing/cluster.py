"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`) and the faults the
chaos tests and the recovery benchmark inject into it: node hard-kills, node joins, worker
SIGKILLs, drains. Every process is stopped by handle or pid, never by name."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import ray

# Production clusters should set these too (`ray start --head --system-config=...`): a dead node
# is declared dead after ~1.5 s instead of Ray's default ~15-30 s.
FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


class LocalCluster:
    """Head node with no CPUs (driver, controller) plus `workers` nodes of one CPU each: one
    training worker per node, so killing a node takes exactly one rank. `log_to_driver`: the
    workers' output is printed by this process, as a user's driver prints it."""

    def __init__(self, workers: int = 2, cpus_per_node: int = 1,
                 object_store_bytes: int = 80 << 20, log_to_driver: bool = False):
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        self.cpus_per_node, self.object_store_bytes = cpus_per_node, object_store_bytes
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": object_store_bytes,
            "include_dashboard": False, "_system_config": FAST_FAILURE_DETECTION})
        self.nodes = [self.add_node(wait=False) for _ in range(workers)]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=log_to_driver)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, wait: bool = True, num_cpus: int | None = None):
        """A worker node of `num_cpus` CPUs (default: the cluster's `cpus_per_node`)."""
        node = self.cluster.add_node(
            num_cpus=self.cpus_per_node if num_cpus is None else num_cpus,
            object_store_memory=self.object_store_bytes)
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def kill_node(self, node) -> float:
        """SIGKILL every process of the node (raylet, workers): a hard loss. Returns the time."""
        t = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        if node in self.nodes:
            self.nodes.remove(node)
        return t

    def replace_node(self, node) -> None:
        """The cloud takes `node` (a drained or a lost one) and brings a fresh one in its place:
        the next test of a shared cluster starts at full size."""
        self.kill_node(node)
        self.nodes.append(self.add_node())

    def node_hosting_a_worker(self):
        """A worker node that runs a training worker (never the head)."""
        hosting = {a.node_id for a in training_workers()}
        for node in self.cluster.worker_nodes:
            if node.node_id in hosting:
                return node
        raise AssertionError("no worker node hosts a training worker")

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@dataclass(frozen=True)
class Actor:
    pid: int
    node_id: str


def training_workers() -> list[Actor]:
    """Live Ray Train workers, read from the GCS actor table (no dashboard needed)."""
    from elastic_gpt.elastic.ray_internals import live_actors

    return [Actor(pid, node_id) for pid, node_id in live_actors("RayTrainWorker")]


def process_alive(pid: int) -> bool:
    """Whether `pid` is still a live process (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


class DutyCycled:
    """A process slowed down for real: SIGSTOP for `stop_s`, SIGCONT for `run_s`, over and over
    from a thread, until `release()` or the process is gone (a straggler's host: a noisy
    neighbour, a throttled device)."""

    def __init__(self, pid: int, stop_s: float, run_s: float):
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.started = time.time()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.run_s)
        except ProcessLookupError:
            pass

    def release(self) -> None:
        self._done.set()
        self._thread.join(5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def sigkill_a_worker() -> int:
    pid = training_workers()[0].pid
    os.kill(pid, signal.SIGKILL)
    return pid


def train_in_background(cfg, fault, timeout_s: float = 600.0):
    """Run `elastic_gpt.elastic.launcher.run_training(cfg)` in a thread while `fault()` runs in
    this one (Ray starts and kills nodes only from the main thread). Returns (summary, what
    `fault` returned); a training error is raised here, in the caller's thread."""
    from elastic_gpt.elastic.launcher import run_training

    outcome: dict = {}

    def target():
        try:
            outcome["summary"] = run_training(cfg)
        except BaseException as e:  # re-raised below
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    injected = fault()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"training did not finish within {timeout_s:.0f} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["summary"], injected


def wait_for(predicate, timeout_s: float = 120.0, interval_s: float = 0.05):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"condition not met within {timeout_s}s")


def committed(store, step: int) -> bool:
    return step in store.step_dirs() and store.verify(step) is None


def progress(run_key: str) -> dict | None:
    """Rank 0's newest published progress for the run, or None (none yet, or the GCS is down)."""
    from elastic_gpt.elastic.membership import RunRecords, best_effort

    return best_effort(RunRecords(run_key).get, "progress")

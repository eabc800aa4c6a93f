"""Spot notices -> Ray drains on a real Ray cluster: an AWS or GCP notice (loopback metadata
endpoints) drains the node, which membership and live capacity then see; an endpoint that is down
is polled until it answers; SIGTERM to the watcher's command drains."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_gpt.elastic import preemption, ray_internals
from elastic_gpt.elastic.preemption import (
    AwsSpotNotices,
    GcpPreemptionNotices,
    PreemptionWatcher,
)
from elastic_gpt.testing.cluster import wait_for
from elastic_gpt.testing.metadata_server import FakeMetadata

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.close()


# ----------------------------------------------------------------- endpoint protocol, no Ray


# ----------------------------------------------------------------- real Ray cluster


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Head + worker nodes; each test adds its own worker holding a busy actor.

    A drained node exits as soon as it is idle, so a pinned actor keeps it up (as a training
    worker would) and its draining state observable until the test removes it.
    """
    tmp = Path(f"/tmp/ray_preemption_{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    old_tmp = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(tmp)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": 80 * 1024**2,
            "gcs_server_port": 36_000 + os.getpid() % 2000,
            "include_dashboard": False,
        },
    )
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if old_tmp is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old_tmp


@pytest.fixture
def busy_worker(ray_cluster):
    """A fresh worker node with an actor pinned to it; yields its node id."""
    import ray

    tag = f"spot_{secrets.token_hex(4)}"
    node = ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2,
                                resources={tag: 1})

    @ray.remote(num_cpus=0, resources={tag: 1})
    class Busy:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    actor = Busy.remote()
    assert ray.get(actor.node.remote(), timeout=60) == node.node_id
    yield node.node_id
    ray.kill(actor)
    if node in ray_cluster.worker_nodes:
        ray_cluster.remove_node(node, allow_graceful=False)


def run_in_thread(watcher: PreemptionWatcher) -> threading.Thread:
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    return thread


def test_aws_notice_drains_node(ray_cluster, busy_worker, metadata):
    address = ray_cluster.address
    watcher = PreemptionWatcher(AwsSpotNotices(metadata.url), busy_worker, address, poll_s=0.2)
    thread = run_in_thread(watcher)
    try:
        # No notice: several polls, no drain.
        assert wait_for(lambda: metadata.instance_action_gets >= 5, timeout_s=10)
        assert not preemption.is_draining(busy_worker, address)
        assert busy_worker in preemption.schedulable_nodes(address)

        deadline_ms = metadata.notice_in(90)
        assert wait_for(lambda: preemption.is_draining(busy_worker, address), timeout_s=10)
        assert ray_internals.draining_nodes(address)[busy_worker] == deadline_ms
        assert busy_worker not in preemption.schedulable_nodes(address)
        assert busy_worker in ray_internals.alive_nodes(address)
        assert metadata.rejected == 0, "every GET carried a valid IMDSv2 token"
        # Further polls see the same notice but do not re-drain a node already draining.
        gets = metadata.instance_action_gets
        assert wait_for(lambda: metadata.instance_action_gets >= gets + 3, timeout_s=10)
        assert watcher.drained is not None and watcher.drained.deadline_ms == deadline_ms
        assert thread.is_alive()
    finally:
        watcher.stop_event.set()
        thread.join(timeout=10)


def test_the_watchers_drain_is_what_membership_and_capacity_see(ray_cluster, busy_worker):
    """One reading of drains for both sides: the worker's watcher and the scaling policy's
    capacity see the drain the preemption watcher made."""
    from elastic_gpt.elastic.membership import WorkerMembership, live_capacity

    assert busy_worker in live_capacity({"CPU": 1})
    membership = WorkerMembership(f"drain-test-{busy_worker[:8]}", [busy_worker], 1, poll_s=0.05)
    try:
        time.sleep(0.3)
        assert membership.reason is None
        assert preemption.drain_node(busy_worker, 60, message="test")
        assert wait_for(lambda: membership.reason is not None, timeout_s=10)
        assert membership.reason.startswith(f"preemption: node {busy_worker[:12]} is draining")
        assert busy_worker not in live_capacity({"CPU": 1})
    finally:
        membership.close()


def test_gcp_notice_drains_node(ray_cluster, busy_worker, metadata):
    address = ray_cluster.address
    watcher = PreemptionWatcher(GcpPreemptionNotices(metadata.url), busy_worker, address,
                                poll_s=0.2)
    thread = run_in_thread(watcher)
    try:
        time.sleep(1.0)
        assert not preemption.is_draining(busy_worker, address)
        metadata.gcp_preempted = True
        t0 = time.time() * 1000
        assert wait_for(lambda: preemption.is_draining(busy_worker, address), timeout_s=10)
        deadline = ray_internals.draining_nodes(address)[busy_worker]
        assert t0 + 20_000 < deadline < t0 + 35_000
    finally:
        watcher.stop_event.set()
        thread.join(timeout=10)


def test_endpoint_down_keeps_polling_then_drains(ray_cluster, busy_worker, caplog):
    """Metadata service refuses connections: warn, keep polling, drain once it answers."""
    address = ray_cluster.address
    probe = FakeMetadata()
    port = probe.server.server_address[1]
    probe.close()  # the port now refuses connections
    watcher = PreemptionWatcher(AwsSpotNotices(f"http://127.0.0.1:{port}", timeout_s=0.5),
                                busy_worker, address, poll_s=0.1)
    caplog.set_level(logging.WARNING, logger="elastic_gpt.elastic.preemption")
    thread = run_in_thread(watcher)
    revived = None
    try:
        assert wait_for(lambda: watcher.failures >= 5, timeout_s=15)
        assert thread.is_alive()
        assert not preemption.is_draining(busy_worker, address)
        assert any("metadata unreadable" in r.getMessage() for r in caplog.records)

        revived = FakeMetadata(port=port)
        revived.notice_in(60)
        assert wait_for(lambda: preemption.is_draining(busy_worker, address), timeout_s=15)
        assert watcher.failures == 0
    finally:
        watcher.stop_event.set()
        thread.join(timeout=10)
        if revived is not None:
            revived.close()


def test_sigterm_to_cli_watcher_drains(ray_cluster, busy_worker, metadata):
    """The CLI as the cluster yaml runs it; SIGTERM drains with the grace deadline and exits 0."""
    address = ray_cluster.address
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_gpt.elastic.preemption", "--provider", "auto",
         "--address", address, "--metadata-url", metadata.url, "--poll-s", "0.2",
         "--node-id", busy_worker, "--sigterm-deadline-s", "40"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )
    try:
        # Started, provider detected (the fake answers GCP's probe), polling, no drain.
        assert wait_for(lambda: metadata.preempted_gets >= 5 or proc.poll() is not None,
                        timeout_s=30)
        assert proc.poll() is None, proc.stdout.read()
        assert not preemption.is_draining(busy_worker, address)
        t0 = time.time() * 1000
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "watching gcp preemption notices" in out
        assert "SIGTERM" in out
        deadline = ray_internals.draining_nodes(address)[busy_worker]
        assert t0 + 30_000 < deadline < t0 + 45_000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()



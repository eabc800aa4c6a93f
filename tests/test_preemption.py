"""Spot notices -> Ray drains, against metadata endpoints served on loopback and a real Ray cluster.

The fake endpoints behave like the real ones where it matters: AWS IMDSv2 rejects GETs without a
valid, unexpired token (401) and answers 404 while no interruption is scheduled; GCP rejects
requests without ``Metadata-Flavor: Google`` (403) and answers TRUE/FALSE.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl

import pytest

from elastic_gpt.elastic import preemption, ray_internals
from elastic_gpt.elastic.preemption import (
    AwsSpotNotices,
    GcpPreemptionNotices,
    MetadataUnavailable,
    PreemptionWatcher,
)

REPO = Path(__file__).resolve().parents[1]


class FakeMetadata:
    """AWS IMDSv2 + GCP metadata routes on one loopback HTTP server."""

    def __init__(self, port: int = 0):
        self.aws_notice: dict | None = None
        self.gcp_preempted = False
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.token_puts = 0
        self.rejected = 0  # GETs refused for a missing/invalid token or header
        self.instance_action_gets = 0
        self.preempted_gets = 0
        self.long_polls = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _reply(self, status: int, body: str = "", etag: str | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                if self.path.startswith("/computeMetadata"):
                    self.send_header("Metadata-Flavor", "Google")
                if etag:
                    self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if self.path != "/latest/api/token":
                    return self._reply(404)
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if ttl is None or not 1 <= int(ttl) <= 21600:
                    return self._reply(400, "missing or bad TTL header")
                token = secrets.token_hex(16)
                fake.tokens[token] = time.monotonic() + int(ttl)
                fake.token_puts += 1
                self._reply(200, token)

            def do_GET(self):
                if self.path.startswith("/latest/"):
                    token = self.headers.get("X-aws-ec2-metadata-token")
                    if token not in fake.tokens or fake.tokens[token] < time.monotonic():
                        fake.rejected += 1
                        return self._reply(401)
                    if self.path == "/latest/meta-data/spot/instance-action":
                        fake.instance_action_gets += 1
                        if fake.aws_notice is None:
                            return self._reply(404, "Not Found")
                        return self._reply(200, json.dumps(fake.aws_notice))
                    return self._reply(404)
                if self.path.startswith("/computeMetadata/v1/"):
                    if self.headers.get("Metadata-Flavor") != "Google":
                        fake.rejected += 1
                        return self._reply(403, "Missing Metadata-Flavor:Google header.")
                    path, _, query = self.path.partition("?")
                    if path == "/computeMetadata/v1/instance/preempted":
                        fake.preempted_gets += 1
                        params = dict(parse_qsl(query))
                        if params.get("wait_for_change") == "true":
                            # Hold the request while the ETag still equals last_etag.
                            fake.long_polls += 1
                            until = time.monotonic() + float(params.get("timeout_sec", 60))
                            while (params.get("last_etag") == fake.gcp_etag()
                                   and time.monotonic() < until):
                                time.sleep(0.02)
                        value = "TRUE" if fake.gcp_preempted else "FALSE"
                        return self._reply(200, value, etag=fake.gcp_etag())
                    if path == "/computeMetadata/v1/instance/id":
                        return self._reply(200, "1234567890")
                return self._reply(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def gcp_etag(self) -> str:
        return "etag-true" if self.gcp_preempted else "etag-false"

    def notice_in(self, seconds: float, action: str = "terminate") -> int:
        when = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=seconds)
        self.aws_notice = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
        return int(when.timestamp() * 1000)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.close()


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


# ----------------------------------------------------------------- endpoint protocol, no Ray


def test_fake_imds_enforces_token(metadata):
    status, _, _ = preemption._http(f"{metadata.url}/latest/meta-data/spot/instance-action")
    assert status == 401 and metadata.rejected == 1
    status, _, _ = preemption._http(f"{metadata.url}/computeMetadata/v1/instance/preempted")
    assert status == 403 and metadata.rejected == 2


def test_aws_notices_follow_imdsv2(metadata):
    aws = AwsSpotNotices(metadata.url)
    assert aws.poll() is None  # 404: nothing scheduled
    assert aws.poll() is None
    assert metadata.token_puts == 1, "the token is reused until it nears expiry"
    deadline_ms = metadata.notice_in(120, action="stop")
    notice = aws.poll()
    assert notice is not None and notice.source == "aws" and "stop" in notice.message
    assert notice.deadline_ms == deadline_ms
    assert metadata.rejected == 0

    # IMDS restarted (all tokens forgotten): one 401, a fresh token, and the notice still read.
    metadata.tokens.clear()
    assert aws.poll() is not None
    assert metadata.token_puts == 2 and metadata.rejected == 1

    # Unreadable time falls back to AWS's two-minute warning instead of failing.
    metadata.aws_notice = {"action": "terminate", "time": "soon"}
    notice = aws.poll()
    assert abs(notice.deadline_ms - (time.time() * 1000 + 120_000)) < 5_000


def test_gcp_notices(metadata):
    gcp = GcpPreemptionNotices(metadata.url)
    assert gcp.poll() is None
    metadata.gcp_preempted = True
    notice = gcp.poll()
    assert notice is not None and notice.source == "gcp"
    assert 25_000 < notice.deadline_ms - time.time() * 1000 <= 30_000
    assert metadata.rejected == 0


def test_gcp_long_poll_sees_existing_and_new_notices(metadata):
    # A notice already there when the watcher starts is not missed by waiting for a change.
    metadata.gcp_preempted = True
    assert GcpPreemptionNotices(metadata.url, wait_for_change=True, wait_timeout_s=10).poll()

    metadata.gcp_preempted = False
    gcp = GcpPreemptionNotices(metadata.url, wait_for_change=True, wait_timeout_s=10)
    assert gcp.poll() is None  # plain GET: learns the ETag
    result = {}

    def long_poll():
        t0 = time.monotonic()
        result["notice"] = gcp.poll()
        result["elapsed"] = time.monotonic() - t0

    waiter = threading.Thread(target=long_poll)
    waiter.start()
    assert wait_for(lambda: metadata.long_polls == 1, timeout_s=5)
    time.sleep(0.5)
    assert waiter.is_alive(), "the request is held until the value changes"
    metadata.gcp_preempted = True
    waiter.join(timeout=5)
    assert result["notice"] is not None and result["elapsed"] < 3


def test_provider_none_only_listens_for_sigterm():
    source = preemption.make_notice_source("none")
    assert source.poll() is None
    with pytest.raises(ValueError, match="provider='azure'"):
        preemption.make_notice_source("azure")


def test_endpoint_down_or_wrong_is_unavailable_not_a_crash(metadata):
    with pytest.raises(MetadataUnavailable, match="returned HTTP 404"):
        GcpPreemptionNotices(metadata.url + "/nothing-here").poll()
    dead_port = FakeMetadata()
    dead_url = dead_port.url
    dead_port.close()
    with pytest.raises(MetadataUnavailable):
        AwsSpotNotices(dead_url, timeout_s=0.5).poll()
    with pytest.raises(MetadataUnavailable):
        GcpPreemptionNotices(dead_url, timeout_s=0.5).poll()


def test_auto_detects_provider(metadata):
    assert preemption.detect_provider(aws_url=metadata.url, gcp_url=metadata.url) == "gcp"
    # An endpoint with only the AWS routes is AWS.
    aws_only = FakeMetadata()
    try:
        assert preemption.detect_provider(aws_url=aws_only.url, gcp_url=aws_only.url + "/x") \
            == "aws"
    finally:
        aws_only.close()
    with pytest.raises(ValueError, match="--provider aws\\|gcp"):
        preemption.detect_provider(aws_url=metadata.url + "/x", gcp_url=metadata.url + "/x")


def test_bad_node_id_and_reason_are_value_errors():
    with pytest.raises(ValueError, match="node_id='nope'"):
        preemption.drain_node("nope", 30)
    with pytest.raises(ValueError, match="reason='bored'"):
        preemption.drain_node("ab" * 28, 30, reason="bored")


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_cli_rejects_bad_arguments():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "elastic_gpt.elastic.preemption", "--provider", "aws", "--node-id", "xyz"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
    )
    assert out.returncode == 2
    assert "node_id='xyz' is not a Ray node id" in out.stderr

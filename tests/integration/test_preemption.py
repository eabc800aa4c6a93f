"""Spot notices read from metadata endpoints served on loopback (testing/metadata_server.py): AWS
IMDSv2 with its token, GCP with its header and long polls, an endpoint down or wrong reported as
unavailable, the provider detected, and the watcher's bad arguments refused."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_gpt.elastic import preemption
from elastic_gpt.elastic.preemption import (
    AwsSpotNotices,
    GcpPreemptionNotices,
    MetadataUnavailable,
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


# ----------------------------------------------------------------- real Ray cluster


def test_cli_rejects_bad_arguments():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "elastic_gpt.elastic.preemption", "--provider", "aws", "--node-id", "xyz"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
    )
    assert out.returncode == 2
    assert "node_id='xyz' is not a Ray node id" in out.stderr

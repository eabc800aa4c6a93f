"""Spot/preemptible notices -> Ray node drains.

Nothing in Ray turns a cloud's "this VM goes away in N seconds" notice into a node drain, yet a
drain is what Ray Train (``ray.train.get_preemption_info``) and our elastic controller react to.
This module closes that gap. One watcher runs on every worker node (ray-cluster.yaml starts it):

    python -m elastic_gpt.elastic.preemption --provider aws --address HEAD_IP:6379

It polls the instance metadata service every few seconds and, on a notice, asks the GCS to drain
this node with reason PREEMPTION and the cloud's deadline. A SIGTERM to the watcher is a notice
too (Kubernetes and systemd deliver node shutdown that way): it drains, then exits.

- AWS: IMDSv2. PUT /latest/api/token (TTL header) first, then
  GET /latest/meta-data/spot/instance-action with the token. 404 = no notice;
  200 {"action": "terminate"|"stop"|"hibernate", "time": "2026-01-01T12:00:00Z"} = notice
  (AWS gives about two minutes).
- GCP: GET /computeMetadata/v1/instance/preempted with ``Metadata-Flavor: Google``;
  "TRUE" = notice (GCP gives about 30 s), "FALSE" = none. Optionally a long poll
  (``?wait_for_change=true``) so the notice arrives without waiting out a poll period.
- none: SIGTERM only, for Kubernetes pods (deploy/kuberay runs the watcher as a sidecar).

``drain_node``, ``is_draining`` and ``schedulable_nodes`` read and write live GCS state, never a
cached view, through ``ray_internals`` (the same ``draining_nodes`` the workers' membership
watcher polls). This module imports no Ray itself, so the watcher starts fast on every node.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from elastic_gpt.console import setup_logging
from elastic_gpt.elastic import ray_internals

log = logging.getLogger(__name__)

AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"
AWS_TOKEN_TTL_S = 21600  # IMDSv2 maximum (6 h); the watcher renews it before it lapses
AWS_NOTICE_LEAD_S = 120.0  # AWS's documented warning time, used when "time" is unreadable
GCP_NOTICE_LEAD_S = 30.0  # GCP's documented warning time for preemptible/spot VMs
SIGTERM_DEADLINE_S = 25.0  # Kubernetes' and GKE's usual grace period is 25-30 s


class MetadataUnavailable(RuntimeError):
    """The metadata endpoint could not be read (down, refused, 5xx, unexpected reply)."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice: why this node goes away and when (unix ms)."""

    source: str  # "aws", "gcp" or "sigterm"
    message: str
    deadline_ms: int


def _now_ms() -> int:
    return int(time.time() * 1000)


def _http(
    url: str, method: str = "GET", headers: dict | None = None, timeout_s: float = 2.0
) -> tuple[int, bytes, dict]:
    """One HTTP exchange; returns (status, body, headers) for any HTTP status, raises
    MetadataUnavailable on network errors.

    The proxy handler is disabled: metadata services are link-local and must never be sent
    through an HTTP(S)_PROXY a user has set for S3 or PyPI.
    """
    request = urllib.request.Request(
        url, method=method, headers=headers or {}, data=b"" if method == "PUT" else None
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers or {})
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise MetadataUnavailable(f"{method} {url}: {reason}") from e


class NoticeSource(Protocol):
    provider: str

    def poll(self) -> Notice | None:
        """Return a Notice if this instance is being preempted, None if not.

        Raises MetadataUnavailable when the endpoint cannot say either way.
        """


class AwsSpotNotices:
    """EC2 spot interruption notices through IMDSv2 (token first, then the instance-action)."""

    provider = "aws"

    def __init__(
        self,
        base_url: str = AWS_METADATA_URL,
        token_ttl_s: int = AWS_TOKEN_TTL_S,
        timeout_s: float = 2.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.token_ttl_s = token_ttl_s
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_expires = 0.0

    def _get_token(self, refresh: bool = False) -> str:
        # Renew at 80% of the TTL so a token never lapses between two polls.
        if refresh or self._token is None or time.monotonic() >= self._token_expires:
            status, body, _ = _http(
                f"{self.base_url}/latest/api/token",
                method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
                timeout_s=self.timeout_s,
            )
            if status != 200 or not body:
                raise MetadataUnavailable(f"IMDSv2 token request returned HTTP {status}")
            self._token = body.decode().strip()
            self._token_expires = time.monotonic() + 0.8 * self.token_ttl_s
        return self._token

    def poll(self) -> Notice | None:
        url = f"{self.base_url}/latest/meta-data/spot/instance-action"
        status, body, _ = _http(
            url, headers={"X-aws-ec2-metadata-token": self._get_token()}, timeout_s=self.timeout_s
        )
        if status == 401:  # token expired or IMDS restarted: fetch a new one once
            status, body, _ = _http(
                url,
                headers={"X-aws-ec2-metadata-token": self._get_token(refresh=True)},
                timeout_s=self.timeout_s,
            )
        if status == 404:
            return None  # the documented "no interruption scheduled" answer
        if status != 200:
            raise MetadataUnavailable(f"GET {url} returned HTTP {status}")
        try:
            payload = json.loads(body)
            action = payload["action"]
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataUnavailable(f"GET {url}: unreadable instance-action {body!r}") from e
        deadline_ms = _parse_aws_time(payload.get("time"))
        return Notice("aws", f"AWS spot instance-action {action} at {payload.get('time')}",
                      deadline_ms)


def _parse_aws_time(value: object) -> int:
    """AWS writes e.g. "2026-01-01T12:00:00Z"; fall back to the documented two minutes."""
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            raise ValueError("no timezone")
        return int(parsed.timestamp() * 1000)
    except ValueError:
        log.warning("unreadable AWS notice time %r; assuming %.0f s", value, AWS_NOTICE_LEAD_S)
        return _now_ms() + int(AWS_NOTICE_LEAD_S * 1000)


class GcpPreemptionNotices:
    """GCE preemptible/spot notices from the metadata server's instance/preempted flag."""

    provider = "gcp"

    def __init__(
        self,
        base_url: str = GCP_METADATA_URL,
        wait_for_change: bool = False,
        wait_timeout_s: int = 30,
        timeout_s: float = 2.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.wait_for_change = wait_for_change
        self.wait_timeout_s = wait_timeout_s
        self.timeout_s = timeout_s
        self._etag: str | None = None

    def poll(self) -> Notice | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        timeout_s = self.timeout_s
        if self.wait_for_change and self._etag is not None:
            # The server holds the request until the value's ETag differs from last_etag (at
            # once if it already does), or timeout_sec passes. Without an ETag a long poll would
            # wait for the *next* change and miss a notice that is already TRUE, so the first
            # poll of a streak is a plain GET.
            url += (f"?wait_for_change=true&timeout_sec={self.wait_timeout_s}"
                    f"&last_etag={self._etag}")
            timeout_s += self.wait_timeout_s
        try:
            status, body, headers = _http(url, headers={"Metadata-Flavor": "Google"},
                                          timeout_s=timeout_s)
        except MetadataUnavailable:
            self._etag = None
            raise
        if status != 200:
            self._etag = None
            raise MetadataUnavailable(f"GET {url} returned HTTP {status}")
        self._etag = {k.lower(): v for k, v in headers.items()}.get("etag")
        value = body.decode(errors="replace").strip().upper()
        if value == "FALSE":
            return None
        if value == "TRUE":
            return Notice("gcp", "GCP instance preempted",
                          _now_ms() + int(GCP_NOTICE_LEAD_S * 1000))
        raise MetadataUnavailable(f"GET {url}: unexpected value {value!r}")


def detect_provider(aws_url: str = AWS_METADATA_URL, gcp_url: str = GCP_METADATA_URL) -> str:
    """'gcp' or 'aws', from which metadata service answers like itself; ValueError if neither."""
    try:
        status, _, _ = _http(f"{gcp_url.rstrip('/')}/computeMetadata/v1/instance/id",
                          headers={"Metadata-Flavor": "Google"}, timeout_s=1.0)
        if status == 200:
            return "gcp"
    except MetadataUnavailable:
        pass
    try:
        status, _, _ = _http(f"{aws_url.rstrip('/')}/latest/api/token", method="PUT",
                          headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout_s=1.0)
        if status == 200:
            return "aws"
    except MetadataUnavailable:
        pass
    raise ValueError(
        "--provider auto: neither the GCP nor the AWS metadata service answered; "
        "pass --provider aws|gcp (and --metadata-url if it lives elsewhere)"
    )


class NoNotices:
    """SIGTERM only: for Kubernetes pods, where the kubelet's SIGTERM is the notice and the
    cloud metadata service may be hidden from pods."""

    provider = "none"

    def poll(self) -> Notice | None:
        return None


def make_notice_source(provider: str, metadata_url: str | None = None,
                       gcp_wait_for_change: bool = False) -> NoticeSource:
    if provider == "auto":
        provider = detect_provider(metadata_url or AWS_METADATA_URL,
                                   metadata_url or GCP_METADATA_URL)
    if provider == "aws":
        return AwsSpotNotices(metadata_url or AWS_METADATA_URL)
    if provider == "gcp":
        return GcpPreemptionNotices(metadata_url or GCP_METADATA_URL,
                                    wait_for_change=gcp_wait_for_change)
    if provider == "none":
        return NoNotices()
    raise ValueError(f"provider={provider!r} is not supported; use aws, gcp, auto or none")


# --------------------------------------------------------------------------- Ray GCS side


def _check_node_id(node_id: str) -> None:
    try:
        ok = len(bytes.fromhex(node_id)) == 28
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise ValueError(
            f"node_id={node_id!r} is not a Ray node id; pass the 56-hex-digit id from "
            "ray.get_runtime_context().get_node_id() or `ray list nodes`"
        )


def drain_node(
    node_id: str,
    deadline_s: float | None,
    reason: str = "preemption",
    message: str = "",
    address: str | None = None,
    deadline_ms: int | None = None,
) -> bool:
    """Ask the GCS to drain ``node_id``; the node will be gone ``deadline_s`` from now.

    ``deadline_ms`` (absolute unix ms) wins over ``deadline_s``; neither means no deadline.
    Draining stops new work from landing on the node and makes Ray Train report preemption.
    PREEMPTION drains cannot be rejected by the raylet; the return value says whether the GCS
    accepted the request. A second drain of the same node updates its deadline.
    """
    _check_node_id(node_id)
    if reason not in ray_internals.DRAIN_REASONS:
        raise ValueError(f"reason={reason!r} is not a drain reason; use one of "
                         f"{list(ray_internals.DRAIN_REASONS)}")
    if deadline_ms is None:
        deadline_ms = 0 if deadline_s is None else _now_ms() + int(deadline_s * 1000)
    accepted, rejection = ray_internals.drain_node(node_id, reason, message, deadline_ms, address)
    if not accepted:
        log.warning("drain of node %s rejected: %s", node_id, rejection)
    return accepted


def is_draining(node_id: str, address: str | None = None) -> bool:
    return node_id in ray_internals.draining_nodes(address)


def schedulable_nodes(address: str | None = None) -> set[str]:
    """Alive and not draining: the nodes a resized worker group may be placed on."""
    return set(ray_internals.alive_nodes(address)) - set(ray_internals.draining_nodes(address))


def local_node_id(address: str | None = None) -> str:
    """This machine's Ray node id, matched by IP (one raylet per VM, as the cluster yamls run)."""
    ip = ray_internals.node_ip_address()
    matches = [nid for nid, raylet in ray_internals.alive_nodes(address).items()
               if raylet.host == ip]
    if len(matches) != 1:
        raise ValueError(
            f"found {len(matches)} alive Ray nodes with IP {ip}; pass --node-id "
            "(ray.get_runtime_context().get_node_id() on that node)"
        )
    return matches[0]


# --------------------------------------------------------------------------- the watch loop


class PreemptionWatcher:
    """Polls a NoticeSource and drains the node on the first notice.

    Network trouble never kills the watcher: an unreadable endpoint is logged (first failure of
    a streak, then once a minute) and polled again. After a drain it keeps polling and drains
    again only if the GCS no longer lists the node as draining (e.g. the GCS restarted).
    """

    def __init__(
        self,
        source: NoticeSource,
        node_id: str | None = None,
        address: str | None = None,
        poll_s: float = 5.0,
        sigterm_deadline_s: float = SIGTERM_DEADLINE_S,
    ):
        self.source = source
        self.address = address
        self.poll_s = poll_s
        self.sigterm_deadline_s = sigterm_deadline_s
        self._node_id = node_id
        self.stop_event = threading.Event()
        self.drained: Notice | None = None
        self.failures = 0  # consecutive metadata failures

    @property
    def node_id(self) -> str:
        # Resolved lazily: the watcher may start before this node's raylet has registered.
        if self._node_id is None:
            self._node_id = local_node_id(self.address)
        return self._node_id

    def drain(self, notice: Notice) -> bool:
        accepted = drain_node(
            self.node_id, None, "preemption", notice.message, self.address,
            deadline_ms=notice.deadline_ms,
        )
        if accepted:
            self.drained = notice
            log.warning(
                "drained node %s: %s (deadline in %.0f s)", self.node_id, notice.message,
                (notice.deadline_ms - _now_ms()) / 1000,
            )
        return accepted

    def check_once(self) -> Notice | None:
        try:
            notice = self.source.poll()
        except MetadataUnavailable as e:
            self.failures += 1
            if self.failures == 1 or self.failures % max(1, int(60 / self.poll_s)) == 0:
                log.warning("%s metadata unreadable (%d in a row), still polling: %s",
                            self.source.provider, self.failures, e)
            return None
        if self.failures:
            log.info("%s metadata readable again after %d failures",
                     self.source.provider, self.failures)
            self.failures = 0
        if notice is None:
            return None
        try:
            # After a drain, drain again only if the node is alive but no longer listed as
            # draining (a restarted GCS forgets drains); a dead node needs nothing more.
            if self.drained is None or self.node_id in schedulable_nodes(self.address):
                self.drain(notice)
        except Exception as e:  # GCS briefly unreachable: the next poll retries
            log.warning("drain of node %s failed, will retry: %s", self._node_id, e)
        return notice

    def run(self) -> None:
        log.info("watching %s preemption notices every %.1f s for node %s",
                 self.source.provider, self.poll_s, self._node_id or "(this machine)")
        while not self.stop_event.is_set():
            self.check_once()
            self.stop_event.wait(self.poll_s)

    def on_sigterm(self) -> None:
        """The machine is shutting down: drain with the grace period as deadline."""
        self.stop_event.set()
        deadline_ms = _now_ms() + int(self.sigterm_deadline_s * 1000)
        if self.drained is not None:  # never push an announced cloud deadline later
            deadline_ms = min(deadline_ms, self.drained.deadline_ms)
        notice = Notice("sigterm", "watcher received SIGTERM (node shutting down)", deadline_ms)
        try:
            self.drain(notice)
        except Exception as e:
            log.error("SIGTERM drain of node %s failed: %s", self._node_id, e)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_gpt.elastic.preemption",
        description="Turn cloud spot/preemption notices (and SIGTERM) into Ray node drains.",
    )
    parser.add_argument("--provider", choices=["aws", "gcp", "auto", "none"], default="auto",
                        help="none = SIGTERM only (Kubernetes pods)")
    parser.add_argument("--address", default=None,
                        help="Ray GCS address HOST:PORT (default: RAY_ADDRESS or the local head)")
    parser.add_argument("--metadata-url", default=None,
                        help="metadata service base URL (default: the provider's own)")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between polls")
    parser.add_argument("--node-id", default=None,
                        help="Ray node id to drain (default: the alive node with this host's IP)")
    parser.add_argument("--sigterm-deadline-s", type=float, default=SIGTERM_DEADLINE_S,
                        help="drain deadline announced when the watcher gets SIGTERM")
    parser.add_argument("--gcp-wait-for-change", action="store_true",
                        help="GCP: long-poll instance/preempted instead of plain polling")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level.upper(), stream=sys.stdout, timestamps=True)
    try:
        if args.node_id is not None:
            _check_node_id(args.node_id)
        source = make_notice_source(args.provider, args.metadata_url, args.gcp_wait_for_change)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    watcher = PreemptionWatcher(source, args.node_id, args.address, args.poll_s,
                                args.sigterm_deadline_s)
    signal.signal(signal.SIGTERM, lambda *_: watcher.on_sigterm())
    try:
        watcher.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    # `python -m` runs this file as __main__; run the imported module instead, so the watcher's
    # log lines carry the module's own name like every other elastic_gpt logger.
    from elastic_gpt.elastic.preemption import main as _main
    sys.exit(_main())

"""Cloud instance-metadata endpoints on one loopback HTTP server, for the spot-notice tests: they
behave like the real ones where it matters. AWS IMDSv2 rejects GETs without a valid, unexpired
token (401) and answers 404 while no interruption is scheduled; GCP rejects requests without
``Metadata-Flavor: Google`` (403) and answers TRUE/FALSE, with ETag long polls."""

from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl


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

"""A real S3-protocol server on loopback (moto) for the tests and benchmarks, plus fsspec options
for it (the tests' `s3` fixture is in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter

BUCKET = "corpus"


class S3Server:
    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log per request

        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._requests: Counter = Counter()
        self._count_lock = threading.Lock()
        wsgi = self._server._server
        app = wsgi.app

        def counted(environ, start_response):  # every request the server answers, by method
            with self._count_lock:
                self._requests[environ["REQUEST_METHOD"]] += 1
            return app(environ, start_response)

        wsgi.app = counted

    def requests(self) -> Counter:
        """Requests served since the last reset, by HTTP method (GET, HEAD, PUT, ...)."""
        with self._count_lock:
            return Counter(self._requests)

    def reset_requests(self) -> None:
        with self._count_lock:
            self._requests.clear()

    def storage_options(self, key: str = "testing", secret: str = "testing") -> dict:
        return {"key": key, "secret": secret, "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    def make_bucket(self, name: str = BUCKET) -> str:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=name)
        return name

    @contextlib.contextmanager
    def enforce_credentials(self):
        """Make the server check credentials: every key it does not know is refused (403)."""
        from moto import settings

        old = settings.INITIAL_NO_AUTH_ACTION_COUNT
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        try:
            yield
        finally:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = old

    def stop(self):
        self._server.stop()

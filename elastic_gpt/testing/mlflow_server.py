"""A real `mlflow server` on loopback for the tracking tests: sqlite backend, artifacts proxied
through the server (`--artifacts-destination`), so clients upload over HTTP as they would to a
shared server. Stopped by process id, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from elastic_gpt.testing.ports import free_port


class MlflowServer:
    def __init__(self, root: str, port: int | None = None, start_timeout_s: float = 60.0):
        self.root = os.path.abspath(root)
        self.db = os.path.join(self.root, "mlflow.db")
        self.artifacts = os.path.join(self.root, "artifacts")
        os.makedirs(self.artifacts, exist_ok=True)
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        mlflow_bin = os.path.join(os.path.dirname(sys.executable), "mlflow")
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log_path = os.path.join(self.root, "server.log")
        self._log = open(self.log_path, "w")
        # Own process group: the gunicorn/uvicorn workers go with it when we stop it.
        self.proc = subprocess.Popen(
            [mlflow_bin, "server", "--backend-store-uri", f"sqlite:///{self.db}",
             "--artifacts-destination", self.artifacts, "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_healthy(start_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}):\n"
                                   + open(self.log_path).read()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server on {self.uri} not healthy after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group we created at start
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

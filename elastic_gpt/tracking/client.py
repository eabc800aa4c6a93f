"""Talking to the MLflow tracking store without letting it stall the driver: a quick reachability
check, bounded HTTP retries, and the client. Every caller in this package goes through here.

Knows nothing of runs, metrics or the model; errors leave it as short, redacted lines.
"""

from __future__ import annotations

import contextlib
import os
import time

from elastic_gpt.console import first_line
from elastic_gpt.tracking.redaction import redact


def is_remote(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https", "databricks")


def check_local_store(uri: str) -> None:
    """A sqlite store's folder must exist: MLflow would create any missing folders, so a typo in
    tracking.uri would quietly start a second store somewhere else."""
    if not uri.lower().startswith("sqlite:///"):
        return
    db = uri[len("sqlite:///"):]
    folder = os.path.dirname(db) or "."
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"tracking.uri={redact(uri)}: the folder {folder} {what}; create it, fix "
                         "the path, or set tracking.enabled=false")
    if os.path.isdir(db):
        raise ValueError(f"tracking.uri={redact(uri)} names a folder; name a database file in it, "
                         f"e.g. sqlite:///{os.path.join(db, 'mlflow.db')}")


def server_reachable(uri: str, attempts: int = 3, timeout_s: float = 3.0) -> str | None:
    """None if an http(s) tracking server answers (any HTTP status counts), else why not.
    Bounded: `attempts` x `timeout_s` plus 1 s between attempts."""
    if not uri.lower().startswith(("http://", "https://")):
        return None
    import requests
    why = "no answer"
    for i in range(attempts):
        try:
            requests.get(uri.rstrip("/") + "/health", timeout=(timeout_s, timeout_s))
            return None
        except requests.RequestException as e:
            why = first_line(e)
        if i + 1 < attempts:
            time.sleep(1.0)
    return redact(why)


@contextlib.contextmanager
def bounded_http(max_retries: int = 2, timeout_s: int = 15):
    """MLflow's own HTTP defaults retry for ~4 minutes (7 retries, 120 s timeout); on the driver
    we would rather degrade quickly. User-set values win."""
    values = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max_retries),
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)}
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def mlflow_client(uri: str):
    import mlflow
    return mlflow.MlflowClient(tracking_uri=uri)


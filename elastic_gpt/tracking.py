"""MLflow: one run per experiment across restarts (C5), metrics logged off the training thread.

The driver resolves the run (reusing the id stored beside the checkpoints); rank 0 of the worker
group logs step metrics through a background thread so a slow tracking server never stalls a step.
"""

from __future__ import annotations

import logging
import os
import platform
import queue
import re
import subprocess
import threading
import time

log = logging.getLogger(__name__)

_SECRET_QUERY = re.compile(r"(?i)([?&](?:[^=&]*(?:token|secret|key|password|signature|credential)"
                           r"[^=&]*)=)[^&]+")
_SECRET_USERINFO = re.compile(r"(://[^/:@]+):[^/@]+@")
_SECRET_ENV = re.compile(r"(?i)(secret|password|token|credential|access_key|private_key)")


def redact(value: str) -> str:
    """Strip credentials from a URL-ish string: user:password@ and ?token=... parts."""
    value = _SECRET_USERINFO.sub(r"\1:***@", str(value))
    return _SECRET_QUERY.sub(r"\1***", value)


def redacted_params(flat: dict) -> dict:
    return {k: ("***" if _SECRET_ENV.search(k) else redact(v) if isinstance(v, str) else v)
            for k, v in flat.items()}


def _client(uri: str):
    import mlflow
    return mlflow.MlflowClient(tracking_uri=uri)


def resolve_run(uri: str, experiment: str, run_name: str, existing_run_id: str | None,
                params: dict, tags: dict | None = None) -> str:
    """Return the MLflow run id to log to: the stored one if it still exists, else a new run."""
    client = _client(uri)
    if existing_run_id:
        try:
            run = client.get_run(existing_run_id)
            if run.info.status != "RUNNING":
                client.update_run(existing_run_id, status="RUNNING")
            return existing_run_id
        except Exception as e:  # deleted, or another store: start a fresh run rather than fail
            log.warning("MLflow run %s not found in %s (%s); starting a new run",
                        existing_run_id, redact(uri), type(e).__name__)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run = client.create_run(exp_id, run_name=run_name, tags={**environment_tags(), **(tags or {})})
    log_params(client, run.info.run_id, params)
    return run.info.run_id


def log_params(client, run_id: str, params: dict) -> None:
    from mlflow.entities import Param
    items = [Param(k, str(v)[:6000]) for k, v in redacted_params(params).items()]
    for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        client.log_batch(run_id, params=items[i:i + 100])


def environment_tags() -> dict:
    import ray
    import torch
    tags = {"ray_version": ray.__version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "host": platform.node()}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
        if commit.returncode == 0:
            tags["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return tags


class MetricLogger:
    """Queue step metrics; a daemon thread ships them in batches. Failures only warn (training
    must not die because the tracking server blinked) and are retried with the next batch."""

    def __init__(self, uri: str, run_id: str, flush_every_s: float = 2.0):
        self.uri, self.run_id, self.flush_every_s = uri, run_id, flush_every_s
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            self._q.put((k, float(v), ts, step))

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        from mlflow.entities import Metric
        client, pending, warned = None, [], False
        while True:
            stopping = self._stop.wait(self.flush_every_s)
            while True:
                try:
                    pending.append(self._q.get_nowait())
                except queue.Empty:
                    break
            if pending:
                try:
                    client = client or _client(self.uri)
                    for i in range(0, len(pending), 1000):
                        client.log_batch(self.run_id, metrics=[Metric(*m) for m in
                                                               pending[i:i + 1000]])
                    pending, warned = [], False
                except Exception as e:
                    if not warned:
                        log.warning("MLflow logging to %s failed (%s); will retry",
                                    redact(self.uri), e)
                        warned = True
                    pending = pending[-100_000:]  # bounded memory while the server is away
            if stopping:
                return


def finish_run(uri: str, run_id: str, config_path: str | None = None, finished: bool = True) -> None:
    """Attach the config and a loss-curve plot, and close the run (FINISHED, or KILLED if the run
    stopped short of max_steps and will be resumed)."""
    import tempfile

    client = _client(uri)
    with tempfile.TemporaryDirectory() as tmp:
        if config_path and os.path.isfile(config_path):
            client.log_artifact(run_id, config_path, artifact_path="config")
        png = os.path.join(tmp, "loss_curve.png")
        if plot_loss_curve(client, run_id, png):
            client.log_artifact(run_id, png, artifact_path="plots")
    client.set_terminated(run_id, status="FINISHED" if finished else "KILLED")


def plot_loss_curve(client, run_id: str, path: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = client.get_metric_history(run_id, "loss")
    if not history:
        return False
    latest_per_step = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    steps = sorted(latest_per_step)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [latest_per_step[s] for s in steps], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"run {run_id[:8]}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

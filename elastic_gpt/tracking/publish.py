"""The end of a submission: what a user looks for in the run, then the run closed (`finish_run`).
The config (redacted), goodput metrics, the checkpointed membership events plus this submission's
end, and a loss-curve plot; the final model through a callable the driver passes.

Must not import model or checkpoint code: the driver hands over the ledger it read from the
newest checkpoint, and the model logging lives in `elastic_gpt.inference.mlflow_model`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable

from elastic_gpt.console import first_line
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.client import bounded_http, mlflow_client, server_reachable
from elastic_gpt.tracking.events import log_events_with
from elastic_gpt.tracking.redaction import redact, redact_obj
from elastic_gpt.tracking.runs import FAILURE_TAG, job_info

log = logging.getLogger(__name__)


def goodput_metrics(ledger: dict) -> dict[str, float]:
    """The goodput metrics (`metric_names.goodput(...)`) from a ledger: the GoodputLedger dict or
    summary (productive_s, lost_s, checkpoint_s, recovery_s, eval_s, lost_steps, goodput) or the
    older training_s form."""
    seconds = {k: float(v) for k, v in ledger.items()
               if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = {mn.goodput(k): v for k, v in seconds.items()}
    if isinstance(ledger.get("lost_steps"), (int, float)):
        out[mn.GOODPUT_LOST_STEPS] = float(ledger["lost_steps"])
    events = ledger.get("events")
    if isinstance(events, (int, float)):
        out[mn.GOODPUT_EVENTS] = float(events)
    elif isinstance(events, list):
        out[mn.GOODPUT_EVENTS] = float(len(events))
    # degraded_s is a part of productive_s (replica groups), not a share of its own.
    wall = sum(v for k, v in seconds.items() if k != "degraded_s")
    useful = seconds.get("productive_s", seconds.get("training_s", 0.0))
    out[mn.GOODPUT_WALL_S] = wall
    out[mn.GOODPUT] = float(ledger["goodput"]) \
        if isinstance(ledger.get("goodput"), (int, float)) else (useful / wall if wall else 1.0)
    return out


def log_goodput(uri: str, run_id: str, ledger: dict, step: int = 0) -> dict[str, float]:
    """Log the goodput split of wall time (at `step`, the optimizer steps done) and return it."""
    from mlflow.entities import Metric
    metrics = goodput_metrics(ledger)
    now = int(time.time() * 1000)
    with bounded_http():
        mlflow_client(uri).log_batch(run_id, metrics=[Metric(k, v, now, step)
                                                      for k, v in metrics.items()])
    return metrics


def finish_run(uri: str, run_id: str, config_path: str | None = None, finished: bool = True, *,
               config: dict | None = None, ledger: dict | None = None, step: int | None = None,
               log_model: Callable[[], object] | None = None) -> None:
    """Publish what a user looks for in the run, then close it (FINISHED, or KILLED if it
    stopped short of max_steps and will be resumed): the config (redacted), goodput metrics,
    events.jsonl, a loss-curve plot and, when finished, the final model (`log_model()`, e.g.
    `elastic_gpt.inference.mlflow_model.log_final_model` bound to the checkpoint). Never raises:
    each part that fails costs a warning.

    `ledger` is the GoodputLedger dict from the newest checkpoint's trainer state: the ledger
    travels in the checkpoints, so the newest one holds every attempt's events."""
    problem = server_reachable(uri)
    if problem:
        log.warning("MLflow server %s is unreachable (%s); run %s is left open without its "
                    "final artifacts", redact(uri), problem, run_id)
        return
    ledger = dict(ledger or {})
    events = list(ledger["events"]) if isinstance(ledger.get("events"), list) else []
    with bounded_http():
        client = mlflow_client(uri)
        parts = [
            ("config", lambda: _log_config(client, run_id, config_path, config)),
            ("goodput", lambda: ledger and log_goodput(uri, run_id, ledger, step or 0)),
            ("events", lambda: log_events_with(client, run_id, [*events, {
                "kind": "submission_end", "at": time.time(), "step": step,
                "finished": finished, **job_info()}])),
            ("loss curve", lambda: _log_loss_curve(client, run_id)),
        ]
        if finished and log_model is not None:
            parts.append(("final model", log_model))
        for name, part in parts:
            try:
                part()
            except Exception as e:
                log.warning("MLflow: could not log the %s of run %s (%s: %s)", name, run_id,
                            type(e).__name__, redact(_describe(e)))
        try:
            client.set_terminated(run_id, status="FINISHED" if finished else "KILLED")
        except Exception as e:
            log.warning("MLflow: could not close run %s (%s)", run_id, redact(first_line(e)))


def close_failed_run(uri: str, run_id: str, reason: str, status: str = "FAILED") -> None:
    """Close a run that stopped on an error (FAILED) or an interrupt (KILLED), with the one-line
    reason as a tag, so no run stays RUNNING after its driver is gone. The next submission that
    passes preflight reopens it (C5 one MLflow run). Never raises: tracking never hides the real
    error."""
    if server_reachable(uri, attempts=1):
        return
    try:
        with bounded_http():
            client = mlflow_client(uri)
            client.set_tag(run_id, FAILURE_TAG, redact(reason)[:5000])
            log_events_with(client, run_id, [{"kind": "submission_end", "at": time.time(),
                                              "status": status, "reason": redact(reason)[:300],
                                              **job_info()}])
            client.set_terminated(run_id, status=status)
    except Exception as e:
        log.warning("MLflow: could not mark run %s %s (%s)", run_id, status, redact(first_line(e)))


def _log_config(client, run_id: str, config_path: str | None, config: dict | None) -> None:
    import yaml
    with tempfile.TemporaryDirectory() as tmp:
        if config_path and os.path.isfile(config_path):
            out = os.path.join(tmp, os.path.basename(config_path))
            with open(config_path) as src, open(out, "w") as dst:
                dst.write(redact(src.read()))
            client.log_artifact(run_id, out, artifact_path="config")
        if config:
            out = os.path.join(tmp, "resolved.yaml")
            with open(out, "w") as f:
                yaml.safe_dump(redact_obj(config), f, sort_keys=False)
            client.log_artifact(run_id, out, artifact_path="config")


def _log_loss_curve(client, run_id: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        png = os.path.join(tmp, "loss_curve.png")
        if plot_loss_curve(client, run_id, png):
            client.log_artifact(run_id, png, artifact_path="plots")


def metric_series(client, run_id: str, name: str) -> dict[int, float]:
    """step -> the last value logged for it (a step re-done after a failure is logged twice).
    For a run resumed across the metric rename, the old-named series is joined in, moved to the
    new step numbering; where both exist the new name wins."""
    out: dict[int, float] = {}
    old = mn.OLD_NAMES.get(name)
    if old:
        for m in sorted(client.get_metric_history(run_id, old), key=lambda m: m.timestamp):
            out[m.step + mn.OLD_STEP_OFFSET] = m.value
    for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.timestamp):
        out[m.step] = m.value
    return out


def plot_loss_curve(client, run_id: str, path: str) -> bool:
    """Training and validation loss against the optimizer steps done, titled by the run name."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = metric_series(client, run_id, mn.TRAIN_LOSS)
    if not train:
        return False
    val = metric_series(client, run_id, mn.VAL_LOSS)
    run = client.get_run(run_id)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = sorted(train)
    ax.plot(steps, [train[s] for s in steps], lw=1.2, label="train")
    if val:
        vsteps = sorted(val)
        ax.plot(vsteps, [val[s] for s in vsteps], "o-", lw=1.2, ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(redact(run.info.run_name or run_id))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _describe(e: BaseException) -> str:
    """First line of the error, plus the file it names (OSError's message often lacks it)."""
    text = first_line(e)
    filename = getattr(e, "filename", None)
    return f"{text}: {filename}" if filename and str(filename) not in text else text

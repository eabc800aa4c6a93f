"""The run's membership events (failure, preemption, resize, resume, submissions) as one
`events/events.jsonl` artifact that every submission appends to: merged, deduplicated, by time.

Both ends of a submission write here (run resolution logs `submission`, publishing logs the
checkpointed events and `submission_end`). Knows nothing of Ray or the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

from elastic_gpt.tracking.client import bounded_http, mlflow_client
from elastic_gpt.tracking.redaction import redact_obj

EVENTS_ARTIFACT = "events/events.jsonl"


def log_events(uri: str, run_id: str, events: list[dict]) -> None:
    """Append membership events (failure, preemption, resize, resume, submissions) to the run's
    events.jsonl artifact: merged with what earlier submissions logged, deduplicated, by time."""
    with bounded_http():
        log_events_with(mlflow_client(uri), run_id, events)


def log_events_with(client, run_id: str, events: list[dict]) -> None:
    """`log_events` through a client the caller already holds (inside its `bounded_http`)."""
    if not events:
        return
    with tempfile.TemporaryDirectory() as tmp:
        merged: dict[str, dict] = {}
        try:
            if not any(f.path == EVENTS_ARTIFACT for f in
                       client.list_artifacts(run_id, os.path.dirname(EVENTS_ARTIFACT))):
                raise FileNotFoundError(EVENTS_ARTIFACT)
            with _no_progress_bars():
                old = client.download_artifacts(run_id, EVENTS_ARTIFACT, tmp)
            with open(old) as f:
                for line in f:
                    if line.strip():
                        merged[line.strip()] = json.loads(line)
        except Exception:
            pass  # the first events of this run
        for e in events:
            e = redact_obj({"at": e.get("at", time.time()), **e})
            merged[json.dumps(e, sort_keys=True)] = e
        path = os.path.join(tmp, "out", os.path.basename(EVENTS_ARTIFACT))
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            for line, _ in sorted(merged.items(), key=lambda kv: kv[1].get("at") or 0):
                f.write(line + "\n")
        client.log_artifact(run_id, path, artifact_path=os.path.dirname(EVENTS_ARTIFACT))


@contextlib.contextmanager
def _no_progress_bars():
    old = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = old

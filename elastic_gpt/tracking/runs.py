"""One MLflow run per experiment across restarts and resubmissions (C5 one MLflow run): the driver
resolves the
run (reusing the id stored beside the checkpoints), logs the resolved config, the software
versions, the code's commit and the Ray job as params and tags, the datasets as the run's
inputs, and the cluster shape; the experiment is marked as model training for MLflow's UI.

Tracking never stops training: an unreachable server costs a warning, bounded retries and, for a
new run, this submission's tracking; a bad *local* store (sqlite path) or refused credentials are
config errors. Knows nothing of the model or of checkpoints (the stored run id is passed in).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import time

from elastic_gpt.console import first_line
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.client import bounded_http, is_remote, mlflow_client, server_reachable
from elastic_gpt.tracking.events import log_events_with
from elastic_gpt.tracking.redaction import redact, redacted_params

log = logging.getLogger(__name__)

FAILURE_TAG = "elastic_gpt.failure"  # why the last submission stopped; cleared when it reopens
# MLflow's experiment type (the value its UI's "experiment type" selector writes for "Machine
# learning"); without it an MLflow 3 experiment reads as GenAI and opens on traces and token usage.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# MLflow 3.17's UI takes the view from a per-browser switch (GenAI / Model training), which a
# link sets with this query; links we print carry it so they open on the runs and their charts.
TRAINING_VIEW_QUERY = "workflowType=machine_learning"


def resolve_run(uri: str, experiment: str, run_name: str, existing_run_id: str | None,
                params: dict, tags: dict | None = None,
                resumed_from_step: int | None = None, added_params: dict | None = None,
                datasets: list[dict] | None = None) -> str | None:
    """Return the MLflow run id to log to: the stored one if it still exists, else a new run
    with `params` plus the environment. Logs a `submission` event either way.

    `added_params` are also logged to a reused run that lacks them (values that runs created by
    older code did not record; an existing param is never changed). `datasets` (see
    `log_datasets`) become the run's inputs once: a run that has inputs gets no more.

    An unreachable server does not stop training: the stored id is kept (workers queue metrics
    and retry), or, for a new run, None (no tracking for this submission) with a warning. A local
    store that cannot be opened is a config error (ValueError). Anything else MLflow raises is
    retried once, then raised as `TrackingSetupError` (a fault, not the user's input)."""
    problem = server_reachable(uri)
    if problem:
        _warn_degraded(uri, problem, existing_run_id)
        return existing_run_id
    created: list[str] = []  # a run a failed attempt made is the run a retry goes on with
    attempt = 0
    while True:
        attempt += 1
        try:
            return _open_run(uri, experiment, run_name, existing_run_id, params, tags,
                             resumed_from_step, added_params, datasets, created)
        except Exception as e:
            if _is_auth_error(e):  # not transient: a retry would fail the same way
                raise ValueError(
                    f"the MLflow server at tracking.uri={redact(uri)} refused the credentials "
                    f"({redact(first_line(e))}); fix the user:password in tracking.uri or "
                    "MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN") from None
            if is_remote(uri):
                _warn_degraded(uri, first_line(e), existing_run_id)
                return existing_run_id
            if _is_store_problem(e):
                raise ValueError(f"tracking.uri={redact(uri)} cannot be used "
                                 f"({redact(first_line(e))}); fix the path, or set "
                                 "tracking.enabled=false") from None
            if attempt == SETUP_ATTEMPTS:
                # Not the store and not the user's input: a library failed. Its own error, with
                # the traceback, is what a report needs; blaming tracking.uri would mislead.
                raise TrackingSetupError(
                    f"MLflow failed {SETUP_ATTEMPTS} times while opening the run in "
                    f"{redact(uri)} ({type(e).__name__}: {redact(first_line(e))}); the store "
                    "itself answered, so this is a fault in MLflow or elastic-gpt, not in "
                    "tracking.uri") from e
            log.warning("MLflow failed while opening the run in %s (%s: %s); retrying",
                        redact(uri), type(e).__name__, redact(first_line(e)))
            time.sleep(SETUP_RETRY_S)


class TrackingSetupError(RuntimeError):
    """MLflow raised something no store problem or input of the user's explains, on every try."""


SETUP_ATTEMPTS = 2
SETUP_RETRY_S = 1.0
# What a local store's own faults raise: the database file or its folder (OSError), SQLite
# ("file is not a database", "unable to open database file", a read-only file) and MLflow's
# store checks (an out-of-date schema). "database is locked" is another process's write in
# flight: retried like any other transient error.
_STORE_ERROR_MODULES = ("sqlite3", "sqlalchemy")


def _is_store_problem(exc: BaseException) -> bool:
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        module = type(e).__module__.split(".")[0]
        if "database is locked" in str(e):
            return False
        if isinstance(e, OSError) or module in _STORE_ERROR_MODULES or \
                type(e).__name__ == "MlflowException":
            return True
        e = e.__cause__ or e.__context__
    return False


def _open_run(uri, experiment, run_name, existing_run_id, params, tags, resumed_from_step,
              added_params, datasets, created: list[str]) -> str:
    env = environment_info()
    with bounded_http():
        client = mlflow_client(uri)
        run_id = _reuse_run(client, uri, created[0] if created else existing_run_id)
        if run_id is None:
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(
                experiment, artifact_location=local_artifact_root(uri),
                tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
            run_id = client.create_run(exp_id, run_name=run_name, tags=_redacted_tags(tags)).info.run_id
            created.append(run_id)
        # A new run (or one an earlier attempt of this call made) gets every param; a reused
        # run only the added ones it lacks (an existing param is never changed).
        wanted = {**params, **(added_params or {}), **{f"env.{k}": v for k, v in env.items()}} \
            if created else (added_params or {})
        have = client.get_run(run_id).data.params
        log_params(client, run_id, {k: v for k, v in wanted.items() if k not in have})
        mark_training_experiment(client, client.get_run(run_id).info.experiment_id)
        if datasets:
            log_datasets(client, run_id, datasets)
        for k, v in {**env, **job_info(), **(tags or {})}.items():
            client.set_tag(run_id, k, redact(v)[:5000])
        log_events_with(client, run_id, [{
            "kind": "submission", "at": time.time(), "resumed_from_step": resumed_from_step,
            **job_info()}])
        return run_id


def _is_auth_error(e: Exception) -> bool:
    code = str(getattr(e, "error_code", ""))
    return code in ("UNAUTHENTICATED", "PERMISSION_DENIED") or \
        re.search(r"error code 40[13]\b", str(e)) is not None


def local_artifact_root(uri: str) -> str | None:
    """For a sqlite store, artifacts go beside the database (mlartifacts/), not into MLflow's
    default ./mlruns under whatever the current directory is (inside `ray job submit`, the job's
    throwaway copy of the working dir). None (the store's default) for servers."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri.removeprefix("sqlite:///")
    if not os.path.isabs(db):
        return None
    return "file://" + os.path.join(os.path.dirname(db), "mlartifacts")


def _reuse_run(client, uri: str, run_id: str | None) -> str | None:
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except Exception as e:
        # Deleted for good, or another store: start a fresh run rather than fail. Any other
        # error is raised (and retried): a second run for one checkpoint trajectory is worse.
        if str(getattr(e, "error_code", "")) != "RESOURCE_DOES_NOT_EXIST":
            raise
        log.warning("MLflow run %s not found in %s; starting a new run", run_id, redact(uri))
        return None
    if run.info.lifecycle_stage == "deleted":
        log.warning("MLflow run %s in %s is deleted; starting a new run", run_id, redact(uri))
        return None
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    if FAILURE_TAG in run.data.tags:
        client.delete_tag(run_id, FAILURE_TAG)
    return run_id


def _warn_degraded(uri: str, problem: str, run_id: str | None) -> None:
    if run_id:
        log.warning("MLflow server %s is unreachable (%s); training continues, and the workers "
                    "keep run %s's metrics queued and retry until it is back", redact(uri),
                    redact(problem), run_id)
    else:
        log.warning("MLflow server %s is unreachable (%s); training continues WITHOUT tracking "
                    "for this submission (a later submission with the server up starts the run)",
                    redact(uri), redact(problem))


def _redacted_tags(tags: dict | None) -> dict:
    return {k: redact(v)[:5000] for k, v in (tags or {}).items()}


def mark_training_experiment(client, experiment_id: str) -> None:
    """Tag the experiment as model training, unless it already says what it is (a user who
    chose another type in the UI keeps it)."""
    exp = client.get_experiment(experiment_id)
    if EXPERIMENT_KIND_TAG not in exp.tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)


def training_view_url(server: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI link that opens the experiment's runs (or the run's training charts)."""
    base = server.rstrip("/") + f"/#/experiments/{experiment_id}"
    if run_id:
        return f"{base}/runs/{run_id}/model-metrics?{TRAINING_VIEW_QUERY}"
    return f"{base}/runs?{TRAINING_VIEW_QUERY}"


def training_view_link(uri: str, run_id: str) -> str | None:
    """`training_view_url` of a run on an http(s) tracking server, without the URI's
    credentials; None for a local store (no UI address to give) or if the run cannot be read."""
    from urllib.parse import urlsplit, urlunsplit
    if not uri.lower().startswith(("http://", "https://")) or server_reachable(uri, attempts=1):
        return None
    try:
        with bounded_http():
            experiment_id = mlflow_client(uri).get_run(run_id).info.experiment_id
    except Exception:
        return None
    parts = urlsplit(uri)
    server = urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))
    return training_view_url(server, experiment_id, run_id)


def dataset_descriptions(manifests: list, names: list[str] | None = None) -> list[dict]:
    """What `log_datasets` needs of each prepared dataset: its URL (redacted), a name (the
    folder's, or the mixture source's), and a digest of its content: the shards' sha256 sums
    from the manifest, so the same data has the same digest wherever it is stored."""
    import hashlib
    out = []
    for i, m in enumerate(manifests):
        content = hashlib.sha256()
        for shard in m.shards:
            content.update(f"{shard.sha256}:{shard.num_samples};".encode())
        name = names[i] if names else (m.url.rstrip("/").rsplit("/", 1)[-1] or m.url)
        out.append({"url": redact(m.url), "name": name, "digest": content.hexdigest()[:16],
                    "num_samples": m.num_samples, "num_tokens": m.num_tokens,
                    "tokenizer": m.tokenizer, "seq_len": m.seq_len})
    return out


def log_datasets(client, run_id: str, datasets: list[dict]) -> bool:
    """Log the training datasets as the run's inputs (context "training"), one per mixture
    source, unless the run has inputs already (resubmissions add none). True if logged."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    if client.get_run(run_id).inputs.dataset_inputs:
        return False
    inputs = []
    for d in datasets:
        with warnings.catch_warnings():  # a file:// URL matches two equivalent source types
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(d["url"])
        entity = MetaDataset(source, name=d["name"], digest=d["digest"])._to_mlflow_entity()
        inputs.append(DatasetInput(entity, tags=[
            InputTag("mlflow.data.context", "training"),
            *(InputTag(f"elastic_gpt.{k}", str(d[k])) for k in
              ("num_samples", "num_tokens", "tokenizer", "seq_len") if k in d)]))
    client.log_inputs(run_id, datasets=inputs)
    return True


def log_params(client, run_id: str, params: dict) -> None:
    from mlflow.entities import Param
    items = [Param(k, str(v)[:6000]) for k, v in redacted_params(params).items()]
    for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        client.log_batch(run_id, params=items[i:i + 100])


def environment_info() -> dict:
    """Software the run used: Ray, torch, MLflow and Python versions, and the code's git commit."""
    import mlflow
    import ray
    import torch
    info = {"ray_version": ray.__version__, "torch_version": torch.__version__,
            "mlflow_version": mlflow.__version__, "python_version": platform.python_version(),
            "host": platform.node()}
    commit = git_commit()
    if commit:
        info["git_commit"] = commit
    if torch.cuda.is_available():
        info["cuda_version"] = str(torch.version.cuda)
    return info


def git_commit() -> str | None:
    """The code's commit: ELASTIC_GPT_GIT_COMMIT, `ray job submit --metadata-json
    '{"git_commit": ...}'`, the source checkout, or a `pip install git+...` record, in that order.
    (`ray job submit --working-dir .` uploads the code without .git.)"""
    if os.environ.get("ELASTIC_GPT_GIT_COMMIT"):
        return os.environ["ELASTIC_GPT_GIT_COMMIT"]
    if job_info().get("git_commit"):
        return job_info()["git_commit"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=here)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10, cwd=here)
            return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from importlib.metadata import distribution
        direct = json.loads(distribution("elastic-gpt").read_text("direct_url.json") or "{}")
        return direct.get("vcs_info", {}).get("commit_id")
    except Exception:
        return None


def job_info() -> dict:
    """The Ray job this driver runs as (`ray job submit`): its submission id and metadata."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    try:
        meta = json.loads(raw).get("metadata") or {}
    except ValueError:
        return {}
    out = {"ray_job_submission_id": meta.get("job_submission_id")}
    if meta.get("git_commit"):
        out["git_commit"] = meta["git_commit"]
    return {k: str(v) for k, v in out.items() if v}


def cluster_shape() -> dict:
    """Alive nodes and total CPUs/GPUs of the connected Ray cluster."""
    import ray
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = ray.cluster_resources()
    shape = {"nodes": len(nodes), "cpus": int(res.get("CPU", 0)), "gpus": int(res.get("GPU", 0))}
    kinds = sorted({k.removeprefix("accelerator_type:") for k in res
                    if k.startswith("accelerator_type:")})
    if kinds:
        shape["accelerators"] = ",".join(kinds)
    return shape


def log_cluster_shape(uri: str, run_id: str | None, step: int = 0) -> None:
    """Params `cluster.*` (the shape the run started on), tags `cluster.*` (this submission's)
    and metrics `metric_names.cluster(...)` at `step`, the step the submission starts from (a
    time series: elastic runs change shape)."""
    if not run_id or server_reachable(uri, attempts=1):
        return
    try:
        shape = cluster_shape()
        with bounded_http():
            client = mlflow_client(uri)
            have = client.get_run(run_id).data.params
            if "cluster.nodes" not in have:
                log_params(client, run_id, {f"cluster.{k}": v for k, v in shape.items()})
            for k, v in shape.items():
                client.set_tag(run_id, f"cluster.{k}", str(v))
            from mlflow.entities import Metric
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(mn.cluster(k), float(v), now, step)
                                              for k, v in shape.items()
                                              if isinstance(v, (int, float))])
    except Exception as e:
        log.warning("could not log the cluster shape to MLflow (%s)", redact(first_line(e)))

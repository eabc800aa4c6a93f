"""Driver side of `elastic-gpt train`: check inputs, connect to Ray, resolve the MLflow run,
run the Ray Train job, and publish the run's artifacts.

Everything that can be wrong with the user's input is checked here, before a worker starts or a
byte is written (C6 clear errors).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.config import Config, resolve_paths
from elastic_gpt.console import first_line, say
from elastic_gpt.elastic.worker_group_job import (
    budget_spent_line,
    fatal_cause,
    job_factory,
    run_key,
    tune_ray_train_env,
    use_gpu,
    worker_env,
)
from elastic_gpt.errors import FailureBudgetSpent, check_checkpoint_shape
from elastic_gpt.train.goodput import GoodputLedger, merge_events

log = logging.getLogger(__name__)


def preflight(cfg: Config):
    """Everything that can be wrong with the input, seen before a cluster, an MLflow run or a
    checkpoint is touched: paths, the tracking store, the dataset (its manifest and every shard's
    size: one listing, no reads), the model shape, any existing checkpoint and whether the
    checkpoint root takes a write with the current credentials."""
    from elastic_gpt.data.manifest import open_validation_manifest
    from elastic_gpt.data.mixture import open_training_data
    from elastic_gpt.tracking.client import check_local_store
    from elastic_gpt.train.model_config import model_config_for

    resolve_paths(cfg)
    if cfg.tracking.enabled:
        check_local_store(cfg.tracking.uri)
    local = cfg.data.path.removeprefix("file://")
    if cfg.data.path.startswith("file://") and os.path.isfile(local):
        raise ValueError(f"data.path {local} is a file, not a dataset folder; point it at the "
                         "folder `elastic-gpt prepare-data --output` wrote (it holds manifest.json)")
    data = open_training_data(cfg.data)
    manifest = data.manifest
    for source in data.manifests:
        check_shard_sizes(source)
    if cfg.eval.samples > 0:
        val = open_validation_manifest(cfg.eval.path, cfg.data.path, manifest)
        if val is not None:
            check_shard_sizes(val)
    gpt_cfg = model_config_for(cfg, manifest)
    if cfg.elastic.replica_groups != "off":  # C7 all-or-nothing step: groups that fit, torchft
        from elastic_gpt.elastic.replica_group_driver import group_size
        from elastic_gpt.parallel.replicate import import_torchft
        group_size(cfg)
        import_torchft()
    store = CheckpointStore(cfg.checkpoint.path)
    try:
        latest = store.latest()
        store.check_writable()
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"checkpoint.path {cfg.checkpoint.path} {_storage_problem(e)}") from None
    if latest is not None:
        check_checkpoint_shape(latest.state, gpt_cfg, latest.url)
        if latest.state.get("global_batch_size", cfg.train.global_batch_size) != \
                cfg.train.global_batch_size:
            raise ValueError(
                f"checkpoint {latest.url} was trained with train.global_batch_size="
                f"{latest.state['global_batch_size']}, this config says "
                f"{cfg.train.global_batch_size}; the global batch is fixed for a run (C1 fixed "
                "global batch): use the old value or a fresh checkpoint.path")
    return manifest, gpt_cfg, store, latest


def _storage_problem(e: Exception) -> str:
    """'cannot be used (...); fix' for a checkpoint root that refused a read or a write."""
    from elastic_gpt.errors import user_error_line
    line = first_line(e)
    if isinstance(e, (NotADirectoryError, FileExistsError)) or "Not a directory" in line:
        return f"is under a file, not a folder ({line}); choose a folder path"
    why = user_error_line(e)
    if why and ("permission" in why or "credentials" in why):
        return (f"refused access ({line}); fix the folder's permissions or the storage "
                "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the instance role, "
                "GOOGLE_APPLICATION_CREDENTIALS)")
    if isinstance(e, OSError) and not isinstance(e, (ConnectionError, TimeoutError)) and \
            "://" not in line:
        return f"cannot be written ({line}); choose a writable folder"
    return f"is unreachable ({line}); check the URL and that the storage endpoint is up"


def check_shard_sizes(manifest) -> None:
    """Every shard and index the manifest lists exists with the size it says: one listing of
    the dataset folder (a truncated shard is refused now, not retried by every worker later)."""
    import fsspec
    fs, root = fsspec.core.url_to_fs(manifest.url)
    try:
        sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"]
                 for e in fs.ls(root, detail=True)}
    except Exception as e:
        raise ValueError(f"dataset {manifest.url} cannot be listed ({first_line(e)}); check the "
                         "path and the storage credentials") from None
    for shard in manifest.shards:
        for name, want in ((shard.path, shard.num_bytes), (shard.index_path, 8 * shard.num_samples)):
            got = sizes.get(name)
            if got != want:
                state = "is missing" if got is None else f"has {got} bytes, the manifest says {want}"
                raise ValueError(f"dataset {manifest.url}: {name} {state} (truncated, replaced or "
                                 "deleted since prepare-data); re-run prepare-data into a fresh "
                                 "--output")


def connect_ray(cfg: Config) -> bool:
    """Join RAY_ADDRESS if set (a real cluster, `ray job submit`), else start a local one.
    Returns True if this process started the cluster (and should shut it down)."""
    import ray
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        try:
            _probe_ray_address(os.environ["RAY_ADDRESS"])
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        except RayTokenRefused:
            raise
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS="
                             f"{os.environ['RAY_ADDRESS']} ({first_line(e)}); start it with "
                             "`ray start --head` or unset RAY_ADDRESS for a local cluster") from None
        return False
    need = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker
    # address="local": a new cluster even where `ray start` left one in this RAY_TMPDIR (ray.init
    # would otherwise join it, and refuse num_cpus for an existing cluster).
    # The dashboard serves the state API Ray Train's PlacementGroupCleaner polls: without it the
    # cleaner cannot work and logs a failure every second. Its processes find this cluster by
    # RAY_ADDRESS (with another Ray cluster on the machine they would refuse to guess), so the
    # GCS port is chosen here and both are in the environment the cluster's processes inherit.
    gcs_port = _free_port()
    with _environ(RAY_GCS_SERVER_PORT=str(gcs_port), RAY_ADDRESS=f"127.0.0.1:{gcs_port}"):
        ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1),
                 object_store_memory=int(os.environ.get("ELASTIC_GPT_OBJECT_STORE_BYTES",
                                                        200 << 20)),
                 include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=_free_port(),
                 log_to_driver=True, runtime_env={"env_vars": worker_env()})
    return True


@contextlib.contextmanager
def _environ(**values: str):
    """Set environment variables for the processes started inside, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayTokenRefused(ValueError):
    """The cluster answers but refuses this process's token (Ray's token authentication)."""


def _probe_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """ray.init retries an unreachable GCS for many minutes, and one that refuses its token too
    (the refusal only in its C++ log): fail fast, and say which of the two it is."""
    import socket
    host, sep, port = address.split("://")[-1].rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and other forms: ray.init resolves them
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"nothing answers at {host}:{port}: {e}") from None
    from ray.exceptions import AuthenticationError

    from elastic_gpt.elastic.ray_internals import gcs_client
    try:
        gcs_client(f"{host}:{port}")
    except AuthenticationError as e:
        on = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
        fix = ("set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the token the head was started "
               "with" if on else "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
               "RAY_AUTH_TOKEN_PATH) to the token the head was started with; this process sends "
               "none without RAY_AUTH_MODE=token, even where ~/.ray/auth_token exists")
        raise RayTokenRefused(f"the Ray cluster at RAY_ADDRESS={address} refused this process's "
                              f"auth token ({first_line(e)}); {fix}") from None



def build_trainer_factory(cfg: Config, faults=None):
    """The restart path's one worker group of min..max workers: check what the trainer needs of
    Ray before an MLflow run exists, and return `make(run_id) -> ElasticTorchTrainer` for once it
    does. `faults`: a test's injected hardware faults, for the workers (`run_training`)."""
    from elastic_gpt.elastic.ray_internals import check_ray_internals

    gpu = use_gpu(cfg)
    s = cfg.scaling
    num_workers = s.min_workers if s.min_workers == s.max_workers else (s.min_workers,
                                                                         s.max_workers)
    name = f"{cfg.run.name}-{int(time.time())}"  # Ray's run state is per submission; ours isn't
    check_ray_internals()
    tune_ray_train_env(cfg)
    key = run_key(cfg)
    job = job_factory(cfg, gpu=gpu, num_workers=num_workers, key=key, name=name)

    def make(run_id: str | None):
        return job({"config": cfg.to_dict(), "mlflow_run_id": run_id, "run_key": key,
                    **({"faults": faults} if faults is not None else {})})
    return make


def _is_training_failure(error: BaseException) -> bool:
    """Ray Train gave up on the run: its failure policy (ours) said RAISE."""
    from ray.train.v2.api.exceptions import TrainingFailedError
    return isinstance(error, TrainingFailedError)


def run_training(cfg: Config, config_path: str | None = None, *, faults=None) -> dict:
    """Train `cfg` on the Ray cluster (RAY_ADDRESS, or a local one) to its end; the summary.
    `faults`: hardware faults a test injects into the workers (testing/hardware_faults.py, on
    the restart path); None in every run."""
    from elastic_gpt.inference.mlflow_model import log_final_model
    from elastic_gpt.tracking.publish import finish_run
    from elastic_gpt.tracking.redaction import install_redaction
    from elastic_gpt.tracking.runs import log_cluster_shape

    install_redaction(cfg.to_dict())  # no credential in printed lines or logs
    config_path = os.path.abspath(config_path) if config_path else None
    manifest, gpt_cfg, store, latest = preflight(cfg)
    _leave_job_working_dir()
    # Ray before MLflow: a cluster that cannot be reached must not reopen or create a run.
    started_cluster = connect_ray(cfg)
    _interrupt_on_sigterm()
    run_id = None
    try:
        if cfg.elastic.replica_groups == "off":
            trainer_ready = build_trainer_factory(cfg, faults)
        else:  # C7 all-or-nothing step: one Ray Train run per replica group (docs/replica-groups.md)
            from elastic_gpt.elastic.replica_group_driver import replica_group_factory
            trainer_ready = replica_group_factory(cfg)
        run_id = _resolve_mlflow_run(cfg, store, latest, manifest, gpt_cfg)
        say(f"[elastic-gpt] run {cfg.run.name!r}: {_n_params(gpt_cfg) / 1e6:.2f}M params, "
            f"{manifest.num_samples:,} samples of {gpt_cfg.seq_len} tokens, workers "
            f"{cfg.scaling.min_workers}..{cfg.scaling.max_workers}, checkpoints at "
            f"{cfg.checkpoint.path}" + (f", resuming from step {latest.step}" if latest else ""))
        log_cluster_shape(cfg.tracking.uri, run_id, step=latest.step if latest else 0)
        try:
            result = trainer_ready(run_id).fit()
        except Exception as e:
            cause = fatal_cause(e)
            if cause is not None:  # bad input found by a worker: one line, exit 2 (C6 clear errors)
                raise ValueError(str(cause).strip().splitlines()[-1]) from None
            if _is_training_failure(e):  # the policy stopped retrying (policies.py)
                raise FailureBudgetSpent(budget_spent_line(cfg, "the run failed", e)) from e
            raise
    except KeyboardInterrupt:
        _close_stopped_run(cfg, run_id, "interrupted (Ctrl-C or SIGINT)", "KILLED")
        raise
    except BaseException as e:
        _close_stopped_run(cfg, run_id, first_line(e), "FAILED")
        raise
    finally:
        if started_cluster:
            import ray
            ray.shutdown()
    final = store.latest()
    # The ledger travels in the checkpoints (Ray Train V2 keeps reported metrics only with
    # reported checkpoints, and we keep our own), so the newest one has every attempt's events.
    ledger = GoodputLedger.from_dict(final.state.get("ledger") if final else None)
    # Replica groups: the checkpoint's ledger is its writer's; the others' events join it (C7
    # all-or-nothing step).
    ledger.events = merge_events(ledger.events, getattr(result, "events", None) or [])
    summary = {"run_id": run_id, "step": final.step if final else 0,
               "checkpoint": final.url if final else None, "metrics": dict(result.metrics or {}),
               "goodput": ledger.summary(), "events": ledger.events}
    if run_id:
        final_model = None
        if final and cfg.tracking.log_model:
            final_model = lambda: log_final_model(cfg.tracking.uri, run_id, final.url, final.step)
        finish_run(cfg.tracking.uri, run_id, config_path=config_path,
                   finished=bool(final and final.step >= cfg.train.max_steps),
                   config=cfg.to_dict(), ledger=ledger.to_dict() if final else None,
                   step=summary["step"], log_model=final_model)
    return summary


def _leave_job_working_dir() -> None:
    """Inside `ray job submit` the driver starts in Ray's unpacked copy of the working dir, and
    Ray deletes that copy when another job sharing it (same code, same hash) ends, even while
    this driver still runs; MLflow and others then fail on os.getcwd(). Every path is absolute
    once preflight has passed, so the driver moves to the temp folder."""
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        import tempfile
        os.chdir(tempfile.gettempdir())


def _interrupt_on_sigterm() -> None:
    """`ray job stop` and schedulers stop a driver with SIGTERM: raise KeyboardInterrupt, as
    Ctrl-C does, so the run is closed KILLED on the way out instead of left RUNNING. Installed
    after ray.init, whose own handler (log and abort) it replaces."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def _close_stopped_run(cfg: Config, run_id: str | None, reason: str, status: str) -> None:
    if run_id:
        from elastic_gpt.tracking.publish import close_failed_run
        close_failed_run(cfg.tracking.uri, run_id, reason, status)


def _resolve_mlflow_run(cfg: Config, store, latest, manifest, gpt_cfg) -> str | None:
    """The run to continue (its id is stored with the checkpoints, C5 one MLflow run) or a new one,
    with the model shape and compute dtype the workers resolve and the training data as its
    inputs."""
    import torch

    from elastic_gpt.data.mixture import open_training_data
    from elastic_gpt.parallel.fsdp import resolve_dtype
    from elastic_gpt.tracking.runs import dataset_descriptions, resolve_run, training_view_link

    if not cfg.tracking.enabled:
        return None
    run_info = store.read_run_info() or {}
    existing = (latest.state.get("mlflow_run_id") if latest else None) or \
        run_info.get("mlflow_run_id")
    params = {**cfg.flat(), "model.n_params": _n_params(gpt_cfg),
              "data.num_samples": manifest.num_samples, "data.num_tokens": manifest.num_tokens}
    # The config leaves the shape to the preset and the dataset, and the dtype to the device
    # (`auto`): the values the workers build with, computed by the same functions. Also logged
    # to a run created before they were recorded.
    device = torch.device("cuda" if use_gpu(cfg) else "cpu")
    resolved = {f"model.resolved.{k}": v for k, v in gpt_cfg.shape().items()}
    resolved["train.resolved_dtype"] = str(resolve_dtype(cfg.train.dtype, device)).removeprefix(
        "torch.")
    data = open_training_data(cfg.data)
    datasets = dataset_descriptions(data.manifests,
                                    [s.name for s in data.sources] if data.is_mixture else None)
    run_id = resolve_run(cfg.tracking.uri, cfg.tracking.experiment, cfg.run.name, existing, params,
                         resumed_from_step=latest.step if latest else None,
                         added_params=resolved, datasets=datasets)
    link = training_view_link(cfg.tracking.uri, run_id) if run_id else None
    if link:
        say(f"[elastic-gpt] MLflow run: {link}")
    if run_id and run_id != run_info.get("mlflow_run_id"):
        # The record's other keys (the data skips of a rolled-back spike) belong to the
        # checkpoints' trajectory, not to the MLflow run: they stay.
        store.write_run_info({**run_info, "mlflow_run_id": run_id, "run_name": cfg.run.name,
                              "created_at": time.time()})
    return run_id


def _n_params(gpt_cfg) -> int:
    from elastic_gpt.model.config import count_params
    return count_params(gpt_cfg)["total"]

"""MLflow: one run per experiment across restarts and resubmissions (C5), and no secret in it.

- The driver resolves the run (reusing the id stored beside the checkpoints), logs the resolved
  config, the cluster shape and the software versions as params, and at the end the goodput
  summary, the membership events, a loss-curve plot and the final model (`finish_run`).
- Rank 0 of the worker group logs step metrics and system metrics (CPU, memory) through a
  background thread (`MetricLogger`), so a slow tracking server never stalls a step.
- Tracking never stops training: an unreachable server costs a warning, bounded retries and,
  for a new run, this submission's tracking; a bad *local* store (sqlite path) is a config error.
- Everything that leaves the process (params, tags, artifacts, printed lines, log records) goes
  through `redact`: URL passwords, signed-URL signatures, tokens and the values of secret-looking
  environment variables become `***`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import platform
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger(__name__)

# ============================================================================ redaction

MASK = "***"
# Names of things that hold secrets: env vars, query parameters, `key=value` text, config keys.
# `token(?![a-z])` keeps tokenizer / tokens_per_s / num_tokens readable.
_SECRET_NAME = (r"(?:secret|passw(?:or)?d|token(?![a-z])|credential|signature|(?<![a-z])sig"
                r"(?![a-z])|api[_-]?key|access[_-]?key|private[_-]?key|account[_-]?key"
                r"|session[_-]?key|authorization)")
_SECRET_NAME_RE = re.compile(_SECRET_NAME, re.I)
# scheme://user:password@host -> scheme://user:***@host
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@'\"]*):([^/\s@'\"]+)@")
# scheme://<long token>@host (GitHub-style token as the user name) -> scheme://***@host
_URL_TOKEN_USER = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s:@'\"]{20,})@")
# ?X-Amz-Signature=...&sig=...&token=... in query strings
_QUERY_SECRET = re.compile(r"(?i)([?&;][\w.-]*" + _SECRET_NAME + r"[\w.-]*=)[^&#\s'\"]+")
# AWS_SECRET_ACCESS_KEY=..., "password": "...", token: ... in free text
_KV_SECRET = re.compile(r"(?i)(\b[\w.-]*" + _SECRET_NAME + r"[\w.-]*['\"]?\s*[=:]\s*['\"]?)"
                        r"(?!\*\*\*|bearer\b|basic\b)([^\s'\",;&}]{4,})")
# Authorization: Bearer xxx / Basic xxx
_AUTH_HEADER = re.compile(r"(?i)\b(bearer|basic)\s+[a-z0-9._~+/=-]{8,}")
# Well-known credential shapes, wherever they appear.
_KNOWN_SHAPES = re.compile(
    r"\b(?:(?:AKIA|ASIA)[A-Z0-9]{16}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}"
    r"|hf_[A-Za-z0-9]{30,}|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
    r"|sk-[A-Za-z0-9_-]{20,})\b")
# Secret values shorter than this are not masked by value (too many false hits on short words);
# the structural patterns above still mask them where they appear as key=value or in URLs.
_MIN_SECRET_VALUE_LEN = 8
_registered_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask this exact value wherever it appears from now on (e.g. a password found in a URL)."""
    if value and len(value) >= _MIN_SECRET_VALUE_LEN:
        _registered_secrets.add(value)


def env_secret_values(environ=None) -> set[str]:
    """Values of environment variables whose names look secret (AWS_SECRET_ACCESS_KEY, ...)."""
    environ = os.environ if environ is None else environ
    return {v for k, v in environ.items()
            if len(v) >= _MIN_SECRET_VALUE_LEN and _SECRET_NAME_RE.search(k)
            and v.lower() not in ("true", "false")}


def redact(value) -> str:
    """Mask every credential in a string: URL passwords and tokens, signed-URL signatures,
    `secret=...` pairs, bearer tokens, known key shapes and known secret values."""
    text = str(value)
    literals = _registered_secrets | env_secret_values()
    for secret in sorted(literals, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    text = _URL_PASSWORD.sub(r"\1:" + MASK + "@", text)
    text = _URL_TOKEN_USER.sub(r"\1" + MASK + "@", text)
    text = _QUERY_SECRET.sub(r"\1" + MASK, text)
    text = _AUTH_HEADER.sub(r"\1 " + MASK, text)
    text = _KV_SECRET.sub(r"\1" + MASK, text)
    return _KNOWN_SHAPES.sub(MASK, text)


def register_secrets_in(obj) -> None:
    """Register the secret parts of every URL in a (nested) config, so they are masked even
    where they later appear without their URL around them (e.g. URL-decoded in an error)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, str) and _SECRET_NAME_RE.search(str(k)):
                register_secret(v)
            register_secrets_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            register_secrets_in(v)
    elif isinstance(obj, str):
        for m in _URL_PASSWORD.finditer(obj):
            register_secret(m.group(2))
        for m in _URL_TOKEN_USER.finditer(obj):
            register_secret(m.group(2))
        for m in _QUERY_SECRET.finditer(obj):
            register_secret(obj[m.end():].split("&")[0].split("#")[0])


def redact_obj(obj):
    """Redact every string in a nested dict/list; values under secret-looking keys become ***."""
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(v, str) and v and _SECRET_NAME_RE.search(str(k))
                    else redact_obj(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return redact(obj) if isinstance(obj, str) else obj


def redacted_params(flat: dict) -> dict:
    return {k: (MASK if _SECRET_NAME_RE.search(k) else redact(v) if isinstance(v, str) else v)
            for k, v in flat.items()}


class _RedactingStream(io.TextIOBase):
    """A text stream that masks secrets in everything written through it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s) -> int:
        self._stream.write(redact(s))
        return len(s)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def install_redaction(config: dict | None = None) -> None:
    """Mask secrets in this process's printed output and log records from now on: wraps
    sys.stdout/sys.stderr (which is also where Ray echoes worker output on the driver) and every
    logging handler that writes to them. Registers the credentials found in `config`. Idempotent."""
    if config is not None:
        register_secrets_in(config)
    originals = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _RedactingStream):
            originals[id(stream)] = wrapped = _RedactingStream(stream)
            setattr(sys, name, wrapped)
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in originals:
                handler.setStream(originals[id(stream)])


# ============================================================================ reachability

def _is_remote(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https", "databricks")


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
            why = _first_line(e)
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


def _client(uri: str):
    import mlflow
    return mlflow.MlflowClient(tracking_uri=uri)


# ============================================================================ the run

def resolve_run(uri: str, experiment: str, run_name: str, existing_run_id: str | None,
                params: dict, tags: dict | None = None,
                resumed_from_step: int | None = None) -> str | None:
    """Return the MLflow run id to log to: the stored one if it still exists, else a new run
    with `params` plus the environment. Logs a `submission` event either way.

    An unreachable server does not stop training: the stored id is kept (workers queue metrics
    and retry), or, for a new run, None (no tracking for this submission) with a warning. A local
    store that cannot be opened is a config error (ValueError)."""
    problem = server_reachable(uri)
    if problem:
        _warn_degraded(uri, problem, existing_run_id)
        return existing_run_id
    try:
        env = environment_info()
        with bounded_http():
            client = _client(uri)
            run_id = _reuse_run(client, uri, existing_run_id)
            if run_id is None:
                exp = client.get_experiment_by_name(experiment)
                exp_id = exp.experiment_id if exp else client.create_experiment(
                    experiment, artifact_location=local_artifact_root(uri))
                run = client.create_run(exp_id, run_name=run_name, tags=_redacted_tags(tags))
                run_id = run.info.run_id
                log_params(client, run_id, {**params, **{f"env.{k}": v for k, v in
                                                         env.items()}})
            for k, v in {**env, **job_info(), **(tags or {})}.items():
                client.set_tag(run_id, k, redact(v)[:5000])
            _log_events_with(client, run_id, [{
                "kind": "submission", "at": time.time(), "resumed_from_step": resumed_from_step,
                **job_info()}])
            return run_id
    except Exception as e:
        if _is_auth_error(e):  # not transient: a retry would fail the same way
            raise ValueError(f"the MLflow server at tracking.uri={redact(uri)} refused the "
                             f"credentials ({redact(_first_line(e))}); fix the user:password in "
                             "tracking.uri or MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN") from None
        if _is_remote(uri):
            _warn_degraded(uri, _first_line(e), existing_run_id)
            return existing_run_id
        raise ValueError(f"tracking.uri={redact(uri)} cannot be used ({redact(_first_line(e))}); "
                         "fix the path, or set tracking.enabled=false") from None


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
    except Exception as e:  # deleted, or another store: start a fresh run rather than fail
        log.warning("MLflow run %s not found in %s (%s); starting a new run", run_id, redact(uri),
                    type(e).__name__)
        return None
    if run.info.lifecycle_stage == "deleted":
        log.warning("MLflow run %s in %s is deleted; starting a new run", run_id, redact(uri))
        return None
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
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


def log_cluster_shape(uri: str, run_id: str | None) -> None:
    """Params `cluster.*` (the shape the run started on), tags `cluster.*` (this submission's)
    and metrics `cluster_*` (a time series: elastic runs change shape)."""
    if not run_id or server_reachable(uri, attempts=1):
        return
    try:
        shape = cluster_shape()
        with bounded_http():
            client = _client(uri)
            have = client.get_run(run_id).data.params
            if "cluster.nodes" not in have:
                log_params(client, run_id, {f"cluster.{k}": v for k, v in shape.items()})
            for k, v in shape.items():
                client.set_tag(run_id, f"cluster.{k}", str(v))
            from mlflow.entities import Metric
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(f"cluster_{k}", float(v), now, 0)
                                              for k, v in shape.items()
                                              if isinstance(v, (int, float))])
    except Exception as e:
        log.warning("could not log the cluster shape to MLflow (%s)", redact(_first_line(e)))


# ============================================================================ step metrics

class MetricLogger:
    """Queue step metrics; a daemon thread ships them in batches, with system metrics (CPU %,
    memory) sampled every `system_every_s`. Failures only warn (training must not die because
    the tracking server blinked) and are retried with the next batch."""

    def __init__(self, uri: str, run_id: str, flush_every_s: float = 2.0,
                 system_every_s: float | None = 5.0):
        self.uri, self.run_id, self.flush_every_s = uri, run_id, flush_every_s
        self.system_every_s = system_every_s
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()  # flush() and close() cut the wait short
        self._last_step = 0
        self._sampler = SystemSampler() if system_every_s else None
        self._thread = threading.Thread(target=self._run, name="mlflow-logger", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._last_step = step
        for k, v in metrics.items():
            self._q.put((k, float(v), ts, step))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Block until everything logged so far is stored (True), or `timeout_s` passed (False).
        Call it before committing a checkpoint: a job stopped right after the commit then has
        every step up to the checkpoint in MLflow, not all but the last flush interval's."""
        done = threading.Event()
        self._q.put(("__flush__", done))
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _sample_system(self) -> None:
        if self._sampler is None:
            return
        ts = int(time.time() * 1000)
        for k, v in self._sampler.sample().items():
            self._q.put((k, v, ts, self._last_step))

    def _run(self) -> None:
        from mlflow.entities import Metric
        client, pending, warned, next_sample, final_tries = None, [], False, 0.0, 0
        while True:
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            if self._sampler is not None and (time.time() >= next_sample or stopping):
                self._sample_system()
                next_sample = time.time() + self.system_every_s
            flushes = []
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "__flush__":
                    flushes.append(item[1])
                else:
                    pending.append(item)
            if pending:
                try:
                    client = client or _client(self.uri)
                    # Our loop retries forever; MLflow's own retries would block it ~4 min.
                    with bounded_http(max_retries=2, timeout_s=30):
                        for i in range(0, len(pending), 1000):
                            client.log_batch(self.run_id, metrics=[Metric(*m) for m in
                                                                   pending[i:i + 1000]])
                    if warned:
                        log.warning("MLflow logging to %s works again", redact(self.uri))
                    pending, warned = [], False
                except Exception as e:
                    if not warned:
                        log.warning("MLflow logging to %s failed (%s); will retry",
                                    redact(self.uri), redact(_first_line(e)))
                        warned = True
                    pending = pending[-100_000:]  # bounded memory while the server is away
            if not pending:
                for done in flushes:
                    done.set()
            else:  # not stored yet: the waiters time out, or see the next successful round
                for done in flushes:
                    self._q.put(("__flush__", done))
            if stopping:
                final_tries += 1
                if not pending or final_tries >= 2:  # one more try for the last batch
                    if pending:
                        log.warning("MLflow: %d metric values could not be sent to %s",
                                    len(pending), redact(self.uri))
                    return


class SystemSampler:
    """Host metrics under MLflow's own `system/` names (CPU %, memory, GPU memory), from psutil
    (bundled with Ray) and torch.cuda; empty if neither is available."""

    def __init__(self):
        try:
            import ray  # noqa: F401  (puts Ray's bundled psutil on sys.path)

            psutil = __import__("psutil")
            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # the first call only primes the counter
            self._proc = psutil.Process()
        except Exception:
            self._psutil = None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        ps = self._psutil
        if ps is not None:
            mem = ps.virtual_memory()
            out["system/cpu_utilization_percentage"] = float(ps.cpu_percent(interval=None))
            out["system/system_memory_usage_megabytes"] = (mem.total - mem.available) / 2**20
            out["system/system_memory_usage_percentage"] = float(mem.percent)
            out["system/process_memory_rss_megabytes"] = self._proc.memory_info().rss / 2**20
        try:
            import torch
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    free, total = torch.cuda.mem_get_info(i)
                    out[f"system/gpu_{i}_memory_usage_megabytes"] = (total - free) / 2**20
        except Exception:
            pass
        return out


# ============================================================================ events, goodput

EVENTS_ARTIFACT = "events/events.jsonl"


def log_events(uri: str, run_id: str, events: list[dict]) -> None:
    """Append membership events (failure, preemption, resize, resume, submissions) to the run's
    events.jsonl artifact: merged with what earlier submissions logged, deduplicated, by time."""
    with bounded_http():
        _log_events_with(_client(uri), run_id, events)


def _log_events_with(client, run_id: str, events: list[dict]) -> None:
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


def goodput_metrics(ledger: dict) -> dict[str, float]:
    """`goodput_*` metrics from a ledger: the GoodputLedger dict or summary (productive_s,
    lost_s, checkpoint_s, recovery_s, lost_steps, goodput) or the older training_s form."""
    seconds = {k: float(v) for k, v in ledger.items()
               if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = {f"goodput_{k}": v for k, v in seconds.items()}
    for k in ("lost_steps",):
        if isinstance(ledger.get(k), (int, float)):
            out[f"goodput_{k}"] = float(ledger[k])
    events = ledger.get("events")
    if isinstance(events, (int, float)):
        out["goodput_events"] = float(events)
    elif isinstance(events, list):
        out["goodput_events"] = float(len(events))
    wall = sum(seconds.values())
    useful = seconds.get("productive_s", seconds.get("training_s", 0.0))
    out["goodput_wall_s"] = wall
    out["goodput"] = float(ledger["goodput"]) if isinstance(ledger.get("goodput"), (int, float)) \
        else (useful / wall if wall else 1.0)
    return out


def log_goodput(uri: str, run_id: str, ledger: dict, step: int = 0) -> dict[str, float]:
    """Log the goodput split of wall time as `goodput_*` metrics (and return them)."""
    from mlflow.entities import Metric
    metrics = goodput_metrics(ledger)
    now = int(time.time() * 1000)
    with bounded_http():
        _client(uri).log_batch(run_id, metrics=[Metric(k, v, now, step)
                                                for k, v in metrics.items()])
    return metrics


def ledger_from_checkpoint(checkpoint_url: str) -> tuple[dict, list[dict]]:
    """The ledger and events saved in a checkpoint's trainer state (Ray Train V2 keeps reported
    metrics only with reported checkpoints, so the run's result may not carry them)."""
    try:
        from elastic_gpt.inference.generate import resolve_checkpoint
        ledger = dict(resolve_checkpoint(checkpoint_url)[1].get("ledger") or {})
    except Exception as e:
        log.warning("could not read the goodput ledger from %s (%s)", redact(checkpoint_url),
                    redact(_first_line(e)))
        return {}, []
    events = ledger.get("events")
    return ledger, list(events) if isinstance(events, list) else []


# ============================================================================ finishing

def finish_run(uri: str, run_id: str, config_path: str | None = None, finished: bool = True, *,
               config: dict | None = None,
               checkpoint_url: str | None = None, step: int | None = None,
               log_model: bool = True) -> None:
    """Publish what a user looks for in the run, then close it (FINISHED, or KILLED if it
    stopped short of max_steps and will be resumed): the config (redacted), goodput metrics,
    events.jsonl, a loss-curve plot and, when finished, the final model (HF directory + an
    mlflow.pytorch model). Never raises: each part that fails costs a warning."""
    problem = server_reachable(uri)
    if problem:
        log.warning("MLflow server %s is unreachable (%s); run %s is left open without its "
                    "final artifacts", redact(uri), problem, run_id)
        return
    with bounded_http():
        client = _client(uri)
        # The ledger travels in the checkpoints: the newest one holds every attempt's events.
        ledger, events = ledger_from_checkpoint(checkpoint_url) if checkpoint_url else ({}, [])
        parts = [
            ("config", lambda: _log_config(client, run_id, config_path, config)),
            ("goodput", lambda: ledger and log_goodput(uri, run_id, ledger, step or 0)),
            ("events", lambda: _log_events_with(client, run_id, [*events, {
                "kind": "submission_end", "at": time.time(), "step": step,
                "finished": finished, **job_info()}])),
            ("loss curve", lambda: _log_loss_curve(client, run_id)),
        ]
        if finished and checkpoint_url and log_model:
            parts.append(("final model", lambda: log_final_model(uri, run_id, checkpoint_url,
                                                                 step or 0)))
        for name, part in parts:
            try:
                part()
            except Exception as e:
                log.warning("MLflow: could not log the %s of run %s (%s: %s)", name, run_id,
                            type(e).__name__, redact(_describe(e)))
        try:
            client.set_terminated(run_id, status="FINISHED" if finished else "KILLED")
        except Exception as e:
            log.warning("MLflow: could not close run %s (%s)", run_id, redact(_first_line(e)))


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


def log_final_model(uri: str, run_id: str, checkpoint_url: str, step: int = 0) -> str:
    """Log the trained model twice: `model_hf/` (config.json + model.safetensors for
    transformers.GPT2LMHeadModel) and an mlflow.pytorch model named `model`; returns the
    latter's URI (also in the run's `elastic_gpt.model_uri` tag). Leaves the run FINISHED."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from elastic_gpt.inference.generate import load_model
    from elastic_gpt.inference.hf_export import export_hf

    client = _client(uri)
    with tempfile.TemporaryDirectory() as tmp:
        client.log_artifacts(run_id, export_hf(checkpoint_url, os.path.join(tmp, "hf")),
                             artifact_path="model_hf")
    model, _ = load_model(checkpoint_url)
    signature = ModelSignature(  # token ids (B, T) -> logits (B, T, vocab)
        inputs=Schema([TensorSpec(np.dtype(np.int64), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1, model.cfg.vocab_size))]))
    import elastic_gpt
    package_dir = os.path.dirname(os.path.abspath(elastic_gpt.__file__))
    # Inside the run, so MLflow files the logged model under the run's experiment (otherwise:
    # the default experiment 0, whose artifacts a sqlite store puts in ./mlruns of the cwd).
    with _tracking_uri(uri), _quiet("mlflow"), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model, name="model", run_id=run_id, step=step, signature=signature,
            serialization_format="pickle",
            code_paths=[package_dir],  # loads where elastic_gpt is not installed
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    client.set_tag(run_id, "elastic_gpt.model_uri", info.model_uri)
    return info.model_uri


@contextlib.contextmanager
def _tracking_uri(uri: str):
    """mlflow.<flavor>.log_model logs to the global tracking URI: point it at ours meanwhile,
    then restore both the global and the MLFLOW_TRACKING_URI variable (set_tracking_uri sets it)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils
    old_global, old_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_global)
        if old_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


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


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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


def _describe(e: BaseException) -> str:
    """First line of the error, plus the file it names (OSError's message often lacks it)."""
    text = _first_line(e)
    filename = getattr(e, "filename", None)
    return f"{text}: {filename}" if filename and str(filename) not in text else text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

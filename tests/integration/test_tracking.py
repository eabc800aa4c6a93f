"""MLflow tracking against local stores and loopback servers: runs opened once, reused, marked as
model training and given their datasets; the metric logger stores every step once (a lead handed
over, params never holding metrics back); events and goodput published; one step numbering
across console, metrics, checkpoints and evaluation (gloo ranks); no secret in a printed line; an
unreachable or refusing server, a bad store or a library's fault each handled as what it is (C6
clear errors); MLflow's telemetry off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.testing.ports import free_port
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.events import EVENTS_ARTIFACT, log_events
from elastic_gpt.tracking.metric_logger import MetricLogger
from elastic_gpt.tracking.publish import finish_run, log_goodput, metric_series, plot_loss_curve
from elastic_gpt.tracking.runs import (
    EXPERIMENT_KIND_TAG,
    TRAINING_KIND,
    dataset_descriptions,
    resolve_run,
    training_view_url,
)
from tests.fake_secrets import AWS_SECRET, PASSWORD, SECRETS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(os.path.dirname(sys.executable), "elastic-gpt")


# ---------------------------------------------------------------------------- redaction


def test_install_redaction_masks_printed_lines_and_log_records():
    code = f"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from elastic_gpt.tracking.redaction import install_redaction
install_redaction({{"tracking": {{"uri": "http://al:{PASSWORD}@h:5000"}}}})
print("uri http://al:{PASSWORD}@h:5000 and env {AWS_SECRET}")
print("bare {PASSWORD}", file=sys.stderr)
logging.getLogger("x").warning("failed for %s", "http://al:{PASSWORD}@h:5000")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "AWS_SECRET_ACCESS_KEY": AWS_SECRET}, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "uri http://al:***@h:5000 and env ***" in out.stdout
    assert "bare ***" in out.stderr and "WARNING failed for http://al:***@h:5000" in out.stderr
    assert not any(s in text for s in SECRETS)


# ---------------------------------------------------------------------------- local store


def test_loss_plot_draws_train_and_val_titled_by_run_name_across_the_rename(tmp_path,
                                                                            monkeypatch):
    """A run resumed across the metric rename holds `loss` (steps from 0) up to the resume and
    `train/loss` (steps from 1) after it: the plot joins them on one numbering."""
    import matplotlib.axes
    import mlflow
    from mlflow.entities import Metric

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    run_id = resolve_run(uri, "exp", "curve-run", None, {})
    client.log_batch(run_id, metrics=[Metric("loss", 5.0 - s, 1000 + s, s) for s in range(3)])
    client.log_batch(run_id, metrics=[Metric(mn.TRAIN_LOSS, 5.0 - s, 2000 + s, s)
                                      for s in range(4, 7)] +
                     [Metric(mn.VAL_LOSS, 4.0, 3000, 6)])
    assert metric_series(client, run_id, mn.TRAIN_LOSS) == {1: 5.0, 2: 4.0, 3: 3.0, 4: 1.0,
                                                            5: 0.0, 6: -1.0}
    drawn = {}
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, title, *a, **k: drawn.setdefault("title", title))
    monkeypatch.setattr(matplotlib.axes.Axes, "legend",
                        lambda self, *a, **k: drawn.setdefault(
                            "lines", [line.get_label() for line in self.get_lines()]))
    assert plot_loss_curve(client, run_id, str(tmp_path / "curve.png"))
    assert drawn == {"title": "curve-run", "lines": ["train", "validation"]}
    assert (tmp_path / "curve.png").stat().st_size > 1000


def _numbering_worker(rank: int, world: int, overrides: list[str], uri: str) -> dict:
    """A short real run (gloo, one process) logging through the real MetricLogger, its console
    captured."""
    import contextlib
    import io

    import mlflow

    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import Trainer

    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("numbering")).info.run_id
    logged: list[tuple[str, int]] = []

    class Recording(MetricLogger):
        def log(self, metrics, step):
            logged.extend((k, step) for k in metrics)
            super().log(metrics, step)

    sink = Recording(uri, run_id, system_every_s=None)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        Trainer(load_config(None, overrides), rank=rank, world_size=world, mlflow_run_id=run_id,
                metrics=sink).train()
    sink.flush(30)
    sink.close()
    return {"run_id": run_id, "logged": logged, "console": console.getvalue()}


def test_one_step_numbering_in_console_mlflow_checkpoints_and_eval(tmp_path):
    """After k optimizer steps: the console says `step k/N`, MLflow has step k, the checkpoint
    folder is step_<k>, and an evaluation after it is logged at k; every name logged is in the
    metric-name table."""
    import re

    import mlflow

    from data_pipelines.tokenize_job import prepare_data
    from elastic_gpt.testing.gloo import run_gloo

    data = str(tmp_path / "ds")
    stdlib = os.path.dirname(os.__file__)
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:8]
    prepare_data(files, data, tokenizer="bytes", seq_len=32, engine="local", progress=False,
                 max_bytes=60_000, val_fraction=0.2, val_seed=1)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ckpt = f"file://{tmp_path}/ckpt"
    got = run_gloo(_numbering_worker, 1, [
        "model.preset=tiny", f"data.path={data}", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.max_steps=4", "train.warmup_steps=1",
        "train.log_every=1", "checkpoint.every_steps=2", f"checkpoint.path={ckpt}",
        "eval.every_steps=2", "eval.samples=4", "scaling.max_workers=1",
        "scaling.min_workers=1"], uri)[0]
    console_steps = [int(k) for k in re.findall(r"\] step (\d+)/4 ", got["console"])]
    eval_steps = [int(k) for k in re.findall(r"eval after step (\d+) ", got["console"])]
    client = mlflow.MlflowClient(uri)
    mlflow_steps = sorted(m.step for m in client.get_metric_history(got["run_id"],
                                                                    mn.TRAIN_LOSS))
    val_steps = sorted(m.step for m in client.get_metric_history(got["run_id"], mn.VAL_LOSS))
    assert console_steps == mlflow_steps == [1, 2, 3, 4]
    assert eval_steps == val_steps == [2, 4]
    assert sorted(CheckpointStore(ckpt).step_dirs()) == [2, 4]
    assert os.path.isdir(tmp_path / "ckpt" / "step_00000004")
    names = {k for k, _ in got["logged"]}
    assert set(mn.STEP_METRICS) <= names and {mn.VAL_LOSS, mn.VAL_PERPLEXITY} <= names
    assert all(mn.is_known(k) for k in names), sorted(k for k in names if not mn.is_known(k))


def test_tracking_imports_no_model_inference_or_checkpoint_code():
    code = ("import sys, elastic_gpt.tracking.client, elastic_gpt.tracking.events, "
            "elastic_gpt.tracking.metric_logger, elastic_gpt.tracking.publish, "
            "elastic_gpt.tracking.redaction, elastic_gpt.tracking.runs\n"
            "print(sorted(m for m in sys.modules if m.startswith(('elastic_gpt.model', "
            "'elastic_gpt.inference', 'elastic_gpt.checkpoint', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unreachable_server_degrades_quickly_with_a_warning(caplog):
    uri = f"http://user:{PASSWORD}@127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.time()
    with caplog.at_level("WARNING"):
        assert resolve_run(uri, "exp", "r", None, {}) is None
        assert resolve_run(uri, "exp", "r", "abc123", {}) == "abc123"
        finish_run(uri, "abc123", finished=True)  # never raises
        logger = MetricLogger(uri, "abc123", flush_every_s=0.2)
        logger.log({mn.TRAIN_LOSS: 1.0}, 1)
        assert not logger.flush(timeout_s=1)
        logger.close(timeout=20)
    assert time.time() - t0 < 60  # MLflow's own defaults retry for ~4 minutes per call
    text = caplog.text
    assert "training continues WITHOUT tracking" in text and "keep run abc123's metrics" in text
    assert "MLflow logging to" in text and PASSWORD not in text


def test_a_server_that_refuses_the_credentials_is_a_config_error():
    """Not transient, so no degrading: a loopback HTTP server that answers 401 to everything."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self):
            body = json.dumps({"error_code": "UNAUTHENTICATED", "message": "bad password"})
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = _refuse

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        uri = f"http://bob:{PASSWORD}@127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(ValueError, match="refused the credentials") as err:
            resolve_run(uri, "e", "r", None, {})
        assert PASSWORD not in str(err.value) and "bob:***@" in str(err.value)
    finally:
        httpd.shutdown()


def test_mlflow_telemetry_is_off_in_our_processes_unless_the_user_turns_it_on():
    """Off in a process that imports elastic_gpt, before MLflow is imported, and in the workers'
    environment; a user's MLFLOW_DISABLE_TELEMETRY=false is kept. Run outside pytest's and CI's
    variables, which MLflow reads as 'do not track' by itself."""
    probe = ("import os, elastic_gpt, mlflow\n"
             "from mlflow.telemetry.client import get_telemetry_client\n"
             "from mlflow.telemetry.utils import is_telemetry_disabled\n"
             "from elastic_gpt.elastic.worker_group_job import worker_env\n"
             "print(is_telemetry_disabled(), get_telemetry_client() is None,"
             " worker_env()['MLFLOW_DISABLE_TELEMETRY'])")
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "MLFLOW_DISABLE_TELEMETRY",
                         "DO_NOT_TRACK")}

    def run(env):
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run(base) == ["True", "True", "true"]
    assert run({**base, "MLFLOW_DISABLE_TELEMETRY": "false"})[::2] == ["False", "false"]


# ---------------------------------------------------------------------------- bad input (C6 clear
# errors)

def test_missing_config_is_one_line_and_exit_2(tmp_path):
    for cmd in ([CLI, "train", "--config", "jobs/configs/nope.yaml"],
                [sys.executable, "jobs/pretrain.py", "--config", "jobs/configs/nope.yaml"]):
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            "elastic-gpt train: error: config file jobs/configs/nope.yaml does not exist; pass --config "
            "with a YAML file such as jobs/configs/mini.yaml"]


def _fail_first_calls(monkeypatch, method: str, times: int) -> list:
    """MlflowClient.`method` raises what MLflow's telemetry race raised (a KeyError from
    os.environ) on its first `times` calls, then runs for real."""
    import mlflow
    real, calls = getattr(mlflow.MlflowClient, method), []

    def flaky(self, *a, **kw):
        calls.append(method)
        if len(calls) <= times:
            raise KeyError("_MLFLOW_TELEMETRY_SESSION_ID")
        return real(self, *a, **kw)
    monkeypatch.setattr(mlflow.MlflowClient, method, flaky)
    return calls


def test_metric_logger_flush_stores_everything_logged_so_far(tmp_path):
    import mlflow
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    logger = MetricLogger(uri, run_id, flush_every_s=60)  # only flush() ships
    for step in range(1, 6):
        logger.log({mn.TRAIN_LOSS: 1.0 / step}, step)
    assert logger.flush(timeout_s=60)
    assert [m.step for m in client.get_metric_history(run_id, mn.TRAIN_LOSS)] == [1, 2, 3, 4, 5]
    logger.close()
    assert mn.SYSTEM_CPU_PERCENT in client.get_run(run_id).data.metrics


def test_a_lead_handed_over_stores_every_step_once(tmp_path):
    """Replica groups (C5 one MLflow run): the leading group's logger ships what it holds and then
    nothing more when it leaves; the next leader logs the held steps the store lacks, keyed by
    step: every step once, whoever stored it."""
    import mlflow
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    leader = MetricLogger(uri, run_id, flush_every_s=60, system_every_s=None)
    for step in (1, 2, 3):
        leader.log({mn.TRAIN_LOSS: step, mn.DATA_FINGERPRINT: step}, step)
    assert leader.flush(timeout_s=60) and leader.logged_through() == 3
    leader.log({mn.TRAIN_LOSS: 4, mn.DATA_FINGERPRINT: 4}, 4)
    assert leader.stop_sending(timeout_s=60)  # step 4 shipped on the way out
    leader.log({mn.TRAIN_LOSS: 5, mn.DATA_FINGERPRINT: 5}, 5)  # after it: never stored
    assert leader.flush(timeout_s=60) and leader.logged_through() == 4
    leader.close()

    # The next leader held its own record of steps 2..5, not yet confirmed stored.
    nxt = MetricLogger(uri, run_id, flush_every_s=60, system_every_s=None)
    nxt.log_missing([(step, 1000 * step, {mn.TRAIN_LOSS: 10 + step, mn.DATA_FINGERPRINT: step})
                     for step in (2, 3, 4, 5)])
    nxt.log({mn.TRAIN_LOSS: 16, mn.DATA_FINGERPRINT: 6}, 6)
    assert nxt.flush(timeout_s=60) and nxt.logged_through() == 6
    nxt.close()
    for key in (mn.TRAIN_LOSS, mn.DATA_FINGERPRINT):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3, 4, 5, 6]
    assert {m.step: m.value for m in client.get_metric_history(run_id, mn.TRAIN_LOSS)} == {
        1: 1, 2: 2, 3: 3, 4: 4, 5: 15, 6: 16}


def test_metric_logger_params_a_run_already_holds_never_hold_back_the_metrics(tmp_path, caplog):
    import mlflow
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    client.log_param(run_id, "resolved.w2.grad_sync", "step")  # an earlier attempt's
    logger = MetricLogger(uri, run_id, flush_every_s=60, system_every_s=None)
    with caplog.at_level("WARNING"):
        # One batch: w2's is refused (params are immutable), w4's is new.
        logger.log_params({"resolved.w2.grad_sync": "microbatch",
                           "resolved.w4.grad_sync": "microbatch"})
        logger.log({mn.TRAIN_LOSS: 0.5}, 1)
        assert logger.flush(timeout_s=60)
        logger.log({mn.TRAIN_LOSS: 0.25}, 2)
        assert logger.flush(timeout_s=60)
    logger.close()
    params = client.get_run(run_id).data.params
    assert params["resolved.w2.grad_sync"] == "step"
    assert [m.step for m in client.get_metric_history(run_id, mn.TRAIN_LOSS)] == [1, 2]
    assert params["resolved.w4.grad_sync"] == "microbatch"  # sent with the refused one
    assert any("kept the run's earlier value of resolved.w2.grad_sync" in r.message
               for r in caplog.records)


def test_events_merge_across_submissions_and_goodput_metrics(tmp_path):
    import mlflow
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = resolve_run(uri, "exp", "r", None, {"train.lr": 0.1}, resumed_from_step=None)
    assert resolve_run(uri, "exp", "r", run_id, {}, resumed_from_step=40) == run_id
    log_events(uri, run_id, [{"kind": "preemption", "at": 5.0, "detail": "node lost"}])
    log_events(uri, run_id, [{"kind": "preemption", "at": 5.0, "detail": "node lost"},
                                      {"kind": "resize", "at": 7.0, "to_world_size": 3}])
    client = mlflow.MlflowClient(uri)
    path = client.download_artifacts(run_id, EVENTS_ARTIFACT, str(tmp_path / "dl"))
    events = [json.loads(line) for line in open(path)]
    kinds = [e["kind"] for e in events]
    assert kinds == ["preemption", "resize", "submission", "submission"]  # by time, no repeats
    assert [e["resumed_from_step"] for e in events if e["kind"] == "submission"] == [None, 40]
    # Artifacts beside the database, not in ./mlruns of whatever directory we run in.
    assert client.get_run(run_id).info.artifact_uri.startswith(f"file://{tmp_path}/mlartifacts")

    ledger = {"productive_s": 30.0, "lost_s": 5.0, "checkpoint_s": 3.0, "recovery_s": 12.0,
              "lost_steps": 4, "events": [{"kind": "x"}]}
    got = log_goodput(uri, run_id, ledger, step=50)
    assert got[mn.GOODPUT] == pytest.approx(0.6) and got[mn.GOODPUT_WALL_S] == pytest.approx(50.0)
    metrics = client.get_run(run_id).data.metrics
    assert metrics[mn.GOODPUT_LOST_STEPS] == 4 and metrics[mn.GOODPUT_EVENTS] == 1
    assert metrics[mn.goodput("recovery_s")] == 12.0
    assert all(mn.is_known(k) for k in got)


def test_finish_run_publishes_the_ledger_and_survives_a_failing_model_export(tmp_path, caplog):
    import mlflow
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = resolve_run(uri, "exp", "r", None, {})
    ledger = {"productive_s": 8.0, "lost_s": 2.0, "events": [{"kind": "resize", "at": 1.0}]}

    def broken_export():
        raise OSError("disk full")

    with caplog.at_level("WARNING"):
        finish_run(uri, run_id, finished=True, config={"train": {"lr": 0.1}}, ledger=ledger,
                   step=7, log_model=broken_export)
    assert "could not log the final model" in caplog.text and "disk full" in caplog.text
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics[mn.GOODPUT] == pytest.approx(0.8)
    path = client.download_artifacts(run_id, EVENTS_ARTIFACT, str(tmp_path / "dl"))
    kinds = [json.loads(line)["kind"] for line in open(path)]
    assert kinds[0] == "resize" and kinds[-1] == "submission_end"
    assert "config/resolved.yaml" in [f.path for f in client.list_artifacts(run_id, "config")]


def test_experiment_is_marked_as_model_training(tmp_path, monkeypatch):
    """MLflow 3 reads the experiment-kind tag to choose the experiment's view; without it an
    experiment reads as GenAI. New experiments get it, old ones that lack it too; a kind a user
    chose is kept."""
    import mlflow
    # Experiments made here with MLflow's defaults keep their artifacts in ./mlruns: the
    # test's folder, not the checkout.
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    resolve_run(uri, "new", "r", None, {})
    old = client.create_experiment("old")  # as an earlier version left it: no kind
    resolve_run(uri, "old", "r", None, {})
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "finetuning"})
    resolve_run(uri, "chosen", "r", None, {})
    assert client.get_experiment_by_name("new").tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "finetuning"
    assert training_view_url("http://h:5000/", "7", "abc") == \
        "http://h:5000/#/experiments/7/runs/abc/model-metrics?workflowType=machine_learning"


def test_resolved_shape_dtype_and_one_dataset_input_across_two_submissions(
        stdlib_dataset, tmp_path, monkeypatch):
    """The driver's run set-up (launcher._resolve_mlflow_run) on a local store, submitted twice
    as a resubmission would be: one run, the resolved model shape and dtype as params, the
    dataset as the run's one input (the second submission adds none)."""
    import mlflow

    from elastic_gpt.config import load_config, resolve_paths
    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.elastic import launcher
    from elastic_gpt.train.model_config import model_config_for

    monkeypatch.setattr(launcher, "use_gpu", lambda cfg: False)  # no Ray: workers on CPU
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = resolve_paths(load_config("jobs/configs/mini.yaml", [
        "model.preset=tiny", f"data.path={stdlib_dataset}", f"tracking.uri={uri}",
        f"checkpoint.path={tmp_path}/ckpt", "run.name=twice"]))
    manifest = load_manifest(cfg.data.path)
    gpt_cfg = model_config_for(cfg, manifest)
    store = CheckpointStore(cfg.checkpoint.path)
    first = launcher._resolve_mlflow_run(cfg, store, None, manifest, gpt_cfg)
    second = launcher._resolve_mlflow_run(cfg, store, None, manifest, gpt_cfg)
    assert first == second
    run = mlflow.MlflowClient(uri).get_run(first)
    p = run.data.params
    assert p["model.n_layer"] == "None"  # the config's value: left to the preset
    assert p["model.resolved.n_layer"] == str(gpt_cfg.n_layer) == "2"
    assert p["model.resolved.seq_len"] == str(manifest.seq_len)
    assert p["model.resolved.vocab_size"] == str(gpt_cfg.vocab_size)
    assert p["train.resolved_dtype"] == "float32"  # auto on CPU
    [entry] = run.inputs.dataset_inputs
    [expected] = dataset_descriptions([manifest])
    assert (entry.dataset.name, entry.dataset.digest) == ("stdlib", expected["digest"])
    assert json.loads(entry.dataset.source)["uri"] == manifest.url
    assert {t.key: t.value for t in entry.tags}["mlflow.data.context"] == "training"


def test_a_local_store_that_cannot_be_opened_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"tracking.uri=sqlite:///.*cannot be used"):
        resolve_run(f"sqlite:///{blocker}/sub/mlflow.db", "e", "r", None, {})


def test_a_store_that_is_not_a_database_is_a_config_error(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_text("notes, not a database")
    with pytest.raises(ValueError, match=r"cannot be used \(.*file is not a database.*fix the path"):
        resolve_run(f"sqlite:///{db}", "e", "r", None, {})


def test_a_library_fault_while_opening_the_run_is_retried_then_reported_as_a_fault(
        tmp_path, monkeypatch, caplog):
    """MLflow's telemetry race struck in the middle of opening a run, on a valid store. Forced
    here at the calls a new run and a resumed one make: one failure is retried and the run
    starts (a new run is made once, with its params; a resume keeps its run); failures on every
    try end as a fault naming MLflow and the KeyError, never as a bad tracking.uri (exit 1 with
    the traceback, not exit 2)."""
    import mlflow

    from elastic_gpt.errors import user_error_line
    from elastic_gpt.tracking import runs

    monkeypatch.setattr(runs, "SETUP_RETRY_S", 0.0)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with monkeypatch.context() as m:
        _fail_first_calls(m, "log_batch", 1)  # after the run was created: the retry reuses it
        first = resolve_run(uri, "e", "r", None, {"train.lr": 0.1})
    client = mlflow.MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.run_id == first and run.data.params["train.lr"] == "0.1"
    with monkeypatch.context() as m:
        _fail_first_calls(m, "get_run", 1)
        assert resolve_run(uri, "e", "r", first, {}) == first
    assert caplog.text.count("KeyError: '_MLFLOW_TELEMETRY_SESSION_ID'); retrying") == 2
    # Only a run the store does not have starts a new one.
    assert resolve_run(uri, "e", "r", "0" * 32, {}) not in (first, None)

    _fail_first_calls(monkeypatch, "get_run", 10**6)
    with pytest.raises(runs.TrackingSetupError) as err:
        resolve_run(uri, "e", "r", first, {})
    message = str(err.value)
    assert "MLflow failed 2 times" in message and "KeyError" in message
    assert "fix the path" not in message and user_error_line(err.value) is None

"""MLflow tracking of real training runs (the `elastic-gpt train` command on a local Ray cluster):
a real `mlflow server` (artifacts proxied through it) holds everything a user looks for in a run,
no secret reaches MLflow or the driver's output, training goes on while the server is down, and an
unreachable Ray address is one line and exit 2 (C6 clear errors)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.testing.mlflow_server import MlflowServer
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.tracking.runs import (
    EXPERIMENT_KIND_TAG,
    TRAINING_KIND,
)
from tests.fake_secrets import AWS_SECRET, HF_TOKEN, PASSWORD, SECRETS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(os.path.dirname(sys.executable), "elastic-gpt")
STEPS = 6


def train_cli(args: list[str], env_extra: dict | None = None, cwd: str | None = None,
              timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("RAY_ADDRESS", None) if "RAY_ADDRESS" not in (env_extra or {}) else None
    return subprocess.run([CLI, "train", *args], cwd=cwd or REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def overrides(data: str, root: str, uri: str, *extra: str) -> list[str]:
    return ["--config", "jobs/configs/mini.yaml", "model.preset=tiny", f"data.path={data}",
            f"checkpoint.path={root}/ckpt", f"run.storage_path={root}/ray", f"tracking.uri={uri}",
            "run.name=server-run", f"train.max_steps={STEPS}", "train.global_batch_size=8",
            "train.micro_batch_size=4", "train.warmup_steps=2", "train.log_every=1",
            "checkpoint.every_steps=3", "scaling.min_workers=1", "scaling.max_workers=1", *extra]


# ---------------------------------------------------------------------------- redaction


# ---------------------------------------------------------------------------- local store


# ---------------------------------------------------------------------------- bad input (C6 clear
# errors)


def test_unreachable_ray_address_is_one_line_and_exit_2(stdlib_dataset, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    out = train_cli(overrides(stdlib_dataset, str(tmp_path), f"sqlite:///{tmp_path}/m.db"),
                    env_extra={"RAY_ADDRESS": f"127.0.0.1:{port}"}, timeout=180)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"elastic-gpt train: error: cannot reach the Ray cluster at RAY_ADDRESS="
                           f"127.0.0.1:{port}") and "ray start --head" in last
    assert "Traceback" not in out.stderr and time.time() - t0 < 120
    assert CheckpointStore(f"file://{tmp_path}/ckpt").latest() is None


# ---------------------------------------------------------------------------- mlflow server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(str(tmp_path_factory.mktemp("mlflow-server")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server_run(server, stdlib_dataset, tmp_path_factory):
    """A short training run tracked on the server, with credentials in the tracking URI and
    secrets in the environment."""
    root = str(tmp_path_factory.mktemp("server-run"))
    uri = server.uri.replace("http://", f"http://alice:{PASSWORD}@")
    out = train_cli(overrides(stdlib_dataset, root, uri),
                    env_extra={"AWS_SECRET_ACCESS_KEY": AWS_SECRET, "HF_TOKEN": HF_TOKEN})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    final = CheckpointStore(f"file://{root}/ckpt").latest()
    return {"out": out, "root": root, "uri": uri, "run_id": final.state["mlflow_run_id"],
            "ckpt": final.url}


def _artifact_files(client, run_id: str, path: str | None = None) -> list[str]:
    files = []
    for f in client.list_artifacts(run_id, path):
        files += _artifact_files(client, run_id, f.path) if f.is_dir else [f.path]
    return files


def test_server_run_has_config_cluster_versions_metrics_events_plot_and_model(server,
                                                                              server_run):
    import mlflow
    import ray
    import torch

    client = mlflow.MlflowClient(server.uri)
    run = client.get_run(server_run["run_id"])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["train.max_steps"] == str(STEPS) and p["model.preset"] == "tiny"
    assert p["tracking.uri"] == f"http://alice:***@127.0.0.1:{server.port}"
    assert (p["cluster.nodes"], p["cluster.gpus"]) == ("1", "0") and int(p["cluster.cpus"]) >= 1
    assert p["env.ray_version"] == ray.__version__ and p["env.torch_version"] == torch.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert p["env.git_commit"].startswith(head)

    # The shape and dtype the workers resolved (the config leaves them to the preset, the
    # dataset and the device).
    assert {k: p[f"model.resolved.{k}"] for k in ("n_layer", "n_head", "n_embd", "seq_len")} == \
        {"n_layer": "2", "n_head": "2", "n_embd": "64", "seq_len": "64"}
    assert int(p["model.resolved.vocab_size"]) >= 257 and p["train.resolved_dtype"] == "float32"
    assert client.get_experiment(run.info.experiment_id).tags[EXPERIMENT_KIND_TAG] == \
        TRAINING_KIND
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == "stdlib" and dataset.dataset.source_type == "local"

    for key in mn.STEP_METRICS:  # one numbering: after step k is step k (C5 one MLflow run)
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == \
            list(range(1, STEPS + 1)), key
    metrics = run.data.metrics
    assert all(mn.is_known(k) for k in metrics), sorted(k for k in metrics if not mn.is_known(k))
    assert metrics[mn.SYSTEM_CPU_PERCENT] >= 0 and metrics[mn.SYSTEM_MEMORY_MB] > 0
    assert 0 < metrics[mn.GOODPUT] <= 1 and metrics[mn.goodput("productive_s")] > 0
    assert metrics[mn.cluster("nodes")] == 1

    files = _artifact_files(client, run.info.run_id)
    for f in ("config/mini.yaml", "config/resolved.yaml", "events/events.jsonl",
              "plots/loss_curve.png", "model_hf/config.json", "model_hf/model.safetensors"):
        assert f in files
        # Proxied: the bytes went through the server into its --artifacts-destination.
        assert any(os.path.join(dirpath, os.path.basename(f)).endswith(f)
                   for dirpath, _, names in os.walk(server.artifacts)
                   if os.path.basename(f) in names), f
    events = open(client.download_artifacts(run.info.run_id, "events/events.jsonl",
                                            server_run["root"] + "/dl")).read()
    assert '"kind": "submission"' in events and '"finished": true' in events


def test_logged_pytorch_model_gives_the_same_logits_as_the_checkpoint(server, server_run):
    import mlflow
    import torch

    from elastic_gpt.inference.generate import load_model

    client = mlflow.MlflowClient(server.uri)
    run = client.get_run(server_run["run_id"])
    model_uri = run.data.tags["elastic_gpt.model_uri"]
    assert client.get_logged_model(model_uri.split("/")[-1]).experiment_id == \
        run.info.experiment_id
    mlflow.set_tracking_uri(server.uri)
    try:
        logged = mlflow.pytorch.load_model(model_uri)
    finally:
        mlflow.set_tracking_uri(None)
    original, _ = load_model(server_run["ckpt"])
    idx = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(logged.eval()(idx), original(idx))


def test_no_secret_reaches_mlflow_or_the_driver_output(server, server_run):
    import mlflow

    out = server_run["out"]
    driver_output = out.stdout + out.stderr
    assert "[elastic-gpt] step 6/6" in driver_output  # the output is there, only masked
    assert "alice:***@" in driver_output
    client = mlflow.MlflowClient(server.uri)
    run = client.get_run(server_run["run_id"])
    texts = [driver_output, json.dumps(run.data.params), json.dumps(run.data.tags)]
    for secret in SECRETS:
        for text in texts:
            assert secret not in text
    # Everything the server stored (database and every artifact, the model files included).
    for dirpath, _, names in os.walk(server.root):
        for name in names:
            if name == "server.log":
                continue
            data = open(os.path.join(dirpath, name), "rb").read()
            for secret in SECRETS:
                assert secret.encode() not in data, os.path.join(dirpath, name)


def test_training_goes_on_when_the_server_is_down(server, server_run, stdlib_dataset):
    """Resume the same run with the server stopped: a warning, the stored run id kept, every
    step trained and checkpointed; the run's metrics wait in the workers' queue."""
    server.stop()
    # Keep the stopped server's port taken (bound, not listening: connections are refused, as
    # at a host whose server is down), so no process started meanwhile (the driver's own local
    # Ray dashboard picks a free port) can answer there in its place.
    port = int(server_run["uri"].rsplit(":", 1)[1].split("/")[0])
    down = socket.socket()
    down.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    down.bind(("127.0.0.1", port))
    t0 = time.time()
    try:
        out = train_cli(overrides(stdlib_dataset, server_run["root"], server_run["uri"],
                                  f"train.max_steps={STEPS + 3}"))
    finally:
        down.close()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "is unreachable" in out.stderr and server_run["run_id"] in out.stderr
    assert PASSWORD not in out.stdout + out.stderr
    final = CheckpointStore(f"file://{server_run['root']}/ckpt").latest()
    assert final.step == STEPS + 3 and final.state["mlflow_run_id"] == server_run["run_id"]
    assert time.time() - t0 < 300

"""End to end on a real Ray cluster: FSDP2 training, resume bit-identically (C3 bit-identical
resume), reshard on resume at another world size, checkpoints on a real S3-protocol server, export
and generate."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.config import load_config
from elastic_gpt.elastic.launcher import run_training
from elastic_gpt.tracking import metric_names as mn
from tests.training_records import metric_by_step

STEPS = 8
# G=12 sequences of 64 tokens in micro-batches of 2: 6 micro-batches, so W=1, 2 and 3 all divide
# the step differently (3 at W=2; 2 at W=3; 6 at W=1).
BASE = ["model.preset=tiny", "train.global_batch_size=12", "train.micro_batch_size=2",
        f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.lr=3e-3", "train.log_every=4",
        "checkpoint.every_steps=4", "checkpoint.keep=3", "elastic.max_failures_per_hour=3"]


@pytest.fixture(scope="module")
def env(stdlib_dataset, ray_cluster, s3, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    os.environ["AWS_ENDPOINT_URL_S3"] = s3.endpoint  # forwarded to workers by the launcher
    s3.make_bucket("ckpts")
    return {"data": stdlib_dataset, "root": str(root),
            "uri": f"sqlite:///{root}/mlflow.db"}


def train(env, name: str, *overrides: str, workers: int = 2, checkpoint: str | None = None):
    cfg = load_config("jobs/configs/mini.yaml", [
        *BASE, f"data.path={env['data']}", f"run.name={name}", f"tracking.uri={env['uri']}",
        f"run.storage_path={env['root']}/ray", f"scaling.min_workers={workers}",
        f"scaling.max_workers={workers}",
        f"checkpoint.path={checkpoint or env['root'] + '/ckpt-' + name}", *overrides])
    return run_training(cfg), cfg


@pytest.fixture(scope="module")
def reference(env):
    """An uninterrupted W=2 run with checkpoints on S3: the figures every other run is held to."""
    summary, cfg = train(env, "reference", workers=2, checkpoint="s3://ckpts/reference")
    run = summary["run_id"]
    return {"summary": summary, "cfg": cfg,
            "loss": metric_by_step(env["uri"], run, mn.TRAIN_LOSS),
            "fp": metric_by_step(env["uri"], run, mn.DATA_FINGERPRINT)}


def test_worker_killed_after_a_checkpoint_resumes_bit_identically(env, reference):
    """SIGKILL a training worker once step 2 is committed: Ray Train restarts the group at the
    same size, it resumes from the newest committed checkpoint, and every step after it has the
    reference run's loss to the bit (C3 bit-identical resume) and the same data (C2 data order)."""
    from elastic_gpt.testing.cluster import training_workers

    ckpt = env["root"] + "/ckpt-killed"
    killed = {}

    def kill_when_committed():
        store = CheckpointStore(ckpt)
        deadline = time.time() + 240
        while time.time() < deadline:
            if 2 in store.step_dirs() and store.verify(2) is None:
                actors = training_workers()
                if actors:
                    pid = actors[0].pid
                    os.kill(pid, signal.SIGKILL)
                    killed["pid"], killed["at"] = pid, time.time()
                    return
            time.sleep(0.05)

    t = threading.Thread(target=kill_when_committed, daemon=True)
    t.start()
    summary, _ = train(env, "killed", "checkpoint.every_steps=2", checkpoint=ckpt)
    t.join(5)
    assert killed, "the kill never happened"
    assert summary["step"] == STEPS
    loss = metric_by_step(env["uri"], summary["run_id"], mn.TRAIN_LOSS)
    fp = metric_by_step(env["uri"], summary["run_id"], mn.DATA_FINGERPRINT)
    assert fp == reference["fp"]
    assert loss == reference["loss"]  # bit-identical, not approximately


# One run stopped and resumed at another size each time: the sizes shrink, grow and shrink
# again, and each resume reads what a resumed run wrote.
SIZES = (2, 1, 3, 2)


def test_reference_run_trains_checkpoints_to_s3_and_logs_every_metric(env, reference):
    s = reference["summary"]
    assert s["step"] == STEPS
    assert s["checkpoint"] == f"s3://ckpts/reference/step_{STEPS:08d}"
    store = CheckpointStore("s3://ckpts/reference")
    assert sorted(store.step_dirs()) == [4, 8]
    assert store.verify(8) is None and store.read_state(8)["samples_seen"] == STEPS * 12
    assert store.read_run_info()["mlflow_run_id"] == s["run_id"]
    loss = reference["loss"]
    assert sorted(loss) == list(range(1, STEPS + 1))  # after step k is step k (C5 one MLflow run)
    assert loss[STEPS] < loss[1] - 0.5, f"loss did not fall: {loss}"
    import mlflow
    run = mlflow.MlflowClient(env["uri"]).get_run(s["run_id"])
    for key in mn.STEP_METRICS:
        assert key in run.data.metrics, key
    assert run.data.metrics[mn.TRAIN_WORLD_SIZE] == 2 and run.data.metrics[mn.TRAIN_GRAD_ACCUM] == 3
    assert run.data.params["train.global_batch_size"] == "12"
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in mlflow.MlflowClient(env["uri"]).list_artifacts(s["run_id"], "plots")}
    assert "plots/loss_curve.png" in artifacts


def test_resume_at_another_world_size_continues_the_same_run(env, reference):
    """Stop after every second step, resume at the next of SIZES: resharded load, the same
    samples per step (C2 data order), the same losses up to float reduction order (C3
    bit-identical resume), one MLflow run (C5 one MLflow run)."""
    per_session = STEPS // len(SIZES)
    runs = []
    for i, workers in enumerate(SIZES):
        stop = [f"run.stop_at_step={(i + 1) * per_session}"] if i + 1 < len(SIZES) else []
        summary, _ = train(env, "resize", *stop, workers=workers)
        assert summary["step"] == (i + 1) * per_session
        runs.append(summary["run_id"])
    assert set(runs) == {runs[0]}
    loss = metric_by_step(env["uri"], runs[0], mn.TRAIN_LOSS)
    fp = metric_by_step(env["uri"], runs[0], mn.DATA_FINGERPRINT)
    ws = metric_by_step(env["uri"], runs[0], mn.TRAIN_WORLD_SIZE)
    assert fp == reference["fp"]
    assert [ws[s] for s in range(1, STEPS + 1)] == [w for w in SIZES for _ in range(per_session)]
    for step in range(1, STEPS + 1):
        assert loss[step] == pytest.approx(reference["loss"][step], rel=2e-5, abs=2e-5), step


def test_export_hf_gives_the_same_logits_and_generate_is_deterministic(env, reference, tmp_path):
    from transformers import GPT2LMHeadModel

    from elastic_gpt.inference.generate import load_model, sample_text
    from elastic_gpt.inference.hf_export import export_hf

    url = "s3://ckpts/reference"
    export_hf(url, str(tmp_path / "hf"))
    ours, state = load_model(url)
    assert state["step"] == STEPS
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)
    a = sample_text(url + f"/step_{STEPS:08d}", "def ", max_new_tokens=20, temperature=0)
    b = sample_text(url, "def ", max_new_tokens=20, temperature=0)
    assert a == b and a.startswith("def ") and len(a) > len("def ")

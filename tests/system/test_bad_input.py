"""Bad input that reaches Ray (C6 clear errors): a Ray address that names no host, and what only a
worker can see (a shard whose bytes were changed in place, a disk that fills up during a
checkpoint), each a real run that stops after one attempt; and a run interrupted by the user is
closed KILLED."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.bad_input_cases import (
    CASES,
    NEEDS_RAY,
    REPO,
    assert_one_line_exit_2_and_nothing_changed,
    make_world,
)

THROUGH_RAY = [c for c in CASES if c.needs == NEEDS_RAY]


@pytest.fixture(scope="module")
def world(tmp_path_factory, stdlib_dataset):
    yield from make_world(str(tmp_path_factory.mktemp("world")), stdlib_dataset, servers=False)


@pytest.mark.parametrize("case", THROUGH_RAY, ids=[c.id for c in THROUGH_RAY])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, world, monkeypatch, capsys):
    assert_one_line_exit_2_and_nothing_changed(case, world, monkeypatch, capsys)


CLI = os.path.join(os.path.dirname(sys.executable), "elastic-gpt")


def train_process(data: str, root: str, *extra: str, timeout: float = 400,
                  background: bool = False):
    """`elastic-gpt train` in its own process and its own local Ray cluster (W=2, tiny model)."""
    args = [CLI, "train", "--config", "jobs/configs/mini.yaml", "model.preset=tiny",
            f"data.path={data}", f"checkpoint.path={root}/ckpt", f"run.storage_path={root}/ray",
            f"tracking.uri=sqlite:///{root}/mlflow.db", "tracking.log_model=false",
            "train.max_steps=4",
            "train.warmup_steps=1", "train.log_every=1", "checkpoint.every_steps=2", *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    if background:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def attempts(output: str) -> int:
    """Worker groups started: rank 0 prints its setup line once per attempt."""
    return output.count("worker(s) on cpu")


def only_run(root: str):
    import mlflow
    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, runs
    return runs[0]


def test_a_shard_changed_in_place_stops_after_one_attempt_then_the_fixed_run_reopens(
        stdlib_dataset, tmp_path):
    """Same sizes, other bytes: only a worker's checksum sees it. The run stops at once, FAILED
    with the reason; once the shards are restored, the same MLflow run goes on and finishes."""
    data = str(tmp_path / "data")
    shutil.copytree(stdlib_dataset, data)
    shards = sorted(f for f in os.listdir(data) if f.endswith(".bin"))
    originals = {}
    for name in shards:
        path = os.path.join(data, name)
        with open(path, "rb") as f:
            originals[name] = f.read()
        with open(path, "wb") as f:
            f.write(bytes(b ^ 1 for b in originals[name]))
    out = train_process(data, str(tmp_path))
    output = out.stdout + out.stderr
    assert out.returncode == 2, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("elastic-gpt train: error: ") and "does not match its checksum" in last
    assert attempts(output) == 1, output[-3000:]
    run = only_run(str(tmp_path))
    assert run.info.status == "FAILED"
    assert "does not match its checksum" in run.data.tags["elastic_gpt.failure"]

    for name, blob in originals.items():
        with open(os.path.join(data, name), "wb") as f:
            f.write(blob)
    out = train_process(data, str(tmp_path))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    again = only_run(str(tmp_path))
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert "elastic_gpt.failure" not in again.data.tags


@pytest.fixture
def small_disk(tmp_path):
    """A real file system with room for about one checkpoint of the tiny model."""
    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2200k", "tmpfs", disk],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root with CAP_SYS_ADMIN")
    yield disk
    subprocess.run(["umount", disk], capture_output=True)


def test_a_full_disk_during_a_checkpoint_stops_once_and_keeps_the_previous_one(
        stdlib_dataset, tmp_path, small_disk):
    from elastic_gpt.checkpoint.store import CheckpointStore

    out = train_process(stdlib_dataset, str(tmp_path), f"checkpoint.path={small_disk}/ckpt",
                        "checkpoint.keep=2", "train.max_steps=6")
    output = out.stdout + out.stderr
    assert out.returncode == 2, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("elastic-gpt train: error: storage is full"), last
    store = CheckpointStore(f"{small_disk}/ckpt")
    latest = store.latest()
    assert latest is not None and f"checkpoint of step {latest.step}" in last and "intact" in last
    assert store.verify(latest.step) is None
    assert attempts(output) == 1, output[-3000:]
    assert only_run(str(tmp_path)).info.status == "FAILED"


def test_an_interrupted_run_is_closed_killed(stdlib_dataset, tmp_path):
    import signal
    import time

    proc = train_process(stdlib_dataset, str(tmp_path), "train.max_steps=2000",
                         "checkpoint.every_steps=1000", background=True)
    seen = []
    t0 = time.time()
    for line in proc.stdout:
        seen.append(line)
        if "step 2/" in line or time.time() - t0 > 300:
            break
    proc.send_signal(signal.SIGTERM)  # what `ray job stop` sends the driver
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted; resume by running the same command again" in output
    run = only_run(str(tmp_path))
    assert run.info.status == "KILLED" and "interrupted" in run.data.tags["elastic_gpt.failure"]

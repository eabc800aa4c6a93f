"""Run it where users run it: `ray job submit` against a head started with `ray start --head` and a
second node started with `ray start --address`, then `ray job stop` and a resubmit that resumes
the same run (C5 one MLflow run); what a submission with bad input says (C6 clear errors); and
the data pipelines submitted as Ray jobs.

The Ray nodes are `ray start --block` processes of our own: SIGTERM to their pids stops every
process they started (never the stop-everything CLI, which would also stop clusters it did not start)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import uuid

import pytest

from elastic_gpt.checkpoint.store import COMMIT_MARKER, CheckpointStore
from elastic_gpt.testing.ports import free_port
from elastic_gpt.tracking import metric_names as mn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
# Steps of 64 x 64 tokens (~0.3-0.8 s on 2 busy cores): `ray job stop` lands some steps after
# the first commit, well before the end.
STEPS = 80
EVERY = 5


def _env(temp_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "MLFLOW_"))}
    # `python` in a job's entrypoint is the one on the nodes' PATH: this venv's.
    env.update(PATH=BIN + os.pathsep + env.get("PATH", ""), RAY_TMPDIR=temp_dir,
               RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    # Ray's token auth with a token of our own (as a production cluster would run), rather than
    # whatever ~/.ray/auth_token other clusters on this machine left behind.
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    return env


class RayNodes:
    """A head (2 CPUs, dashboard + job server on loopback) and one worker node (1 CPU)."""

    def __init__(self, temp_dir: str):
        os.makedirs(temp_dir, exist_ok=True)
        self.temp_dir, self.env = temp_dir, _env(temp_dir)
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.procs: list[subprocess.Popen] = []
        self._logs = []
        self._start("head", "--head", f"--port={self.gcs_port}", "--num-cpus=2",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={self.dashboard_port}", f"--temp-dir={temp_dir}",
                    *self._ports())
        try:
            self._start_nodes()
        except BaseException:
            self.stop()
            raise

    def _start_nodes(self) -> None:
        self._wait_for_job_server()
        for attempt in range(3):  # Ray gives a raylet 30 s to register: too short on a busy box
            # A temp folder of its own, as on a machine of its own: each node unpacks a job's
            # working dir into its session folder, and in a shared one the worker's unpacking
            # would replace the files under a job's driver on the head.
            self._start(f"worker{attempt}", f"--address=127.0.0.1:{self.gcs_port}",
                        "--num-cpus=1", f"--temp-dir={self.temp_dir}/w{attempt}", *self._ports())
            if self._wait_for_nodes(2, worker=self.procs[-1]):
                return
        raise AssertionError("the worker node did not join:\n" + self._tail("worker2"))

    def _ports(self) -> list[str]:
        # Explicit free ports for everything a node listens on: other Ray clusters may be running.
        return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                "--object-store-memory=100000000"]

    def _start(self, name: str, *args: str) -> None:
        log = open(os.path.join(self.temp_dir, f"{name}.log"), "w")
        self._logs.append(log)
        self.procs.append(subprocess.Popen(
            [os.path.join(BIN, "ray"), "start", "--block", "--disable-usage-stats", *args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_for_job_server(self, timeout_s: float = 90) -> None:
        import urllib.error
        import urllib.request
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.procs[0].poll() is None, self._tail("head")
            try:
                with urllib.request.urlopen(f"{self.address}/api/version", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers (401 where Ray's token auth is on: the CLI sends the token)
            except OSError:
                time.sleep(0.5)
        raise AssertionError("job server did not come up:\n" + self._tail("head"))

    def _wait_for_nodes(self, n: int, worker: subprocess.Popen, timeout_s: float = 90) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline and worker.poll() is None:
            out = subprocess.run(
                [os.path.join(BIN, "ray"), "list", "nodes", "--address",
                 f"127.0.0.1:{self.gcs_port}", "--filter", "state=ALIVE", "--format", "json"],
                env=self.env, capture_output=True, text=True, timeout=60)
            try:
                if len(json.loads(out.stdout)) >= n:
                    return True
            except ValueError:
                pass
            time.sleep(1)
        return False

    def _tail(self, name: str) -> str:
        with open(os.path.join(self.temp_dir, f"{name}.log")) as f:
            return f.read()[-3000:]

    def ray(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        """`ray job ...` against this cluster, from the repository root (--working-dir .)."""
        return subprocess.run([os.path.join(BIN, "ray"), "job", *args, "--address", self.address]
                              if args[0] != "submit" else
                              [os.path.join(BIN, "ray"), "job", "submit", "--address",
                               self.address, *args[1:]],
                              cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def stop(self) -> None:
        """SIGTERM to each `ray start --block` and, with it, every process of its node (they
        share the process group it was started in), then SIGKILL what is left after a short grace
        for all of them (a test cluster has nothing to save; `ray start --block` took over 10 s
        to exit on its SIGTERM, for each node)."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 3
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        for log in self._logs:
            log.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    # A short temp dir: Ray's socket paths must stay under 107 bytes.
    temp_dir = f"/tmp/ray_jobs_{os.getpid()}"
    cluster = RayNodes(temp_dir)
    yield cluster
    cluster.stop()
    shutil.rmtree(temp_dir, ignore_errors=True)


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or "unknown"


def submit_args(name: str, data: str, root: str, commit: str, *extra: str,
                wait: bool = True) -> list[str]:
    # --working-dir uploads the code without .git: the commit travels as job metadata.
    return ["submit", "--submission-id", name, "--working-dir", ".",
            "--runtime-env", "jobs/runtime_env.yaml",
            "--metadata-json", json.dumps({"git_commit": commit}),
            *([] if wait else ["--no-wait"]), "--",
            "python", "jobs/pretrain.py", "--config", "jobs/configs/mini.yaml",
            # Absolute paths: inside a job, relative ones would land in the job's unpacked copy
            # of the working dir (see docs/operations.md).
            "model.preset=tiny", f"data.path={data}", f"checkpoint.path={root}/ckpt",
            f"run.storage_path={root}/ray", f"tracking.uri=sqlite:///{root}/mlflow.db",
            "run.name=job-test", f"train.max_steps={STEPS}", "train.global_batch_size=64",
            "train.micro_batch_size=16", "train.warmup_steps=5", "train.log_every=5",
            f"checkpoint.every_steps={EVERY}", "checkpoint.keep=3",
            "scaling.min_workers=2", "scaling.max_workers=2", *extra]


def job_status(nodes: RayNodes, job: str) -> str:
    """The job's status from the job server's REST API (the CLI takes seconds per call)."""
    import urllib.request
    req = urllib.request.Request(f"{nodes.address}/api/jobs/{job}", headers={
        "Authorization": f"Bearer {nodes.env['RAY_AUTH_TOKEN']}"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return json.load(r)["status"]
    except OSError as e:  # a busy job server: ask again later
        return f"UNKNOWN ({e})"


def wait_for_status(nodes: RayNodes, job: str, wanted: set[str], timeout_s: float) -> str:
    deadline, status = time.time() + timeout_s, ""
    while time.time() < deadline:
        status = job_status(nodes, job)
        if status in wanted:
            return status
        time.sleep(1)
    raise AssertionError(f"job {job} still {status} after {timeout_s}s:\n"
                         + nodes.ray("logs", job).stdout[-4000:])


def newest_committed(ckpt: str) -> int | None:
    latest = CheckpointStore(ckpt).latest()
    return latest.step if latest else None


def test_submit_stop_resubmit_resumes_the_same_run(nodes, stdlib_dataset, tmp_path):
    import mlflow

    root, commit = str(tmp_path), git_head()
    ckpt = f"{root}/ckpt"
    # Bad input first, in parallel with the real job: a missing config fails the job with one line.
    bad = nodes.ray("submit", "--submission-id", "job-missing-config", "--working-dir", ".",
                    "--runtime-env", "jobs/runtime_env.yaml", "--no-wait", "--", "python",
                    "jobs/pretrain.py", "--config", "jobs/configs/missing.yaml")
    assert bad.returncode == 0, bad.stderr

    first = nodes.ray(*submit_args("job-1", stdlib_dataset, root, commit, wait=False))
    assert first.returncode == 0, first.stdout + first.stderr
    # Stop it once a checkpoint is committed and while it still has steps to go.
    deadline, next_check = time.time() + 240, 0.0
    while not glob.glob(os.path.join(ckpt, "step_*", COMMIT_MARKER)):
        if time.time() > next_check:  # the job server answers slowly on a busy machine
            status = job_status(nodes, "job-1")
            assert time.time() < deadline, "no checkpoint after 240 s"
            assert status in ("PENDING", "RUNNING") or status.startswith("UNKNOWN"), \
                status + nodes.ray("logs", "job-1").stdout[-4000:]
            next_check = time.time() + 5
        time.sleep(0.1)
    stop = nodes.ray("stop", "job-1")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_for_status(nodes, "job-1", {"STOPPED"}, 60) == "STOPPED"
    # The workers go with their driver; wait until no new checkpoint appears.
    committed = newest_committed(ckpt)
    time.sleep(3)
    while newest_committed(ckpt) != committed:
        committed = newest_committed(ckpt)
        time.sleep(3)
    assert EVERY <= committed < STEPS, f"job-1 was not stopped mid-run (step {committed})"
    run_id = CheckpointStore(ckpt).latest().state["mlflow_run_id"]
    assert run_id

    # The same command again: it resumes from the committed step and finishes the run.
    second = nodes.ray(*submit_args("job-2", stdlib_dataset, root, commit), timeout=240)
    assert wait_for_status(nodes, "job-2", {"SUCCEEDED", "FAILED"}, 30) == "SUCCEEDED", \
        second.stdout[-4000:] + second.stderr[-2000:]
    logs = nodes.ray("logs", "job-2").stdout
    assert f"resumed from file://{ckpt}/step_{committed:08d} at step {committed}" in logs, logs
    assert re.search(rf"\[elastic-gpt\] step {STEPS}/{STEPS} \| loss \d+\.\d+ \| lr ", logs), logs
    assert f"[elastic-gpt] done: step {STEPS}" in logs
    final = CheckpointStore(ckpt).latest()
    assert final.step == STEPS and final.state["mlflow_run_id"] == run_id

    # One MLflow run across both submissions (C5 one MLflow run), every step logged, closed as
    # FINISHED.
    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("elastic-gpt").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    logged = {m.step for m in client.get_metric_history(run_id, mn.TRAIN_LOSS)}
    assert set(range(committed + 1, STEPS + 1)) <= logged <= set(range(1, STEPS + 1))
    # Steps before the checkpoint logged by job-1 in its last flush interval may be lost with it
    # unless the trainer flushes the MetricLogger before each commit.
    assert len(logged) >= committed - 2 * EVERY
    assert run.data.params["env.git_commit"] == commit
    assert run.data.tags["ray_job_submission_id"] == "job-2"
    assert int(run.data.params["cluster.nodes"]) == 2 and run.data.params["cluster.cpus"] == "3"
    # The final model, filed under the run's experiment with artifacts beside the database
    # (not in ./mlruns of the job's throwaway working dir).
    model = client.get_logged_model(run.data.tags["elastic_gpt.model_uri"].split("/")[-1])
    assert model.experiment_id == run.info.experiment_id
    assert f"{root}/mlartifacts/" in model.artifact_location
    events = [json.loads(line) for line in open(client.download_artifacts(
        run_id, "events/events.jsonl", str(tmp_path / "dl")))]
    starts = [e for e in events if e["kind"] == "submission"]
    assert [(e["ray_job_submission_id"], e["resumed_from_step"]) for e in starts] == \
        [("job-1", None), ("job-2", committed)]

    # The job with a missing config failed with one readable line, not a traceback.
    assert wait_for_status(nodes, "job-missing-config", {"FAILED", "SUCCEEDED"}, 30) == "FAILED"
    bad_logs = nodes.ray("logs", "job-missing-config").stdout
    assert "elastic-gpt train: error: config file jobs/configs/missing.yaml does not exist" in bad_logs
    assert "Traceback" not in bad_logs


def test_the_data_pipelines_run_as_ray_jobs(nodes, tmp_path):
    """`python -m data_pipelines prepare` as a Ray Data job over the cluster's nodes and the
    compatible `jobs/prepare_data.py` in one process, both writing to S3
    (a real S3-protocol server on loopback: a multi-node job needs storage every node sees):
    both commit a dataset, and the same input makes the same shards whichever way it ran."""
    from elastic_gpt.data.manifest import load_manifest, validation_url
    from elastic_gpt.testing.s3_server import S3Server

    server = S3Server()
    try:
        bucket, options = server.make_bucket(), server.storage_options()
        stdlib = sysconfig.get_paths()["stdlib"]
        fs = server.filesystem()
        for name in sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))[:12]:
            fs.put(os.path.join(stdlib, name), f"{bucket}/raw/{name}")
        out = {"ray": f"s3://{bucket}/ray", "local": f"s3://{bucket}/local"}
        for engine, command in (("ray", ["-m", "data_pipelines", "prepare"]),
                                ("local", ["jobs/prepare_data.py"])):
            job = f"prepare-{engine}"
            sub = nodes.ray("submit", "--submission-id", job, "--working-dir", ".",
                            "--runtime-env", "jobs/runtime_env.yaml", "--", "python", *command,
                            "--input", f"s3://{bucket}/raw/*.py", "--output", out[engine],
                            "--storage-options", json.dumps(options), "--tokenizer", "bytes",
                            "--seq-len", "64", "--part-bytes", "64KB", "--val-docs", "2",
                            "--engine", engine, "--no-progress")
            assert wait_for_status(nodes, job, {"SUCCEEDED", "FAILED"}, 60) == "SUCCEEDED", \
                sub.stdout[-4000:] + sub.stderr[-2000:]
            assert f"prepared {out[engine]}:" in sub.stdout and f"tokenizing ({engine})" in \
                sub.stdout, sub.stdout[-4000:]
        train = {e: load_manifest(url, options) for e, url in out.items()}
        val = {e: load_manifest(validation_url(url), options) for e, url in out.items()}
        assert len(train["ray"].shards) > 1 and train["ray"].num_samples > 0
        for manifests in (train, val):  # shard by shard: sizes, sample counts, sha256
            assert manifests["ray"].shards == manifests["local"].shards
        names = {e: sorted(p.rsplit("/", 1)[1] for p in fs.ls(url.removeprefix("s3://")))
                 for e, url in out.items()}
        assert names["ray"] == names["local"] and "manifest.json" in names["ray"]
        for name in names["ray"]:
            if name.endswith((".bin", ".idx")):
                assert fs.cat(f"{bucket}/ray/{name}") == fs.cat(f"{bucket}/local/{name}"), name
    finally:
        server.stop()

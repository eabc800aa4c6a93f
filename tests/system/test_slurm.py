"""deploy/slurm/ against a real Slurm: munged, slurmctld and a slurmd for each of n1..n3 on
loopback (elastic_gpt/testing/slurm.py, Debian's packages installed when missing), the batch
scripts submitted with sbatch as a user submits them, training the small job on a Ray cluster the
scripts start on the emulated nodes.

One main job carries the slow tests through every event, in this order (each Ray start on two
busy cores costs tens of seconds, so one run serves them all):

1. it starts on n1 and n2 and trains at W=2; a shell without the job's token is refused;
2. n2's Ray step is SIGKILLed: the run shrinks to W=1, the job is not requeued;
3. a grow job on n3 joins: the run grows back to W=2; its own warning drains n3 only: a
   checkpoint at the step boundary, back to W=1 with no step lost, and the grow job ends;
4. with a second grow job pending, the main job's time limit is brought close so that Slurm
   itself sends the warning: drain, checkpoint, requeue (the pending grow job is cancelled), and
   the rerun on two nodes resumes from that step and trains to the end (the config it rereads
   is shortened while it waits in the queue: the step the warning lands on depends on Slurm's
   30-second timer, the rerun's length should not).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml

from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.config import load_config
from elastic_gpt.elastic import slurm as slurm_helpers
from elastic_gpt.testing.slurm import ENDED, BatchJob, SlurmCluster, ensure_installed
from elastic_gpt.tracking import metric_names as mn
from tests.training_records import metric_by_step, uninterrupted_fingerprints

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
SLURM = os.path.join(REPO, "deploy", "slurm")
MAIN_SCRIPT = os.path.join(SLURM, "elastic-gpt.sbatch")
GROW_SCRIPT = os.path.join(SLURM, "grow.sbatch")
SCRIPTS = ["deploy/slurm/elastic-gpt.sbatch", "deploy/slurm/grow.sbatch",
           "deploy/slurm/ray-node.sh", "deploy/slurm/fabric.sh"]
def step_at(world_size: int) -> str:
    """A step line at this world size; group 1 is the step."""
    return rf"\[elastic-gpt\] step (\d+)/\d+ .*\| W={world_size} "


# ---- the scripts, without Slurm -------------------------------------------------------------------

def test_scripts_pass_bash_n_and_shellcheck():
    ensure_installed(("shellcheck",))
    for script in SCRIPTS:
        out = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    # -x follows the `source` of fabric.sh; paths are the repository's.
    out = subprocess.run(["shellcheck", "-x", *SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("argv, says", [
    (["deploy/slurm/elastic-gpt.sbatch"], "pass elastic-gpt train's arguments: --config FILE"),
    (["deploy/slurm/elastic-gpt.sbatch", "train.max_steps=5"], "--config FILE"),
    (["deploy/slurm/elastic-gpt.sbatch", "--config", "no/such.yaml"],
     "config file no/such.yaml does not exist"),
    (["deploy/slurm/elastic-gpt.sbatch", "--config", "jobs/configs/mini.yaml"],
     "runs as a Slurm batch job: sbatch deploy/slurm/elastic-gpt.sbatch"),
    (["deploy/slurm/grow.sbatch"], "pass the main job's id: grow.sbatch MAIN_JOB_ID"),
    (["deploy/slurm/grow.sbatch", "12", "13"], "pass the main job's id"),
    (["deploy/slurm/grow.sbatch", "abc"], "pass the main job's id"),
    (["deploy/slurm/grow.sbatch", "12"], "runs as a Slurm batch job"),
    (["deploy/slurm/ray-node.sh", "leader", "1", "h:1"], "unknown role 'leader'"),
    (["deploy/slurm/ray-node.sh", "head", "1", "6379"], "head takes RUN_JOB GCS_PORT DASHBOARD_PORT"),
    (["deploy/slurm/ray-node.sh", "worker", "1", "nohostport"], "worker takes RUN_JOB HEAD_IP:GCS_PORT"),
    (["deploy/slurm/ray-node.sh", "worker", "main", "h:1"], "RUN_JOB 'main' is not a Slurm job id"),
    (["deploy/slurm/ray-node.sh", "worker", "1", "h:1"], "runs inside a Slurm step"),
])
def test_script_arguments_parse(argv, says):
    """Bad arguments, or a script run outside Slurm: one line naming the fix, exit 2, nothing
    started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run(["bash", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and ": error: " in lines[0], out.stderr


def test_scripts_help_shows_the_submission():
    for script, shows in (("deploy/slurm/elastic-gpt.sbatch", "--signal=B:USR1@<lead>"),
                          ("deploy/slurm/grow.sbatch", "--job-name=elastic-gpt-grow-<MAIN_JOB_ID>")):
        out = subprocess.run(["bash", script, "--help"], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0 and shows in out.stdout and "#SBATCH" not in out.stdout


def lead(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_gpt.elastic.slurm", "lead", *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_lead_from_a_step_and_a_checkpoint_write(tmp_path, capsys):
    """The warning's lead: two steps and a checkpoint write with margin, plus what does not
    scale with the model; bad flags are one line and exit 2."""
    out = lead("--step-s", "2", "--checkpoint-s", "30")  # as a user runs it
    assert out.returncode == 0 and int(out.stdout) == slurm_helpers.lead_seconds(2, 30)
    assert slurm_helpers.lead_seconds(2, 30) == 81  # 1.5 x (2 x 2 s + 30 s) + 30 s
    assert slurm_helpers.lead_seconds(4, 30) > slurm_helpers.lead_seconds(2, 30)
    for argv, says in ((["--step-s", "2"], "pass --plan plan.json, or both --step-s and"),
                       (["--plan", "p.json", "--step-s", "1"], "not both"),
                       (["--plan", str(tmp_path / "none.json")], "does not exist"),
                       (["--step-s", "-1", "--checkpoint-s", "1"], "argument --step-s")):
        try:
            code = slurm_helpers.main(["lead", *argv])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.splitlines()) == 1, err


def test_lead_from_a_plan(tmp_path):
    """`elastic-gpt plan --json` gives the step and the checkpoint write the lead is made of."""
    made = subprocess.run([os.path.join(BIN, "elastic-gpt"), "plan", "--model", "gpt2-1.5b",
                           "--gpu", "H100", "--gpus", "64", "--tokens", "30e9", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    plan = tmp_path / "plan.json"
    plan.write_text(made.stdout)
    summary = json.loads(made.stdout)
    out = lead("--plan", str(plan))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == slurm_helpers.lead_seconds(summary["step_s"], summary["ckpt_write_s"])
    plan.write_text("{}")
    out = lead("--plan", str(plan))
    assert out.returncode == 2 and "is not an `elastic-gpt plan --json` output" in out.stderr


def test_time_left_is_read_as_squeue_writes_it():
    assert slurm_helpers.parse_time_left("4:05") == 245
    assert slurm_helpers.parse_time_left("1:02:03") == 3723
    assert slurm_helpers.parse_time_left("2-01:00:00") == 2 * 86400 + 3600
    assert slurm_helpers.parse_time_left("UNLIMITED") is None
    assert slurm_helpers.parse_time_left("") is None


def fake_sysfs(root, ports: dict[str, tuple[str, str]], modules: tuple[str, ...] = ()) -> str:
    """A sysfs tree with InfiniBand ports `{"mlx5_0/1": (state, link_layer)}` and kernel
    modules, as the kernel lays them out."""
    for port, (state, link) in ports.items():
        dev, num = port.split("/")
        path = os.path.join(root, "class", "infiniband", dev, "ports", num)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state"), "w") as f:
            f.write(state + "\n")
        with open(os.path.join(path, "link_layer"), "w") as f:
            f.write(link + "\n")
    for module in modules:
        os.makedirs(os.path.join(root, "module", module), exist_ok=True)
    os.makedirs(os.path.join(root, "class"), exist_ok=True)
    return str(root)


def fabric_env(sysfs: str, **env) -> tuple[dict[str, str], str]:
    """The NCCL_* settings fabric.sh leaves for a node with this sysfs, and its report line."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    out = subprocess.run(["bash", "-c", 'ip=127.0.0.1; source deploy/slurm/fabric.sh; env'],
                         cwd=REPO, env={**base, "ELASTIC_GPT_SYSFS": sysfs, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found = dict(line.split("=", 1) for line in out.stdout.splitlines()
                 if line.startswith("NCCL_") and "=" in line)
    return found, out.stderr


def test_fabric_settings_are_each_nodes_own(tmp_path):
    """Active InfiniBand ports only (not a port that is down, not RoCE), as an exact list; the
    socket interface of the node's address; GPUDirect RDMA reported; a job-wide setting kept."""
    ib = fake_sysfs(tmp_path / "ib", {
        "mlx5_0/1": ("4: ACTIVE", "InfiniBand"), "mlx5_1/1": ("1: DOWN", "InfiniBand"),
        "mlx5_2/1": ("4: ACTIVE", "Ethernet"), "mlx5_3/1": ("4: ACTIVE", "InfiniBand")},
        modules=("nvidia_peermem",))
    found, said = fabric_env(ib)
    assert found["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_3:1"
    assert found["NCCL_SOCKET_IFNAME"] == "lo"  # 127.0.0.1's interface
    assert "GPUDirect-RDMA=yes" in said and "SHARP=no" in said

    found, said = fabric_env(fake_sysfs(tmp_path / "none", {}))
    assert "NCCL_IB_HCA" not in found and "NCCL will use sockets" in said

    found, _ = fabric_env(ib, NCCL_IB_HCA="mlx5_3")
    assert found["NCCL_IB_HCA"] == "mlx5_3"  # the job's own choice wins


# ---- a real Slurm ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    # A requeued job starts again once its credentials expired (5 s) and its processes are gone
    # (SIGKILL 2 s after SIGTERM).
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")), nodes=3, cred_expire_s=5,
                           kill_wait_s=2)
    # Ray's temp dirs: short (socket paths under 107 bytes) and this session's own (job ids
    # restart at 1 in every test cluster).
    cluster.ray_tmp = f"/tmp/egs{os.getpid()}"
    os.makedirs(cluster.ray_tmp, exist_ok=True)
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.ray_tmp, ignore_errors=True)


def job_env(cluster: SlurmCluster, root: str, **extra: str) -> dict[str, str]:
    """What a user's shell has when they sbatch: the environment with elastic-gpt on PATH (sbatch
    passes it to the job), and the scripts' settings for this machine: one CPU per Ray worker
    node (one training worker per node), a small object store."""
    env = {"PATH": BIN + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
           "ELASTIC_GPT_SLURM_STATE": f"{root}/state", "ELASTIC_GPT_RAY_CPUS": "1",
           "ELASTIC_GPT_RAY_OBJECT_STORE_BYTES": "80000000", "ELASTIC_GPT_RAY_TMP": cluster.ray_tmp,
           "RAY_DEDUP_LOGS": "0", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    return {**env, **extra}


RUN_NAME = "slurm-run"


def write_config(path: str, data: str, root: str, **train) -> str:
    """The small job: the tiny preset, 16 samples of 64 tokens a step, a step line each step, a
    checkpoint every 5 steps."""
    cfg = {"model": {"preset": "tiny"}, "data": {"path": data, "seed": 1234},
           "train": {"global_batch_size": 16, "micro_batch_size": 8, "max_steps": 5000,
                     "warmup_steps": 2, "lr": 3e-3, "log_every": 1, **train},
           "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
           "eval": {"samples": 0},
           "checkpoint": {"path": f"{root}/ckpt", "every_steps": 5, "keep": 3},
           "tracking": {"uri": f"sqlite:///{root}/mlflow.db", "log_model": False},
           "run": {"name": RUN_NAME, "storage_path": f"{root}/ray"},
           "elastic": {"grow_settle_s": 0, "worker_start_timeout_s": 60},
           "health": {"straggler_every_steps": 0}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path



def seconds(runtime: str) -> int:
    """`scontrol show job`'s RunTime ([days-]hh:mm:ss) in seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def worker_fabric(cluster: SlurmCluster, job_ids: set[str]) -> dict[str, set[str]]:
    """NCCL_IB_HCA of the live Ray Train workers of this Slurm cluster's jobs, by the job whose
    node runs them (read from their environment, as NCCL in them would)."""
    found: dict[str, set[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::RayTrainWorker"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        job = env.get(b"SLURM_JOB_ID", b"").decode()
        if env.get(b"SLURM_CONF") == cluster.conf.encode() and job in job_ids:
            found.setdefault(job, set()).add(env.get(b"NCCL_IB_HCA", b"").decode())
    return found


def start_without_the_token(root: str, job_id: str, data: str) -> list[subprocess.Popen]:
    """`elastic-gpt train` against the run's head (token auth, the job's own token) from a shell
    without it: once with a stale ~/.ray/auth_token and no RAY_AUTH_MODE (Ray's client then sends
    nothing), once with a wrong token. Started now, read when the run is done."""
    home = os.path.join(root, "home")
    os.makedirs(os.path.join(home, ".ray"), exist_ok=True)
    with open(os.path.join(home, ".ray", "auth_token"), "w") as f:
        f.write(uuid.uuid4().hex)
    with open(os.path.join(root, "state", job_id, "head.env")) as f:
        address = f.read().strip().split("=", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=home, PATH=BIN + os.pathsep + env["PATH"], RAY_ADDRESS=address)
    procs = []
    for name, extra in (("none", {}), ("wrong", {"RAY_AUTH_MODE": "token",
                                                 "RAY_AUTH_TOKEN": uuid.uuid4().hex})):
        procs.append(subprocess.Popen(
            [os.path.join(BIN, "elastic-gpt"), "train", "--config", "jobs/configs/mini.yaml",
             "model.preset=tiny", f"data.path={data}", f"checkpoint.path={root}/{name}/ckpt",
             f"tracking.uri=sqlite:///{root}/{name}.db", "train.max_steps=2"],
            cwd=REPO, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    return procs


@pytest.fixture(scope="module")
def run(slurm, stdlib_dataset, tmp_path_factory):
    """One main job through every Slurm event (the module docstring's order); returns what the
    tests check. One run because each Ray start on two busy cores costs tens of seconds."""
    root = str(tmp_path_factory.mktemp("run"))
    config = write_config(f"{root}/run.yaml", stdlib_dataset, root)
    # The lead the scripts document: from a step and a checkpoint write (generous for this
    # machine's sub-second steps and checkpoints).
    lead = slurm_helpers.lead_seconds(step_s=1.0, checkpoint_s=5.0)
    # The main job's user exported an HCA for the whole job; the grow job's node has other HCAs.
    main_ib = fake_sysfs(f"{root}/sys-main", {})
    grow_ib = fake_sysfs(f"{root}/sys-grow", {"mlx5_4/1": ("4: ACTIVE", "InfiniBand"),
                                              "mlx5_5/1": ("1: DOWN", "InfiniBand")})
    job = BatchJob(slurm, f"{root}/job.out", "--nodes=2", "--time=30", f"--signal=B:USR1@{lead}",
                   MAIN_SCRIPT, "--config", config, cwd=REPO,
                   env=job_env(slurm, root, NCCL_IB_HCA="mlx5_0", ELASTIC_GPT_SYSFS=main_ib))
    seen = {"job": job, "root": root, "config": config, "lead": lead}
    job.wait_for(step_at(2), timeout_s=300)
    seen["refused"] = start_without_the_token(root, job.id, stdlib_dataset)
    first = job.wait_for(r"\[elastic-gpt\] step 7/", timeout_s=120)  # step 5 is committed

    # A node's Ray step killed (SIGKILL to its raylet and everything under it): a hard loss.
    steps = slurm.run("squeue", "-h", "-s", "-j", job.id, "-o", "%i %j").stdout.splitlines()
    (n2_step,) = [s.split()[0] for s in steps if s.split()[1:] == ["ray-n2"]]
    slurm.run("scancel", "--signal=KILL", n2_step)
    shrunk = job.wait_for(step_at(1), timeout_s=180, after=first.end())
    seen.update(killed_step=n2_step, shrunk=shrunk, after_kill=job.state(),
                steps_after_kill=slurm.steps(job.id))

    # A grow job on n3 joins: the run grows back to two workers.
    grow = BatchJob(slurm, f"{root}/grow.out", "--nodes=1", f"--job-name=elastic-gpt-grow-{job.id}",
                    GROW_SCRIPT, job.id, cwd=REPO, env=job_env(slurm, root, ELASTIC_GPT_SYSFS=grow_ib))
    grown = job.wait_for(step_at(2), timeout_s=180, after=shrunk.end())
    seen.update(grow=grow, grown=grown, grow_state=grow.state(),
                fabric=worker_fabric(slurm, {job.id, grow.id}))

    # The grow job's own warning (the signal Slurm sends it before its time limit). What the run
    # says of it is read from n1's worker: n3's lines may not be sent before n3 goes.
    slurm.run("scancel", "--batch", "--signal=USR1", grow.id)
    grow_stop = job.wait_for(r"W 2 -> 1, resuming at step (\d+) \((\d+) step\(s\) to redo\)",
                             timeout_s=180, after=grown.end())
    back = job.wait_for(step_at(1), timeout_s=180, after=grow_stop.end())
    seen.update(grow_stop=grow_stop, back=back,
                grow_final=slurm.wait_for_state(grow.id, ENDED, timeout_s=120))

    # Another grow job, still pending when the main job's allocation ends.
    pending = BatchJob(slurm, f"{root}/pending.out", "--nodes=1", "--begin=now+3600",
                       f"--job-name=elastic-gpt-grow-{job.id}", GROW_SCRIPT, job.id, cwd=REPO,
                       env=job_env(slurm, root))
    # The end of the allocation comes close: Slurm sends the warning `lead` seconds before it (at
    # its next periodic check, at most 30 s later).
    limit = seconds(job.state()["RunTime"]) + lead + 2
    slurm.run("scontrol", "update", f"JobId={job.id}",
              f"TimeLimit={limit // 3600}:{limit // 60 % 60:02d}:{limit % 60:02d}")
    updated_at = len(job.text())
    warned = job.wait_for(r"warning received", timeout_s=90, after=updated_at)
    requeued = job.wait_for(r"requeueing job", timeout_s=120, after=warned.end())
    # The script requeues once the run has stopped: its newest checkpoint is the one it took.
    step = CheckpointStore(f"{root}/ckpt").latest().step
    seen.update(warned=warned, requeued=requeued, step=step,
                pending_final=slurm.wait_for_state(pending.id, ENDED, timeout_s=60))
    # While the job waits in the queue: its rerun trains 6 more steps and ends, under the time
    # limit it was submitted with (a requeued job keeps the one it had).
    write_config(config, stdlib_dataset, root, max_steps=step + 6)
    slurm.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=30")
    seen["final"] = slurm.wait_for_state(job.id, ENDED, timeout_s=400)
    seen["text"], seen["grow_text"] = job.text(), grow.text()
    seen["refused"] = [(p.communicate(timeout=300)[1], p.returncode) for p in seen["refused"]]
    import mlflow

    uri = f"sqlite:///{root}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  f"attributes.run_name = '{RUN_NAME}'")
    seen.update(mlrun=mlrun, fingerprints=metric_by_step(uri, mlrun.info.run_id,
                                                         mn.DATA_FINGERPRINT),
                # Every step record in the order it was logged: (step, world size).
                trained=[(m.step, m.value) for m in sorted(
                    client.get_metric_history(mlrun.info.run_id, mn.TRAIN_WORLD_SIZE),
                    key=lambda m: m.timestamp)])
    return seen


def trained_once(trained: list[tuple[int, float]], first: int, last: int) -> bool:
    """Whether every step from `first` to `last` was trained exactly once."""
    steps = [s for s, _ in trained if first <= s <= last]
    return sorted(steps) == list(range(first, last + 1))


def test_batch_script_trains_on_two_emulated_nodes_to_completion(run, slurm):
    text, final = run["text"], run["final"]
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", text[-3000:]
    end = run["step"] + 6
    assert f"[elastic-gpt] done: step {end}, checkpoint" in text
    assert "elastic-gpt train exited 0" in text
    # Each run of the job: a head, and a worker on each of its two nodes, all joined.
    heads = re.findall(r"job \d+ run (\d): Ray head at \S+ on (n\d), workers on (n\d) (n\d)", text)
    assert [r for r, *_ in heads] == ["0", "1"] and all(a != b for _, _, a, b in heads)
    assert len(re.findall(r"2 Ray worker node\(s\) of job \d+ joined", text)) == 2
    # The rerun trained on both: W=2 from its first step to the last.
    rerun = [w for s, w in run["trained"] if s > run["step"]]
    assert rerun and set(rerun) == {2}
    assert CheckpointStore(f"{run['root']}/ckpt").latest().step == end
    assert run["mlrun"].info.status == "FINISHED"
    assert not slurm.steps(run["job"].id)  # nothing of the job is left running


def test_killed_node_step_shrinks_the_run_without_requeue(run):
    text, after = run["text"], run["after_kill"]
    # The job lives on (--no-kill): running, never requeued, the killed step gone, the others up.
    assert after["JobState"] == "RUNNING" and after["Restarts"] == "0"
    assert run["killed_step"] not in run["steps_after_kill"]
    assert len(run["steps_after_kill"]) >= 2  # the head and n1's worker
    # A failure charged to the budget; the run went on with one worker from the newest committed
    # checkpoint, on the cadence (checkpoint.every_steps=5), at or before the last step trained
    # at W=2 (from MLflow: a killed node takes the lines its log monitor had not sent yet).
    assert "elastic-gpt: failure 1 in the last hour" in text
    assert "elastic-gpt: failure 2" not in text  # no other event was a failure
    first_w1 = next(i for i, (_, w) in enumerate(run["trained"]) if w == 1)
    last_w2 = max(s for s, _ in run["trained"][:first_w1])
    resumed_from = run["trained"][first_w1][0] - 1
    assert resumed_from == int(run["shrunk"].group(1)) - 1
    assert resumed_from % 5 == 0 and resumed_from <= last_w2
    assert f"resumed from file://{run['root']}/ckpt/step_{resumed_from:08d}" in text


def test_grow_job_grows_the_run_and_its_warning_shrinks_it_with_no_step_lost(run):
    text, grow_id, main_id = run["text"], run["grow"].id, run["job"].id
    assert run["grow_state"]["JobName"] == f"elastic-gpt-grow-{main_id}"
    # Grown to two workers: one on the main job's n1, one on the grow job's n3, each with its own
    # node's fabric settings (the job-wide HCA of the main job never reached the grow job's node).
    assert run["fabric"] == {main_id: {"mlx5_0"}, grow_id: {"=mlx5_4:1"}}
    # Its warning drained its node only: a checkpoint at the step boundary, back to one worker
    # from that very step; the grow job ended by itself.
    assert f"drained 1 of 1 Ray worker node(s) with elastic-gpt/slurm-job={grow_id}" in \
        run["grow_text"]
    k, redone = (int(g) for g in run["grow_stop"].groups())
    assert redone == 0 and int(run["back"].group(1)) == k + 1
    assert f"resumed from file://{run['root']}/ckpt/step_{k:08d} at step {k} (saved by 2" in text
    assert run["grow_final"]["JobState"] == "COMPLETED"
    # No step trained twice from the grow to the step after the shrink.
    assert trained_once(run["trained"], int(run["grown"].group(1)), k + 1)


def test_time_limit_warning_drains_checkpoints_requeues_and_resumes(run):
    text, step, job_id = run["text"], run["step"], run["job"].id
    # Requeued once, by the script, before the time limit (never TIMEOUT).
    assert run["final"]["Restarts"] == "1"
    # In order: Slurm's warning, the drain of the run's worker node (by label), the run leaving it
    # (its checkpoint at the step boundary), the requeue, the rerun resuming from that step.
    at = run["warned"].end()
    for line in (f"drained 1 of 1 Ray worker node(s) with elastic-gpt/slurm-run={job_id}",
                 "the run left the drained nodes", f"requeueing job {job_id}",
                 f"job {job_id} run 1: Ray head", f"resuming from step {step}"):
        found = text.find(line, at)
        assert found > 0, f"{line!r} missing after position {at}:\n{text[at:at + 4000]}"
        at = found
    # The just-in-time checkpoint, committed.
    store = CheckpointStore(f"{run['root']}/ckpt")
    assert step in store.step_dirs() and store.verify(step) is None
    # C2 data order: every step of both runs, the re-done ones after the killed node included,
    # trained the uninterrupted run's samples; none twice from the shrink back to one worker to
    # the end (the step in flight at the warning was finished and saved, not lost).
    cfg = load_config(run["config"])
    assert run["fingerprints"] == uninterrupted_fingerprints(cfg, step + 6)
    assert trained_once(run["trained"], int(run["back"].group(1)), step + 6)


def test_main_job_cancels_its_grow_jobs_when_it_ends(run):
    # The requeue ended the allocation: the grow job still pending was cancelled with it.
    assert run["pending_final"]["JobState"] == "CANCELLED"
    assert "cancelling grow job(s)" in run["text"][run["warned"].end():run["requeued"].end()]


def test_train_tells_a_refused_token_from_an_unreachable_cluster(run):
    """The run's head refuses a shell without the job's token: one line that names the token and
    its fix, not "cannot reach the Ray cluster" (tests/test_bad_input.py has that one), exit 2,
    and no MLflow store created."""
    (none, wrong) = run["refused"]
    for (stderr, code), says, name in (
            (none, "set RAY_AUTH_MODE=token", "none"),
            (wrong, "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the token the head", "wrong")):
        assert code == 2, stderr[-3000:]
        errors = [ln for ln in stderr.splitlines() if ln.startswith("elastic-gpt train: error:")]
        assert len(errors) == 1, stderr[-3000:]
        assert "refused this process's auth token" in errors[0] and says in errors[0]
        assert "cannot reach" not in errors[0]
        assert not os.path.exists(f"{run['root']}/{name}.db")

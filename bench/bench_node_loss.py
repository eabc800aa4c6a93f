"""A node killed under a running group: the time to the first step at W-1, and where it goes.

    .venv/bin/python bench/bench_node_loss.py [--trials 5] [--json out.json]

A 2-worker run of the default job's model (`jobs/configs/mini.yaml`, preset mini, on ~0.5 MB of the
standard library's source in 64-token byte samples, a checkpoint every 4 steps) on a 3-node local
Ray cluster (a head with no CPU for the driver and the controller, two one-CPU nodes, the fast
node health checks of `elastic_gpt/testing/cluster.py`). Each trial hard-kills the node of one
worker (SIGKILL of its raylet and workers), waits for the first step at W=1, then adds a node and
waits for W=2 again before the next trial.

The breakdown of each restart, in the order it happens:

    detection        the kill to the failure's record (the failure policy's decision)
    controller       to the new group sized (the scaling policy's record)
    placement        its placement group made (the GCS's own timing)
    worker start     to the Trainer's construction: the worker actors, their imports, the
                     process group, the ranks' node ids
    build            the Trainer's construction: data, mesh, model, optimizer
    checkpoint read  the restore
    to first step    the rest, to the first step's start
    first step       the first step at W=1 itself

Every part but detection is what the run logs at each attempt's first step
(`system/debug/startup_*`, train/metrics.py); detection is the failure's time (the recovery
event's, from the run's own ledger, as MLflow's `system/debug/event_recovery_s` gives it) less the
kill's. The total is the kill to the first W=1 step's record. The worker start is split further
from Ray Train's own timings in its controller's log: the worker actors made (a process each,
importing Ray and Ray Train), the train context set on them (its arguments' imports: torch), and
the train function launched (its module's imports: the trainer). The machine's load average is
printed with each trial: a figure taken with other work running is not this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_TMPDIR", "/tmp/elastic_gpt_ray_bench")
os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)

from elastic_gpt.testing.cluster import LocalCluster, training_workers, wait_for  # noqa: E402
from elastic_gpt.tracking import metric_names as mn  # noqa: E402

PARTS = ("detection_s", "controller_s", "placement_s", "worker_start_s", "build_s",
         "checkpoint_read_s", "to_first_step_s", "first_step_s")
LOGGED = {"controller_s": mn.STARTUP_CONTROLLER_S, "placement_s": mn.STARTUP_PLACEMENT_S,
          "worker_start_s": mn.STARTUP_WORKER_START_S, "build_s": mn.STARTUP_BUILD_S,
          "checkpoint_read_s": mn.STARTUP_CHECKPOINT_READ_S,
          "to_first_step_s": mn.STARTUP_TO_FIRST_STEP_S, "first_step_s": mn.STARTUP_FIRST_STEP_S,
          "recovery_s": mn.EVENT_RECOVERY_S}


class Run:
    """`elastic-gpt train` as a driver subprocess on the cluster, read back from its MLflow run."""

    def __init__(self, cluster, data: str, root: str):
        self.uri = f"sqlite:///{root}/mlflow.db"
        args = [sys.executable, "-m", "elastic_gpt.cli", "train", "--config",
                os.path.join(ROOT, "jobs/configs/mini.yaml"), "model.preset=mini",
                f"data.path={data}", "train.global_batch_size=12", "train.micro_batch_size=2",
                "train.max_steps=1000000", "train.warmup_steps=2", "checkpoint.every_steps=4",
                "checkpoint.keep=2", f"checkpoint.path={root}/ckpt", "run.name=bench-node-loss",
                f"tracking.uri={self.uri}", f"run.storage_path={root}/ray", "eval.samples=0",
                "scaling.min_workers=1", "scaling.max_workers=2", "train.log_every=100000",
                "elastic.max_failures_per_hour=1000"]
        self.log = open(f"{root}/driver.log", "w")  # the driver's output, for a failed run
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ,
                                                          "RAY_ADDRESS": cluster.address},
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def _client(self):
        import mlflow
        return mlflow.MlflowClient(self.uri)

    def run_id(self) -> str | None:
        client = self._client()
        experiment = client.get_experiment_by_name("elastic-gpt")
        runs = client.search_runs(experiment.experiment_id) if experiment else []
        return runs[0].info.run_id if runs else None

    def sizes(self) -> list[tuple[float, int, int]]:
        """(record time, step, world size) of every logged step, in time order."""
        run_id = self.run_id()
        if run_id is None:
            return []
        return sorted((m.timestamp / 1000, m.step, int(m.value))
                      for m in self._client().get_metric_history(run_id, mn.TRAIN_WORLD_SIZE))

    def at_step(self, step: int, after: float) -> dict[str, float]:
        """The start-up metrics of the attempt whose first step is `step`, logged after time
        `after` (its recovery event goes with the step it resumed from, the step before)."""
        client, run_id, out = self._client(), self.run_id(), {}
        for part, name in LOGGED.items():
            at = step - 1 if name == mn.EVENT_RECOVERY_S else step
            values = [m.value for m in client.get_metric_history(run_id, name)
                      if m.step == at and m.timestamp / 1000 > after]
            if values:
                out[part] = values[-1]
        return out

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()


def first_step_at(run: Run, size: int, after: float, timeout_s: float = 300) -> tuple[float, int]:
    """(record time, step) of the first step a group of `size` workers logged after `after`."""
    def found():
        return next(((t, s) for t, s, w in run.sizes() if t > after and w == size), None)
    return wait_for(found, timeout_s=timeout_s, interval_s=0.2)


RAY_TRAIN_PHASES = {"actors_s": r"worker actors created in ([0-9.]+)s",
                    "train_context_s": r"Train context initialized on workers in ([0-9.]+)s",
                    "launch_s": r"Train function launched on workers in ([0-9.]+)s"}


def ray_train_phases(cluster, after: float) -> dict[str, float]:
    """The worker group start's phases, as Ray Train's controller logged them (at debug level,
    in its log file) for the first group it started after time `after`."""
    import glob
    import re

    logs = cluster.cluster.head_node.get_logs_dir_path()
    found: dict[str, float] = {}
    for path in glob.glob(os.path.join(logs, "**", "ray-train-sys-controller-*.log"),
                          recursive=True):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                at = time.mktime(time.strptime(record["asctime"][:19], "%Y-%m-%d %H:%M:%S"))
                if at + 1 < after:
                    continue
                for part, pattern in RAY_TRAIN_PHASES.items():
                    match = re.search(pattern, record.get("message", ""))
                    if match and part not in found:
                        found[part] = float(match.group(1))
    return found


def trial(cluster, run: Run) -> dict:
    load_before = os.getloadavg()[0]
    killed_at = cluster.kill_node(cluster.node_hosting_a_worker())
    recorded_at, step = first_step_at(run, 1, killed_at)
    # The start-up metrics go with the step's own record (one logger call).
    got = wait_for(lambda: (lambda m: m if "first_step_s" in m and "recovery_s" in m else None)(
        run.at_step(step, killed_at)), timeout_s=60, interval_s=0.5)
    first_step_started = recorded_at - got["first_step_s"]
    failure_at = first_step_started - got.pop("recovery_s")
    out = {"total_s": recorded_at - killed_at, "detection_s": failure_at - killed_at, **got,
           "worker_start_by_ray_train": ray_train_phases(cluster, failure_at),
           "load_before": load_before, "load_after": os.getloadavg()[0]}
    # Back to full size before the next trial.
    added = time.time()
    cluster.nodes.append(cluster.add_node())
    first_step_at(run, 2, added)
    time.sleep(3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json", help="write the trials and medians here")
    args = p.parse_args()

    from data_pipelines.tokenize_job import prepare_data

    root = tempfile.mkdtemp(prefix="bench_node_loss_")
    data = os.path.join(root, "data")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:40]
    prepare_data(files, data, tokenizer="bytes", seq_len=64, engine="local", progress=False,
                 max_bytes=500_000)
    cluster = LocalCluster(workers=2)
    run = Run(cluster, data, root)
    results = []
    try:
        first_step_at(run, 2, 0)
        time.sleep(5)  # past the first steps and the first checkpoint
        for i in range(args.trials):
            results.append(trial(cluster, run))
            r = results[-1]
            print(f"trial {i + 1}: node killed -> first step at W=1 {r['total_s']:.1f} s ("
                  + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {r[k]:.1f}"
                              for k in PARTS if k in r)
                  + "; worker start: " + ", ".join(
                      f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f}"
                      for k, v in r["worker_start_by_ray_train"].items())
                  + f"); load average {r['load_before']:.1f} -> {r['load_after']:.1f}", flush=True)
    finally:
        run.stop()
        wait_for(lambda: not training_workers(), timeout_s=60)
        cluster.shutdown()
    medians = {k: round(statistics.median(r[k] for r in results), 2)
               for k in ("total_s", *PARTS) if all(k in r for r in results)}
    print("\n| part | median (s) |\n|---|---|")
    for k, v in medians.items():
        print(f"| {k.removesuffix('_s').replace('_', ' ')} | {v} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trials": results, "median": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

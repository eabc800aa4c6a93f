"""Recovery and scale-up time, lost steps and goodput under node loss: elastic-gpt's restart path,
elastic-gpt's replica groups (C7 all-or-nothing step) and a plain Ray Train elastic job with Ray's
defaults, side by side on one multi-node Ray cluster on this machine.

    .venv/bin/python bench/bench_recovery.py [--trials 5] [--goodput-s 200] [--skip-baseline]
        [--systems elastic-gpt,replica-groups,ray-train-defaults] [--steady-rounds 2]

The replica-group run trains the same job on the same two 1-CPU nodes as 2 groups of 1 worker
(the restart path: one group of 2): a lost node takes one group, the other steps on alone. Its
"size" is the number of live groups; its steady tokens/s next to the restart path's at full size
is the cost of torchft's cross-group all-reduce against one FSDP group of the same size, and its
per-step records (`ELASTIC_GPT_REPLICA_RECORDS`) give the survivors' stall and the step attempts
re-done per failure.

Each trial: hard-kill a node hosting a training worker (SIGKILL of its raylet and workers), time
until the first step completes at the smaller size; then add a node, time until the first step
completes at the larger size. Both systems train a tiny GPT-sized all-reduce workload on 1-CPU
nodes; times come from per-step wall-clock records (MLflow metric timestamps for elastic-gpt, a
per-step JSONL for the baseline). The cluster uses the same fast node health checks for both.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_TMPDIR", "/tmp/elastic_gpt_ray_bench")
os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)

from elastic_gpt.testing.cluster import LocalCluster, training_workers, wait_for  # noqa: E402
from elastic_gpt.tracking import metric_names as mn  # noqa: E402
from elastic_gpt.train.goodput import TOTALS  # noqa: E402

# ---- the two systems under test ------------------------------------------------------------------


class ElasticGPTRun:
    """`elastic-gpt train` as a job driver subprocess on the cluster."""

    name = "elastic-gpt"

    size_metric = mn.TRAIN_WORLD_SIZE
    extra: list[str] = []

    def __init__(self, cluster, data: str, root: str, tag: str, every_steps: int = 10):
        tag = f"{self.name}-{tag}"
        self.every = every_steps
        self.uri = f"sqlite:///{root}/mlflow-{tag}.db"
        self.ckpt = f"{root}/ckpt-{tag}"
        self.records = f"{root}/records-{tag}"
        args = [sys.executable, "-m", "elastic_gpt.cli", "train", "--config",
                os.path.join(ROOT, "jobs/configs/mini.yaml"), "model.preset=tiny",
                f"data.path={data}", "train.global_batch_size=12", "train.micro_batch_size=2",
                "train.max_steps=100000", "train.warmup_steps=2", f"checkpoint.every_steps={every_steps}",
                f"checkpoint.path={self.ckpt}", f"run.name=bench-{tag}", f"tracking.uri={self.uri}",
                f"run.storage_path={root}/ray", "scaling.min_workers=1", "scaling.max_workers=2",
                "elastic.max_failures_per_hour=1000", "train.log_every=1000", *self.extra]
        with open(f"{root}/{tag}.log", "w") as log:  # the driver's output, for a failed run
            self.proc = subprocess.Popen(args, cwd=ROOT, env={
                **os.environ, "RAY_ADDRESS": cluster.address,
                "ELASTIC_GPT_REPLICA_RECORDS": self.records}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def steps(self) -> list[tuple[float, int, int]]:
        """(completion time, step, world size) of every logged step, in time order."""
        import mlflow

        client = mlflow.MlflowClient(self.uri)
        experiment = client.get_experiment_by_name("elastic-gpt")
        runs = client.search_runs(experiment.experiment_id) if experiment else []
        if not runs:
            return []
        hist = client.get_metric_history(runs[0].info.run_id, self.size_metric)
        return sorted((m.timestamp / 1000, m.step, int(m.value)) for m in hist)

    def tokens_per_s(self, after: float) -> float:
        """Median train/tokens_per_s of the steps logged after `after` at full size."""
        import mlflow

        client = mlflow.MlflowClient(self.uri)
        run = client.search_runs(client.get_experiment_by_name("elastic-gpt").experiment_id)[0]
        full = {m.step for m in client.get_metric_history(run.info.run_id, self.size_metric)
                if m.value == 2}
        return statistics.median(m.value for m in client.get_metric_history(
            run.info.run_id, mn.TRAIN_TOKENS_PER_S) if m.timestamp / 1000 > after
            and m.step in full)

    def lost_steps(self) -> list[int]:
        """Steps re-done per failure, from the goodput ledger in the newest checkpoint (the
        metric log misses the last seconds before a kill; the ledger counts from progress)."""
        from elastic_gpt.checkpoint.store import CheckpointStore

        latest = CheckpointStore(self.ckpt).latest()
        events = (latest.state.get("ledger") or {}).get("events", []) if latest else []
        return [e["lost_steps"] for e in events if e["kind"] == "failure"]

    def ledger(self) -> dict:
        """The run's goodput ledger as of its newest checkpoint, with `saved_at`: when that
        checkpoint's trainer state was taken."""
        from elastic_gpt.checkpoint.store import CheckpointStore

        latest = CheckpointStore(self.ckpt).latest()
        if latest is None or not latest.state.get("ledger"):
            return {}
        return {**latest.state["ledger"], "saved_at": latest.state["saved_at"]}

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


BASELINE_FN = '''
import json, os, time, tempfile
import torch, torch.distributed as dist
import ray.train
from ray.train import Checkpoint

def train_fn(config):
    ctx = ray.train.get_context()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.load_state_dict(state["model"]); step = int(state["step"])
    while True:
        x = torch.randn(256, 256)
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad); p.grad /= ctx.get_world_size()
        opt.step(); opt.zero_grad()
        step += 1
        if ctx.get_world_rank() == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps([time.time(), step, ctx.get_world_size()]) + "\\n")
        if step % 10 == 0:
            with tempfile.TemporaryDirectory() as d:
                if ctx.get_world_rank() == 0:
                    torch.save({"model": model.state_dict(), "step": step}, os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d)
                                 if ctx.get_world_rank() == 0 else None)
        else:
            time.sleep(0.0)
'''

BASELINE_DRIVER = '''
import sys, ray
sys.path.insert(0, sys.argv[3])
from baseline_fn import train_fn
from ray.train import RunConfig, ScalingConfig, FailureConfig
from ray.train.torch import TorchTrainer
ray.init(address="auto")
TorchTrainer(train_fn, train_loop_config={"log": sys.argv[1]},
             scaling_config=ScalingConfig(num_workers=(1, 2)),
             run_config=RunConfig(name="baseline", storage_path=sys.argv[2],
                                  failure_config=FailureConfig(max_failures=-1))).fit()
'''


class ReplicaGroupsRun(ElasticGPTRun):
    """`elastic-gpt train` with elastic.replica_groups=2: a group per 1-CPU node."""

    name = "replica-groups"
    size_metric = mn.TRAIN_REPLICA_GROUPS
    extra = ["elastic.replica_groups=2", "scaling.min_workers=2",
             "elastic.replica_heartbeat_timeout_s=1.5"]

    def lost_steps(self) -> list[int]:
        return []  # counted from the records in `failures`

    def failures(self, kills: list[float]) -> dict:
        """Per kill: the survivors' stall (the largest gap between the leader's committed steps
        around it) and the step attempts that did not commit (re-done)."""
        recs = []
        for path in glob.glob(os.path.join(self.records, "*.jsonl")):
            with open(path) as f:
                recs += [json.loads(line) for line in f if line.strip()]
        steps = sorted((r for r in recs if r.get("event") == "step" and r["rank"] == 0),
                       key=lambda r: r["t"])
        stalls, redone, waits = [], [], []
        departures = [r for r in recs if r.get("event") == "departure"]
        for t in kills:
            near = [r for r in steps if t - 5 < r["t"] < t + 10]
            # The survivor: the group that committed a step alone after the kill.
            alone = [r for r in near if r["t"] > t and r["committed"] and r["groups"] == 1]
            if not alone:
                continue
            mine = [r for r in near if r["group"] == alone[0]["group"]]
            done = [r["t"] for r in mine if r["committed"]]
            # The largest gap between its commits from the last one before the kill on: a step
            # already past its collectives may still commit just after the kill, and the stall
            # (the failed step, the heartbeat, the re-done step) comes after it.
            start = max([i for i, x in enumerate(done) if x <= t], default=None)
            if start is not None and start + 1 < len(done):
                stalls.append(max(b - a for a, b in zip(done[start:], done[start + 1:])))
            redone.append(len([r for r in mine if not r["committed"] and r["t"] > t]))
            waits.append(next(r["quorum_s"] for r in mine if r["t"] > t and r["groups"] == 1))
        # How the Lighthouse learnt of each loss: before the heartbeat timed out (a refused
        # probe, or the group leaving on its way out), or by the timeout (no departure noted).
        how = [next((d["why"] for d in departures if t < d["t"] < t + 10), "none noted")
               for t in kills]
        # A healthy group dropped (its heartbeat or the join timeout ran out under load): a
        # departure no kill explains.
        unexplained = [d for d in departures if not any(t < d["t"] < t + 10 for t in kills)
                       and d["why"] in ("heartbeat timeout", "join timeout")]
        return {"stall_s": _stats(stalls or [float("nan")]),
                "redone_attempts": _stats(redone or [0]),
                "drop_wait_s": _stats(waits or [float("nan")]),
                "detected_by": {k: how.count(k) for k in sorted(set(how))},
                "healthy_groups_dropped": len(unexplained)}


class RayTrainBaseline:
    """Plain Ray Train V2 elastic job, Ray's defaults (except max_failures=-1 so it survives)."""

    name = "ray-train-defaults"

    def __init__(self, cluster, data: str, root: str, tag: str):
        self.log = f"{root}/baseline-{tag}.jsonl"
        code = os.path.join(root, "code")
        os.makedirs(code, exist_ok=True)
        with open(os.path.join(code, "baseline_fn.py"), "w") as f:
            f.write(BASELINE_FN)
        with open(os.path.join(code, "driver.py"), "w") as f:
            f.write(BASELINE_DRIVER)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_TRAIN_")}
        env.update(RAY_ADDRESS=cluster.address, PYTHONPATH=code)
        self._lost: list[int] = []
        self.proc = subprocess.Popen([sys.executable, os.path.join(code, "driver.py"), self.log,
                                      f"{root}/ray-baseline-{tag}", code], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def steps(self) -> list[tuple[float, int, int]]:
        try:
            with open(self.log) as f:
                return [tuple(json.loads(line)) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def lost_steps(self) -> list[int]:
        """Per failure: last step before the kill minus the first step after it, plus one (every
        step is in the log, written as it completes)."""
        return self._lost

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


# ---- measurements --------------------------------------------------------------------------------

def first_step_at(run, size: int, after: float, timeout_s: float = 240) -> float:
    """Seconds from `after` to the first step completed by a group of `size` workers."""
    def found():
        for t, _, w in run.steps():
            if t > after and w == size:
                return t
        return None
    return wait_for(found, timeout_s=timeout_s, interval_s=0.2) - after


def trials(cluster, run, n: int) -> dict:
    first_step_at(run, 2, 0, timeout_s=300)  # running at full size
    time.sleep(2)
    recovery, scale_up = [], []
    for i in range(n):
        before = max(s for _, s, _ in run.steps())
        t_kill = cluster.kill_node(cluster.node_hosting_a_worker())
        recovery.append(first_step_at(run, 1, t_kill))
        if isinstance(run, RayTrainBaseline):
            after = min(s for t, s, w in run.steps() if t > t_kill and w == 1)
            run._lost.append(max(0, before - after + 1))
        time.sleep(2)  # a few steps at the smaller size
        t_add = time.time()
        cluster.nodes.append(cluster.add_node())
        scale_up.append(first_step_at(run, 2, t_add))
        print(f"  {run.name} trial {i + 1}: recovery {recovery[-1]:.1f}s, scale-up "
              f"{scale_up[-1]:.1f}s", flush=True)
        time.sleep(2)
    lost = run.lost_steps()
    return {"recovery_s": _stats(recovery), "scale_up_s": _stats(scale_up),
            "lost_steps": _stats(lost or [0])}


KILL_EVERY_S = 60.0


def checkpoint_every(system, args) -> int:
    """Each mode's checkpoint interval as `elastic-gpt plan` sets it (Young/Daly,
    `elastic_gpt.planner.reliability`): the restart path's for the cluster's MTBF (`goodput` kills a
    node every KILL_EVERY_S), replica groups' for their fallback's (the driver's node: the node MTBF, which is
    the cluster's times its nodes), since their checkpoints serve only the fallback."""
    from elastic_gpt.planner.reliability import young_interval_s

    mtbf = KILL_EVERY_S * (2 if system is ReplicaGroupsRun else 1)
    every = max(1, round(young_interval_s(args.checkpoint_write_s, mtbf) / args.step_s))
    print(f"  {system.name}: checkpoint every {every} steps (Young/Daly: write "
          f"{args.checkpoint_write_s} s, MTBF {mtbf:.0f} s, step {args.step_s} s)", flush=True)
    return every


def goodput(cluster, run, duration_s: float, every_s: float = KILL_EVERY_S,
            replace_after_s: float = 20.0):
    """A node lost every `every_s` seconds, a replacement `replace_after_s` later.

    goodput: the ledger's (C5 one MLflow run) productive time over the wall time between two of its
    checkpoints (the first after the start, the newest at the end), where productive is the
    committed steps' time at whatever size the run had (degraded_share: the part of it with fewer
    replica groups), and recovery, re-done steps and checkpoint writes are not (the ledger's own
    productive / accounted time beside it). throughput: undisturbed step time x steps of the
    final trajectory / wall time, so a step at half size counts half; capacity: the mean share
    of the nodes that were up, its ceiling."""
    first_step_at(run, 2, 0, timeout_s=300)
    # The ledger's window starts at the first checkpoint (it has the start-up behind it). Ray
    # Train's plain job keeps none.
    has_ledger = hasattr(run, "ledger")
    start = wait_for(lambda: run.ledger() or None, timeout_s=120, interval_s=0.5) \
        if has_ledger else {}
    t0 = time.time()
    next_kill = t0 + every_s
    kills = []
    while time.time() < t0 + duration_s:
        if time.time() >= next_kill:
            kills.append(cluster.kill_node(cluster.node_hosting_a_worker()))
            time.sleep(replace_after_s)
            cluster.nodes.append(cluster.add_node())
            next_kill += every_s
        time.sleep(0.5)
    wall = time.time() - t0
    steps = [(t, s, w) for t, s, w in run.steps() if t >= t0]
    times = sorted(t for t, _, _ in steps)
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b - a < 5)
    undisturbed = statistics.median(gaps) if gaps else float("nan")
    progress = max(s for _, s, _ in steps) - min(s for _, s, _ in steps)
    end = run.ledger() if has_ledger else {}
    delta = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in (*TOTALS, "degraded_s", "saved_at")}
    accounted = sum(delta[k] for k in TOTALS)
    node_down_s = len(kills) * replace_after_s - max(0.0, (kills[-1] + replace_after_s) -
                                                     (t0 + wall)) if kills else 0.0
    out = {"wall_s": round(wall, 1), "net_steps": progress, "kills": len(kills),
           "median_step_s": round(undisturbed, 3),
           "goodput": round(delta["productive_s"] / delta["saved_at"], 3)
           if delta["saved_at"] else None,
           "goodput_of_accounted": round(delta["productive_s"] / accounted, 3)
           if accounted else None,
           "degraded_share": round(delta["degraded_s"] / delta["productive_s"], 3)
           if delta["productive_s"] else None,
           "ledger_s": {k: round(v, 1) for k, v in delta.items()},
           "checkpoint_write_s": round(delta["checkpoint_s"] / max(1, progress // run.every), 3)
           if has_ledger else None,
           "throughput": round(progress * undisturbed / wall, 3),
           "capacity": round(1 - node_down_s / (2 * wall), 3)}
    if isinstance(run, ReplicaGroupsRun):
        out.update(run.failures(kills))
    return out


def steady(data: str, root: str, rounds: int, seconds: float) -> dict:
    """Steady tokens/s at full size, one FSDP group of 2 (the restart path) against 2 replica
    groups of 1, in short runs that alternate on one cluster: this machine's speed drifts over
    minutes, so each round's ratio compares neighbours, not runs a quarter of an hour apart."""
    cluster = LocalCluster(workers=2)
    tokens: dict[str, list[float]] = {ElasticGPTRun.name: [], ReplicaGroupsRun.name: []}
    ratios = []
    try:
        for i in range(rounds):
            got = {}
            for system in (ElasticGPTRun, ReplicaGroupsRun)[::1 if i % 2 == 0 else -1]:
                run = system(cluster, data, root, f"steady{i}")
                try:
                    first_step_at(run, 2, 0, timeout_s=300)
                    time.sleep(5)  # past the first steps' warm-up
                    since = time.time()
                    time.sleep(seconds)
                    got[system.name] = run.tokens_per_s(since)
                finally:
                    run.stop()
                wait_for(lambda: not training_workers(), timeout_s=60)
                time.sleep(10)  # the stopped job's actors and placement groups are cleaned up
                tokens[system.name].append(round(got[system.name]))
            ratios.append(got[ReplicaGroupsRun.name] / got[ElasticGPTRun.name])
            print(f"  steady round {i + 1}: tokens/s {got[ElasticGPTRun.name]:,.0f} (one group) "
                  f"vs {got[ReplicaGroupsRun.name]:,.0f} (replica groups), ratio "
                  f"{ratios[-1]:.3f}", flush=True)
    finally:
        cluster.shutdown()
    return {"tokens_per_s": tokens, "ratio": _stats(ratios)}


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "max": round(max(xs), 2),
            "n": len(xs), "all": [round(x, 2) for x in xs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--baseline-trials", type=int, default=None,
                   help="trials for Ray Train's defaults (default: --trials; each of its events "
                        "waits out the ~60 s placement timeout, so fewer keep a run short)")
    p.add_argument("--goodput-s", type=float, default=200.0, help="0 skips the goodput runs")
    p.add_argument("--steady-rounds", type=int, default=0,
                   help="rounds of alternating steady runs (restart path, replica groups) for "
                        "the tokens/s ratio; 0 skips them")
    p.add_argument("--steady-s", type=float, default=30.0, help="seconds measured per steady run")
    p.add_argument("--checkpoint-write-s", type=float, default=0.2,
                   help="a checkpoint's blocking write time here, for the goodput runs' "
                        "intervals (each run prints the one it measured)")
    p.add_argument("--step-s", type=float, default=0.065,
                   help="the step time here at full size, for the same")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--systems", default="elastic-gpt,replica-groups,ray-train-defaults",
                   help="which systems, comma-separated")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "recovery.json"))
    args = p.parse_args()

    from data_pipelines.tokenize_job import prepare_data

    root = tempfile.mkdtemp(prefix="bench_recovery_")
    data = os.path.join(root, "data")
    import sysconfig
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))[:40]
    prepare_data(files, data, tokenizer="bytes", seq_len=64, engine="local", progress=False,
                 max_bytes=500_000)
    results = {}
    wanted = args.systems.split(",")
    systems = [s for s in (ElasticGPTRun, ReplicaGroupsRun, RayTrainBaseline)
               if s.name in wanted and not (args.skip_baseline and s is RayTrainBaseline)]
    for system in systems:
        cluster = LocalCluster(workers=2)
        try:
            results[system.name] = {}
            n = args.trials if system is not RayTrainBaseline or args.baseline_trials is None \
                else args.baseline_trials
            if n:
                run = system(cluster, data, root, "trials")
                print(f"{system.name}: {n} trials of node kill + node add", flush=True)
                results[system.name] = trials(cluster, run, n)
                run.stop()
                wait_for(lambda: not training_workers(), timeout_s=60)
            if args.goodput_s:
                print(f"{system.name}: goodput with a node lost every 60 s for "
                      f"{args.goodput_s:.0f} s", flush=True)
                if issubclass(system, ElasticGPTRun):
                    run = system(cluster, data, root, "goodput",
                                 every_steps=checkpoint_every(system, args))
                else:  # Ray Train's plain job checkpoints every 10 steps
                    run = system(cluster, data, root, "goodput")
                results[system.name]["goodput"] = goodput(cluster, run, args.goodput_s)
                if isinstance(run, ElasticGPTRun):
                    results[system.name]["tokens_per_s"] = run.tokens_per_s(0)
                run.stop()
        finally:
            cluster.shutdown()
    print("\n| system | recovery median / max (s) | scale-up median / max (s) | steps re-done "
          "median | goodput (node lost / 60 s): ledger / throughput / capacity | "
          "tokens/s at full size |")
    print("|---|---|---|---|---|---|")
    dash = {"median": "-", "max": "-"}
    for name, r in results.items():
        g = r.get("goodput", {})
        rec, up = r.get("recovery_s", dash), r.get("scale_up_s", dash)
        print(f"| {name} | {rec['median']} / {rec['max']} | {up['median']} / {up['max']} | "
              f"{r.get('lost_steps', dash)['median']} | {g.get('goodput', '-')} / "
              f"{g.get('throughput', '-')} / {g.get('capacity', '-')} | "
              f"{r.get('tokens_per_s', float('nan')):,.0f} |")
    rg = results.get("replica-groups", {}).get("goodput", {})
    if "stall_s" in rg:
        print(f"\nreplica groups, per node lost: survivors' stall median "
              f"{rg['stall_s']['median']} s / max {rg['stall_s']['max']} s (heartbeat 1.5 s, "
              f"step {rg['median_step_s']} s), step attempts re-done median "
              f"{rg['redone_attempts']['median']} / max {rg['redone_attempts']['max']}")
        print(f"replica groups: the survivors' wait in the quorum that dropped the lost group "
              f"median {rg['drop_wait_s']['median']} s / max {rg['drop_wait_s']['max']} s; "
              f"losses detected by {rg['detected_by']}; healthy groups dropped by a timeout: "
              f"{rg['healthy_groups_dropped']}")
    if "tokens_per_s" in results.get("replica-groups", {}) and \
            "tokens_per_s" in results.get("elastic-gpt", {}):
        print(f"steady state, 2 groups x 1 worker vs 1 FSDP group of 2: tokens/s ratio "
              f"{results['replica-groups']['tokens_per_s'] / results['elastic-gpt']['tokens_per_s']:.3f}")
    if args.steady_rounds:
        print(f"steady state: {args.steady_rounds} round(s) of alternating runs, "
              f"{args.steady_s:.0f} s each", flush=True)
        results["steady"] = steady(data, root, args.steady_rounds, args.steady_s)
        r = results["steady"]["ratio"]
        print(f"steady state, alternating runs, 2 groups x 1 worker vs 1 FSDP group of 2: "
              f"tokens/s ratio median {r['median']} (rounds {r['all']})")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replica groups (C7) on a real Ray cluster with a real torchft Lighthouse: 2 groups of the tiny
model, each its own Ray Train run. A worker of group 1 is SIGKILLed mid-run: group 0 keeps
stepping (no restart, no checkpoint read), Ray restarts group 1's run, which heals from group 0 to
identical parameters and optimizer state, and every committed step has the data and (within
float noise) the loss of an uninterrupted single-process run. Then the Lighthouse is SIGKILLed:
the run falls back to the restart path (a new Lighthouse, every group restored from the newest
checkpoint, bit-identical to the live state it saved) and finishes on the same trajectory."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest

from elastic_gpt.config import load_config
from elastic_gpt.data.fingerprint import join_fingerprint
from elastic_gpt.tracking import metric_names as mn

pytestmark = pytest.mark.slow

# The survivor must still be stepping when Ray has restarted the killed group's run (~10-30 s
# on 2 loaded cores), so the run is long in steps; a tiny-model step is ~0.1-0.3 s here.
STEPS = 150
CHECKPOINT_EVERY = 10  # the fallback's restart point
KILL_AT = 12  # between two checkpoint steps: the stall measured is the failure's alone
WORKERS = 2  # per group: FSDP2 shards inside each group, and the heal goes shard by shard
HEARTBEAT_S = 1.0
# 6 micro-batches over 2 groups x 2 ranks: blocks of 1 and 2, so the cross-group average must
# keep the token weighting (C1); alone, group 0 splits them 3 + 3.
ARGS = ["model.preset=tiny", "train.global_batch_size=6", "train.micro_batch_size=1",
        f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.lr=3e-3", "train.log_every=8",
        "train.dtype=float32", "data.prefetch_steps=2", "eval.samples=0",
        "scaling.cpus_per_worker=1", f"checkpoint.every_steps={CHECKPOINT_EVERY}", "checkpoint.keep=2",
        f"elastic.replica_heartbeat_timeout_s={HEARTBEAT_S}", "elastic.max_failures_per_hour=3"]


def _overrides(data: str, root: str, name: str, extra: list[str]) -> list[str]:
    return [*ARGS, f"data.path={data}", f"run.name={name}", f"run.storage_path={root}/ray",
            f"checkpoint.path={root}/{name}", f"tracking.uri=sqlite:///{root}/mlflow.db", *extra]


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, object_store_memory=100 << 20, include_dashboard=False,
             _temp_dir=os.path.join(os.environ["RAY_TMPDIR"], "replica_groups"),
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(stdlib_dataset, tmp_path_factory):
    return _reference(stdlib_dataset, str(tmp_path_factory.mktemp("reference")), STEPS)


def _reference(data: str, root: str, steps: int):
    """Every step's loss and data fingerprint of an uninterrupted run: one process, no Ray."""
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config(None, _overrides(data, root, "reference",
                                       ["tracking.enabled=false", f"train.max_steps={steps}"]))
    with gloo_group():
        trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None)
        stream = trainer._open_stream()
        losses, fingerprints = {}, {}
        for step in range(steps):
            result = trainer.train_step(next(stream))
            losses[step], fingerprints[step] = result.loss, result.fingerprint
            trainer.step += 1
        stream.close()
        tokens = cfg.train.global_batch_size * trainer.gpt_cfg.seq_len
    return losses, fingerprints, tokens


def _records(folder: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda r: r["t"])


def _wait_records(folder: str, found, timeout_s: float = 150.0, what: str = ""):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        recs = _records(folder)
        hit = found(recs)
        if hit:
            return recs, hit
        time.sleep(0.1)
    raise TimeoutError(f"never saw {what}")


def _faults(folder: str) -> dict:
    """SIGKILL group 1's rank-0 worker once it has committed KILL_AT together with group 0; once
    its replacement has healed and both groups have committed a few steps and a checkpoint
    together, SIGKILL the Lighthouse."""
    recs, _ = _wait_records(folder, lambda recs: [
        r for r in recs if r["group"] == 1 and r.get("event") == "step" and r["committed"]
        and r["step"] >= KILL_AT and r["groups"] == 2], what="group 1 at the kill step")
    start = [r for r in recs if r["group"] == 1 and r["rank"] == 0 and r["event"] == "start"][-1]
    os.kill(start["pid"], signal.SIGKILL)
    worker_kill = time.time()

    def rejoined(recs):
        healed = [r for r in recs if r["group"] == 1 and r["event"] == "join"
                  and r["t"] > worker_kill]
        together = [r for r in recs if r.get("event") == "step" and r["committed"]
                    and r["t"] > worker_kill and r["groups"] == 2]
        return healed and len(together) >= 4 * 2 * WORKERS and together
    _, together = _wait_records(folder, rejoined, what="group 1 healed and stepping")
    # Past a checkpoint step, so the fallback re-does some steps (C4 + C7).
    at = together[-1]["step"] // CHECKPOINT_EVERY * CHECKPOINT_EVERY + 3
    recs, _ = _wait_records(folder, lambda recs: [
        r for r in recs if r.get("event") == "step" and r["committed"] and r["step"] >= at],
        what=f"step {at}")
    lighthouse = [r for r in recs if r.get("event") == "lighthouse"][-1]
    os.kill(lighthouse["pid"], signal.SIGKILL)
    return {"t": worker_kill, "pid": start["pid"], "lighthouse_t": time.time()}


def test_survivor_keeps_training_and_replacement_heals(ray_local, stdlib_dataset, reference,
                                                       tmp_path, monkeypatch):
    from elastic_gpt.checkpoint.store import CheckpointStore
    from elastic_gpt.elastic.replica_groups import RECORD_DIR_ENV, STATE_HASH_ENV
    from elastic_gpt.testing.cluster import train_in_background

    records = str(tmp_path / "records")
    monkeypatch.setenv(RECORD_DIR_ENV, records)
    monkeypatch.setenv(STATE_HASH_ENV, "1")
    cfg = load_config(None, _overrides(stdlib_dataset, str(tmp_path), "rg", [
        "elastic.replica_groups=2", f"scaling.min_workers={2 * WORKERS}",
        f"scaling.max_workers={2 * WORKERS}"]))
    summary, kill = train_in_background(cfg, lambda: _faults(records), timeout_s=500)
    everything = _records(records)
    # Until the Lighthouse died: one torchft run of replica groups.
    recs = [r for r in everything if r["t"] < kill["lighthouse_t"]]
    after = [r for r in everything if r["t"] >= kill["lighthouse_t"]]
    steps = [r for r in recs if r.get("event") == "step"]
    committed = [r for r in steps if r["committed"]]

    # The run ends at max_steps with its last step committed to storage (C4), written by the
    # group leading that step.
    assert summary["step"] == STEPS
    assert CheckpointStore(cfg.checkpoint.path).latest().step == STEPS

    # (a) group 0 never restarted, never read a checkpoint, and its step never went back.
    g0 = [r for r in committed if r["group"] == 0 and r["rank"] == 0]
    assert len([r for r in recs if r["group"] == 0 and r["event"] == "start"]) == WORKERS
    # (Group 0 may have been the later of the two to start, and healed at its first quorum.)
    assert [r["step"] for r in g0] == list(range(g0[0]["step"], g0[-1]["step"] + 1))
    gaps = [b["t"] - a["t"] for a, b in zip(g0, g0[1:])]
    steady = sorted(gaps)[len(gaps) // 2]
    stall = max(b["t"] - a["t"] for a, b in zip(g0, g0[1:]) if b["t"] >= kill["t"] - steady)
    alone = {r["step"] for r in g0 if r["groups"] == 1}
    assert alone, "group 0 stepped alone while group 1 was restarting"

    # (b) group 1 restarted once and joined by healing from group 0 (there is no checkpoint to
    # read before the last step), and its
    # state at the step it joined equals group 0's at that step, rank by rank.
    joins = [r for r in recs if r["group"] == 1 and r["event"] == "join"]
    assert len(joins) == 2 * WORKERS, joins  # the first start and the one restart, every rank
    rejoin = [r for r in joins if r["t"] > kill["t"]]
    assert rejoin and all(r["healed"] for r in rejoin), rejoin
    heal_s = max(r["quorum_s"] for r in rejoin)
    healed_step = rejoin[0]["step"]
    assert KILL_AT < healed_step < STEPS
    state = {(r["group"], r["rank"], r["step"]): r["hash"] for r in recs if r["event"] == "state"}
    for rank in range(WORKERS):
        assert state[(1, rank, healed_step)] == state[(0, rank, healed_step)]

    # (g) The Lighthouse lost: every group restarted once more and restored the newest
    # checkpoint, whose state is the live state of that step (C3), and the groups went on
    # together to the end, equal to each other.
    restarts = [r for r in after if r["event"] == "start"]
    assert sorted((r["group"], r["rank"]) for r in restarts) == [
        (g, rank) for g in range(2) for rank in range(WORKERS)], restarts
    resumed = min(r["step"] for r in after if r["event"] == "state")
    assert resumed % CHECKPOINT_EVERY == 0 and resumed < max(r["step"] for r in g0)
    restored = {(r["group"], r["rank"]): r["hash"] for r in after
                if r["event"] == "state" and r["step"] == resumed}
    live = {(r["group"], r["rank"]): r["hash"] for r in recs
            if r["event"] == "state" and r["step"] == resumed}
    common = restored.keys() & live.keys()  # group 1 may not have been live at that step
    assert common and all(restored[k] == live[k] for k in common), (restored, live)
    final = {(r["group"], r["rank"]): r["hash"] for r in after
             if r["event"] == "state" and r["step"] == STEPS - 1}
    for rank in range(WORKERS):
        assert final[(1, rank)] == final[(0, rank)]
    steps += [r for r in after if r.get("event") == "step"]
    committed += [r for r in after if r.get("event") == "step" and r["committed"]]

    # (c), (d) C7 with C1/C2: every step committed exactly once per live group, on the data of
    # the uninterrupted run, with its loss within float noise (before and after the fallback).
    ref_loss, ref_fp, tokens = reference
    for s in range(STEPS):
        at = [r for r in committed if r["step"] == s and r["rank"] == 0]
        assert at, f"step {s} never committed"
        for r in at:
            lo, hi = r["fp"]
            assert join_fingerprint(lo, hi) == ref_fp[s], f"step {s} trained other samples (C2)"
            assert r["loss_sum"] / tokens == pytest.approx(ref_loss[s], abs=2e-3), s
    # One run for the user (C5): the ledger counts the degraded time, the groups lost and
    # joined and the fallback; MLflow has the live groups per step.
    import mlflow
    events = [e["kind"] for e in summary["events"]]
    assert "replica group lost" in events and "replica group joined" in events, events
    assert "failure" in events, events  # the fallback, with the steps it re-did
    assert summary["goodput"]["degraded_s"] > 0 and summary["goodput"]["lost_steps"] > 0
    live = [m.value for m in mlflow.tracking.MlflowClient(cfg.tracking.uri).get_metric_history(
        summary["run_id"], mn.TRAIN_REPLICA_GROUPS)]
    assert set(live) == {1, 2}, set(live)
    redone = len([r for r in steps if not r["committed"] and r["rank"] == 0])
    print(f"\n[replica groups] stall {stall:.2f} s (steady step {steady:.2f} s, heartbeat "
          f"{HEARTBEAT_S} s), {len(alone)} step(s) alone, heal {heal_s:.2f} s at step "
          f"{healed_step}, {redone} step attempt(s) not committed")
    assert stall <= HEARTBEAT_S + 3 * steady + 5.0, stall


# ---- (e) a whole node lost and re-added, (f) a drain: a multi-node cluster ------------------------

NODE_STEPS = 520  # the faults (two absences of a Ray restart each, a hang) end inside it


HANG_TIMEOUT_S = 6.0


def _stopped_alive(pid: int) -> bool:
    """Whether `pid` is still a live process (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _node_of(group: int, recs: list[dict]) -> str:
    """The node hosting replica group `group`'s current rank 0 (GCS actor table)."""
    from elastic_gpt.testing.cluster import training_workers

    pid = [r for r in recs if r["group"] == group and r["rank"] == 0 and r["event"] == "start"][-1]
    return next(a.node_id for a in training_workers() if a.pid == pid["pid"])


def _steps_together_after(t: float, n: int):
    def found(recs):
        together = [r for r in recs if r.get("event") == "step" and r["committed"]
                    and r["t"] > t and r["groups"] == 2]
        return len(together) >= n * 2 * WORKERS and together
    return found


def _node_faults(cluster, folder: str) -> dict:
    """(f) drain group 1's node and add a replacement: group 1 leaves at a step boundary and
    comes back on the new node, healing; the cloud then takes the drained node. (e) hard-kill
    group 0's node and add one back: group 1 goes on alone, group 0 comes back and heals. Then a
    hung rank (SIGSTOP) in group 1."""
    from elastic_gpt.elastic import preemption

    recs, _ = _wait_records(folder, _steps_together_after(0, 5), what="both groups stepping")
    drained = _node_of(1, recs)
    t_drain = time.time()
    assert preemption.drain_node(drained, 60, "preemption", "replica group test",
                                 cluster.address)
    # The replacement the drain asked for (not waited for: the draining node is not "alive"
    # in the count that waits).
    cluster.nodes.append(cluster.add_node(wait=False))
    _wait_records(folder, lambda recs: [r for r in recs if r.get("event") == "step"
                                        and r["t"] > t_drain and r["groups"] == 1],
                  what="group 0 alone after the drain")
    recs, _ = _wait_records(folder, _steps_together_after(t_drain, 3),
                            what="group 1 back after the drain")
    t_back = time.time()
    node = next(n for n in cluster.cluster.worker_nodes if n.node_id == drained)
    cluster.nodes.remove(node)
    cluster.cluster.remove_node(node, allow_graceful=False)  # the cloud takes it at its deadline
    killed = _node_of(0, recs)
    t_kill = cluster.kill_node(next(n for n in cluster.cluster.worker_nodes
                                    if n.node_id == killed))
    cluster.nodes.append(cluster.add_node(wait=False))  # capacity comes back at once
    _wait_records(folder, lambda recs: [r for r in recs if r.get("event") == "step"
                                        and r["t"] > t_kill and r["groups"] == 1],
                  what="group 1 alone after the node kill")
    _wait_records(folder, _steps_together_after(t_kill, 3), what="group 0 back after the kill")
    # A hung rank: group 1's rank 1 stopped (SIGSTOP) inside its collectives. Its group fails
    # after elastic.hang_timeout_s and Ray restarts it; group 0 goes on alone meanwhile.
    recs = _records(folder)
    hung = [r for r in recs if r["group"] == 1 and r["rank"] == 1 and r["event"] == "start"][-1]
    t_stop = time.time()
    os.kill(hung["pid"], signal.SIGSTOP)
    # (Group 1's restart goes on in the background: the run ends only when both runs have.)
    _wait_records(folder, lambda recs: [r for r in recs if r.get("event") == "step"
                                        and r["t"] > t_stop and r["groups"] == 1
                                        and r["committed"]], what="group 0 alone after the hang")
    return {"drain": t_drain, "back": t_back, "kill": t_kill, "stop": t_stop,
            "hung_pid": hung["pid"]}


def test_drained_and_lost_nodes_leave_and_their_groups_come_back(stdlib_dataset, tmp_path,
                                                                  monkeypatch):
    from elastic_gpt.elastic.replica_groups import RECORD_DIR_ENV, STATE_HASH_ENV
    from elastic_gpt.testing.cluster import LocalCluster, train_in_background

    reference = _reference(stdlib_dataset, str(tmp_path / "reference"), NODE_STEPS)
    records = str(tmp_path / "records")
    monkeypatch.setenv(RECORD_DIR_ENV, records)
    monkeypatch.setenv(STATE_HASH_ENV, "1")
    cluster = LocalCluster(workers=2, cpus_per_node=WORKERS)  # a node per group
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        cfg = load_config(None, _overrides(stdlib_dataset, str(tmp_path), "rg-nodes", [
            "elastic.replica_groups=2", f"scaling.min_workers={2 * WORKERS}",
            f"scaling.max_workers={2 * WORKERS}", f"train.max_steps={NODE_STEPS}",
            "checkpoint.every_steps=100", "train.log_every=100",
            f"elastic.hang_timeout_s={HANG_TIMEOUT_S}"]))
        summary, at = train_in_background(cfg, lambda: _node_faults(cluster, records),
                                          timeout_s=500)
    finally:
        cluster.shutdown()
    recs = _records(records)
    steps = [r for r in recs if r.get("event") == "step" and r["rank"] == 0]
    assert summary["step"] == NODE_STEPS

    # (f) The drained group left at a step boundary: its last step was committed by both
    # groups, and group 0 re-did nothing for it (no failed collective, no timeout of a step).
    g1_before = [r for r in steps if r["group"] == 1 and at["drain"] < r["t"] < at["back"]]
    g0_drain = [r for r in steps if r["group"] == 0 and at["drain"] < r["t"] < at["back"]]
    assert g1_before and all(r["committed"] for r in g1_before)
    assert all(r["committed"] for r in g0_drain), [r for r in g0_drain if not r["committed"]]
    assert {r["groups"] for r in g0_drain} == {1, 2}
    # (e) The lost node's group: group 1 went on alone, re-doing at most the step in flight.
    g1_kill = [r for r in steps if r["group"] == 1 and at["kill"] < r["t"] < at["stop"]]
    assert len([r for r in g1_kill if not r["committed"]]) <= 1
    assert [r["step"] for r in g1_kill if r["committed"]] == list(
        range(g1_kill[0]["step"], g1_kill[-1]["step"] + 1))
    # The hung rank: group 0 went on alone within a bound set by elastic.hang_timeout_s (its
    # own collective with the stopped rank, then the hung group's in-group collectives, each
    # given up after it, and the heartbeat), and the stopped process was killed with its group.
    g0 = [r for r in steps if r["group"] == 0 and r["committed"]]
    before = max(r["t"] for r in g0 if r["t"] < at["stop"])
    alone = min(r["t"] for r in g0 if r["t"] > at["stop"] and r["groups"] == 1)
    # (A few times hang_timeout_s: the heartbeat of the hung group's rank 0 goes on until its
    # own collective gives up, and the quorum refuses one group of two meanwhile.)
    assert alone - before <= 6 * HANG_TIMEOUT_S + HEARTBEAT_S + 10.0, alone - before
    assert _stopped_alive(at["hung_pid"]) is False
    print(f"\n[replica groups] hung rank: group 0 alone {alone - at['stop']:.1f} s after the "
          f"SIGSTOP (hang timeout {HANG_TIMEOUT_S} s)")

    # Both comebacks healed from the live peer to its state, rank by rank.
    joins = [r for r in recs if r["event"] == "join" and r["t"] > at["drain"]]
    assert {r["group"] for r in joins if r["healed"]} == {0, 1}, joins
    state = {(r["group"], r["rank"], r["step"]): r["hash"] for r in recs if r["event"] == "state"}
    for j in joins:
        peer = 1 - j["group"]
        assert state[(j["group"], j["rank"], j["step"])] == state[(peer, j["rank"], j["step"])]

    # Every committed step trained the uninterrupted run's samples, to its loss (C1, C2, C7).
    ref_loss, ref_fp, tokens = reference
    for s in range(NODE_STEPS):
        at_s = [r for r in steps if r["step"] == s and r["committed"]]
        assert at_s, f"step {s} never committed"
        for r in at_s:
            assert join_fingerprint(*r["fp"]) == ref_fp[s], f"step {s} trained other samples"
            assert r["loss_sum"] / tokens == pytest.approx(ref_loss[s], abs=2e-3), s
    # The ledger written last is its leader's: events noted by a group while another one led
    # reach it only through a heal, so not every loss is in it (see docs/replica-groups.md).
    kinds = [e["kind"] for e in summary["events"]]
    assert "replica group lost" in kinds and "replica group joined" in kinds, kinds

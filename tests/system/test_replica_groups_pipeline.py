"""Replica groups that hold whole pipelines: 2 groups, each one pipeline of 2 stages
(parallel.pp=2, 2 workers), on a real Ray cluster with a real Lighthouse. Group 1's rank-0 worker
(its first stage) is SIGKILLed: group 0 goes on alone, its pipeline taking the whole step's
micro-batches (a new schedule, for the new split), and group 1's run restarts and heals from
group 0 stage by stage. Every committed step has the data and (within float noise) the loss of
an uninterrupted single-process run (C1, C2, C7). For GPT-2 (its tied embedding on the first and
last stage) and for Llama (untied: each stage's weights its own)."""

from __future__ import annotations

import glob
import os
import time

import pytest

from elastic_gpt.config import load_config
from tests.system.test_replica_groups import (
    _records,
    assert_steps_are_the_reference,
    kill_group_1_rank_0,
    reference_run,
)

STEPS = 200  # outlasts the killed group's restart and heal (the tiny model steps in ~0.1 s)
KILL_AT = 8
WORKERS = 2  # per group: one pipeline of 2 stages
# 4 micro-batches of 1: 2 pipelines share them (2 each, filling 2 stages); alone, one takes 4.
ARGS = ["train.global_batch_size=4", "train.micro_batch_size=1",
        f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.lr=3e-3",
        "train.log_every=100", "train.dtype=float32", "train.peak_tflops=0.05",
        "data.prefetch_steps=2", "eval.samples=0", "scaling.cpus_per_worker=1",
        "checkpoint.every_steps=20", "checkpoint.keep=2", "parallel.pp=2",
        "elastic.replica_heartbeat_timeout_s=1.0", "elastic.max_failures_per_hour=5",
        "elastic.hang_timeout_s=10.0", "elastic.replica_groups=2",
        "elastic.replica_collective_timeout_s=2.0",
        f"scaling.min_workers={2 * WORKERS}", f"scaling.max_workers={2 * WORKERS}"]


def _overrides(data: str, root: str, name: str, extra: list[str]) -> list[str]:
    return [*ARGS, f"data.path={data}", f"run.name={name}", f"run.storage_path={root}/ray",
            f"checkpoint.path={root}/{name}", f"tracking.uri=sqlite:///{root}/mlflow.db", *extra]


def _reference(data: str, root: str, preset: str):
    """Every step's loss and data fingerprint of an uninterrupted run: one process, no pipeline,
    no Ray."""
    return reference_run(load_config(None, _overrides(data, root, "reference", [
        f"model.preset={preset}",
        "tracking.enabled=false", "parallel.pp=1", "elastic.replica_groups=off",
        "scaling.min_workers=1", "scaling.max_workers=1"])), STEPS)


@pytest.mark.parametrize("preset", ["tiny", "llama3-tiny"], ids=["gpt2", "llama"])
def test_a_group_of_whole_pipelines_is_lost_and_heals_while_the_other_trains(
        preset, stdlib_dataset, tmp_path, monkeypatch, capfd):
    from elastic_gpt.elastic.replica_group_driver import RECORD_DIR_ENV, STATE_HASH_ENV
    from elastic_gpt.testing.cluster import LocalCluster, train_in_background

    reference = _reference(stdlib_dataset, str(tmp_path / "reference"), preset)
    records = str(tmp_path / "records")
    monkeypatch.setenv(RECORD_DIR_ENV, records)
    monkeypatch.setenv(STATE_HASH_ENV, "1")
    at: dict = {}

    def kill_group_1_first_stage():
        at["kill"], at["pid"], _ = kill_group_1_rank_0(records, KILL_AT, 3)
        at["back"] = time.time()
        return at

    # A node per group; the workers' output printed here, as a user's driver prints it.
    cluster = LocalCluster(workers=2, cpus_per_node=WORKERS, log_to_driver=True)
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        cfg = load_config(None, _overrides(stdlib_dataset, str(tmp_path), "rg-pp",
                                           [f"model.preset={preset}"]))
        summary, _ = train_in_background(cfg, kill_group_1_first_stage, timeout_s=420)
    finally:
        cluster.shutdown()
    recs = _records(records)
    committed = [r for r in recs if r.get("event") == "step" and r["rank"] == 0
                 and r["committed"]]
    assert summary["step"] == STEPS

    # Group 0 never restarted: it trained on alone, its pipeline over the whole step.
    assert len([r for r in recs if r["group"] == 0 and r["event"] == "start"]) == WORKERS
    alone = [r for r in committed if r["group"] == 0 and at["kill"] < r["t"] < at["back"]
             and r["groups"] == 1]
    assert alone, "group 0 stepped alone while group 1 was restarting"
    g0 = [r["step"] for r in committed if r["group"] == 0]
    assert g0 == list(range(g0[0], g0[-1] + 1))
    # Group 1 came back by healing from group 0, each stage's rank to its peer's state.
    healed = [r for r in recs if r["group"] == 1 and r["event"] == "join" and r["healed"]
              and r["t"] > at["kill"]]
    assert sorted(r["rank"] for r in healed) == list(range(WORKERS)), healed
    for j in healed:
        peer = [r["hash"] for r in recs if r["event"] == "state" and r["group"] == 0
                and r["rank"] == j["rank"] and r["step"] == j["step"]]
        mine = [r["hash"] for r in recs if r["event"] == "state" and r["group"] == 1
                and r["rank"] == j["rank"] and r["step"] == j["step"]]
        assert peer and mine and mine[-1] == peer[-1], j

    # C1, C2, C7: every step committed by every live group on the uninterrupted run's data, with
    # its loss within float noise.
    assert_steps_are_the_reference(committed, reference, STEPS)

    # The quiet log of the restart path: torchft's per-step lines (quorum, reconfiguration,
    # commit vote; from its Python side and its Rust core) are in each worker's file, at debug
    # level, not on the console.
    console = "".join(capfd.readouterr()).splitlines()
    assert [line for line in console if "(RayTrainWorker" in line and "step 200/200" in line]
    per_step = ("enough_replicas=", "should_commit request", "should_commit completed",
                "quorum for group_rank", "reconfiguring for quorum_id", "[INFO] [torchft::")
    assert not [line for line in console if any(p in line for p in per_step)][:5]
    files = {os.path.basename(f): f for f in glob.glob(str(tmp_path / "ray/rg-pp/logs/*.log"))}
    assert sorted(files) == [f"torchft-g{g}-r{r}.log" for g in range(2) for r in range(WORKERS)]
    with open(files["torchft-g0-r0.log"]) as f:
        detail = f.read()
    assert "should_commit=True" in detail and "torchft_commits" in detail, detail[-2000:]
    print(f"\n[replica groups x pp=2] group 0 alone for {len(alone)} step(s) while group 1 "
          f"restarted; healed at step {healed[0]['step']}; {len(console)} console lines")

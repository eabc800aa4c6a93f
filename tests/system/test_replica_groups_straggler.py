"""A slow replica group leaves and the others train on: 2 groups of one worker (a node each) on a
real Ray cluster with a real Lighthouse. Group 1's worker is slowed for real (SIGSTOP 15 ms /
SIGCONT 5 ms over and over): every step of both groups waits for it in the cross-group average,
so neither group's step time says which is slow, but the groups' compute figures, compared every
few steps, do (health/stragglers.py). Group 1 is named, drains its own node and leaves the
quorum; group 0 never restarts and steps on alone; the replacement node brings group 1 back,
healed. Every committed step has the data and (within float noise) the loss of an
uninterrupted single-process run (C1, C2, C7)."""

from __future__ import annotations

from elastic_gpt.config import load_config
from tests.system.test_replica_groups import (
    _last_start,
    _records,
    _wait_records,
    assert_steps_are_the_reference,
    reference_run,
)

STEPS = 120  # outlasts the slowdown, the naming and the slow group's leaving
EVERY, WINDOW = 2, 8  # a share every 2 steps over a window of 8
ARGS = ["model.preset=tiny", "train.global_batch_size=8", "train.micro_batch_size=1",
        f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.lr=3e-3",
        "train.log_every=100", "train.dtype=float32", "train.peak_tflops=0.05",
        "data.prefetch_steps=2", "eval.samples=0", "scaling.cpus_per_worker=1",
        "checkpoint.every_steps=20", "checkpoint.keep=2",
        "elastic.replica_heartbeat_timeout_s=1.0", "elastic.max_failures_per_hour=5",
        "elastic.hang_timeout_s=10.0", "elastic.replica_groups=2",
        "elastic.replica_collective_timeout_s=2.0", "scaling.min_workers=2",
        "scaling.max_workers=2", f"health.straggler_every_steps={EVERY}",
        f"health.straggler_window={WINDOW}"]


def _overrides(data: str, root: str, name: str, extra: list[str]) -> list[str]:
    return [*ARGS, f"data.path={data}", f"run.name={name}", f"run.storage_path={root}/ray",
            f"checkpoint.path={root}/{name}", f"tracking.uri=sqlite:///{root}/mlflow.db", *extra]


def test_the_slow_replica_group_is_the_one_that_leaves(stdlib_dataset, tmp_path, monkeypatch):
    from elastic_gpt.elastic.replica_group_driver import RECORD_DIR_ENV
    from elastic_gpt.testing.cluster import DutyCycled, LocalCluster, train_in_background

    reference = reference_run(load_config(None, _overrides(
        stdlib_dataset, str(tmp_path / "reference"), "reference",
        ["tracking.enabled=false", "elastic.replica_groups=off", "scaling.min_workers=1",
         "scaling.max_workers=1"])), STEPS)
    records = str(tmp_path / "records")
    monkeypatch.setenv(RECORD_DIR_ENV, records)
    at: dict = {}

    def slow_group_1():
        recs, together = _wait_records(records, lambda recs: [
            r for r in recs if r.get("event") == "step" and r["group"] == 1 and r["committed"]
            and r["groups"] == 2 and r["step"] >= 12], what="both groups stepping")
        at["from_step"] = max(r["step"] for r in together)
        at["pid"] = _last_start(recs, 1, 0)["pid"]
        slowed = DutyCycled(at["pid"], stop_s=0.015, run_s=0.005)
        at["slowed"] = slowed.started
        try:
            _, alone = _wait_records(records, lambda recs: [
                r for r in recs if r.get("event") == "step" and r["group"] == 0
                and r["committed"] and r["groups"] == 1 and r["t"] > at["slowed"]],
                timeout_s=180, what="group 0 alone after the slow group left")
        finally:
            slowed.release()
        at["alone"] = alone[0]["t"]
        cluster.nodes.append(cluster.add_node(wait=False))  # the drained node's replacement

    cluster = LocalCluster(workers=2)  # a node per group
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        cfg = load_config(None, _overrides(stdlib_dataset, str(tmp_path), "rg-slow", []))
        summary, _ = train_in_background(cfg, slow_group_1, timeout_s=420)
    finally:
        cluster.shutdown()
    recs = _records(records)
    committed = [r for r in recs if r.get("event") == "step" and r["committed"]]
    assert summary["step"] == STEPS

    # Group 1 was named from the groups' compute, its node drained: the slow group left.
    found = [e for e in summary["events"] if e["kind"] == "straggler"]
    assert len(found) == 1 and found[0]["groups"] == [1], summary["events"]
    assert found[0]["action"] == "node drained" and found[0]["ratios"][0] >= 1.5, found[0]
    # Within the bound: a window of slowed steps, the next share, and the step after it that
    # carries the groups' exchange (the progress of the records may lag a step).
    assert found[0]["step"] - at["from_step"] <= WINDOW + EVERY + 2, (found[0], at)
    left = [r for r in recs if r["event"] == "departure" and r["t"] > found[0]["at"]]
    assert left and int(left[0]["replica"].split(":")[0].rsplit("_", 1)[1]) == 1, left
    # Group 0 never restarted and stepped on alone, its step never going back.
    assert len([r for r in recs if r["group"] == 0 and r["event"] == "start"]) == 1
    g0 = [r["step"] for r in committed if r["group"] == 0]
    assert g0 == list(range(g0[0], g0[-1] + 1))
    # C1, C2, C7: every step committed by every live group on the uninterrupted run's data.
    assert_steps_are_the_reference(committed, reference, STEPS)
    print(f"\n[replica groups] slow group named {found[0]['at'] - at['slowed']:.1f} s after the "
          f"slowdown began, {found[0]['step'] - at['from_step']} steps on, "
          f"{found[0]['ratios'][0]:.1f}x the median group; group 0 alone "
          f"{at['alone'] - found[0]['at']:.1f} s after the naming")

"""The elastic controller's pieces on their own: failure-policy decisions, planning groups in whole
tensor-parallel groups and pipelines, and the goodput ledger's arithmetic."""

from __future__ import annotations

import pytest
from ray import cloudpickle
from ray.train import FailureConfig, ScalingConfig

from elastic_gpt.elastic.membership import RunRecords
from elastic_gpt.elastic.policies import (
    ElasticFailurePolicy,
    LiveCapacityScalingPolicy,
    gather_arrivals,
    group_plan,
)
from elastic_gpt.errors import ElasticRestart, NonFiniteLossError
from elastic_gpt.train.goodput import GoodputLedger
from tests.failure_policies import WorkerGroupError, failure_policy


def test_planned_restarts_are_free_fatal_errors_stop_at_once():
    policy, _ = failure_policy()
    planned = WorkerGroupError({0: ElasticRestart("resize: 1 -> 2 workers", 5),
                                 1: ElasticRestart("resize: 1 -> 2 workers", 5)})
    for _ in range(10):
        assert policy.make_decision(planned).name == "RETRY"
    assert len(policy.window) == 0
    fatal = WorkerGroupError({0: NonFiniteLossError("loss is nan"), 1: RuntimeError("peer")})
    assert policy.make_decision(fatal).name == "RAISE"


def test_failures_are_budgeted_per_sliding_hour():
    # No Ray here: the failure record's GCS write fails quietly, and the decisions don't care.
    policy, clock = failure_policy()
    attributes = set(vars(policy))
    crash = WorkerGroupError({1: RuntimeError("worker died")})
    assert [policy.make_decision(crash).name for _ in range(3)] == ["RETRY"] * 3
    assert policy.make_decision(crash).name == "RAISE"  # a 4th within the hour: budget is 3
    clock.t += 3601  # an hour later the old failures no longer count
    assert policy.make_decision(crash).name == "RETRY"
    assert set(vars(policy)) == attributes, "all state is made in the constructor"


def test_policies_reach_the_controller_by_reference_with_their_state():
    """Ray Train pickles the policies into its controller actor: they must arrive as instances
    of this package's classes (importable there), with everything their constructors made."""
    records = RunRecords("test-pickle")
    scaling = LiveCapacityScalingPolicy(ScalingConfig(num_workers=(2, 4)), records, tp=2,
                                        hsdp="on", grow_settle_s=7.0, node_mtbf_h=50.0)
    failure = ElasticFailurePolicy(FailureConfig(), records, 3)
    for policy in (scaling, failure):
        copy = cloudpickle.loads(cloudpickle.dumps(policy))
        assert type(copy) is type(policy)
        assert set(vars(copy)) == set(vars(policy))
        assert copy.records.run_key == "test-pickle"
    assert scaling.more_room_since is None and scaling.last_group_nodes == {}
    scaling_copy = cloudpickle.loads(cloudpickle.dumps(scaling))
    assert (scaling_copy.tp, scaling_copy.hsdp) == (2, "on")
    assert (scaling_copy.grow_settle_s, scaling_copy.node_mtbf_h) == (7.0, 50.0)


@pytest.mark.parametrize("per_node,max_workers,tp,hsdp,plan", [
    ({"a": 2, "b": 1}, 4, 1, "auto", {"a": 2, "b": 1}),  # tp=1: every worker that fits
    ({"a": 2, "b": 1}, 2, 1, "auto", {"a": 2}),  # the fullest nodes first, as few as hold it
    ({"a": 2, "b": 2}, 4, 2, "auto", {"a": 2, "b": 2}),
    ({"a": 2}, 4, 2, "auto", {"a": 2}),  # a node lost: the data-parallel degree drops, tp stays
    ({"a": 3, "b": 1}, 8, 2, "auto", {"a": 2}),  # whole tensor-parallel groups per node only
    # Room 3 + 2: PACK would put 3 workers on a and split a group; the plan pins 2 + 2.
    ({"a": 3, "b": 2}, 4, 2, "auto", {"a": 2, "b": 2}),
    ({"a": 3, "b": 1, "c": 2}, 4, 2, "auto", {"a": 2, "c": 2}),
    ({"a": 1, "b": 1}, 4, 2, "auto", {}),  # no node holds a group: wait for capacity
    ({"a": 8, "b": 8, "c": 8}, 16, 4, "auto", {"a": 8, "b": 8}),
    ({"a": 8, "b": 8, "c": 8}, 12, 4, "auto", {"a": 8, "b": 4}),
    ({"a": 4, "b": 4, "c": 2}, 12, 2, "on", {"a": 4, "b": 4}),  # replicas: 2 x 4 beat 3 x 2
    ({"a": 4, "b": 2, "c": 2}, 12, 2, "on", {"a": 2, "b": 2, "c": 2}),  # 3 x 2 beat 1 x 4
    ({"a": 8, "b": 8, "c": 8}, 16, 4, "on", {"a": 8, "b": 8}),  # capped in whole replicas
])
def test_groups_are_planned_in_whole_tensor_parallel_groups_per_node(per_node, max_workers, tp,
                                                                     hsdp, plan):
    got = group_plan(per_node, max_workers, tp, hsdp)
    assert got == plan
    assert list(got) == list(plan), "nodes in the order their ranks take (fullest first)"
    assert all(w % tp == 0 and w <= per_node[n] for n, w in got.items())


@pytest.mark.parametrize("per_node,max_workers,tp,pp,hsdp,plan", [
    ({"a": 2, "b": 2}, 4, 1, 2, "auto", {"a": 2, "b": 2}),  # two pipelines of 2 stages
    ({"a": 2, "b": 1}, 4, 1, 2, "auto", {"a": 2}),  # 3 fit: whole pipelines only, so 2
    ({"a": 3, "b": 2, "c": 1}, 8, 1, 4, "auto", {"a": 3, "b": 1}),  # a stage may cross nodes
    ({"a": 4, "b": 2}, 8, 2, 2, "auto", {"a": 4}),  # whole pipelines of pp 2 x tp 2
    ({"a": 2}, 4, 1, 4, "auto", {}),  # not one whole pipeline: wait for capacity
    ({"a": 2, "b": 2, "c": 2}, 12, 1, 2, "on", {"a": 2, "b": 2, "c": 2}),
    ({"a": 3, "b": 3, "c": 3}, 12, 1, 2, "on", {"a": 3, "b": 3}),  # replicas, whole pipelines
])
def test_groups_are_planned_in_whole_pipelines(per_node, max_workers, tp, pp, hsdp, plan):
    got = group_plan(per_node, max_workers, tp, hsdp, pp)
    assert got == plan
    assert sum(got.values()) % (pp * tp) == 0


def test_goodput_ledger_moves_redone_work_from_productive_to_lost():
    ledger = GoodputLedger(_attempt_started=100.0)
    assert ledger.on_resume(restored_step=0, world_size=2, previous=None, cause=None,
                            attempt_started=100.0) is None
    ledger.on_first_step_started(now=105.0)  # 5 s of startup
    for _ in range(10):
        ledger.on_step(1.0)
    ledger.on_checkpoint(0.5)
    # The attempt died at step 10 with the newest checkpoint at step 8: 2 steps to redo.
    event = ledger.on_resume(
        restored_step=8, world_size=1, attempt_started=130.0,
        previous={"step": 10, "world_size": 2, "avg_step_s": 1.0, "at": 120.0},
        cause={"kind": "failure", "error": "node died", "at": 121.0})
    assert event["lost_steps"] == 2 and event["from_world_size"] == 2
    ledger.on_first_step_started(now=131.0)
    s = ledger.summary()
    assert s["productive_s"] == 8.0 and s["lost_s"] == 2.0 and s["lost_steps"] == 2
    assert s["recovery_s"] == 5.0 + 10.0  # startup + (first step 131 - failure 121)
    assert s["goodput"] == pytest.approx(8.0 / (8.0 + 2.0 + 0.5 + 15.0), abs=1e-4)
    assert ledger.events[0]["recovery_s"] == 10.0
    restored = GoodputLedger.from_dict(ledger.to_dict())
    assert restored.summary() == s


def test_the_wait_for_a_quorum_change_is_recovery_not_productive_time():
    ledger = GoodputLedger(_attempt_started=10.0)
    ledger.on_first_step_started(now=10.0)
    ledger.on_step(1.0)
    event = ledger.on_quorum_change(2, 1, 2, step=2, waited_s=1.5)
    ledger.on_step(0.25, degraded=True)  # the step's time less its quorum's wait (Trainer)
    s = ledger.summary()
    assert (s["productive_s"], s["recovery_s"], s["degraded_s"]) == (1.25, 1.5, 0.25)
    assert event["recovery_s"] == 1.5 and s["goodput"] == round(1.25 / 2.75, 4)


def test_a_resumed_ledger_keeps_what_happened_after_the_checkpoint_it_restored():
    # What a restart really hands the next attempt: the checkpoint's ledger (step 8), and the
    # ledger the dead attempt published at step 10, which alone has steps 9-10, the checkpoint
    # write and the event after step 8.
    live = GoodputLedger(_attempt_started=100.0)
    live.on_first_step_started(now=101.0)
    for _ in range(8):
        live.on_step(1.0)
    checkpointed = live.to_dict()
    live.on_quorum_change(1, 2, 2, step=9)
    for _ in range(2):
        live.on_step(1.0)
    live.on_checkpoint(0.5)
    ledger = GoodputLedger.from_dict(checkpointed)  # Trainer.restore
    ledger.on_resume(restored_step=8, world_size=2, attempt_started=130.0,
                     previous={"step": 10, "world_size": 2, "avg_step_s": 1.0, "at": 120.0,
                               "ledger": live.to_dict()},
                     cause={"kind": "failure", "error": "lighthouse lost", "at": 121.0})
    ledger.on_first_step_started(now=131.0)
    s = ledger.summary()
    assert s["productive_s"] == 8.0 and s["lost_s"] == 2.0 and s["checkpoint_s"] == 0.5
    assert [e["kind"] for e in ledger.events] == ["replica group joined", "failure"]
    # An attempt that dies before its first step has published what it restored (step 8, the
    # re-done steps already counted): the next one does not count them again.
    dying = GoodputLedger.from_dict(checkpointed)
    dying.on_resume(restored_step=8, world_size=2, attempt_started=130.0,
                    previous={"step": 10, "world_size": 2, "avg_step_s": 1.0, "at": 120.0,
                              "ledger": live.to_dict()}, cause=None)
    third = GoodputLedger.from_dict(checkpointed)
    third.on_resume(restored_step=8, world_size=2, attempt_started=140.0,
                    previous={"step": 8, "world_size": 2, "avg_step_s": 1.0, "at": 131.0,
                              "ledger": dying.to_dict()}, cause=None)
    assert third.lost_steps == 2 and third.productive_s == 8.0 and third.lost_s == 2.0
    # A progress record older than the checkpoint adds nothing the checkpoint lacks.
    stale = GoodputLedger.from_dict(checkpointed)
    stale.on_resume(restored_step=8, world_size=2, attempt_started=130.0,
                    previous={"step": 6, "world_size": 2, "avg_step_s": 1.0, "at": 110.0,
                              "ledger": {"productive_s": 6.0}}, cause=None)
    assert stale.productive_s == 8.0 and stale.lost_steps == 0


def test_a_healed_group_adopts_its_peers_ledger_and_keeps_the_events_only_it_saw():
    from elastic_gpt.train.goodput import merge_events

    peer = GoodputLedger(_attempt_started=0.0)
    peer.on_first_step_started(now=0.0)
    peer.on_step(5.0)
    lost = peer.on_quorum_change(2, 1, 2, step=5, waited_s=0.1)
    lost["at"] = 10.0
    # The restarted group: why it restarted is in its own ledger alone.
    mine = GoodputLedger(_attempt_started=20.0)
    mine.on_resume(restored_step=0, world_size=2, attempt_started=20.0, previous=None,
                   cause={"kind": "failure", "error": "worker killed", "at": 19.0})
    mine.on_first_step_started(now=21.0)
    mine.adopt(peer.to_dict())  # the heal: the peer's totals, and the union of the events
    assert mine.summary()["productive_s"] == 5.0
    assert [e["kind"] for e in mine.events] == ["replica group lost", "failure"]  # by time
    assert lost in mine.events
    # Both then note the join; the driver's union of the groups' ledgers has each event once.
    for ledger in (peer, mine):
        ledger.events.append({"kind": "replica group joined", "at": 30.0, "step": 9})
    merged = merge_events(peer.events, mine.events)
    assert [e["kind"] for e in merged].count("replica group joined") == 1
    assert [e["at"] for e in merged] == sorted(e["at"] for e in merged)
    assert {e["kind"] for e in merged} == {"failure", "replica group lost", "replica group joined"}


def test_a_grow_gathers_only_the_launches_the_autoscaler_reports_coming():
    assert not gather_arrivals(0, 0.0, 30.0)  # nothing coming: a returning node is used at once
    assert gather_arrivals(2, 0.0, 30.0) and gather_arrivals(1, 29.9, 30.0)
    assert not gather_arrivals(2, 30.0, 30.0)  # bounded: what is up by then is used


def test_an_attempts_start_is_broken_down_from_its_marks():
    from elastic_gpt.train.metrics import startup_breakdown, startup_line

    failure = {"at": 100.0, "recovery_s": 0.0, "lost_steps": 0}
    marks = {"planned_at": 101.5, "placement_s": 0.5, "built_s": 2.0, "init_s": 0.0,
             "checkpoint_read_s": 1.0, "entered_at": 104.0}
    parts = startup_breakdown(failure, marks, started=105.0, first_step_at=108.5)
    assert parts == {"controller_s": 1.5, "placement_s": 0.5, "worker_start_s": 3.0,
                     "build_s": 2.0, "checkpoint_read_s": 1.0, "to_first_step_s": 0.5}
    assert startup_line(parts).startswith("controller 1.5 s, placement 0.5 s, worker start 3.0 s")
    # Under a plain process group (no worker marks): the Trainer's own parts only.
    bare = startup_breakdown(None, {"init_s": 0.3, "checkpoint_read_s": 0.0}, 10.0, 12.0)
    assert bare == {"checkpoint_read_s": 0.0, "to_first_step_s": 2.0}

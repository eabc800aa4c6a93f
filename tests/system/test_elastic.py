"""The elastic controller's pieces against a real GCS (a local Ray cluster): a placement the layout
cannot use retried for free at the aligned size, the run's records a failure leaves for the next
attempt, `use_gpu: auto` on a GPU cluster whose GPU nodes are not up yet, live capacity, and the
launches an autoscaler reports in flight."""

from __future__ import annotations

import time

import pytest

from elastic_gpt.elastic.membership import RunRecords, live_capacity
from elastic_gpt.errors import PlacementError
from tests.failure_policies import WorkerGroupError, failure_policy


def test_a_placement_the_layout_cannot_use_is_retried_for_free_at_the_aligned_size(ray_cluster):
    records = RunRecords(f"test-placement-{time.time_ns()}")
    policy, _ = failure_policy(records.run_key, budget=1)
    split = PlacementError("workers per node [3, 1] are not all multiples of parallel.tp=2",
                           [3, 1], 2)
    for _ in range(5):
        assert policy.make_decision(WorkerGroupError({0: split, 1: split})).name == "RETRY"
    assert len(policy.window) == 0, "not charged to the failure budget"
    assert records.get("placement")["aligned_workers"] == 2  # the scaling policy's cap
    cause = records.consume_cause()
    assert cause["kind"] == "placement" and "not all multiples" in cause["reason"]
    # A placement error beside a real failure is a failure.
    mixed = WorkerGroupError({0: split, 1: RuntimeError("worker died")})
    assert policy.make_decision(mixed).name == "RETRY" and len(policy.window) == 1


def test_a_failure_leaves_the_record_the_next_attempt_reads(ray_cluster):
    records = RunRecords(f"test-failure-{time.time_ns()}")
    policy, _ = failure_policy(records.run_key)
    error = WorkerGroupError({1: RuntimeError("worker died")})
    assert policy.make_decision(error).name == "RETRY"
    cause = records.consume_cause()
    assert cause["kind"] == "failure" and cause["error"] == "workers failed"
    assert records.consume_cause() is None, "read once"


def test_use_gpu_auto_refuses_a_gpu_cluster_whose_gpu_nodes_are_not_up_yet(ray_cluster):
    """The autoscaler (or KubeRay) publishes its node types in the GCS; where they bring GPUs
    and none is up, `auto` would train on CPUs: one line instead. The record is written where
    the autoscaler keeps it, and read back through Ray's own reader."""
    import ray

    from elastic_gpt.config import load_config
    from elastic_gpt.elastic.ray_internals import publish_node_types
    from elastic_gpt.elastic.worker_group_job import use_gpu

    def cfg(value):
        return load_config("jobs/configs/mini.yaml", ["data.path=unused",
                                                      f"scaling.use_gpu={value}"])

    assert ray.cluster_resources().get("GPU", 0) == 0
    assert use_gpu(cfg("auto")) is False  # no autoscaler record: a fixed CPU cluster
    publish_node_types({"head": ({"CPU": 8}, 1), "p4d": ({"CPU": 96, "GPU": 8}, 4)})
    try:
        with pytest.raises(ValueError) as e:
            use_gpu(cfg("auto"))
        assert str(e.value) == (
            "scaling.use_gpu=auto: the cluster's node types bring up to 32 GPUs, but no GPU "
            "node is up yet; set scaling.use_gpu=true to wait for them (the autoscaler starts "
            "them for the workers) or scaling.use_gpu=false to train on CPUs")
        assert use_gpu(cfg("true")) is True and use_gpu(cfg("false")) is False
        publish_node_types({"head": ({"CPU": 8}, 1), "cpu": ({"CPU": 16}, 10)})
        assert use_gpu(cfg("auto")) is False  # an autoscaling CPU cluster
    finally:
        publish_node_types(None)
    assert use_gpu(cfg("auto")) is False


def test_live_capacity_reads_free_resources_from_the_gcs(ray_cluster):
    import ray

    cap = live_capacity({"CPU": 1})
    assert sum(cap.values()) == 4  # the fixture's 4 CPUs, nothing running

    @ray.remote(num_cpus=1)
    class Hog:
        def ping(self):
            return 1

    hogs = [Hog.remote() for _ in range(3)]
    ray.get([h.ping.remote() for h in hogs])
    deadline = time.time() + 10
    while sum(live_capacity({"CPU": 1}).values()) != 1 and time.time() < deadline:
        time.sleep(0.1)
    assert sum(live_capacity({"CPU": 1}).values()) == 1
    node = next(iter(cap))
    assert live_capacity({"CPU": 1}, held={node: 2})[node] == 3  # our own group's share counts
    assert live_capacity({"CPU": 1}, exclude={node}) == {}
    for h in hogs:
        ray.kill(h)


def test_the_launches_an_autoscaler_reports_in_flight_are_read_from_either_autoscaler(
        ray_cluster):
    """What a grow gathers for (elastic/policies.py): the launches Ray's autoscaler reports in
    flight, from v2's report to the GCS and from v1's status record, each written where the
    autoscaler writes it. A node whose IP is an alive node's has arrived; a v1 record its monitor
    stopped refreshing counts for nothing; no autoscaler, nothing coming."""
    from elastic_gpt.elastic.ray_internals import (
        alive_nodes,
        pending_launches,
        report_autoscaler_v1_status,
        report_pending_launches,
    )

    assert pending_launches() == 0  # a fixed cluster: no autoscaler reports
    report_pending_launches(3)  # v2: three launches requested
    assert pending_launches() == 3
    report_pending_launches(0)
    assert pending_launches() == 0
    here = next(iter(alive_nodes().values())).host
    report_autoscaler_v1_status({"cpu": 2}, [("10.250.0.7", "cpu", "waiting-for-ssh"),
                                             (here, "cpu", "setting-up")], at=time.time())
    assert pending_launches() == 3  # two to launch, one made and not up; `here` has arrived
    report_autoscaler_v1_status({"cpu": 2}, [], at=time.time() - 600)  # its monitor is gone
    assert pending_launches() == 0

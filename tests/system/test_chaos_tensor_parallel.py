"""Elastic over data parallelism on a real multi-node Ray cluster: 2 nodes x 2 CPUs, tp=2 (a
tensor-parallel group per node, HSDP across the two: the nodes share one IP here, so only Ray's
node ids tell them apart) or pp=2 (a pipeline of two stages per node). One node is hard-killed
mid-run: the run goes on at dp=1 on the other node from the newest checkpoint (resharded from
the 2-node layout), ends at the exact step count, and trains on the same samples at every step
as an uninterrupted run (C2 data order)."""

from __future__ import annotations

import pytest

from elastic_gpt.config import load_config, resolve_paths
from elastic_gpt.elastic.worker_group_job import run_key
from elastic_gpt.testing.cluster import LocalCluster, progress, train_in_background, wait_for
from elastic_gpt.tracking import metric_names as mn
from tests.training_records import metric_by_step, uninterrupted_fingerprints

STEPS = 24


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module (a start costs more than a node): 2 nodes x 2 CPUs; a test
    that kills a node adds one back."""
    c = LocalCluster(workers=2, cpus_per_node=2)
    yield c
    c.shutdown()


@pytest.mark.parametrize("layout", [
    ("parallel.tp=2",),
    # each pipeline's two stages on one node, two pipelines: one whole pipeline goes on
    ("parallel.pp=2", "model.n_layer=4", "eval.samples=0"),
], ids=["tp2", "pp2"])
def test_node_killed_under_model_parallelism_continues_at_dp_1(stdlib_dataset, tmp_path, layout,
                                                              cluster):
    cfg = load_config("jobs/configs/mini.yaml", [
        "model.preset=tiny", f"data.path={stdlib_dataset}", "train.global_batch_size=8",
        "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.warmup_steps=2",
        "train.log_every=100", "checkpoint.every_steps=4", "checkpoint.keep=2",
        *layout, "scaling.min_workers=2", "scaling.max_workers=4",
        "elastic.max_failures_per_hour=5", "elastic.worker_start_timeout_s=15",
        "run.name=node-kill", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"run.storage_path={tmp_path}/ray", f"checkpoint.path={tmp_path}/ckpt"])
    resolve_paths(cfg)  # as run_training does: the run's key is its resolved checkpoint URL
    key = run_key(cfg)

    def kill_a_node_mid_run():
        # Past the first checkpoint, at the 2-node layout: the kill lands mid-run.
        wait_for(lambda: (lambda p: p.get("world_size") == 4 and p.get("step", 0) > 4)(
            progress(key) or {}), timeout_s=300)
        cluster.kill_node(cluster.node_hosting_a_worker())

    try:
        summary, _ = train_in_background(cfg, kill_a_node_mid_run)
    finally:
        cluster.nodes.append(cluster.add_node())  # the one killed, replaced for the next test

    assert summary["step"] == STEPS
    run = summary["run_id"]
    fingerprints = metric_by_step(cfg.tracking.uri, run, mn.DATA_FINGERPRINT)
    sizes = metric_by_step(cfg.tracking.uri, run, mn.TRAIN_WORLD_SIZE)
    assert sorted(fingerprints) == list(range(1, STEPS + 1)), "every step trained, none skipped"
    assert sizes[1] == 4 and sizes[STEPS] == 2, sizes  # 2 model-parallel groups of 2, then 1
    assert fingerprints == uninterrupted_fingerprints(cfg, STEPS)  # C2 data order
    assert "failure" in [e["kind"] for e in summary["events"]]


def test_nodes_of_uneven_room_get_whole_tensor_parallel_groups(stdlib_dataset, tmp_path, cluster):
    """Nodes with room for 3, 1 and 2 workers, tp=2, up to 4 workers: Ray's PACK placement alone
    puts 3 workers on the first node, splitting a tensor-parallel group across nodes (which used
    to end the run). The scaling policy plans whole groups per node and pins each worker to its
    node: 2 on the 3-CPU node, 2 on the 2-CPU node, none on the 1-CPU one; the run trains at
    4 workers from its first step with no failure."""
    from collections import Counter

    import ray

    from elastic_gpt.testing.cluster import training_workers

    for node in list(cluster.nodes):  # the module's 2-CPU nodes leave cleanly for these
        cluster.nodes.remove(node)
        cluster.cluster.remove_node(node, allow_graceful=True)
    wait_for(lambda: not [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")])
    rooms = {cluster.add_node(wait=False, num_cpus=n).node_id: n for n in (3, 1, 2)}
    cluster.cluster.wait_for_nodes()
    cfg = load_config("jobs/configs/mini.yaml", [
        "model.preset=tiny", f"data.path={stdlib_dataset}", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.max_steps=6", "train.warmup_steps=2",
        "train.log_every=100", "checkpoint.every_steps=6", "parallel.tp=2",
        "scaling.min_workers=2", "scaling.max_workers=4", "elastic.max_failures_per_hour=5",
        "elastic.worker_start_timeout_s=15", "run.name=tp-uneven",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"run.storage_path={tmp_path}/ray",
        f"checkpoint.path={tmp_path}/ckpt"])
    resolve_paths(cfg)
    key = run_key(cfg)

    def workers_per_node_once_stepping():
        wait_for(lambda: (progress(key) or {}).get("step", 0) >= 1, timeout_s=300)
        return Counter(rooms[w.node_id] for w in training_workers())

    summary, placed = train_in_background(cfg, workers_per_node_once_stepping)

    assert placed == {3: 2, 2: 2}, placed  # node room -> workers on it
    assert summary["step"] == 6
    sizes = metric_by_step(cfg.tracking.uri, summary["run_id"], mn.TRAIN_WORLD_SIZE)
    assert set(sizes.values()) == {4}, sizes
    assert [e["kind"] for e in summary["events"]] == [], summary["events"]

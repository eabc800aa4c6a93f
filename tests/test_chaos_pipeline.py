"""Elastic over data parallelism with pipeline parallelism on a real multi-node Ray cluster:
2 nodes x 2 CPUs, pp=2 (each pipeline's stages on one node, two pipelines). One node is
hard-killed mid-run: the run goes on with one whole pipeline (dp=1, pp=2 stays) from the newest
checkpoint, ends at the exact step count, and trains on the same samples at every step as an
uninterrupted run (C2 data order)."""

from __future__ import annotations

import pytest
from conftest import metric_by_step

from elastic_gpt.config import load_config, resolve_paths
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.data.stream import open_step_stream
from elastic_gpt.elastic.worker_group_job import run_key
from elastic_gpt.testing.cluster import LocalCluster, progress, train_in_background, wait_for
from elastic_gpt.tracking import metric_names as mn

pytestmark = pytest.mark.slow

STEPS = 24


def test_node_killed_under_pipeline_parallelism_continues_with_whole_pipelines(
        stdlib_dataset, tmp_path):
    cluster = LocalCluster(workers=2, cpus_per_node=2)
    try:
        cfg = load_config("jobs/configs/mini.yaml", [
            "model.preset=tiny", "model.n_layer=4", f"data.path={stdlib_dataset}",
            "train.global_batch_size=8", "train.micro_batch_size=2", f"train.max_steps={STEPS}",
            "train.warmup_steps=2", "train.log_every=100", "checkpoint.every_steps=4",
            "checkpoint.keep=2", "parallel.pp=2", "scaling.min_workers=2",
            "scaling.max_workers=4", "eval.samples=0", "elastic.max_failures_per_hour=5",
            "elastic.worker_start_timeout_s=15", "run.name=pp-node-kill",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"run.storage_path={tmp_path}/ray",
            f"checkpoint.path={tmp_path}/ckpt"])
        resolve_paths(cfg)
        key = run_key(cfg)

        def kill_a_node_mid_run():
            wait_for(lambda: (lambda p: p.get("world_size") == 4 and p.get("step", 0) > 4)(
                progress(key) or {}), timeout_s=300)
            cluster.kill_node(cluster.node_hosting_a_worker())

        summary, _ = train_in_background(cfg, kill_a_node_mid_run)
    finally:
        cluster.shutdown()

    assert summary["step"] == STEPS
    run = summary["run_id"]
    fingerprints = metric_by_step(cfg.tracking.uri, run, mn.DATA_FINGERPRINT)
    sizes = metric_by_step(cfg.tracking.uri, run, mn.TRAIN_WORLD_SIZE)
    assert sorted(fingerprints) == list(range(1, STEPS + 1)), "every step trained, none skipped"
    assert sizes[1] == 4 and sizes[STEPS] == 2, sizes  # 2 pipelines of 2 stages, then 1
    plan = BatchSplit(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    with open_step_stream(cfg.data.path, batch_split=plan, rank=0, world_size=1, start_step=0,
                          seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window) as stream:
        expected = {s + 1: float(next(stream).fingerprint) for s in range(STEPS)}
    assert fingerprints == expected
    assert "failure" in [e["kind"] for e in summary["events"]]

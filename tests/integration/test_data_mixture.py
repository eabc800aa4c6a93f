"""Weighted mixtures (data.sources) in training (a gloo rank): the trainer logs the samples it has
seen of each source, and its checkpoint records the sources and their weights."""

from __future__ import annotations

import json

import pytest

from elastic_gpt.tracking import metric_names as mn
from tests.mixture_sources import make_sources

SEED, WINDOW = 11, 32


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three byte datasets of different sizes (so up- and down-sampling both happen)."""
    return make_sources(tmp_path_factory.mktemp("mix"))


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import NullMetricSink, Trainer

    logged: dict[int, dict] = {}

    class Recorder(NullMetricSink):
        def log(self, metrics, step):
            logged.setdefault(step, {}).update(metrics)

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None, metrics=Recorder())
    trainer.train()
    return {"logged": logged, "state": trainer.trainer_state()}


def test_trainer_logs_samples_seen_per_source(sources, tmp_path):
    from elastic_gpt.testing.gloo import run_gloo

    mix = [{"path": sources[0], "weight": 3.0}, {"path": sources[1], "weight": 1.0}]
    overrides = ["model.preset=tiny", "train.global_batch_size=8", "train.micro_batch_size=2",
                 "train.max_steps=3", "train.warmup_steps=1", "scaling.max_workers=1",
                 "scaling.min_workers=1", "eval.samples=0", "tracking.enabled=false",
                 "checkpoint.path=" + str(tmp_path / "ckpt"), f"data.sources={json.dumps(mix)}"]
    got = run_gloo(_train_worker, 1, overrides)[0]
    last = got["logged"][3]  # after step 3
    per_source = {k: v for k, v in last.items() if k.startswith(mn.source_samples_seen(""))}
    assert set(per_source) == {mn.source_samples_seen("code"), mn.source_samples_seen("prose")}
    assert sum(per_source.values()) == last[mn.TRAIN_SAMPLES_SEEN] == 24
    assert per_source[mn.source_samples_seen("code")] == pytest.approx(18, abs=1)
    assert [s["weight"] for s in got["state"]["data"]["sources"]] == [3.0, 1.0]

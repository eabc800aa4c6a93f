"""The Trainer runs with the memory settings it resolved, and records them as the run's params
with the predicted peak."""

from __future__ import annotations

import pytest

from elastic_gpt.hardware import GiB


def test_the_trainer_runs_and_records_what_it_resolved(stdlib_dataset, tmp_path):
    from elastic_gpt.config import load_config
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.trainer import NullMetricSink, Trainer

    class Params(NullMetricSink):
        def __init__(self):
            self.params = {}

        def log_params(self, params):
            self.params.update(params)

    cfg = load_config("jobs/configs/mini.yaml", [
        f"data.path={stdlib_dataset}", f"checkpoint.path={tmp_path}/ckpt", "train.max_steps=1",
        "eval.samples=0", "model.n_layer=2", "train.micro_batch_size=2",
        "train.global_batch_size=4"])
    sink = Params()
    with gloo_group():
        trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None, metrics=sink)
        trainer.train()
        line = trainer.setup_line()
    ms = trainer.layout.memory
    # Two micro-batches on one CPU worker with room to spare: reduce once per step, keep gathered.
    assert (ms.grad_sync, ms.reshard_after_forward, ms.hsdp) == ("step", False, False)
    assert sink.params["resolved.w1.grad_sync"] == "step"
    assert sink.params["resolved.w1.reshard_after_forward"] == "never"
    assert float(sink.params["resolved.w1.predicted_memory_gib"]) == pytest.approx(
        ms.memory.total / GiB, abs=0.01)
    assert "grad_sync=step (auto)" in line and "reshard_after_forward=never (auto)" in line
    assert float(sink.params["resolved.w1.usable_memory_gib"]) == pytest.approx(
        ms.usable_bytes / GiB, abs=0.01)

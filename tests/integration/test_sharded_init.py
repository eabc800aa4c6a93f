"""Weight init where each shard lives: every rank draws only the tiles its shards cover, and the
gathered weights equal a single-process `GPT.init_weights` at any world size and layout (plain
FSDP2 with uneven shards, HSDP, FSDP2 over tensor parallelism with its strided fused q|k|v); a
resume skips the init, and a checkpoint removed while a group starts is replaced by the newest."""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.model import gpt as gpt_module
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT
from elastic_gpt.testing.gloo import run_gloo

# n_embd 40 over 3 or 4 ranks: uneven shards, some ranks holding a part of a tile row.
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=40, seq_len=12, vocab_size=70)
SMALL_TILE = (7, 9)  # several tiles per matrix, cut by every shard edge


def _init_worker(rank: int, world: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.parallel.fsdp import init_sharded_weights, parallelize

    gpt_module.INIT_TILE = SMALL_TILE
    with torch.device("meta"):
        model = GPT(CFG)
    if layout == "fsdp":
        parallelize(model, init_device_mesh("cpu", (world,)), compute_dtype=torch.float32)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        parallelize(model, mesh, compute_dtype=torch.float32)
    else:  # dp x tp
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["dp"], compute_dtype=torch.float32, tp_mesh=mesh["tp"])
    model.to_empty(device="cpu")
    drawn = []
    real = gpt_module.init_tiles

    def counting(seed, index, shape, rows, cols, std):
        drawn.append(len(rows) * len(cols))
        return real(seed, index, shape, rows, cols, std)

    gpt_module.init_tiles = counting
    try:
        init_sharded_weights(model, seed=5)
    finally:
        gpt_module.init_tiles = real
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"full": full, "drawn": sum(drawn)}


@pytest.mark.parametrize("layout, world", [("fsdp", 3), ("hsdp", 4), ("dp_tp", 4)])
def test_sharded_init_equals_the_single_process_init(layout, world, monkeypatch):
    monkeypatch.setattr(gpt_module, "INIT_TILE", SMALL_TILE)
    whole = GPT(CFG)
    whole.init_weights(seed=5)
    expected = dict(whole.named_parameters())
    got = run_gloo(_init_worker, world, layout)
    for name, value in got[0]["full"].items():
        clean = name.replace("_checkpoint_wrapped_module.", "")
        torch.testing.assert_close(value, expected[clean].detach(), rtol=0, atol=0, msg=name)
    # Each rank drew its share of the matrices' elements, not all of them.
    matrices = sum(p.numel() for p in whole.parameters() if p.dim() == 2)
    assert all(r["drawn"] < matrices * 0.75 for r in got), [r["drawn"] for r in got]


def test_a_resume_skips_the_init_and_reports_its_startup(stdlib_dataset, tmp_path):
    """The Trainer finds the checkpoint before building: a resume draws no weights, reads them,
    and logs its startup by part with its first step's metrics."""
    from elastic_gpt.config import load_config
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.tracking import metric_names as mn
    from elastic_gpt.train.trainer import NullMetricSink, Trainer

    class Steps(NullMetricSink):
        def __init__(self):
            self.logged = []

        def log(self, metrics, step):
            self.logged.append((step, metrics))

    def run(max_steps):
        cfg = load_config("jobs/configs/mini.yaml", [
            f"data.path={stdlib_dataset}", f"checkpoint.path={tmp_path}/ckpt", "eval.samples=0",
            "model.n_layer=2", f"train.max_steps={max_steps}", "checkpoint.every_steps=2",
            "train.global_batch_size=4", "train.micro_batch_size=2"])
        sink = Steps()
        with gloo_group():
            trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None, metrics=sink)
            trainer.train()
        return trainer, sink

    fresh, fresh_log = run(2)
    assert fresh.resume_from is None and fresh.startup["init_s"] > 0
    assert fresh.startup["checkpoint_read_s"] == 0
    resumed, resumed_log = run(3)
    assert resumed.resume_from is not None and resumed.resume_from.step == 2
    assert resumed.startup["init_s"] == 0 and resumed.startup["checkpoint_read_s"] > 0
    # Once per attempt, with the first step's metrics (step 3 here: the state after 3 steps).
    with_startup = [(step, m) for step, m in resumed_log.logged if mn.STARTUP_S in m]
    assert [step for step, _ in with_startup] == [3]
    m = with_startup[0][1]
    assert m[mn.STARTUP_INIT_S] == 0 and m[mn.STARTUP_CHECKPOINT_READ_S] > 0
    assert m[mn.STARTUP_S] >= m[mn.STARTUP_CHECKPOINT_READ_S] and mn.TRAIN_LOSS in m
    assert [s for s, m in fresh_log.logged if mn.STARTUP_S in m] == [1]


def test_a_checkpoint_removed_while_a_group_starts_is_replaced_by_the_newest(stdlib_dataset,
                                                                               tmp_path):
    """Chosen before the build, removed by retention before the load (another replica group went
    on saving): the newest committed step is loaded instead, not a failure of the run."""
    from elastic_gpt.config import load_config
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.trainer import Trainer

    def trainer(max_steps):
        cfg = load_config("jobs/configs/mini.yaml", [
            f"data.path={stdlib_dataset}", f"checkpoint.path={tmp_path}/ckpt", "eval.samples=0",
            "model.n_layer=2", f"train.max_steps={max_steps}", "checkpoint.every_steps=2",
            "checkpoint.keep=1", "train.global_batch_size=4", "train.micro_batch_size=2"])
        return Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None)

    with gloo_group():
        trainer(2).train()
        starting = trainer(5)
        assert starting.resume_from.step == 2 and starting.startup["init_s"] == 0
        trainer(4).train()  # commits step 4; keep=1 removes step 2
        starting.train()
    assert starting.resume_from.step == 4 and starting.step == 5

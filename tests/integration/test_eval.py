"""Held-out evaluation in the trainer, with real gloo process groups:

- val/loss and val/bits_per_byte are the same at W=1, at W=2 under FSDP (reshard_after_forward
  never and always) and at tp=2 (vocab-parallel loss), on an evaluation set that the ranks split
  unevenly;
- evaluating leaves the model as training needs it: every parameter resharded (the weights
  gathered for the forward are released), dropout back on, and the next step's gradients equal
  those of a model that was never evaluated;
- a run evaluates every eval.every_steps and at its last step, logs val/* through the metric
  sink, books the time as eval_s in the goodput ledger, and trains exactly as without evaluation;
- a version-1 dataset evaluates without bits per byte.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from elastic_gpt.config import load_config
from elastic_gpt.testing.gloo import run_gloo
from elastic_gpt.tracking import metric_names as mn

FIXTURE_DATASET = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "main-v0", "dataset")
EVAL_SAMPLES = 7  # not a multiple of the micro-batch or of W: uneven blocks, padded slots




def _overrides(data: str, world: int, tmp: str, extra: tuple[str, ...] = ()) -> list[str]:
    return ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=8",
            "train.micro_batch_size=2", f"scaling.max_workers={world}", "scaling.min_workers=1",
            f"eval.samples={EVAL_SAMPLES}", "checkpoint.path=" + os.path.join(tmp, "ckpt"),
            "tracking.enabled=false", *extra]


def _eval_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from torch.distributed.tensor import DTensor

    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    stream = open_step_stream(trainer.data, batch_split=trainer.batch_split, rank=trainer.dp_rank,
                              world_size=trainer.dp_degree, start_step=0, seed=cfg.data.seed)
    batch = next(stream)
    stream.close()

    def step_gradients() -> dict:
        trainer.forward_backward(batch)
        grads = {n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()}
        trainer.optimizer.zero_grad(set_to_none=True)
        return grads

    before = step_gradients()  # a step of a model that was never evaluated
    result = trainer.evaluate(0)
    resharded = all(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
                    for p in trainer.model.parameters())
    training_mode = all(m.training for m in trainer.model.modules())
    after = step_gradients()  # the same step right after an evaluation
    same = all(torch.equal(before[n], after[n]) for n in before)
    return {"loss": result.loss, "bpb": result.bits_per_byte, "tokens": result.tokens,
            "bytes": result.text_bytes, "resharded": resharded, "training": training_mode,
            "same_step_after_eval": same}


@pytest.fixture(scope="module")
def single(dataset_with_val, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("w1"))
    return run_gloo(_eval_worker, 1, _overrides(dataset_with_val, 1, tmp))[0]


def test_single_process_eval_counts_every_token_and_byte(single, dataset_with_val):
    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.data.stream import ShardReader
    from elastic_gpt.train.evaluate import first_records

    val = load_manifest(dataset_with_val + "/val")
    table = val.load_token_bytes()
    tokens, _ = ShardReader(val).read(first_records(val, EVAL_SAMPLES))
    assert single["tokens"] == EVAL_SAMPLES * 32
    assert single["bytes"] == int(table[tokens[:, 1:].astype("int64")].sum())
    assert single["bpb"] == pytest.approx(single["loss"] * single["tokens"]
                                          / (math.log(2) * single["bytes"]))
    # An untrained byte model is near-uniform over its padded vocabulary.
    assert abs(single["loss"] - math.log(320)) < 0.5
    assert single["resharded"] and single["training"] and single["same_step_after_eval"]


@pytest.mark.parametrize("world,extra", [
    (2, ()),  # auto: never for this model, so the gathered weights outlive the forward
    (2, ("parallel.tp=2", "scaling.min_workers=2")),  # vocab-parallel loss
    (2, ("train.reshard_after_forward=always",)),
])
def test_eval_is_the_same_at_any_world_size_and_releases_the_weights(
        single, dataset_with_val, tmp_path, world, extra):
    got = run_gloo(_eval_worker, world, _overrides(dataset_with_val, world, str(tmp_path),
                                                   extra))
    for rank_result in got:
        assert rank_result["loss"] == pytest.approx(single["loss"], rel=1e-6)
        assert rank_result["bpb"] == pytest.approx(single["bpb"], rel=1e-6)
        assert (rank_result["tokens"], rank_result["bytes"]) == (single["tokens"],
                                                                 single["bytes"])
        assert rank_result["resharded"], "weights gathered for the evaluation were not released"
        assert rank_result["training"]
        # The step after an evaluation computes exactly what it computes without one.
        assert rank_result["same_step_after_eval"]


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from elastic_gpt.train.trainer import NullMetricSink, Trainer

    logged: dict[int, dict] = {}

    class Recorder(NullMetricSink):
        def log(self, metrics, step):
            logged.setdefault(step, {}).update(metrics)

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None, metrics=Recorder())
    summary = trainer.train()
    return {"logged": logged, "ledger": summary["ledger"].to_dict(),
            "goodput": summary["ledger"].summary(), "eval": summary["eval"]}


def test_run_evaluates_on_schedule_and_at_the_end_without_changing_training(
        dataset_with_val, tmp_path):
    base = _overrides(dataset_with_val, 1, str(tmp_path / "a"),
                      ("train.max_steps=5", "eval.every_steps=2", "train.warmup_steps=1",
                       "checkpoint.every_steps=50"))
    with_eval = run_gloo(_train_worker, 1, base)[0]
    without = run_gloo(_train_worker, 1, [*base, "eval.samples=0",
                                          "checkpoint.path=" + str(tmp_path / "b")])[0]
    val_steps = sorted(s for s, m in with_eval["logged"].items() if mn.VAL_LOSS in m)
    assert val_steps == [2, 4, 5]  # after steps 2 and 4 (every 2), and the last, step 5
    last = with_eval["logged"][5]
    assert last[mn.VAL_PERPLEXITY] == pytest.approx(math.exp(last[mn.VAL_LOSS]))
    assert 0 < last[mn.VAL_BITS_PER_BYTE] < 8 and with_eval["eval"].loss == last[mn.VAL_LOSS]
    # The model learns: the held-out loss falls from the untrained model's.
    assert with_eval["logged"][5][mn.VAL_LOSS] < with_eval["logged"][2][mn.VAL_LOSS] + 0.5
    assert with_eval["ledger"]["eval_s"] > 0 and without["ledger"]["eval_s"] == 0
    # Evaluation neither perturbs the training trajectory nor counts as productive time.
    for step in range(1, 6):
        assert with_eval["logged"][step][mn.TRAIN_LOSS] == \
            without["logged"][step][mn.TRAIN_LOSS], step
        assert mn.VAL_LOSS not in without["logged"][step]


def test_version_1_validation_set_has_no_bits_per_byte(tmp_path):
    overrides = ["model.preset=tiny", f"data.path={FIXTURE_DATASET}",
                 f"eval.path={FIXTURE_DATASET}", "train.global_batch_size=8",
                 "train.micro_batch_size=2", "scaling.max_workers=1", "scaling.min_workers=1",
                 "eval.samples=4", "checkpoint.path=" + str(tmp_path / "ckpt")]
    got = run_gloo(_eval_worker, 1, overrides)[0]
    assert got["bpb"] is None and got["bytes"] is None and math.isfinite(got["loss"])



"""A step whose loss or gradient is not finite is skipped on the device (fused AdamW's
`found_inf`) and applies nothing: every rank's parameters, moments and step counts stay as they
were, to the bit; `train.nan_patience` consecutive such steps are tolerated, one more ends the run
with `NonFiniteLossError`. Under FSDP2 (2 ranks) and tensor parallelism (tp=2) over real gloo
groups, with the non-finite value on one rank only: the reduced loss and gradient norm carry it to
every rank, so all skip together. And the optimizer is launched before the step's host sync."""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch

from elastic_gpt.config import load_config
from elastic_gpt.testing.gloo import run_gloo

# Per step: applied, or made non-finite on rank 0 (a NaN in one gradient element of its shard,
# or an infinite loss). nan_patience=1: one skipped step in a row is tolerated, two end the run.
# The first step is skipped too: no optimizer state existed before it. The last one ends the run.
PLAN = ["nan_grad", "ok", "nan_grad", "ok", "inf_loss", "nan_grad"]


def _overrides(data: str, tmp: str, world: int, tp: int) -> list[str]:
    return ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.warmup_steps=0", "train.lr=1e-2",
            "train.nan_patience=1", "health.spike_action=off", f"scaling.max_workers={world}",
            f"scaling.min_workers={tp}",
            f"parallel.tp={tp}", "train.dtype=float32", "eval.samples=0",
            "tracking.enabled=false", f"checkpoint.path={tmp}/unused"]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(trainer) -> dict:
    """This rank's shards of every parameter and optimizer state tensor."""
    out = {f"p.{n}": _local(p).detach().clone() for n, p in trainer.model.named_parameters()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        out.update({f"o.{names[id(p)]}.{k}": _local(v).clone() for k, v in state.items()})
    return out


def _worker(rank: int, world: int, overrides: list[str]) -> list[dict]:
    from elastic_gpt.errors import NonFiniteLossError
    from elastic_gpt.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides), rank=rank, world_size=world,
                      mlflow_run_id=None)
    stream = trainer._open_stream()
    forward_backward = trainer.stepper.forward_backward
    records = []
    try:
        for action in PLAN:
            def poisoned(batch, *split, action=action):
                loss_sum = forward_backward(batch, *split)
                if rank == 0 and action == "nan_grad":
                    grad = _local(trainer.model.get_parameter("h.0.mlp.c_fc.weight").grad)
                    grad.view(-1)[0] = float("nan")
                if rank == 0 and action == "inf_loss":
                    loss_sum = loss_sum + float("inf")
                return loss_sum

            trainer.stepper.forward_backward = poisoned
            before = _snapshot(trainer)
            record = {"action": action}
            try:
                result = trainer.train_step(next(stream))
                record.update(loss=result.loss, grad_norm=result.grad_norm)
            except NonFiniteLossError as e:
                record["error"] = str(e)
            after = _snapshot(trainer)
            record["unchanged"] = [k for k in before if torch.equal(before[k], after[k])]
            record["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
            record["new_state"] = {k: v for k, v in after.items() if k not in before}
            record["steps"] = sorted({float(v) for k, v in after.items() if k.endswith(".step")})
            record["streak"] = trainer.nonfinite.count
            records.append(record)
            if "error" in record:
                break
            trainer.step += 1
    finally:
        stream.close()
    return records


@pytest.mark.parametrize("world,tp", [(2, 1), pytest.param(2, 2)])
def test_a_non_finite_step_applies_nothing_and_patience_ends_the_run(world, tp, stdlib_dataset,
                                                                      tmp_path):
    ranks = run_gloo(_worker, world, _overrides(stdlib_dataset, str(tmp_path), world, tp))
    for records in ranks:
        assert [r["action"] for r in records] == PLAN
        first, *rest = records
        # A skipped first step: the parameters as initialised, the optimizer state made but zero.
        assert not first["changed"] and first["steps"] == [0.0] and first["streak"] == 1
        assert first["new_state"] and all(
            not v.any() for v in first["new_state"].values()), "moments of a skipped step"
        applied = 0
        for r in rest:
            if r["action"] == "ok":
                applied += 1
                assert r["steps"] == [float(applied)] and r["streak"] == 0
                assert not [k for k in r["unchanged"] if k.startswith("p.")], "an applied step"
            else:  # every parameter, moment and step count to the bit
                assert not r["changed"] and r["steps"] == [float(applied)]
        assert [r["streak"] for r in rest] == [0, 1, 0, 1, 2]
        assert re.fullmatch(r"loss is [0-9.]+ \(grad norm nan\) at step 5 for 2 step\(s\), beyond "
                            r"train.nan_patience=1; .*", rest[-1]["error"]), rest[-1]["error"]
        inf = rest[3]
        assert inf["loss"] == math.inf and math.isfinite(inf["grad_norm"])
    # Every rank skipped the same steps, though only rank 0 saw the non-finite values.
    assert len({tuple(r["loss"] for r in records[:-1]) for records in ranks}) == 1


def test_the_optimizer_is_launched_before_the_host_sync(stdlib_dataset, tmp_path, monkeypatch):
    """The restart path: the only host reads of a step (Tensor.tolist, .item) come after the
    fused optimizer step is launched, with found_inf on the device."""
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.trainer import Trainer

    events = []
    for name in ("tolist", "item"):
        method = getattr(torch.Tensor, name)

        def record(self, *args, _method=method, _name=name):
            if threading.current_thread() is threading.main_thread():  # not the data prefetch
                events.append(_name)
            return _method(self, *args)
        monkeypatch.setattr(torch.Tensor, name, record)
    with gloo_group():
        trainer = Trainer(load_config(None, _overrides(stdlib_dataset, str(tmp_path), 1, 1)),
                          rank=0, world_size=1, mlflow_run_id=None)
        step = trainer.optimizer.step

        def launched(*args, **kwargs):
            found_inf = getattr(trainer.optimizer, "found_inf", None)
            events.append(("step", None if found_inf is None else found_inf.dtype))
            return step(*args, **kwargs)
        trainer.optimizer.step = launched
        stream = trainer._open_stream()
        try:
            batch = next(stream)
            events.clear()
            trainer.train_step(batch)
        finally:
            stream.close()
    assert events == [("step", torch.float32), "tolist"]

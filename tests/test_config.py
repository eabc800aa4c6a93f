"""Configuration: overrides, validation messages (C6), and the LR schedule."""

from __future__ import annotations

import pytest

from elastic_gpt.config import load_config
from elastic_gpt.train.metrics import lr_at

TINY = "jobs/configs/mini.yaml"


def test_file_then_overrides():
    cfg = load_config(TINY, ["train.lr=1e-4", "scaling.max_workers=3", "run.name=x",
                             "checkpoint.async_save=true", "model.n_layer=3"])
    assert cfg.train.lr == 1e-4 and cfg.scaling.max_workers == 3 and cfg.run.name == "x"
    assert cfg.checkpoint.async_save is True and cfg.model.n_layer == 3
    assert cfg.model.preset == "mini" and cfg.train.global_batch_size == 16  # from the file
    flat = cfg.flat()
    for key in ["model.preset", "data.path", "train.global_batch_size", "train.micro_batch_size",
                "train.max_steps", "train.lr", "scaling.min_workers", "scaling.max_workers",
                "checkpoint.path", "checkpoint.every_steps", "tracking.uri",
                "tracking.experiment", "run.name"]:
        assert key in flat


@pytest.mark.parametrize("overrides,message", [
    (["train.lrr=1"], "unknown config key 'train.lrr'; keys of train: global_batch_size"),
    (["trian.lr=1"], "unknown config key 'trian.lr'; sections are"),
    (["train.lr"], "must look like section.key=value"),
    (["train.max_steps=ten"], "train.max_steps='ten' must be an integer"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"],
     "train.global_batch_size=10 is not a multiple of train.micro_batch_size=4"),
    (["train.global_batch_size=8", "train.micro_batch_size=4", "scaling.max_workers=3"],
     "gives 2 micro-batches, fewer than scaling.max_workers=3"),
    (["scaling.min_workers=3", "scaling.max_workers=2"], "below scaling.min_workers=3"),
    (["model.preset=gpt5"], "model.preset='gpt5' is unknown"),
    (["data.path="], "data.path is empty"),
    (["train.dtype=fp8"], "train.dtype='fp8' must be auto, float32 or bfloat16"),
    (["train.reshard_after_forward=sometimes"],
     "train.reshard_after_forward='sometimes' must be auto, always or never"),
    (["train.grad_sync=never"], "train.grad_sync='never' must be step or microbatch"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(str(bad))


def test_lr_schedule_warms_up_then_decays_to_min():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))

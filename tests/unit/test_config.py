"""Configuration: overrides, validation messages (C6 clear errors), field types and docstrings,
dicts written by older code, and the LR schedule."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from elastic_gpt import config as config_module
from elastic_gpt.config import Config, HealthSection, config_from_dict, load_config
from elastic_gpt.train.schedule import lr_at

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
    (["train.grad_sync=never"], "train.grad_sync='never' must be auto, step or microbatch"),
    (["scaling.use_gpu=sometimes"], "scaling.use_gpu='sometimes' must be auto, true or false"),
    (["scaling.use_gpu=1"], "scaling.use_gpu=1 must be auto, true or false"),
    (["checkpoint.async_save=yes please"],
     "checkpoint.async_save='yes please' must be auto, true or false"),
    (["checkpoint.every_steps=0"], "checkpoint.every_steps=0 and checkpoint.every_minutes=0 "
     "leave no periodic checkpoint (a failure would lose the whole session); set "
     "checkpoint.every_minutes (wall-clock) or checkpoint.every_steps"),
    (["checkpoint.every_minutes=-5"], "checkpoint.every_minutes=-5.0 must be at least 0"),
    (["checkpoint.every_minutes=soon"], "checkpoint.every_minutes='soon' must be a number"),
    (["checkpoint.write_streams=0"], "checkpoint.write_streams=0 must be in [1, 65)"),
    (["train.lr=fast"], "train.lr='fast' must be a number"),
    (["train.dtype="], "train.dtype='' must be auto, float32 or bfloat16"),
    (["train.max_steps=0"], "train.max_steps=0 must be at least 1"),
    (["checkpoint.keep=0"], "checkpoint.keep=0 must be at least 1"),
    (["model.dropout=1.0"], "model.dropout=1.0 must be in [0, 1)"),
    (["model.n_layer=two"], "model.n_layer='two' must be an integer"),
    (["train.warmup_steps=-1"], "train.warmup_steps=-1 must be at least 0"),
    (["train.lr=.nan"], "train.lr=nan must be a finite number"),
    (["train.grad_clip=.inf"], "train.grad_clip=inf must be a finite number"),
    (["data.path=", "data.sources=[]"], "data.sources is an empty list"),
    (["data.path=", "data.sources=[{path: a, weight: 0}]"],
     "data.sources[0].weight=0 must be a finite number > 0"),
    (["data.path=", "data.sources=[{path: a, wieght: 1}]"], "must be a mapping with keys path and weight"),
    (["data.sources=[{path: a}]"], "data.path and data.sources are both set"),
    (["eval.samples=-1"], "eval.samples=-1 must be at least 0"),
    (["parallel.tp=0"], "parallel.tp=0 must be at least 1"),
    (["parallel.hsdp=maybe"], "parallel.hsdp='maybe' must be auto, on or off"),
    (["parallel.tp=2", "scaling.min_workers=1", "scaling.max_workers=3"],
     "scaling.min_workers=1 and scaling.max_workers=3 must be multiples of parallel.tp=2 "
     "(workers come in whole tensor-parallel groups); e.g. scaling.min_workers=2 "
     "scaling.max_workers=2"),
    # tp > workers is the same rule: a group of fewer workers than tp holds no whole TP group.
    (["parallel.tp=4", "scaling.min_workers=2", "scaling.max_workers=2"],
     "must be multiples of parallel.tp=4"),
    # C1 fixed global batch over the data-parallel degree: 8 workers at tp=2 are 4 data-parallel
    # ranks.
    (["parallel.tp=2", "train.global_batch_size=12", "train.micro_batch_size=4",
      "scaling.min_workers=2", "scaling.max_workers=8"],
     "gives 3 micro-batches, fewer than the 4 data-parallel ranks of scaling.max_workers=8 / "
     "parallel.tp=2"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_micro_batches_are_counted_per_data_parallel_rank():
    # 4 micro-batches fill 4 data-parallel ranks: 8 workers at tp=2 (but not at tp=1).
    over = ["train.global_batch_size=16", "train.micro_batch_size=4", "scaling.min_workers=2",
            "scaling.max_workers=8"]
    cfg = load_config(TINY, [*over, "parallel.tp=2", "parallel.hsdp=on"])
    assert (cfg.parallel.tp, cfg.parallel.hsdp) == (2, "on")
    with pytest.raises(ValueError, match="fewer than scaling.max_workers=8"):
        load_config(TINY, over)


def test_a_pipeline_the_run_cannot_fill_or_schedule_is_one_clear_line():
    ok = ["train.global_batch_size=16", "train.micro_batch_size=2", "scaling.min_workers=2",
          "scaling.max_workers=4", "parallel.pp=2"]
    cfg = load_config(TINY, ok)
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule) == (2, "1f1b")
    # replica groups of whole pipelines: 2 groups of one pipeline each; 4 groups of one worker
    # would cut the pipelines (the launcher's preflight asks `group_size`)
    from elastic_gpt.elastic.replica_group_driver import group_size
    assert group_size(load_config(TINY, [*ok, "elastic.replica_groups=2"])) == 2
    with pytest.raises(ValueError, match=r"groups of a multiple of parallel.pp x parallel.tp = 2"):
        group_size(load_config(TINY, [*ok, "elastic.replica_groups=4"]))
    for extra, says in (
            (["scaling.max_workers=5"], r"must be multiples of parallel.tp x parallel.pp=2 "
                                        r"\(workers come in whole pipelines\)"),
            (["parallel.tp=2"], "must be multiples of parallel.tp x parallel.pp=4"),
            (["train.global_batch_size=4"], r"a step gives each pipeline 1 micro-batch\(es\), "
                                            r"fewer than its parallel.pp=2 stages"),
            (["parallel.pp_schedule=interleaved_1f1b"], "needs parallel.pp_stages_per_rank >= 2"),
            (["parallel.pp_stages_per_rank=2"], "pp_schedule=1f1b runs one stage per rank")):
        with pytest.raises(ValueError, match=says):
            load_config(TINY, [*ok, *extra])


def test_yaml_values_users_write_today_keep_their_meaning(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("data: {path: d}\nscaling: {use_gpu: auto}\ntrain: {dtype: bfloat16, "
                   "lr: 1e-3, min_lr: 1e-4, reshard_after_forward: never, grad_sync: microbatch}\n")
    cfg = load_config(str(yml))
    assert cfg.scaling.use_gpu == "auto" and cfg.train.dtype == "bfloat16"
    assert cfg.train.lr == 1e-3 and cfg.train.min_lr == 1e-4  # YAML 1.1 reads 1e-4 as a string
    assert (cfg.train.reshard_after_forward, cfg.train.grad_sync) == ("never", "microbatch")
    yml.write_text("data: {path: d}\nparallel: {hsdp: off}\n")  # YAML 1.1: a bare off is false
    assert load_config(str(yml)).parallel.hsdp == "off"
    for text, expected in [("true", True), ("false", False), ("auto", "auto")]:
        assert load_config(str(yml), [f"scaling.use_gpu={text}"]).scaling.use_gpu == expected
    cfg = load_config(str(yml), ["model.n_layer=3", "model.n_layer=null", "run.name=123",
                                 "train.weight_decay=0"])
    assert cfg.model.n_layer is None  # null resets an optional field
    assert cfg.run.name == "123" and cfg.train.weight_decay == 0.0
    assert isinstance(cfg.train.weight_decay, float)


def test_every_field_has_a_docstring():
    """torchtitan style: the line under each field says what it is (what `--help` and the
    README can point to). Read from the source: dataclasses keep no field docstrings."""
    tree = ast.parse(inspect.getsource(config_module))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    sections = [Config] + [f.default_factory for f in dataclasses.fields(Config)]
    missing = []
    for cls in sections:
        body = classes[cls.__name__].body
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.AnnAssign):
                continue
            doc = body[i + 1] if i + 1 < len(body) else None
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str) and doc.value.value.strip()):
                missing.append(f"{cls.__name__}.{stmt.target.id}")
        assert len([s for s in body if isinstance(s, ast.AnnAssign)]) == \
            len(dataclasses.fields(cls))
    assert not missing, f"fields without a docstring: {missing}"


# What main's code before the layout change (commit 6fe36d8) sent workers as train_loop_config
# ["config"]: `resolve_paths(load_config(tests/fixtures/main-v0/config.yaml, [train.dtype=bfloat16,
# train.reshard_after_forward=never, scaling.use_gpu=auto, run.stop_at_step=3]), cwd="/old/run")
# .to_dict()`, printed by that code. Written out here so that a change to today's Config cannot
# change it too.
OLD_MAIN_DICT = {
    "model": {"preset": "tiny", "n_layer": None, "n_head": None, "n_embd": None,
              "seq_len": None, "vocab_size": None, "dropout": 0.0},
    "data": {"path": "file:///old/run/dataset", "seed": 7, "shuffle_window": 16384,
             "prefetch_steps": 4},
    "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 4, "lr": 0.003,
              "min_lr": None, "warmup_steps": 1, "weight_decay": 0.1, "beta1": 0.9,
              "beta2": 0.95, "grad_clip": 1.0, "dtype": "bfloat16",
              "activation_checkpointing": False, "compile": False,
              "reshard_after_forward": "never", "grad_sync": "step", "seed": 0, "log_every": 1,
              "threads_per_worker": 0, "nan_patience": 0},
    "scaling": {"min_workers": 1, "max_workers": 2, "use_gpu": "auto", "cpus_per_worker": 1,
                "accelerator_type": None},
    "checkpoint": {"path": "file:///old/run/checkpoints", "every_steps": 2, "keep": 2,
                   "async_save": False},
    "tracking": {"uri": "sqlite:////old/run/mlflow.db", "experiment": "elastic-gpt",
                 "enabled": False, "log_model": True},
    "run": {"name": "v0-fixture", "storage_path": "/old/run/runs", "stop_at_step": 3},
    "elastic": {"max_failures_per_hour": 10.0, "worker_start_timeout_s": 20.0},
}


def test_a_config_dict_written_by_old_main_loads():
    cfg = config_from_dict(OLD_MAIN_DICT)
    # A section old main lacked gets its defaults, which are what old main did: no tensor
    # parallelism (and HSDP's auto, which a group of one node leaves off), one dataset rather than
    # a mixture, and evaluation only where a validation split exists (old datasets have none).
    assert cfg.to_dict() == {**OLD_MAIN_DICT, "parallel": {"tp": 1, "hsdp": "auto", "async_tp": False,
                                                           "pp": 1, "pp_schedule": "1f1b",
                                                           "pp_stages_per_rank": 1},
                             # No clock cadence, as old main; its saves are written by more
                             # streams per rank, which changes the files, not what they hold.
                             "checkpoint": {**OLD_MAIN_DICT["checkpoint"], "every_minutes": 0.0,
                                            "write_streams": 8, "init_from": ""},
                             # GPT-2, as old main built: no family, no Llama keys.
                             "model": {**OLD_MAIN_DICT["model"], "family": None,
                                       "n_kv_head": None, "ffn_hidden": None,
                                       "rope_theta": None, "rope_scaling": None,
                                       "tie_embeddings": None},
                             # Old main read record by record; today reads blocks (the same
                             # samples, in fewer requests).
                             "data": {**OLD_MAIN_DICT["data"], "sources": None,
                                      "read_block_bytes": 1 << 20},
                             "eval": {"path": "", "every_steps": 0, "samples": 64},
                             # MFU against the device's own peak, as old main measured it.
                             "train": {**OLD_MAIN_DICT["train"], "peak_tflops": 0.0,
                                       "activation_checkpointing_mode": "full",
                                       "float8": False},
                             # Replica groups off: one worker group, as old main ran; and
                             # the hang bound is old main's collective timeout (a start-up
                             # gets a longer one). Grows are
                             # today's: gathered and weighed (old main grew after 1 s).
                             "elastic": {**OLD_MAIN_DICT["elastic"], "replica_groups": "off",
                                         "replica_heartbeat_timeout_s": 2.0,
                                         "replica_collective_timeout_s": 10.0,
                                         "hang_timeout_s": 600.0, "init_timeout_s": 1800.0,
                                         "grow_settle_s": 30.0,
                                         "node_mtbf_h": 200.0},
                             # Today's training health: old main stopped at a non-finite loss
                             # and ignored spikes; a resumed old run is guarded as a new one.
                             "health": dataclasses.asdict(HealthSection())}
    assert cfg.scaling.use_gpu == "auto" and cfg.train.reshard_after_forward == "never"
    assert cfg.run.stop_at_step == 3 and cfg.data.path == "file:///old/run/dataset"
    # And today's dicts round-trip: what the launcher sends is what the worker rebuilds.
    today = load_config("tests/fixtures/main-v0/config.yaml", ["scaling.use_gpu=true"])
    assert config_from_dict(today.to_dict()) == today


def test_a_config_dict_with_a_key_this_code_lacks_names_it():
    old = {**OLD_MAIN_DICT, "train": {**OLD_MAIN_DICT["train"], "dtype": "fp8"}}
    with pytest.raises(ValueError, match="train.dtype='fp8' must be auto, float32 or bfloat16"):
        config_from_dict(old)
    with pytest.raises(ValueError, match="unknown config key 'train.lrr'"):
        config_from_dict({"train": {"lrr": 1.0}})


def test_shuffle_window_default_is_the_data_layers():
    from elastic_gpt.data.order import DEFAULT_SHUFFLE_WINDOW

    assert Config().data.shuffle_window == DEFAULT_SHUFFLE_WINDOW


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


def test_warmup_longer_than_max_steps_is_clamped_with_a_note(caplog):
    cfg = load_config(None, ["data.path=x", "train.max_steps=5", "train.warmup_steps=11"])
    assert cfg.train.warmup_steps == 5
    assert "warming up over all 5 steps" in caplog.text


def test_a_mixture_of_sources_resolves_every_path():
    from elastic_gpt.config import resolve_paths
    cfg = load_config(None, ["data.sources=[{path: a, weight: 3}, {path: 's3://b/c'}]"])
    resolve_paths(cfg, cwd="/w")
    assert cfg.data.sources == [{"path": "file:///w/a", "weight": 3.0},
                                {"path": "s3://b/c", "weight": 1.0}]

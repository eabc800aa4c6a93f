"""`elastic-gpt tune` on a real local Ray cluster: one Ray Train job measures every candidate on
2 FSDP2 workers, picks the fastest that fits, writes a config that loads; an impossible memory
budget or an unknown GPU is refused with one line saying what would fit, exit code 2."""

from __future__ import annotations

import json

import pytest

from elastic_gpt.cli import build_parser
from elastic_gpt.config import load_config
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.planner.measure import TrainSettings, candidate_list, pick_winner, predicted_bytes
from elastic_gpt.planner.plan import model_shape
from elastic_gpt.train.model_config import model_config_for


def overrides(tmp_path, data: str, *extra: str) -> list[str]:
    return [f"data.path={data}", "model.preset=tiny", "train.global_batch_size=8",
            "scaling.min_workers=2", "scaling.max_workers=2",
            f"run.storage_path={tmp_path}/ray", f"checkpoint.path={tmp_path}/ckpt", *extra]


def tune(tmp_path, data: str, *flags: str, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    args = build_parser().parse_args(["tune", "--config", "jobs/configs/mini.yaml",
                                      *overrides(tmp_path, data, *extra), *flags])
    return args.func(args), args


def test_candidates_divide_the_global_batch_and_leave_every_worker_one():
    got = candidate_list(8, 3, None, cuda=False)
    assert sorted({c.micro_batch for c in got}) == [1, 2]  # 4 would leave a worker idle
    assert {c.compile for c in got} == {False}  # no compile on CPU
    assert len(candidate_list(8, 2, None, cuda=True)) == 3 * 2 * 2
    with pytest.raises(ValueError, match="micro-batch-sizes 3"):
        candidate_list(8, 2, [1, 3], cuda=False)


@pytest.mark.slow
def test_tune_measures_every_candidate_and_writes_the_fastest_that_fits(
        stdlib_dataset, ray_cluster, tmp_path, capsys):
    out, table = tmp_path / "tuned.yaml", tmp_path / "table.json"
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "2", "--micro-batch-sizes", "2,4",
                 "--write-config", str(out), "--json", str(table))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(table.read_text())
    rows = res["rows"]
    tried = {(r["micro_batch"], r["activation_checkpointing"], r["compile"]) for r in rows}
    assert tried == {(m, ck, False) for m in (2, 4) for ck in (False, True)}
    for r in rows:  # every candidate ran, was timed and had its memory measured
        assert r["fits"] and r["step_s"] > 0 and r["peak_bytes"] > 0, r
    # auto keeps a model this small gathered (a few MiB against GiBs of RAM per worker)
    assert {r["reshard_after_forward"] for r in rows} == {False}
    assert "reshard_after_forward=never (auto), grad_sync=step" in printed
    # The printed table has a line per candidate and marks the winner.
    assert printed.count("fits") >= len(rows) and "<- fastest that fits" in printed
    assert "torch.compile not tried" in printed and "VmHWM" in res["memory_method"]
    winner = res["winner"]
    assert winner["step_s"] == min(r["step_s"] for r in rows if r["fits"])
    assert winner == pick_winner(rows)
    # Activation checkpointing keeps less in memory at the largest micro-batch.
    peak = {(r["micro_batch"], r["activation_checkpointing"]): r["peak_bytes"] for r in rows}
    assert peak[(4, True)] < peak[(4, False)]
    cfg = load_config(str(out))
    assert cfg.train.micro_batch_size == winner["micro_batch"]
    assert cfg.train.activation_checkpointing == winner["activation_checkpointing"]
    assert cfg.train.compile is False
    assert cfg.train.global_batch_size == 8 and cfg.data.path == stdlib_dataset


def test_an_impossible_memory_budget_says_what_would_fit(stdlib_dataset, ray_cluster, tmp_path,
                                                        capsys):
    out = tmp_path / "never.yaml"
    rc, _ = tune(tmp_path, stdlib_dataset, "--memory-budget-gib", "0.0001",
                 "--write-config", str(out))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    assert "does not fit on 2 x CPU-worker even at micro-batch 1 with activation checkpointing" \
        in err[0]
    assert "give each worker at least" in err[0]
    assert not out.exists()


def test_an_unknown_gpu_lists_the_known_ones(stdlib_dataset, tmp_path, capsys):
    rc, _ = tune(tmp_path, stdlib_dataset, "--gpu", "TPU-v9")
    err = capsys.readouterr().err
    assert rc == 2 and "unknown GPU 'TPU-v9'" in err and "H100" in err


def test_the_winner_is_the_fastest_fitting_row():
    rows = [{"micro_batch": 1, "fits": True, "step_s": 0.3},
            {"micro_batch": 2, "fits": False, "step_s": 0.1},
            {"micro_batch": 4, "fits": True, "step_s": 0.2}]
    assert pick_winner(rows)["micro_batch"] == 4
    assert pick_winner([dict(r, fits=False) for r in rows]) is None
    assert TrainSettings(2, True, False).label == "mb=2 ckpt=on compile=off"


@pytest.mark.slow
@pytest.mark.parametrize("policy, grad_sync, resharded", [
    ("auto", "step", False),  # auto keeps a 4-layer toy gathered on CPU (never)
    ("always", "microbatch", True),
])
def test_the_planner_column_predicts_what_the_trainer_ran(stdlib_dataset, ray_cluster, tmp_path,
                                                          capsys, policy, grad_sync, resharded):
    """The 'planner MiB' of each row is memory_per_gpu for the resharding the row's Trainer
    resolved and the run's grad sync; 4 layers, so keeping blocks gathered changes the figure."""
    extra = ("model.n_layer=4", f"train.reshard_after_forward={policy}",
             f"train.grad_sync={grad_sync}")
    table = tmp_path / "table.json"
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "1", "--micro-batch-sizes", "2",
                 "--json", str(table), extra=extra)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(table.read_text())
    assert res["reshard_after_forward"] is resharded and res["grad_sync"] == grad_sync
    assert f"reshard_after_forward={'always' if resharded else 'never (auto)'}" in printed
    cfg = load_config("jobs/configs/mini.yaml", overrides(tmp_path, stdlib_dataset, *extra))
    shape = model_shape(model_config_for(cfg, load_manifest(stdlib_dataset)))
    assert shape.cfg.n_layer == 4
    for row, pred in zip(res["rows"], res["predicted_bytes"]):
        assert row["reshard_after_forward"] is resharded, row
        cand = TrainSettings(row["micro_batch"], row["activation_checkpointing"], row["compile"])
        ran = predicted_bytes(shape, 2, 8, cand, "float32", False, grad_sync=grad_sync,
                              reshard_after_forward=resharded)
        other = predicted_bytes(shape, 2, 8, cand, "float32", False, grad_sync=grad_sync,
                                reshard_after_forward=not resharded)
        assert pred == pytest.approx(ran)
        # the 2 blocks more that stay gathered (4 fp32 bytes a param) separate the two figures
        assert abs(ran - other) == pytest.approx(2 * 4 * shape.block_params)

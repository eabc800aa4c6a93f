"""`elastic-gpt tune` on a real local Ray cluster: one Ray Train job measures every candidate on
2 FSDP2 workers (tensor-parallel ones on the trainer's TP + FSDP model over gloo, pipelined ones on
its pipeline stages), picks the fastest that fits, writes a config that loads; an impossible
memory budget says what would fit; a worker killed mid-measurement costs a re-measurement; the
planner's column predicts what the trainer ran."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import pytest
import yaml

from elastic_gpt.config import load_config
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.pipeline import pipelined_memory
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.planner.tune import pick_winner, tuned_config_dict
from elastic_gpt.planner.tune_candidates import (
    TrainSettings,
    predicted_bytes,
)
from elastic_gpt.testing.cluster import process_alive, training_workers
from elastic_gpt.train.model_config import model_config_for
from tests.planner_helpers import overrides, tune


def test_tune_measures_every_candidate_and_writes_the_fastest_that_fits(
        stdlib_dataset, ray_cluster, tmp_path, capsys):
    out, table = tmp_path / "tuned.yaml", tmp_path / "table.json"
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "2", "--micro-batch-sizes", "2,4",
                 "--tp", "1", "--write-config", str(out), "--json", str(table))
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


def test_tune_measures_tp_next_to_fsdp_and_writes_the_winners_layout(
        stdlib_dataset, ray_cluster, tmp_path, capsys):
    """W=2: tp=1 (FSDP over 2) and tp=2 (one TP group, FSDP over 1) on the trainer's own mesh and
    model over gloo; each row is timed, its memory measured and predicted for its own layout."""
    out, table = tmp_path / "tuned.yaml", tmp_path / "table.json"
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "1", "--micro-batch-sizes", "4",
                 "--write-config", str(out), "--json", str(table))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(table.read_text())
    rows = res["rows"]
    assert res["tp_choices"] == [1, 2]
    assert {(r["tp"], r["hsdp"], r["activation_checkpointing"]) for r in rows} == {
        (tp, False, ck) for tp in (1, 2) for ck in (False, True)}
    for r in rows:
        assert r["fits"] and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0, r
        assert (r["dp_replicate"], r["dp_shard"]) == (1, 2 // r["tp"]), r
    assert any(line.split()[:3] == ["2", "1", "off"] for line in printed.splitlines())
    cfg = load_config("jobs/configs/mini.yaml", overrides(tmp_path, stdlib_dataset))
    shape = model_shape(model_config_for(cfg, load_manifest(stdlib_dataset)))
    for row, pred in zip(rows, res["predicted_bytes"]):
        cand = TrainSettings(4, row["activation_checkpointing"], False, row["tp"])
        assert pred == pytest.approx(predicted_bytes(
            shape, 2, 8, cand, "float32", False, grad_sync=row["grad_sync"],
            reshard_after_forward=row["reshard_after_forward"], dp_shard=row["dp_shard"]))
    by_tp = {(r["tp"], r["activation_checkpointing"]): p
             for r, p in zip(rows, res["predicted_bytes"])}
    assert by_tp[(2, False)] != by_tp[(1, False)]  # the prediction is tp=2's, not tp=1's
    winner = res["winner"]
    assert winner == pick_winner(rows)
    written = load_config(str(out))
    assert written.parallel.tp == winner["tp"] and written.parallel.hsdp == "auto"
    assert written.train.micro_batch_size == 4


@pytest.mark.parametrize("retries", [1, 0])
def test_a_worker_killed_mid_measurement_costs_a_re_measurement_not_the_tune(
        stdlib_dataset, ray_cluster, tmp_path, capsys, monkeypatch, retries):
    """SIGKILL one of tune's two workers while it measures (a spot node reclaimed): a fresh group
    measures every candidate again and tune ends with the whole table, exit 0. With no retry
    left, tune stops with one line and exit 1, not a traceback."""
    from elastic_gpt.planner import tune as tune_module

    monkeypatch.setattr(tune_module, "TUNE_RETRIES", retries)
    killed = {}

    def measured(pid: int) -> bool:
        """Whether the worker's own log (Ray's, under RAY_TMPDIR) shows a candidate measured."""
        for path in glob.glob(os.path.join(os.environ["RAY_TMPDIR"], "*", "session_latest",
                                           "logs", f"worker-*-{pid}.out")):
            try:
                with open(path, errors="replace") as f:
                    if "[elastic-gpt tune] 1/" in f.read():
                        return True
            except FileNotFoundError:  # globbed, then removed before it was opened
                continue
        return False

    def kill_one_once_measuring():
        # Once a candidate is measured the group is inside tune's loop (a death while Ray Train
        # starts the group is retried by Ray Train itself, whatever the failure budget).
        deadline = time.time() + 120
        while time.time() < deadline:
            workers = training_workers()
            if len(workers) == 2 and any(measured(w.pid) for w in workers):
                os.kill(workers[0].pid, signal.SIGKILL)
                killed["pid"] = workers[0].pid
                return
            time.sleep(0.05)

    t = threading.Thread(target=kill_one_once_measuring, daemon=True)
    t.start()
    table = tmp_path / "table.json"
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "1", "--micro-batch-sizes", "4",
                 "--tp", "1", "--json", str(table))
    t.join(5)
    captured = capsys.readouterr()
    printed = captured.out
    assert killed, "the kill never happened"
    assert not process_alive(killed["pid"])
    if not retries:
        ours = [line for line in captured.err.splitlines() if line.startswith("elastic-gpt")]
        assert rc == 1 and "Traceback" not in captured.err, captured.err[-3000:]
        assert len(ours) == 1 and ours[0].startswith(
            "elastic-gpt tune: failed: tune lost a worker 1 time(s)"), ours
        assert not table.exists()
        return
    assert rc == 0, printed
    rows = json.loads(table.read_text())["rows"]
    assert {r["activation_checkpointing"] for r in rows} == {False, True}
    assert all(r["fits"] and r["step_s"] > 0 for r in rows), rows


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
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "1", "--micro-batch-sizes", "2", "--tp", "1",
                 "--json", str(table), extra=extra)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(table.read_text())
    label = "always" if resharded else "never (auto)"
    assert res["reshard_after_forward"] == label and res["grad_sync"] == grad_sync
    assert f"reshard_after_forward={label}" in printed
    cfg = load_config("jobs/configs/mini.yaml", overrides(tmp_path, stdlib_dataset, *extra))
    shape = model_shape(model_config_for(cfg, load_manifest(stdlib_dataset)))
    assert shape.cfg.n_layer == 4
    for row, pred in zip(res["rows"], res["predicted_bytes"]):
        assert row["reshard_after_forward"] is resharded and row["grad_sync"] == grad_sync, row
        cand = TrainSettings(row["micro_batch"], row["activation_checkpointing"], row["compile"])
        ran = predicted_bytes(shape, 2, 8, cand, "float32", False, grad_sync=grad_sync,
                              reshard_after_forward=resharded)
        other = predicted_bytes(shape, 2, 8, cand, "float32", False, grad_sync=grad_sync,
                                reshard_after_forward=not resharded)
        assert pred == pytest.approx(ran)
        # the 2 blocks more that stay gathered (4 fp32 bytes a param) separate the two figures
        assert abs(ran - other) == pytest.approx(2 * 4 * shape.block_params)


def test_tune_measures_a_pipeline_next_to_fsdp_and_its_config_loads(
        stdlib_dataset, ray_cluster, tmp_path, capsys):
    """W=2, --pp 1,2: pp=2 (the trainer's two 1F1B stages, one block each, over gloo) next to
    FSDP over 2; each row timed, its memory measured and predicted by the pipelined model."""
    out, table = tmp_path / "tuned.yaml", tmp_path / "table.json"
    rc, _ = tune(tmp_path, stdlib_dataset, "--steps", "1", "--micro-batch-sizes", "4", "--tp", "1",
                 "--pp", "1,2", "--write-config", str(out), "--json", str(table))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(table.read_text())
    rows = res["rows"]
    assert res["pp_choices"] == [1, 2] and res["stages_per_rank_choices"] == [1]
    assert {(r["pp"], r["activation_checkpointing"]) for r in rows} == {
        (pp, ck) for pp in (1, 2) for ck in (False, True)}
    for r in rows:
        assert r["fits"] and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0, r
        # a stage's ranks: both of them without a pipeline, one with
        assert (r["dp_replicate"], r["dp_shard"]) == (1, 2 // r["pp"]), r
        if r["pp"] == 2:  # the schedule's: stages kept gathered, one gradient sync per step
            assert (r["grad_sync"], r["reshard_after_forward"]) == ("step", False), r
    assert any(line.split()[:3] == ["1", "2", "off"] for line in printed.splitlines())
    cfg = load_config("jobs/configs/mini.yaml", overrides(tmp_path, stdlib_dataset))
    shape = model_shape(model_config_for(cfg, load_manifest(stdlib_dataset)))
    by_layout = {}
    for row, pred in zip(rows, res["predicted_bytes"]):
        ck = row["activation_checkpointing"]
        by_layout[(row["pp"], ck)] = pred
        if row["pp"] == 1:
            continue
        # the planner's most loaded pipeline rank (make_mesh: one data-parallel rank, 2 stages of
        # one block), G / mb = 2 micro-batches a step
        mesh = make_mesh(2, 1, False, 2, 2, 1)
        assert pred == pytest.approx(pipelined_memory(
            shape, mesh, 4, 2, activation_checkpointing=ck, dtype="float32",
            micro_batches_per_rank=2, context_bytes=0, fragmentation=0).total)
    assert by_layout[(2, False)] != by_layout[(1, False)]  # pp=2's figure, not FSDP's
    winner = res["winner"]
    assert winner == pick_winner(rows)
    written = load_config(str(out))
    assert (written.parallel.pp, written.parallel.tp) == (winner["pp"], 1)
    # The pipelined row's config, whichever row won, loads and runs its pipeline.
    piped = next(r for r in rows if r["pp"] == 2)
    raw, _ = tuned_config_dict("jobs/configs/mini.yaml", overrides(tmp_path, stdlib_dataset),
                               piped)
    (tmp_path / "piped.yaml").write_text(yaml.safe_dump(raw))
    piped_cfg = load_config(str(tmp_path / "piped.yaml"))
    assert (piped_cfg.parallel.pp, piped_cfg.parallel.pp_schedule,
            piped_cfg.parallel.pp_stages_per_rank) == (2, "1f1b", 1)
    assert piped_cfg.train.micro_batch_size == 4
    assert piped_cfg.train.activation_checkpointing == piped["activation_checkpointing"]

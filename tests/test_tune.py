"""`elastic-gpt tune` on a real local Ray cluster: one Ray Train job measures every candidate on
2 FSDP2 workers (tensor-parallel ones on the trainer's TP + FSDP model over gloo, pipelined ones on
its pipeline stages), picks the fastest that fits, writes a config that loads; an impossible
memory budget, an unknown GPU or a tp the model cannot split by is refused with one line, exit
code 2."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import pytest
import yaml

from elastic_gpt.cli import build_parser, main
from elastic_gpt.config import load_config
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.pipeline import pipelined_memory
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.hardware import GiB
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.planner.tune import pick_winner, tuned_config_dict
from elastic_gpt.planner.tune_candidates import (
    TrainSettings,
    candidate_list,
    layout_for_nodes,
    pp_choices,
    pp_problem,
    predicted_bytes,
    tp_choices,
    what_would_fit,
)
from elastic_gpt.testing.cluster import process_alive, training_workers
from elastic_gpt.train.model_config import model_config_for


def overrides(tmp_path, data: str, *extra: str) -> list[str]:
    return [f"data.path={data}", "model.preset=tiny", "train.global_batch_size=8",
            "scaling.min_workers=2", "scaling.max_workers=2",
            f"run.storage_path={tmp_path}/ray", f"checkpoint.path={tmp_path}/ckpt", *extra]


def tune(tmp_path, data: str, *flags: str, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    """Through the CLI's error boundary, as a user runs it: (exit code, the parsed arguments)."""
    argv = ["tune", "--config", "jobs/configs/mini.yaml", *overrides(tmp_path, data, *extra),
            *flags]
    return main(argv), build_parser().parse_args(argv)


def test_candidates_divide_the_global_batch_and_leave_every_worker_one():
    got = candidate_list(8, 3, None, cuda=False)
    assert sorted({c.micro_batch for c in got}) == [1, 2]  # 4 would leave a worker idle
    assert {c.compile for c in got} == {False}  # no compile on CPU
    assert len(candidate_list(8, 2, None, cuda=True)) == 3 * 2 * 2
    with pytest.raises(ValueError, match="micro-batch-sizes 3"):
        candidate_list(8, 2, [1, 3], cuda=False)


def test_tp_candidates_divide_the_workers_the_heads_and_the_sequence():
    assert tp_choices(4, 2, 64, None) == [1, 2]  # 4 would split 2 heads
    assert tp_choices(4, 4, 64, None) == [1, 2, 4]
    assert tp_choices(6, 6, 64, None) == [1, 2]  # 3 and 6 divide the heads, not 64 positions
    with pytest.raises(ValueError, match="--tp=3 does not divide model.n_head=2"):
        tp_choices(4, 2, 64, [1, 3])
    with pytest.raises(ValueError, match="--workers=2 must be a multiple of --tp=4"):
        tp_choices(2, 4, 64, [4])
    # A tensor-parallel group reads one data-parallel rank's micro-batches: at tp=2 on 2
    # workers one rank takes the whole global batch.
    got = candidate_list(8, 2, None, cuda=False, tps=[1, 2])
    assert sorted({c.micro_batch for c in got if c.tp == 1}) == [1, 2, 4]
    assert sorted({c.micro_batch for c in got if c.tp == 2}) == [1, 2, 4, 8]
    only = candidate_list(8, 2, [8], cuda=False, tps=[1, 2])
    assert {(c.tp, c.micro_batch) for c in only} == {(2, 8)}


def test_the_node_layout_adds_hsdp_and_refuses_tp_groups_across_nodes():
    cands = [TrainSettings(1, False, False, tp) for tp in (1, 2)]
    two_by_two = layout_for_nodes(cands, ["a", "a", "b", "b"], "auto")
    assert [(c.tp, c.hsdp) for c, _, _ in two_by_two] == [(1, False), (1, True), (2, False),
                                                          (2, True)]
    shapes = {(c.tp, c.hsdp): (d.dp_replicate, d.dp_shard) for c, d, _ in two_by_two}
    assert shapes == {(1, False): (1, 4), (1, True): (2, 2), (2, False): (1, 2),
                      (2, True): (2, 1)}
    assert [c.hsdp for c, _, _ in layout_for_nodes(cands, ["a", "a", "b", "b"], "off")] == \
        [False, False]
    uneven = layout_for_nodes(cands, ["a", "a", "a", "b"], "auto")
    assert [(c.tp, c.hsdp, d is None) for c, d, _ in uneven] == [(1, False, False),
                                                                 (2, False, True)]
    assert uneven[1][2] == "tp=2 does not divide the workers per node [3, 1]"
    one_node = layout_for_nodes(cands, ["a"] * 4, "on")  # HSDP on one node is plain FSDP
    assert [c.hsdp for c, _, _ in one_node] == [False, False]


def test_pipeline_candidates_fill_the_pipeline_and_give_every_stage_a_block():
    # W=2, G=8: a pipeline of 2 is the one data-parallel rank, and a step must give it >= 2
    # micro-batches (mb 8 would leave a stage idle); tp=2 x pp=2 is more than the 2 workers.
    got = candidate_list(8, 2, None, cuda=False, tps=[1, 2], pps=[1, 2], n_layer=2)
    assert sorted({(c.tp, c.pp, c.micro_batch) for c in got if c.pp == 2}) == [
        (1, 2, 1), (1, 2, 2), (1, 2, 4)]
    assert sorted({c.micro_batch for c in got if (c.tp, c.pp) == (2, 1)}) == [1, 2, 4, 8]
    # W=4, G=8, 4 blocks: interleaving only where pp x stages per rank <= 4 blocks; at pp=2 the
    # two data-parallel ranks need 2 micro-batches each, at pp=4 the one needs 4: mb <= 2.
    got = candidate_list(8, 4, None, cuda=False, pps=[2, 4], stages_per_rank=[1, 2], n_layer=4)
    assert {(c.pp, c.stages_per_rank) for c in got} == {(2, 1), (2, 2), (4, 1)}
    assert {c.micro_batch for c in got} == {1, 2}
    with pytest.raises(ValueError, match="--micro-batch-sizes 8 .* usable: 1,2,4$"):
        candidate_list(8, 2, [8], cuda=False, pps=[2], n_layer=2)


def test_a_pipeline_the_workers_the_model_or_the_batch_cannot_hold_is_refused_in_one_line():
    kw = dict(world=2, tps=[1, 2], n_layer=2, global_batch=8)
    assert pp_problem(2, **kw) is None
    assert pp_problem(3, **kw) == ("the 2 worker(s) (--workers, default scaling.max_workers) are "
                                   "not whole pipelines of --pp=3 x --tp=1/2 ranks; use --pp in "
                                   "{1, 2}")
    assert pp_problem(2, **kw, stages_per_rank=[2]).startswith(
        "--pp=2 x --pp-stages-per-rank=2 stages need at least one block each, and "
        "model.n_layer=2")
    line = pp_problem(2, **kw, micro_batch_sizes=[8])  # one micro-batch a step
    assert "--pp=2 needs a step of at least 2 micro-batches per data-parallel rank" in line
    assert "raise train.global_batch_size to at least 16" in line and "{1}" in line
    kw = dict(world=8, tps=[1, 2], n_layer=4)
    assert pp_choices(None, **kw, global_batch=16) == ([1], [1])  # the default: no pipeline
    assert pp_choices("auto", **kw, global_batch=16) == ([1, 2, 4], [1])  # 8 > 4 blocks
    assert pp_choices("auto", **kw, global_batch=2) == ([1], [1])  # no step fills a pipeline
    assert pp_choices([2, 1], **kw, global_batch=16, stages_per_rank=[2, 1]) == ([1, 2], [1, 2])
    with pytest.raises(ValueError, match=r"^--pp=8 stages need at least one block each"):
        pp_choices([1, 8], **kw, global_batch=16)
    with pytest.raises(ValueError, match="--pp-stages-per-rank=0 must be at least 1"):
        pp_choices([2], **kw, global_batch=16, stages_per_rank=[0])
    with pytest.raises(ValueError, match="applies to pipelines, and only --pp 1 is measured"):
        pp_choices(None, **kw, global_batch=16, stages_per_rank=[2])


def test_a_pipeline_has_hsdp_only_where_its_stages_span_nodes():
    cands = [TrainSettings(1, False, False, 1, False, 2)]
    # 2 nodes of 2 ranks: each stage is one node, where HSDP is plain FSDP
    for hsdp in ("auto", "on"):
        got = layout_for_nodes(cands, ["a", "a", "b", "b"], hsdp)
        assert [(c.pp, c.hsdp) for c, _, _ in got] == [(2, False)]
        dims = got[0][1]
        assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 2, 1)
    # 4 nodes of 2: a stage spans 2 nodes, and HSDP replicates across them
    got = layout_for_nodes(cands, list("aabbccdd"), "auto")
    assert {c.hsdp: (d.pp, d.dp_replicate, d.dp_shard) for c, d, _ in got} == {
        False: (2, 1, 4), True: (2, 2, 2)}
    tp2 = layout_for_nodes([TrainSettings(1, False, False, 2, False, 2)], list("aaab"), "auto")
    assert tp2[0][1] is None and tp2[0][2] == "tp=2 does not divide the workers per node [3, 1]"


def test_the_pre_check_plans_the_pipelines_tune_measures():
    """A budget between the planner's floors: FSDP at micro-batch 1 fits, a pipeline of 2 (the
    first rank keeps 2 micro-batches in flight and its blocks gathered) does not."""
    gpt = GPTConfig(n_layer=4, n_head=4, n_embd=128, seq_len=64, vocab_size=512)
    budget = 0.014 * GiB
    assert what_would_fit(gpt, 2, 8, budget, 0.1, "float32", None, pps=[1]) is None
    line = what_would_fit(gpt, 2, 8, budget, 0.1, "float32", None, pps=[2])
    assert "does not fit on 2 x CPU-worker even at micro-batch 1" in line
    need = float(line.rsplit("at least ", 1)[1].removesuffix(" GiB"))
    floor = pipelined_memory(model_shape(gpt), make_mesh(2, 1, False, 2, 2, 1), 1, 8,
                             activation_checkpointing=True, dtype="float32",
                             micro_batches_per_rank=8, context_bytes=0, fragmentation=0).total
    assert need == pytest.approx(floor / 0.9 / GiB, rel=1e-2) and need * GiB > budget
    assert what_would_fit(gpt, 2, 8, budget, 0.1, "float32", None, pps=[1, 2]) is None


def test_the_written_config_runs_the_winners_pipeline(tmp_path):
    src = tmp_path / "in.yaml"
    src.write_text("data:\n  path: somewhere\ntrain:\n  global_batch_size: 8\n"
                   "scaling:\n  min_workers: 2\n  max_workers: 8\n")
    winner = {"micro_batch": 2, "activation_checkpointing": False, "compile": False, "tp": 1,
              "hsdp": False, "pp": 2, "stages_per_rank": 2}
    raw, notes = tuned_config_dict(str(src), [], winner)
    assert raw["parallel"] == {"tp": 1, "hsdp": "auto", "pp": 2, "pp_schedule": "interleaved_1f1b",
                               "pp_stages_per_rank": 2}
    # G=8 at mb 2 is 4 micro-batches: 4 pipelines (8 workers) would get 1 each, 3 get 2 slots
    # (config validation's rule: ceil(4 / 3), the short rank padded)
    assert (raw["scaling"]["min_workers"], raw["scaling"]["max_workers"]) == (2, 6)
    assert notes == ["scaling.max_workers=8 -> 6 (a multiple of parallel.pp x parallel.tp = 2, "
                     "at which a step still gives every pipeline 2 micro-batches)"]
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(out))
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank) == (
        2, "interleaved_1f1b", 2)
    # A winner without a pipeline turns the input's off (1f1b with 2 stages per rank is invalid)
    src.write_text(src.read_text() + "parallel:\n  pp: 2\n  pp_schedule: interleaved_1f1b\n"
                   "  pp_stages_per_rank: 2\n")
    raw, _ = tuned_config_dict(str(src), [], dict(winner, pp=1, stages_per_rank=1))
    assert raw["parallel"] == {"tp": 1, "hsdp": "auto", "pp": 1, "pp_schedule": "1f1b",
                               "pp_stages_per_rank": 1}
    assert raw["scaling"]["max_workers"] == 8


def test_the_written_config_keeps_whole_tp_groups(tmp_path):
    src = tmp_path / "in.yaml"
    src.write_text("scaling:\n  min_workers: 3\n  max_workers: 5\n")
    winner = {"micro_batch": 2, "activation_checkpointing": True, "compile": False, "tp": 2,
              "hsdp": True}
    raw, notes = tuned_config_dict(str(src), [], winner, spans_nodes=True)
    assert raw["parallel"] == {"tp": 2, "hsdp": "on"}
    assert (raw["scaling"]["min_workers"], raw["scaling"]["max_workers"]) == (4, 4)
    assert notes == ["scaling.min_workers=3 -> 4 (a multiple of parallel.tp=2)",
                     "scaling.max_workers=5 -> 4 (a multiple of parallel.tp=2)"]
    raw, _ = tuned_config_dict(str(src), [], winner, spans_nodes=False)
    assert raw["parallel"]["hsdp"] == "auto"  # one node measured nothing about HSDP


@pytest.mark.slow
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
    assert TrainSettings(2, True, False).label == "tp=1 mb=2 ckpt=on compile=off"
    assert TrainSettings(2, True, False, 2, True).label == "tp=2 hsdp mb=2 ckpt=on compile=off"
    assert TrainSettings(2, True, False, 1, False, 2).label == "tp=1 pp=2 mb=2 ckpt=on compile=off"
    assert TrainSettings(2, True, False, 1, False, 2, 2).label == \
        "tp=1 pp=2x2 mb=2 ckpt=on compile=off"
    tied = [dict(r, fits=True, step_s=0.1, micro_batch=2, tp=tp) for r, tp in zip(rows, (2, 1, 4))]
    assert pick_winner(tied)["tp"] == 1  # a tie goes to the simpler layout
    tied = [dict(r, fits=True, step_s=0.1, micro_batch=2, pp=pp) for r, pp in zip(rows, (2, 1, 4))]
    assert pick_winner(tied)["pp"] == 1  # ... no pipeline


def test_a_tp_that_does_not_split_the_heads_is_refused_in_one_line(stdlib_dataset, tmp_path,
                                                                    capsys):
    rc, _ = tune(tmp_path, stdlib_dataset, "--tp", "1,3")  # tiny has 2 heads
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--tp=3 does not divide model.n_head=2" in err[0] and "--tp in {1, 2}" in err[0]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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

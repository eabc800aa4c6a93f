"""`elastic-gpt tune`'s choices without a cluster: the candidates (micro-batches, tp, pipelines,
HSDP where the nodes allow), the planner's pre-check, the winner, the config it writes, and one
line for what cannot run."""

from __future__ import annotations

import pytest
import yaml

from elastic_gpt.config import load_config
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.pipeline import pipelined_memory
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.hardware import GiB
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.planner.tune import pick_winner, tuned_config_dict
from elastic_gpt.planner.tune_candidates import (
    TrainSettings,
    candidate_list,
    layout_for_nodes,
    pp_choices,
    pp_problem,
    tp_choices,
    what_would_fit,
)
from tests.planner_helpers import tune


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

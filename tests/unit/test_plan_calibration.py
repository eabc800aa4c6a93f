"""The planner's compute calibration (cost_model/calibration.py, planner/calibration_fit.py,
planner/calibration_file.py) as arithmetic: where each term acts on a step, which family's terms
a GPU takes, the fit recovering terms it was given, the calibration file's round trip and its
one-line errors, and the report naming its calibration with the range it implies. The fit to the
published runs themselves is tests/validation/test_calibration.py's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_gpt.cli import main
from elastic_gpt.cost_model.calibration import (
    DEFAULT_CALIBRATION,
    KERNEL_MODEL,
    UNCALIBRATED,
    Calibration,
    ComputeTerms,
    FamilyCalibration,
)
from elastic_gpt.cost_model.kernels import Kernels, block_times, head_times
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.cost_model.step_time import step_time
from elastic_gpt.hardware import GPU, GPUS
from elastic_gpt.model.config import preset_config
from elastic_gpt.planner.calibration_file import (
    CalibrationFileError,
    calibration_document,
    load_calibration,
    write_calibration,
)
from elastic_gpt.planner.calibration_fit import (
    MeasuredRun,
    ModelSpec,
    planned_over_measured,
    planned_step_s,
)
from elastic_gpt.planner.inputs import PlanError, PlanInputs
from elastic_gpt.planner.report import format_report, plan_summary
from elastic_gpt.planner.training_plan import plan_training

H100 = GPUS["H100"]
ONE_GPU = Network(8, H100.intra_node_gbps, H100.inter_node_gbps)


def _step(terms: ComputeTerms, *, recompute: bool = False, compiled: bool = False):
    shape = model_shape(preset_config("gpt3-1.3b"))
    return step_time(shape, H100, ONE_GPU, 1, 4, 1, activation_checkpointing=recompute,
                     calibration=terms, compiled=compiled)


def test_the_backward_term_slows_the_backward_and_nothing_else():
    """compute = L (forward + backward / b) + output layer (forward + backward / b): halving b
    adds exactly one more backward of every block and of the output layer; a recomputed forward
    runs at the forward's speed whatever b is."""
    cfg = preset_config("gpt3-1.3b")
    k = Kernels(H100, 2, elementwise_bandwidth=KERNEL_MODEL.eager_elementwise)
    block = block_times(k, 4, cfg.seq_len, cfg.n_embd, 1)
    head = head_times(k, 4, cfg.seq_len, cfg.n_embd, cfg.vocab_size, 1)
    full, half = _step(KERNEL_MODEL), _step(ComputeTerms(backward=0.5))
    assert half.compute_s - full.compute_s == pytest.approx(
        cfg.n_layer * block.backward_s + head.backward_s)
    for terms in (KERNEL_MODEL, ComputeTerms(backward=0.5)):
        assert (_step(terms, recompute=True).compute_s - _step(terms).compute_s
                == pytest.approx(cfg.n_layer * block.forward_s))


def test_the_eager_term_slows_eager_blocks_elementwise_kernels_only():
    """Eager blocks' norms, activation and residual adds at a fraction of the bandwidth: slower
    than compiled ones by that much more of those kernels; compiled blocks, and a plan in
    float8 (which the written config compiles), are untouched by it."""
    terms = ComputeTerms(eager_elementwise=0.25)
    eager, compiled = _step(terms), _step(terms, compiled=True)
    assert compiled.compute_s == pytest.approx(_step(KERNEL_MODEL, compiled=True).compute_s)
    assert compiled.compute_s == pytest.approx(_step(KERNEL_MODEL).compute_s)
    cfg = preset_config("gpt3-1.3b")
    plain = Kernels(H100, 2)
    slow = dataclasses.replace(plain, elementwise_bandwidth=0.25)
    extra = sum(block_times(slow, 4, cfg.seq_len, cfg.n_embd, 1).__dict__.values()) - sum(
        block_times(plain, 4, cfg.seq_len, cfg.n_embd, 1).__dict__.values())
    assert extra > 0 and eager.compute_s - compiled.compute_s == pytest.approx(
        cfg.n_layer * extra)
    shape = model_shape(cfg)
    fp8 = [step_time(shape, H100, ONE_GPU, 1, 4, 1, activation_checkpointing=False,
                     dtype="float8", calibration=t).compute_s for t in (terms, KERNEL_MODEL)]
    assert fp8[0] == pytest.approx(fp8[1])


def test_a_gpu_without_a_measured_run_takes_the_nearest_familys_terms_and_says_so():
    """The default has runs on A100, H100 and H200; L4, A10G and L40S take A100's (nearest by
    peak and HBM bandwidth), a B200-like row H200's; a measured family is its own. The
    uncalibrated kernel model has no terms but its own."""
    for name in ("L4", "A10G", "L40S"):
        fc = DEFAULT_CALIBRATION.for_gpu(GPUS[name])
        assert (fc.family, fc.scaled_from, fc.terms) == (
            name, "A100", DEFAULT_CALIBRATION.families["A100"].terms)
    b200 = dataclasses.replace(H100, name="B200", peak_flops=2250e12, hbm_gbps=8000)
    assert DEFAULT_CALIBRATION.for_gpu(b200).scaled_from == "H200"
    for name, family in (("A100-40GB", "A100"), ("A100-80GB", "A100"), ("H100", "H100")):
        assert DEFAULT_CALIBRATION.for_gpu(GPUS[name]) is DEFAULT_CALIBRATION.families[family]
    assert UNCALIBRATED.for_gpu(H100).terms == KERNEL_MODEL


def _measured(terms: ComputeTerms, gpu: GPU = H100) -> list[MeasuredRun]:
    """Runs whose throughput is exactly what `terms` plan for them."""
    runs = []
    for preset, mb, recompute, compiled in (("gpt2-124m", 16, 0.0, True),
                                            ("gpt3-1.3b", 8, 0.0, True),
                                            ("gpt3-1.3b", 8, 1.0, False),
                                            ("gpt2-350m", 8, 0.5, True)):
        c = preset_config(preset)
        model = ModelSpec(c.n_layer, c.n_embd, c.n_head, c.seq_len, c.vocab_size)
        run = MeasuredRun(f"{preset} mb{mb}", model, gpu.name, 1, mb, 1.0, recompute=recompute,
                          eager=not compiled)
        tokens_per_s = run.tokens_per_step() / planned_step_s(run, gpu, terms)
        runs.append(dataclasses.replace(run, tokens_per_s_per_gpu=tokens_per_s))
    return runs


def test_a_calibration_file_round_trips_and_its_fit_finds_the_terms_its_runs_ran_at(tmp_path):
    """Runs measured at a backward term of 0.6 (eager ones at the default's eager term), written
    as a calibration file and read back: the fit finds 0.6, every run lands on its plan (spread
    1), and the calibration names the file and speaks for H100 only."""
    eager = DEFAULT_CALIBRATION.for_gpu(H100).terms.eager_elementwise
    runs = _measured(ComputeTerms(backward=0.6, eager_elementwise=eager))
    path = tmp_path / "h100.json"
    write_calibration(str(path), calibration_document("H100", runs, written_by="a test",
                                                      date="2026-12-07"))
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], len(doc["runs"])) == ("elastic-gpt calibration", 1, 4)
    cal = load_calibration(str(path), dict(GPUS))
    fc = cal.families["H100"]
    assert fc.terms.backward == pytest.approx(0.6, abs=1e-3)
    assert fc.terms.eager_elementwise == eager
    assert cal.spread == pytest.approx((1.0, 1.0), abs=2e-3)
    assert str(path) in cal.name and "a test" in cal.name and "2026-12-07" in cal.name
    assert not cal.scales_to_unmeasured
    for run in runs:
        assert planned_over_measured(run, dict(GPUS), fc.terms) == pytest.approx(1, abs=2e-3)


def _good_doc() -> dict:
    """Runs at a backward term of 0.7 and the default's eager term (which a file keeps)."""
    terms = dataclasses.replace(DEFAULT_CALIBRATION.for_gpu(H100).terms, backward=0.7)
    return calibration_document("H100", _measured(terms), written_by="test")


def _set(doc: dict, path: str, value) -> dict:
    """doc with the dotted `path` ("runs.0.model.n_head") set to value (or removed: ...)."""
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is ...:
        del node[int(last) if isinstance(node, list) else last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return doc


BAD_FILES = [
    ("format", lambda d: _set(d, "format", "something else"),
     "is not an elastic-gpt calibration"),
    ("newer", lambda d: _set(d, "version", 2), "is version 2; this elastic-gpt reads version 1: "
                                               "upgrade elastic-gpt"),
    ("unversioned", lambda d: _set(d, "version", ...), "is version None"),
    ("gpu", lambda d: _set(d, "gpu", "B300"), "\"gpu\": unknown GPU 'B300'"),
    ("no runs", lambda d: _set(d, "runs", []), "\"runs\" must be a non-empty list"),
    ("negative speed", lambda d: _set(d, "runs.1.tokens_per_s_per_gpu", -3),
     "runs[1].tokens_per_s_per_gpu must be positive, not -3"),
    ("no compiled", lambda d: _set(d, "runs.0.compiled", ...), "runs[0].compiled must be true "
                                                               "or false"),
    ("fractional gpus", lambda d: _set(d, "runs.0.gpus", 1.5),
     "runs[0].gpus must be a positive whole number, not 1.5"),
    ("heads", lambda d: _set(d, "runs.0.model.n_head", 7),
     "runs[0].model: n_embd 768 is not divisible by n_head 7"),
    ("recompute", lambda d: _set(d, "runs.2.recompute", 2), "runs[2].recompute must be the "
                                                             "fraction of the forward"),
    ("dtype", lambda d: _set(d, "runs.0.dtype", "float32"), "runs[0].dtype must be one of "
                                                            "bfloat16, float8"),
    ("unknown field", lambda d: _set(d, "runs.0.speed", 1), "runs[0]: unknown field(s) "
                                                            "['speed']"),
    ("layout", lambda d: _set(d, "runs.0.tp", 2), "runs[0]: gpus 1 is not a multiple of tp x pp"),
    ("network", lambda d: _set(d, "runs.0.network", {"gpus_per_node": 8}),
     "runs[0].network.intra_node_gbps must be a number"),
    ("per cluster", lambda d: [_set(d, f"runs.{i}.tokens_per_s_per_gpu",
                                    r["tokens_per_s_per_gpu"] * 64)
                               for i, r in enumerate(d["runs"])][-1],
     "its runs ran faster than the kernel model on H100 explains with a backward at any 0.2-1.5 "
     "of its speed: check that tokens_per_s_per_gpu is per GPU"),
]


@pytest.mark.parametrize("name,spoil,says", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_calibration_file_is_one_line_naming_the_file_and_the_field(tmp_path, name, spoil,
                                                                          says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spoil(_good_doc())))
    with pytest.raises(CalibrationFileError) as e:
        load_calibration(str(path), dict(GPUS))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"calibration file {path}") and says in line


def test_plan_calibration_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    """Through the command: a missing file, a file that is not JSON, a measured calibration of
    another GPU, and a calibration beside --efficiency each exit 2 with one line."""
    good = tmp_path / "h100.json"
    write_calibration(str(good), _good_doc())
    not_json = tmp_path / "notes.json"
    not_json.write_text("{not json")
    cases = [(["--calibration", str(tmp_path / "nothing.json")], "does not exist; write one with "
                                                                 "bench/gpu.sh"),
             (["--calibration", str(not_json)], "is not readable JSON"),
             (["--calibration", str(good), "--gpu", "A100-80GB"],
              "was measured on H100; this plan is for A100-80GB: plan --gpu H100"),
             (["--calibration", str(good), "--efficiency", "0.5"],
              "--calibration and --efficiency both set the compute speed")]
    for argv, says in cases:
        capsys.readouterr()
        assert main(["plan", "--model", "gpt3-1.3b", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("elastic-gpt plan: error:"), err
        assert says in err and "Traceback" not in err


def test_every_report_names_its_calibration_and_the_range_it_implies():
    """The default: its name, the family's terms and evidence, and the step, MFU, time and cost
    the spread puts the plan between (the plan's figure inside); the JSON the same. A plan of
    --efficiency or --achieved-tflops says no calibration, and gives no range."""
    plan = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=8))
    report = format_report(plan)
    assert f"compute   calibration {DEFAULT_CALIBRATION.name}" in report
    assert "H100: backward at 0.57 of the kernel model" in report
    lo, hi = DEFAULT_CALIBRATION.spread
    assert f"range: the runs this calibration rests on ran {lo:.2f}-{hi:.2f}x" in report
    ranges = plan_summary(plan)["calibration"]["ranges"]
    assert ranges["spread"] == [lo, hi]
    assert ranges["step_s"] == pytest.approx([plan.step_s / hi, plan.step_s / lo])
    assert ranges["mfu"][0] < plan.mfu < ranges["mfu"][1]
    assert ranges["cost_on_demand_usd"][0] < plan.cost_usd(spot=False) < \
        ranges["cost_on_demand_usd"][1]
    assert f"MFU {100 * ranges['mfu'][0]:.1f}-{100 * ranges['mfu'][1]:.1f}%" in report
    assert "best published MFU of this class (H100, bf16, without full recomputation): 45.7% " \
           "(MosaicML: MPT 7B, 128 x H100)" in report
    for kw, says in ((dict(efficiency=0.6), "(--efficiency); no calibration"),
                     (dict(achieved_flops_per_gpu=300e12), "(--achieved-tflops); no calibration")):
        other = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=8, **kw))
        text = format_report(other)
        assert says in text and "range:" not in text
        assert plan_summary(other)["calibration"]["ranges"] is None


def test_a_plan_of_an_unmeasured_gpu_says_whose_terms_it_takes():
    report = format_report(plan_training(PlanInputs(model="gpt3-1.3b", gpu="L4", n_gpus=8)))
    assert "no run measured on L4: A100's terms, the family nearest it by datasheet" in report
    assert "none published for L4 in bf16" in report


def test_a_plan_above_the_best_published_mfu_of_its_class_says_so():
    """A calibration that runs the backward faster than the kernel model plans the class's best
    published MFU out of reach: the report's note says the step is optimistic."""
    fast = Calibration("too fast", {"H100": FamilyCalibration("H100", ComputeTerms(backward=1.5))},
                       spread=(1.0, 1.0))
    plan = plan_training(PlanInputs(model="gpt3-6.7b", gpu="H100", n_gpus=8, calibration=fast))
    assert plan.mfu > 0.457
    assert "note: the planned MFU" in format_report(plan)
    default = plan_training(PlanInputs(model="gpt3-6.7b", gpu="H100", n_gpus=8))
    assert default.mfu < 0.457 and "note: the planned MFU" not in format_report(default)


def test_a_measured_calibration_replaces_the_default(tmp_path):
    """The plan with a file's calibration runs at the file's terms, and its report names the
    file; a plan without it is the default's."""
    path = tmp_path / "h100.json"
    write_calibration(str(path), _good_doc())
    cal = load_calibration(str(path), dict(GPUS))
    measured = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=8, calibration=cal))
    default = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=8))
    assert measured.family_calibration.terms.backward == pytest.approx(0.7, abs=1e-3)
    assert measured.step_s < default.step_s  # 0.7 > the default's 0.57
    assert f"calibration measured: {path}" in format_report(measured)
    with pytest.raises(PlanError, match="was measured on H100; this plan is for L4"):
        plan_training(PlanInputs(model="gpt3-1.3b", gpu="L4", n_gpus=8, calibration=cal))


def test_tune_writes_every_candidate_that_ran_as_a_calibration(tmp_path):
    """`elastic-gpt tune --write-calibration`: the rows that ran to the end (not the ones out of
    memory, refused or failed), each with its layout, its micro-batches per rank, the trainer's
    recomputation and its tokens per second per worker, on the workers' GPU row and placement;
    the planner reads it back."""
    from elastic_gpt.config import load_config
    from elastic_gpt.planner.tune import write_tune_calibration

    cfg = load_config(None, ["data.path=unused", "train.global_batch_size=64"])
    gpt = preset_config("gpt3-1.3b")
    base = dict(oom=False, error=None, grad_sync="microbatch", reshard_after_forward=True,
                compile=True, hsdp=False, pp=1, stages_per_rank=1)
    rows = [dict(base, tp=1, micro_batch=4, activation_checkpointing=False, step_s=0.2,
                 tokens_per_s=64 * 2048 / 0.2),
            dict(base, tp=2, micro_batch=8, activation_checkpointing=True, step_s=0.4,
                 tokens_per_s=64 * 2048 / 0.4, compile=False),
            dict(base, tp=1, micro_batch=16, activation_checkpointing=False, step_s=None,
                 tokens_per_s=None, oom=True),
            dict(base, tp=8, micro_batch=1, activation_checkpointing=False, step_s=None,
                 tokens_per_s=None, refused="a node holds 4 workers")]
    path = tmp_path / "tuned.json"
    write_tune_calibration(str(path), rows, H100, gpt, cfg, world=16, nodes=2)
    doc = json.loads(path.read_text())
    assert doc["written_by"] == "elastic-gpt tune" and doc["gpu"] == "H100"
    first, second = doc["runs"]
    assert (first["tp"], first["micro_batches_per_rank"], first["recompute"],
            first["compiled"]) == (1, 1, 0.0, True)
    assert (second["tp"], second["micro_batches_per_rank"], second["recompute"],
            second["compiled"]) == (2, 1, 1.0, False)
    assert second["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / 0.4 / 16)
    assert first["network"]["gpus_per_node"] == 8
    assert set(load_calibration(str(path), dict(GPUS)).families) == {"H100"}

"""A measured calibration on disk: the runs a GPU measured, as JSON, and the calibration fitted
to them (`plan --calibration FILE`). bench/gpu.sh writes one from a GPU's own runs
(bench/gpu_mfu.py), `elastic-gpt tune --write-calibration FILE` from a cluster's.

The file holds measurements, not terms: loading it fits the terms to the cost model of the
elastic-gpt reading it (planner/calibration_fit.py), so a file written once stays valid when
the kernel model changes. Format, version 1:

    {"format": "elastic-gpt calibration", "version": 1,
     "gpu": "H100",                       # a GPU row: hardware.py's or a --hardware-file's
     "written_by": "bench/gpu_mfu.py",    # optional, like "name", "date" and "environment"
     "runs": [{"model": {"n_layer": 24, "n_embd": 2048, "n_head": 32, "seq_len": 2048,
                         "vocab_size": 50304},     # + optional n_kv_head, ffn_dim, mlp
               "gpus": 1, "micro_batch": 8, "compiled": true,
               "tokens_per_s_per_gpu": 52000.0,
               # optional, with their defaults:
               "label": "", "micro_batches_per_rank": 1, "tp": 1, "pp": 1,
               "pp_stages_per_rank": 1, "hsdp": false, "recompute": 0.0,
               "dtype": "bfloat16", "reshard_after_forward": true, "grad_sync": "microbatch",
               "network": {"gpus_per_node": 8, "intra_node_gbps": 370, "inter_node_gbps": 320}}]}

The fit: the backward term (cost_model/calibration.py) over the file's runs, the eager term kept
from the default calibration (it is the software's, measured where eager and compiled runs of
one model sit side by side); the spread over the file's runs. Runs no backward term in the fit's
range explains (a cluster's tokens per second given per GPU, say) are refused. Bad input is one
line naming the file, the field and what would do.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from elastic_gpt.cost_model.calibration import (
    DEFAULT_CALIBRATION,
    Calibration,
    ComputeTerms,
    gpu_family,
)
from elastic_gpt.hardware import GPU, get_gpu
from elastic_gpt.planner.calibration_fit import (
    TERM_BOUNDS,
    MeasuredRun,
    ModelSpec,
    fit_family,
    planned_over_measured,
    spread,
)

FORMAT = "elastic-gpt calibration"
VERSION = 1
MLP_KINDS = ("gelu", "swiglu")
DTYPES = ("bfloat16", "float8")
"""float32 runs say nothing of the bf16 speed a plan assumes."""
RUN_FIELDS = frozenset({
    "label", "model", "gpus", "micro_batch", "compiled", "tokens_per_s_per_gpu",
    "micro_batches_per_rank", "tp", "pp", "pp_stages_per_rank", "hsdp", "recompute", "dtype",
    "reshard_after_forward", "grad_sync", "network"})


class CalibrationFileError(ValueError):
    """A calibration file that cannot be read or fitted; the message says what would do."""


def calibration_document(gpu: str, runs: list[MeasuredRun], *, written_by: str,
                         name: str = "", date: str = "", environment: dict | None = None) -> dict:
    """The JSON object a writer saves: every run on `gpu`."""
    doc = {"format": FORMAT, "version": VERSION, "gpu": gpu, "written_by": written_by}
    doc |= {k: v for k, v in (("name", name), ("date", date), ("environment", environment))
            if v}
    doc["runs"] = [_run_record(r) for r in runs]
    return doc


def _run_record(r: MeasuredRun) -> dict:
    record = {"label": r.label, "model": {k: v for k, v in dataclasses.asdict(r.model).items()
                                          if v is not None},
              "gpus": r.gpus, "micro_batch": r.micro_batch, "compiled": not r.eager,
              "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
              "micro_batches_per_rank": r.micro_batches_per_rank, "tp": r.tp, "pp": r.pp,
              "pp_stages_per_rank": r.pp_stages_per_rank, "hsdp": r.hsdp,
              "recompute": r.recompute, "dtype": r.dtype,
              "reshard_after_forward": r.reshard_after_forward, "grad_sync": r.grad_sync}
    if r.network:
        record["network"] = dict(zip(("gpus_per_node", "intra_node_gbps", "inter_node_gbps"),
                                     r.network))
    return record


def write_calibration(path: str, document: dict) -> None:
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def load_calibration(path: str, hardware: dict[str, GPU]) -> Calibration:
    """The calibration fitted to the runs of the file at `path`; a CalibrationFileError (one
    line) for anything that is not such a file."""
    where = f"calibration file {path}"
    fix = "; write one with bench/gpu.sh or `elastic-gpt tune --write-calibration FILE`"
    p = Path(path)
    if not p.is_file():
        raise CalibrationFileError(f"{where} does not exist{fix}")
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationFileError(f"{where} is not readable JSON ({e}){fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CalibrationFileError(f"{where} is not an elastic-gpt calibration (its \"format\" "
                                   f"is not {FORMAT!r}){fix}")
    version = doc.get("version")
    if version != VERSION:
        newer = isinstance(version, int) and version > VERSION
        raise CalibrationFileError(
            f"{where} is version {version!r}; this elastic-gpt reads version {VERSION}"
            + (": upgrade elastic-gpt to read it" if newer else fix))
    try:
        gpu = get_gpu(str(doc.get("gpu")), hardware)
    except ValueError as e:
        raise CalibrationFileError(f"{where}: \"gpu\": {e}") from None
    raw_runs = doc.get("runs")
    if not isinstance(raw_runs, list) or not raw_runs:
        raise CalibrationFileError(f"{where}: \"runs\" must be a non-empty list of measured "
                                   f"runs{fix}")
    runs = [_run(f"{where}: runs[{i}]", raw, gpu) for i, raw in enumerate(raw_runs)]
    start = DEFAULT_CALIBRATION.for_gpu(gpu).terms
    for i, run in enumerate(runs):
        _check_plannable(f"{where}: runs[{i}]", run, hardware, start)
    family = gpu_family(gpu.name)
    written_by = str(doc.get("written_by") or "unknown")
    evidence = (f"fitted on {len(runs)} run(s) measured by {written_by}; the eager term is the "
                "default's")
    family_cal = fit_family(runs, hardware, start, evidence)
    lo, hi = TERM_BOUNDS["backward"]
    fitted = family_cal.terms.backward
    if not 1.01 * lo < fitted < 0.99 * hi:
        raise CalibrationFileError(
            f"{where}: its runs ran {'slower' if fitted < 1 else 'faster'} than the kernel model "
            f"on {gpu.name} explains with a backward at any {lo}-{hi} of its speed: check that "
            "tokens_per_s_per_gpu is per GPU, and that gpu, layout and dtype are what ran")
    device = (doc.get("environment") or {}).get("device") if isinstance(
        doc.get("environment"), dict) else None
    name = str(doc.get("name") or f"measured: {path} ({len(runs)} run(s) on "
                                   f"{device or gpu.name} by {written_by}"
                                   + (f", {doc['date']}" if doc.get("date") else "") + ")")
    calibration = Calibration(name, {family: family_cal}, scales_to_unmeasured=False)
    return dataclasses.replace(calibration, spread=spread(runs, hardware, calibration))


def _run(where: str, raw, gpu: GPU) -> MeasuredRun:
    if not isinstance(raw, dict):
        raise CalibrationFileError(f"{where} must be an object with the run's model, layout and "
                                   "tokens_per_s_per_gpu")
    model = raw.get("model")
    if not isinstance(model, dict):
        raise CalibrationFileError(f"{where}.model must be an object (n_layer, n_embd, n_head, "
                                   "seq_len, vocab_size)")
    m = {k: _count(f"{where}.model.{k}", model.get(k))
         for k in ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size")}
    for k in ("n_kv_head", "ffn_dim"):
        if model.get(k) is not None:
            m[k] = _count(f"{where}.model.{k}", model[k])
    m["mlp"] = _choice(f"{where}.model.mlp", model.get("mlp", "gelu"), MLP_KINDS)
    if m["n_embd"] % m["n_head"]:
        raise CalibrationFileError(f"{where}.model: n_embd {m['n_embd']} is not divisible by "
                                   f"n_head {m['n_head']}")
    unknown = set(raw) - RUN_FIELDS
    if unknown:
        raise CalibrationFileError(f"{where}: unknown field(s) {sorted(unknown)}; a run's "
                                   f"fields are {', '.join(sorted(RUN_FIELDS))}")
    if not isinstance(raw.get("compiled"), bool):
        raise CalibrationFileError(f"{where}.compiled must be true or false (whether the blocks "
                                   "ran compiled), not " + repr(raw.get("compiled")))
    recompute = _number(f"{where}.recompute", raw.get("recompute", 0.0))
    if not 0 <= recompute <= 1:
        raise CalibrationFileError(f"{where}.recompute must be the fraction of the forward "
                                   f"recomputed, 0 to 1, not {recompute}")
    return MeasuredRun(
        label=str(raw.get("label", "")), model=ModelSpec(**m), gpu=gpu.name,
        gpus=_count(f"{where}.gpus", raw.get("gpus")),
        micro_batch=_count(f"{where}.micro_batch", raw.get("micro_batch")),
        tokens_per_s_per_gpu=_positive(f"{where}.tokens_per_s_per_gpu",
                                       raw.get("tokens_per_s_per_gpu")),
        micro_batches_per_rank=_count(f"{where}.micro_batches_per_rank",
                                      raw.get("micro_batches_per_rank", 1)),
        tp=_count(f"{where}.tp", raw.get("tp", 1)), pp=_count(f"{where}.pp", raw.get("pp", 1)),
        pp_stages_per_rank=_count(f"{where}.pp_stages_per_rank",
                                  raw.get("pp_stages_per_rank", 1)),
        hsdp=_flag(f"{where}.hsdp", raw.get("hsdp", False)), recompute=recompute,
        dtype=_choice(f"{where}.dtype", raw.get("dtype", "bfloat16"), DTYPES),
        eager=not raw["compiled"],
        reshard_after_forward=_flag(f"{where}.reshard_after_forward",
                                    raw.get("reshard_after_forward", True)),
        grad_sync=_choice(f"{where}.grad_sync", raw.get("grad_sync", "microbatch"),
                          ("microbatch", "step")),
        network=_network(f"{where}.network", raw.get("network")))


def _check_plannable(where: str, run: MeasuredRun, hardware: dict[str, GPU],
                     terms: ComputeTerms) -> None:
    """A run the cost model can plan: its GPUs split into tp x pp, its heads by tp, a block
    for every stage, and then planned."""
    cfg = run.model
    if run.gpus % (run.tp * run.pp):
        raise CalibrationFileError(f"{where}: gpus {run.gpus} is not a multiple of tp x pp = "
                                   f"{run.tp * run.pp}")
    if cfg.n_head % run.tp:
        raise CalibrationFileError(f"{where}: tp {run.tp} does not divide n_head {cfg.n_head}")
    if run.pp * run.pp_stages_per_rank > cfg.n_layer:
        raise CalibrationFileError(f"{where}: {run.pp * run.pp_stages_per_rank} pipeline stages "
                                   f"for {cfg.n_layer} layers; a stage needs a block")
    if run.dtype == "float8" and not get_gpu(run.gpu, hardware).fp8_peak_flops:
        raise CalibrationFileError(f"{where}: dtype float8 on {run.gpu}, which has no float8 "
                                   "tensor cores")
    try:
        planned_over_measured(run, hardware, terms)
    except (ValueError, ArithmeticError) as e:  # a layout the cost model cannot build
        raise CalibrationFileError(f"{where} cannot be planned: {e}") from None


def _count(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CalibrationFileError(f"{where} must be a positive whole number, not {value!r}")
    return value


def _number(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CalibrationFileError(f"{where} must be a number, not {value!r}")
    return float(value)


def _positive(where: str, value) -> float:
    number = _number(where, value)
    if number <= 0:
        raise CalibrationFileError(f"{where} must be positive, not {value!r}")
    return number


def _flag(where: str, value) -> bool:
    if not isinstance(value, bool):
        raise CalibrationFileError(f"{where} must be true or false, not {value!r}")
    return value


def _choice(where: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise CalibrationFileError(f"{where} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _network(where: str, value) -> tuple[int, float, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CalibrationFileError(f"{where} must be an object (gpus_per_node, intra_node_gbps, "
                                   "inter_node_gbps)")
    return (_count(f"{where}.gpus_per_node", value.get("gpus_per_node")),
            _positive(f"{where}.intra_node_gbps", value.get("intra_node_gbps")),
            _positive(f"{where}.inter_node_gbps", value.get("inter_node_gbps")))

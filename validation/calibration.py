"""The default calibration fitted from the published runs of this trainer's software
(calibration_runs.py), each run's plan against its measurement before and after, the best MFU
published for each class of plan, and a few plans before and after the calibration. The product
freezes the fit (elastic_gpt/cost_model/calibration.py); tests/validation/ checks that it is
still what this fit gives. validation/reports/ holds dated records of what this prints.

    .venv/bin/python -m validation.calibration
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_gpt.cost_model.calibration import (
    DEFAULT_NAME,
    KERNEL_MODEL,
    UNCALIBRATED,
    Calibration,
    PublishedMFU,
)
from elastic_gpt.hardware import GPUS, get_gpu
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.planner.calibration_fit import (
    MeasuredRun,
    fit_family,
    planned_over_measured,
    spread,
)
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.training_plan import plan_training
from validation.calibration_runs import CHECK, FIT, FREE_TERMS, MISSES, UNPLANNED_FEATURES
from validation.runs import LLAMA3, RUNS, TORCHTITAN_H100

HARDWARE = {**GPUS, TORCHTITAN_H100.name: TORCHTITAN_H100}
FAMILY_ORDER = ("H100", "A100", "H200")
"""H100 first: its fit sets the eager term the others take."""


def _sources(runs) -> str:
    names = {"torchtitan's" if r.source.startswith("torchtitan") else "MosaicML's" for r in runs}
    return " and ".join(n for n in ("torchtitan's", "MosaicML's") if n in names)


def fit_default() -> Calibration:
    """Each family's terms on its FIT runs; the spread over every FIT and CHECK run but those of
    what no plan writes."""
    families, start = {}, KERNEL_MODEL
    for family in FAMILY_ORDER:
        fit, checks = FIT[family], CHECK[family]
        evidence = (f"fitted on {len(fit)} of {_sources(fit)} {family} runs, checked on "
                    f"{len(checks)} of {_sources(checks)}")
        fc = fit_family(list(fit), HARDWARE, start, evidence, FREE_TERMS[family])
        families[family] = fc
        start = dataclasses.replace(start, eager_elementwise=fc.terms.eager_elementwise)
    calibration = Calibration(DEFAULT_NAME, families)
    in_spread = [r for family in FAMILY_ORDER for r in FIT[family] + CHECK[family]
                 if (r.source, r.label) not in UNPLANNED_FEATURES]
    return dataclasses.replace(calibration, spread=spread(in_spread, HARDWARE, calibration))


@dataclass(frozen=True)
class Residual:
    family: str
    role: str
    """fit or check"""
    run: MeasuredRun
    kernel_model: float
    """Planned over measured throughput, uncalibrated."""
    calibrated: float
    """The same with the family's fitted terms."""

    @property
    def miss(self) -> str | None:
        return MISSES.get((self.run.source, self.run.label))


def residuals(calibration: Calibration) -> list[Residual]:
    out = []
    for family in FAMILY_ORDER:
        terms = calibration.families[family].terms
        for role, runs in (("fit", FIT[family]), ("check", CHECK[family])):
            out += [Residual(family, role, r, planned_over_measured(r, HARDWARE, KERNEL_MODEL),
                             planned_over_measured(r, HARDWARE, terms)) for r in runs]
    return out


KORTHIKANTI_ABSTRACT = (
    ("A100", False, 0.542, "Megatron-LM, GPT 530B, 2,240 A100s, sequence parallelism and "
                           "selective recomputation (Korthikanti et al. 2022)"),
    ("A100", True, 0.421, "Megatron-LM, GPT 530B, 2,240 A100s, full recomputation "
                          "(Korthikanti et al. 2022)"),
)
"""The MFUs Korthikanti et al. 2022 state in their abstract, for runs not in the tables."""


def describe(run: MeasuredRun) -> str:
    """A run in a phrase: who published it, the model and how it ran, on what."""
    who = "torchtitan" if run.source.startswith("torchtitan") else "MosaicML"
    where = "" if " x " in run.label else f", {run.gpus} x {run.gpu}"
    return f"{who}: {run.label}{where}"


def best_published_mfu() -> dict[tuple[str, bool], PublishedMFU]:
    """(GPU family, full recomputation) -> the best MFU a published bf16 run of that class
    reached: the calibration's runs (each model's own FLOPs over the chip's bf16 peak, as its
    publisher counts), Llama 3's stated MFUs (its recomputation not stated: counted as without
    full recomputation) and Korthikanti's."""
    found: dict[tuple[str, bool], PublishedMFU] = {}

    def offer(family: str, full: bool, mfu: float, run: str) -> None:
        key = (family, full)
        if key not in found or mfu > found[key].mfu:
            found[key] = PublishedMFU(round(mfu, 3), run)

    for family in FAMILY_ORDER:
        for r in FIT[family] + CHECK[family]:
            if r.dtype == "bfloat16":
                peak = get_gpu(r.gpu, HARDWARE).peak_flops
                offer(family, r.recompute == 1.0,
                      r.tokens_per_s_per_gpu * r.model.flops_per_token() / peak, describe(r))
    for run in RUNS:
        if run.source == LLAMA3:
            offer("H100", False, run.published_tflops / 989,
                  f"Meta's Llama 3 405B on {run.gpus} H100s")
    for family, full, mfu, run in KORTHIKANTI_ABSTRACT:
        offer(family, full, mfu, run)
    return found


ONE_T = GPTConfig(n_layer=128, n_head=160, n_embd=25600, seq_len=2048, vocab_size=51200)
"""SC21's 1T model (Table 1)."""
PLANS = (
    ("gpt3-175b on 64 A100-80GB", dict(model="gpt3-175b", gpu="A100-80GB", n_gpus=64)),
    ("1T on 3,072 A100-80GB, batch 3,072", dict(model=ONE_T, gpu="A100-80GB", n_gpus=3072,
                                                global_batch_size=3072)),
    ("the same on SC21's network (NVLink3 195 GB/s, 160 GB/s per node)",
     dict(model=ONE_T, gpu="A100-80GB", n_gpus=3072, global_batch_size=3072,
          intra_node_gbps=195, inter_node_gbps=160)),
    ("gpt3-175b on 1,024 A100-80GB", dict(model="gpt3-175b", gpu="A100-80GB", n_gpus=1024)),
    ("gpt3-13b on 64 H100", dict(model="gpt3-13b", gpu="H100", n_gpus=64)),
    ("gpt3-6.7b on 8 H100", dict(model="gpt3-6.7b", gpu="H100", n_gpus=8)),
    ("gpt3-1.3b on 8 L4 (no measured run: scaled)", dict(model="gpt3-1.3b", gpu="L4", n_gpus=8)),
)


def plan_line(label: str, kw: dict) -> str:
    before = plan_training(PlanInputs(**kw, calibration=UNCALIBRATED))
    after = plan_training(PlanInputs(**kw))
    c = after.chosen
    return (f"| {label} | {100 * before.mfu:.1f}% ({before.chosen.mesh.short()}) | "
            f"{100 * after.mfu:.1f}% ({c.mesh.short()}, micro-batch {c.micro_batch}, "
            f"recomputation {'on' if c.activation_checkpointing else 'off'}) |")


def main() -> None:
    calibration = fit_default()
    print("Fitted terms (the product freezes them in elastic_gpt/cost_model/calibration.py):\n")
    print("| family | backward | eager elementwise | runs |")
    print("|---|---|---|---|")
    for family, fc in calibration.families.items():
        t = fc.terms
        print(f"| {family} | {t.backward:.3f} | {t.eager_elementwise:.3f} | {fc.evidence} |")
    lo, hi = calibration.spread
    print(f"\nSpread: the runs ran {lo:.2f}-{hi:.2f} x the calibrated plan's throughput (every "
          "run fitted or checked, but those with async TP, which no plan writes).")
    print("\nEach run planned in the layout it ran, planned over measured throughput (model "
          "FLOP/s):\n")
    print("| family | role | source | run | GPUs | measured tokens/s/GPU | kernel model | "
          "calibrated |")
    print("|---|---|---|---|---|---|---|---|")
    for r in residuals(calibration):
        miss = f" (not reproduced: {r.miss})" if r.miss else ""
        print(f"| {r.family} | {r.role} | {r.run.source} | {r.run.label} | {r.run.gpus} | "
              f"{r.run.tokens_per_s_per_gpu:,.0f} | {r.kernel_model:.2f} | "
              f"{r.calibrated:.2f}{miss} |")
    print("\nBest published bf16 MFU by class (the bound no default plan may exceed):\n")
    for (family, full), best in sorted(best_published_mfu().items()):
        print(f"- {family}, {'full' if full else 'no full'} recomputation: {100 * best.mfu:.1f}% "
              f"({best.run})")
    print("\nDefault plans (MFU), the kernel model uncalibrated -> calibrated:\n")
    print("| plan | uncalibrated | calibrated |")
    print("|---|---|---|")
    for label, kw in PLANS:
        print(plan_line(label, kw))


if __name__ == "__main__":
    main()

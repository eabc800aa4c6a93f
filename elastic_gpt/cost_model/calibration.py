"""How fast this trainer's software runs the kernels the kernel model costs: a calibration's terms
(`ComputeTerms`), a calibration by GPU family (`Calibration`), and the default one, fitted to
published runs of the same software.

The kernel model (kernels.py: Calculon's curves topped at the GPU's measured matmul ceiling)
plans the tuned stacks it was built on within 15%: Megatron-LM's SC21 and 2022 runs, Meta's
Llama 3 405B (the repository's validation/ wing). Runs of the torch stack this trainer uses
(torchtitan: FSDP2, DTensor tensor parallelism, torch.distributed.pipelining; MosaicML's
llm-foundry on PyTorch FSDP) ran slower than it plans them, and by a pattern: runs without
recomputation fell further behind than runs with it, as if the backward pass reached less of the
kernel model than the forward did. Two terms describe them:

- `backward`: the fraction of the kernel model's speed a block's and the output layer's backward
  reach; the forward (and its recomputation) run as the kernel model costs them. An exploratory
  fit with a forward term as well put the forward above the kernel model (1.3x on H100), past
  the measured matmul peak the kernel model is topped at: the forward is held at the kernel model
  and only the backward is fitted.
- `eager_elementwise`: the fraction of the modelled HBM bandwidth a block's elementwise kernels
  (norms, activation, residual adds) reach when the blocks run eager (`train.compile` off), each
  op its own kernel with its own reads and writes. Compiled blocks, and stacks with their own
  fused kernels (MosaicML's), run them as modelled.

The default calibration (`DEFAULT_CALIBRATION`) is frozen here, not computed: the validation wing
fits it from the published runs (`python -m validation.calibration`), its tests assert that the
fit still gives these figures and that every run set aside to check it is reproduced, and its
dated reports (validation/reports/calibration_*.md) record the fit. A family with no measured
run takes the terms of the measured family nearest it by its datasheet (hardware.py): the one
whose dense bf16 peak and HBM bandwidth, the two speeds the kernel model scales every kernel by,
are closest (in ratio). A measured calibration (`plan --calibration FILE`,
planner/calibration_file.py) replaces the default for its GPU family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic_gpt.hardware import GPU, GPUS


@dataclass(frozen=True)
class ComputeTerms:
    """What the kernel model's compute is multiplied by for one GPU family and software."""

    backward: float = 1.0
    """Fraction of the kernel model's speed the backward pass's kernels reach."""
    eager_elementwise: float = 1.0
    """Fraction of the modelled HBM bandwidth eager blocks' elementwise kernels reach."""

    def describe(self) -> str:
        return (f"backward at {self.backward:.2f} of the kernel model, eager blocks' elementwise "
                f"kernels at {self.eager_elementwise:.2f} of its bandwidth")


KERNEL_MODEL = ComputeTerms()
"""The kernel model as it stands: what the validation wing plans other stacks' runs with."""


@dataclass(frozen=True)
class FamilyCalibration:
    """The terms for one GPU family, with what they rest on."""

    family: str
    terms: ComputeTerms
    evidence: str = ""
    """The runs, in a phrase: what the report names."""
    scaled_from: str | None = None
    """None: fitted on this family's runs; else the measured family whose terms it takes."""


@dataclass(frozen=True)
class Calibration:
    """Terms by GPU family under one name (what every report prints), and how far the runs they
    were fitted and checked on fell from the plans they give."""

    name: str
    families: dict[str, FamilyCalibration] = field(default_factory=dict)
    """Measured families. Empty: the kernel model, uncalibrated, for every GPU."""
    scales_to_unmeasured: bool = True
    """Whether a GPU family it has no runs of takes the nearest measured family's terms (the
    default) or is refused (a measured calibration speaks for its own GPU only)."""
    spread: tuple[float, float] | None = None
    """(least, most) measured over planned throughput of every run the terms were fitted and
    checked on, each with its family's terms: the range a plan's throughput is read in. One
    spread for all families: the terms shift each family's level, the model's errors are the
    same model's. None: nothing measured."""

    def for_gpu(self, gpu: GPU) -> FamilyCalibration:
        """The terms for `gpu`: its family's, or (no run measured on it) the nearest measured
        family's by the datasheet, saying so."""
        family = gpu_family(gpu.name)
        if not self.families:
            return FamilyCalibration(family, KERNEL_MODEL, "uncalibrated")
        if family in self.families:
            return self.families[family]
        if not self.scales_to_unmeasured:
            measured = ", ".join(self.families)
            raise ValueError(f"calibration {self.name!r} was measured on {measured}; this plan "
                             f"is for {gpu.name}: plan --gpu {measured}, or measure {gpu.name} "
                             "(bench/gpu.sh) and pass that calibration")
        nearest = min(self.families, key=lambda f: datasheet_distance(gpu, _datasheet(f)))
        near = self.families[nearest]
        return FamilyCalibration(family, near.terms, near.evidence, nearest)


def gpu_family(name: str) -> str:
    """"A100-80GB" -> "A100": the rows of one chip share a family."""
    return name.split("-")[0]


def datasheet_distance(a: GPU, b: GPU) -> float:
    """How far apart two chips' datasheets put them: the distance between their (log dense bf16
    peak, log HBM bandwidth), the two speeds the kernel model scales every kernel by."""
    return math.hypot(math.log(a.peak_flops / b.peak_flops), math.log(a.hbm_gbps / b.hbm_gbps))


def _datasheet(family: str) -> GPU:
    return next(g for g in GPUS.values() if gpu_family(g.name) == family)


UNCALIBRATED = Calibration("none: the kernel model, uncalibrated")
"""The kernel model's own speeds for every GPU (the validation wing's plans of other stacks)."""

DEFAULT_NAME = ("default: fitted to published runs of this software (torchtitan's, checked on "
                "theirs and MosaicML's; validation/reports/calibration_2026-12-07.md)")
DEFAULT_CALIBRATION = Calibration(DEFAULT_NAME, {
    "H100": FamilyCalibration(
        "H100", ComputeTerms(backward=0.574, eager_elementwise=0.204),
        "fitted on 4 of torchtitan's H100 runs, checked on 14 of torchtitan's and MosaicML's"),
    "A100": FamilyCalibration(
        "A100", ComputeTerms(backward=0.782, eager_elementwise=0.204),
        "fitted on 2 of torchtitan's A100 runs, checked on 11 of torchtitan's and MosaicML's"),
    "H200": FamilyCalibration(
        "H200", ComputeTerms(backward=0.612, eager_elementwise=0.204),
        "fitted on 1 of torchtitan's H200 runs, checked on 1 of torchtitan's"),
}, spread=(0.70, 1.13))
"""Frozen from the validation wing's fit (`python -m validation.calibration`), the terms to three
decimals, the spread to two; tests/validation/ fits it again and compares."""


@dataclass(frozen=True)
class PublishedMFU:
    """The best MFU a published bf16 run of a class reached: model FLOPs (no recomputation)
    over the bf16 peak."""

    mfu: float
    run: str


BEST_PUBLISHED_MFU: dict[tuple[str, bool], PublishedMFU] = {
    ("A100", False): PublishedMFU(0.604, "torchtitan: Llama 2 13B, no recomputation, "
                                         "64 x A100-80GB"),
    ("A100", True): PublishedMFU(0.532, "MosaicML: MPT 70B, 64 x A100-80GB"),
    ("H100", False): PublishedMFU(0.457, "MosaicML: MPT 7B, 128 x H100"),
    ("H100", True): PublishedMFU(0.433, "MosaicML: MPT 70B, 128 x H100"),
}
"""(GPU family, every block recomputed): the best MFU a published bf16 run of that class reached
(the validation wing's runs, each model's own FLOPs per token), frozen as the fit is. No default
plan goes above it (tests/validation/); H200 has only float8 runs published, the other rows
none."""


def best_published_mfu(gpu: GPU, full_recompute: bool) -> PublishedMFU | None:
    return BEST_PUBLISHED_MFU.get((gpu_family(gpu.name), full_recompute))

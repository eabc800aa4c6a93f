"""How far the calibrated step-time model was from the published FSDP runs of this trainer's kind
of software, by GPU family: planned over published throughput, the least and the most. The
report's step-time note prints them, so that a reader knows which way the plan errs.

The runs: torchtitan's Llama 3.1 8B (FSDP2, torch.compile, bf16 and float8 linears, 8 and 128
H100s; its benchmarks/llama3_h100_202412_torchtitan.md) and MosaicML's MPT 7B to 70B
(llm-foundry's benchmark tables at 5e85bd62: PyTorch FSDP FULL_SHARD, flash attention, 32-128
A100s and 128-512 H100s), each planned with its own model, GPUs, batch and micro-batch. No tensor
or pipeline parallelism in any of them.

Frozen figures, not computed here: the repository's validation/ wing plans those runs
(`python -m validation.published_runs`), its tests assert that these still equal what it
computes, and its dated reports record the table they come from. A change to the step-time
model that moves them fails that test until they are frozen again here.
"""

from __future__ import annotations

PLANNED_OVER_PUBLISHED: dict[str, tuple[float, float]] = {
    "A100": (1.14, 1.63),  # MPT on 32-128 A100-40GB and A100-80GB: 7 runs
    "H100": (1.23, 1.57),  # Llama 3.1 8B on 8 and 128 H100s (4 runs), MPT on 128-512 H100s (8)
}
"""(least, most) planned over published throughput of the runs on each GPU family."""
EVERY_FAMILY = (1.14, 1.63)
"""The same over all 19 runs: what a plan on a family none of them ran on is told."""


def planned_over_published(gpu_family: str) -> tuple[float, float, bool]:
    """(least, most, whether the runs were of `gpu_family`): the family's range ("A100",
    "H100"), else every run's."""
    if gpu_family in PLANNED_OVER_PUBLISHED:
        return (*PLANNED_OVER_PUBLISHED[gpu_family], True)
    return (*EVERY_FAMILY, False)

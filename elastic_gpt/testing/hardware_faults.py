"""Hardware faults injected into a real run, for the training-health tests and benchmarks: the
`health/faults.FaultInjection` a test hands to the Trainer (or, under Ray, puts in the workers'
loop config). Every run that is not a test's gets `health.faults.NoFaults`.

    HardwareFaults(FlippedBit(rank=1, step=40))               a faulty update: the top exponent
                                                              bit of rank 1's first parameter
                                                              value after step 40's update
    HardwareFaults(FlippedBit(1, 20, bit=3))                  a low mantissa bit: silent data
                                                              corruption, no spike follows
    HardwareFaults(FlippedBit(1, 41, in_gradient=True))       a faulty backward: a gradient rank 1
                                                              computes in step 41, before the
                                                              reduce-scatter
    HardwareFaults(FlippedBit(1, 40, every_pass=True),        a device that computes wrong every
                   WrongProbeAnswers(1, from_step=40))        time: each pass over step 40, and its
                                                              known answer from step 40 on

Each fault fires in the process of its rank; a one-off fires once per process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from elastic_gpt.parallel.gradient_checksum import flip_bit


@dataclass(frozen=True)
class FlippedBit:
    rank: int
    step: int
    """Steps done: after the update of this step (or, `in_gradient`, in the backward of it)."""
    bit: int | None = None
    """None: the top exponent bit (the value becomes huge or non-finite: a spike)."""
    in_gradient: bool = False
    every_pass: bool = False


@dataclass(frozen=True)
class WrongProbeAnswers:
    """The rank's device gives a wrong known answer (one bit off) from `from_step` on."""

    rank: int
    from_step: int


class HardwareFaults:
    """The faults of a run's ranks; `for_rank` is one rank's `FaultInjection`. Picklable: it
    travels to gloo ranks as an argument and to Ray workers in the loop config."""

    def __init__(self, *faults: FlippedBit | WrongProbeAnswers):
        self.faults = faults

    def for_rank(self, rank: int) -> RankFaults:
        return RankFaults([f for f in self.faults if f.rank == rank])


class RankFaults:
    def __init__(self, faults: list[FlippedBit | WrongProbeAnswers]):
        self._flips = [f for f in faults if isinstance(f, FlippedBit)]
        self._wrong_from = min((f.from_step for f in faults if isinstance(f, WrongProbeAnswers)),
                               default=None)

    def after_update(self, model: torch.nn.Module, step: int) -> None:
        for f in [f for f in self._flips if not f.in_gradient and f.step == step]:
            _flip_first_value(model, f.bit)
            if not f.every_pass:
                self._flips.remove(f)

    def corrupt_gradient(self, step: int) -> bool:
        due = [f for f in self._flips if f.in_gradient and f.step == step]
        for f in due:
            self._flips.remove(f)
        return bool(due)

    def probe_answer(self, answer: int, step: int) -> int:
        if self._wrong_from is not None and step >= self._wrong_from:
            return answer ^ 1
        return answer


def _flip_first_value(model: torch.nn.Module, bit: int | None) -> None:
    for p in model.parameters():
        t = (p.to_local() if isinstance(p, DTensor) else p).detach()
        if t.numel():
            flip_bit(t, bit)
            return

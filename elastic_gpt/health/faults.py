"""Where a test's injected hardware faults act, as a collaborator of the health checks that does
nothing unless a test hands one in (torchft hands its tests wrappers the same way, and keeps its
chaos tool apart from the training path).

The points, each where a real fault of that kind would act:

    after_update(model, step)       after the optimizer step of step `step`, before its
                                    checkpoint is written: a parameter bit flipped, as a faulty
                                    update would leave it
    corrupt_gradient(step) -> bool  before step `step` is trained: whether one gradient this
                                    rank computes in it comes out wrong (a faulty backward,
                                    before the reduce-scatter spreads it)
    probe_answer(answer, step)      the device probe's known answer as this rank's device gives
                                    it (a device that computes wrong)

A run gets `NoFaults`. A test builds the injector of `elastic_gpt/testing/hardware_faults.py`
and passes it to the Trainer, or, for workers under Ray, in the loop config (`for_rank`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class FaultInjection(Protocol):
    def after_update(self, model: torch.nn.Module, step: int) -> None: ...

    def corrupt_gradient(self, step: int) -> bool: ...

    def probe_answer(self, answer: int, step: int) -> int: ...


class NoFaults:
    """Every run's: nothing is injected. Holds no state, so one instance serves every rank."""

    def for_rank(self, rank: int) -> NoFaults:
        return self

    def after_update(self, model: torch.nn.Module, step: int) -> None:
        pass

    def corrupt_gradient(self, step: int) -> bool:
        return False

    def probe_answer(self, answer: int, step: int) -> int:
        return answer

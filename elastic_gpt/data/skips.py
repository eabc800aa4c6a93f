"""Steps of data a run skips, part of its record: C2 data order with the skips.

A rolled-back loss spike (health/recovery.py) leaves out the batches it blames: from then on, the
run's step t trains on the batch the unskipped order has at a later step, `data_step(t)`. A skip
is whole steps of the global batch, so the split of a step over ranks (C1 fixed global batch) is
untouched and every world size reads the same samples at the same step. The skips are written to
the checkpoint root's run record when they are made and travel in every later checkpoint, so a
restart, a resize or a resume reads the same order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Skip:
    from_step: int
    """The run's step (optimizer steps done) from which the order is moved on."""
    steps: int
    """Global batches left out there."""


@dataclass(frozen=True)
class DataSkips:
    """The run's skips, in the order they were made (each from a step at or after the last's)."""

    skips: tuple[Skip, ...] = ()

    @classmethod
    def from_list(cls, items: list[dict] | None) -> DataSkips:
        return cls(tuple(Skip(int(d["from_step"]), int(d["steps"])) for d in items or ()))

    def to_list(self) -> list[dict]:
        return [{"from_step": s.from_step, "steps": s.steps} for s in self.skips]

    def data_step(self, step: int) -> int:
        """The step of the unskipped order whose batch the run trains on at `step`."""
        return step + sum(s.steps for s in self.skips if step >= s.from_step)

    def add(self, from_step: int, steps: int) -> DataSkips:
        if steps < 1:
            raise ValueError(f"a skip leaves out at least one step, not {steps}")
        if self.skips and from_step < self.skips[-1].from_step:
            raise ValueError(f"a skip from step {from_step} is before the last one's, from step "
                             f"{self.skips[-1].from_step}")
        return DataSkips((*self.skips, Skip(from_step, steps)))

    def skipped_steps(self) -> int:
        return sum(s.steps for s in self.skips)

    def positions(self, index: int, global_batch_size: int) -> range:
        """Run positions of the unskipped order (data/order.py) that the index-th skip leaves
        out: the batches after those the skips made before it left out."""
        skip = self.skips[index]
        first = DataSkips(self.skips[:index]).data_step(skip.from_step)
        return range(first * global_batch_size, (first + skip.steps) * global_batch_size)

    def __bool__(self) -> bool:
        return bool(self.skips)

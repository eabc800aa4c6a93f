"""Naming the rank whose hardware made a spike: each rank's exact checksums of its own work at
every step, kept for a first run and for its re-run, and the rank whose work differs first.

Training is deterministic on the same ranks (C3 bit-identical resume), so a re-run from a
checkpoint repeats every bit of the first run unless a device computed wrong. Each rank keeps,
for the steps a rollback can reach, an exact checksum of its parameter shard before each step and
of the gradients it computed in each step before FSDP's reduce-scatter spreads them over every
shard (parallel/gradient_checksum.py). The rank whose checksum differs first between the two runs
did the faulty work: a fault in a rank's weights or its update shows on its weights first, a fault
in its forward or backward on its gradients first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_gpt.parallel import gradient_checksum
from elastic_gpt.parallel.gradient_checksum import bit_sum


def shard_checksum(model: torch.nn.Module) -> torch.Tensor:
    """An exact checksum of this rank's parameter shard, on its device (no host sync): the sum
    of the values' bit patterns as integers, so a single flipped bit anywhere changes it."""
    total = None
    for p in model.parameters():
        t = (p.to_local() if isinstance(p, DTensor) else p).detach()
        if t.numel() == 0:
            continue
        s = bit_sum(t)
        total = s if total is None else total + s
    return total if total is not None else torch.zeros((), dtype=torch.int64)


class RerunAttribution:
    """One rank's books: step -> checksum of its weights and of its gradients, for the first run
    and for the re-run in progress, `keep_steps` steps back."""

    def __init__(self, *, rank: int, world_size: int, keep_steps: int):
        self.rank, self.world_size, self.keep_steps = rank, world_size, keep_steps
        self.weights: dict[int, torch.Tensor] = {}
        self.gradients: dict[int, torch.Tensor] = {}
        self._rerun_weights: dict[int, torch.Tensor] = {}
        self._rerun_gradients: dict[int, torch.Tensor] = {}
        self._grad_sums: gradient_checksum.GradientChecksum | None = None
        self._installed = False

    def start_rerun(self) -> None:
        self._rerun_weights, self._rerun_gradients = {}, {}

    def before_step(self, model: torch.nn.Module, step: int, *, rerun: bool,
                    corrupt_gradient: bool = False) -> torch.Tensor:
        """Before the forward of the step after `step` steps: this rank's shard checksum, kept.
        `corrupt_gradient`: a test's injected fault, one gradient of this step computed wrong."""
        value = shard_checksum(model)
        book = self._rerun_weights if rerun else self.weights
        book[step] = value
        _trim(book, step - self.keep_steps)
        if not self._installed:
            self._installed = True
            self._grad_sums = gradient_checksum.install(model)
        if self._grad_sums is not None:
            self._grad_sums.take()  # an attempt not committed left its sums: this one's own
            if corrupt_gradient:
                self._grad_sums.corrupt_next()
        return value

    def after_step(self, step: int, *, rerun: bool) -> None:
        """After committed step `step`: the checksum of the gradients this rank computed in it."""
        if self._grad_sums is None:
            return
        value = self._grad_sums.take()
        if value is not None:
            book = self._rerun_gradients if rerun else self.gradients
            book[step] = value
            _trim(book, step - self.keep_steps)

    def first_diverged_ranks(self, start: int, end: int) -> list[int]:
        """Collective: the ranks whose own work first differs between the first run and the
        re-run of steps start+1..end+1, unless every rank's does at once (then no single one). In
        the order things happen: the weights after step s (s = start..end), then the gradients
        each rank computed in step s + 1 from them, then the weights after s + 1."""
        books = ((self.weights, self._rerun_weights, 0, end),
                 (self.gradients, self._rerun_gradients, -1, end + 1))
        never = 2 * (end + 1)
        mine = never
        for s in range(start, end + 2):
            for first_run, rerun, offset, last in books:
                a, b = (first_run.get(s), rerun.get(s)) if s <= last else (None, None)
                if a is not None and b is not None and int(a) != int(b):
                    mine = min(mine, 2 * s + offset)
        first = torch.full((self.world_size,), 0, dtype=torch.int64)
        first[self.rank] = mine
        if dist.is_initialized() and self.world_size > 1:
            device = next(iter(self.weights.values()), first).device
            first = first.to(device)
            dist.all_reduce(first)
        first = first.tolist()
        # The re-run's checksums are the trajectory's now.
        for first_run, rerun, _, _ in books:
            first_run.update(rerun)
            rerun.clear()
        earliest = min(first)
        culprits = [r for r, s in enumerate(first) if s == earliest]
        return [] if earliest == never or len(culprits) == self.world_size else culprits


def _trim(book: dict[int, object], before: int) -> None:
    """Drop a per-step book's entries older than `before` (steps are added in order, so the
    oldest come first: this stops at the first kept one)."""
    while book:
        oldest = next(iter(book))
        if oldest >= before:
            return
        del book[oldest]

"""One reader per tensor-parallel group: its first rank reads the step's batch, the others receive
it over the group's own communicator.

The ranks of a tensor-parallel group are one data-parallel rank: they train on the same samples.
Reading them once per group, as Megatron-LM's `broadcast_data` does, divides the group's object
store requests and bytes by tp, and the broadcast travels over the fastest link there is (the
group sits inside one node; NVLink on GPUs). The broadcast is of device tensors and needs no host
sync: the receivers learn nothing from it that the host must read (the step's data fingerprint
is counted by the reading rank alone, as the trainer's metrics all-reduce already does).

A read that fails fails the reading rank, whose error ends the group (Ray Train stops every
worker of a group when one raises); the receivers wait in the broadcast meanwhile, bounded by
the collective timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_gpt.data.order import BatchSplit
from elastic_gpt.data.stream import StepBatch


class GroupBroadcastBatches:
    """The `StepStream` interface for every rank of one tensor-parallel group. `source` is the
    group's first rank's stream (None on the others); batches are broadcast from it."""

    def __init__(self, source, *, group, batch_split: BatchSplit, batch_rank: int,
                 batch_degree: int, record_tokens: int, start_step: int, device: torch.device):
        self.source, self.group, self.device = source, group, device
        self.src = dist.get_global_rank(group, 0)
        self.next_step = start_step
        self.slots = batch_split.slots(batch_degree)
        n_real = len(batch_split.rank_micro_batches(batch_rank, batch_degree))
        self.real_shape = (n_real, batch_split.micro_batch_size, record_tokens)
        self.weights = [1.0] * n_real + [0.0] * (self.slots - n_real)

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        if self.source is not None:
            batch = next(self.source)
            assert batch.step == self.next_step, (batch.step, self.next_step)
            # The batch as assembled, page-locked on a GPU run: the copy to the device is an
            # async DMA straight from it. Stacking the slots would copy it into pageable memory.
            real = batch.real_tokens.to(self.device, non_blocking=True)
            fingerprint = batch.fingerprint
        else:
            real = torch.empty(self.real_shape, dtype=torch.int64, device=self.device)
            fingerprint = 0  # counted once per group, by the reading rank
        dist.broadcast(real, src=self.src, group=self.group)
        tokens = list(real.unbind(0))
        # Every rank pads its own slots, as assemble_step does: the repeats need no broadcast.
        tokens += [tokens[-1]] * (self.slots - len(tokens))
        step, self.next_step = self.next_step, self.next_step + 1
        return StepBatch(step=step, tokens=tokens, weights=list(self.weights),
                         fingerprint=fingerprint, real_tokens=real)

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read if self.source is not None else 0

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""Each rank's exact checksum of the gradients it computed, taken before FSDP reduce-scatters them.

The re-run attribution (health/recovery.py) blames the rank whose state first differs between a run
and its re-run. A fault in one rank's backward (or in the forward before it) reaches the others
through the reduce-scatter: each element of the corrupted gradient lands in the shard of the rank
that owns it, so the parameter checksums would first differ on that owner, not on the rank that
computed it. The reduce-scatter's input is the last place a rank's own work is its own: FSDP2 lets
a module's reduce-scatter be replaced (`FSDPModule.set_custom_reduce_scatter`), and this one adds
the bit patterns of its input to a running sum on the device (no host sync: on the reduce-scatter
stream, ordered before the collective) and then reduce-scatters as FSDP's default does.
"""

from __future__ import annotations

import logging

import torch

from elastic_gpt.torch_internals import DefaultReduceScatter

log = logging.getLogger(__name__)

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's values' bit patterns as integers (int64, on its device): exact, and
    changed by any single flipped bit."""
    return t.reshape(-1).view(_BITS[t.element_size()]).sum(dtype=torch.int64)


def flip_bit(t: torch.Tensor, bit: int | None = None) -> None:
    """The injected hardware fault of the tests: one bit (None: the top exponent bit) of a
    tensor's first value, in place."""
    bits = t.reshape(-1).view(_BITS[t.element_size()])
    with torch.no_grad():
        bits[0] ^= 1 << (8 * t.element_size() - 2 if bit is None else bit)


class GradientChecksum(DefaultReduceScatter):
    """One rank's reduce-scatter for every FSDP module of its model: the checksum of what it
    sends, summed over a step's reduce-scatters (`take`)."""

    def __init__(self):
        super().__init__()
        self._total: torch.Tensor | None = None
        self._flip = False

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if self._flip:
            self._flip = False
            flip_bit(input_tensor)
        value = bit_sum(input_tensor)
        self._total = value if self._total is None else self._total + value
        return super().__call__(output_tensor, input_tensor, group, op, async_op)

    def take(self) -> torch.Tensor | None:
        """The checksum of everything reduce-scattered since the last call (None: nothing)."""
        total, self._total = self._total, None
        return total

    def corrupt_next(self) -> None:
        """Tests: flip the top exponent bit of the next reduce-scatter's first input value, as a
        faulty device computing that gradient would."""
        self._flip = True


def install(model: torch.nn.Module) -> GradientChecksum | None:
    """Route every FSDP module's reduce-scatter through one `GradientChecksum`; None when the
    model has none (one rank, or no FSDP: nothing is reduce-scattered)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None
    comm = GradientChecksum()
    for m in modules:
        try:
            m.set_custom_reduce_scatter(comm)
        except ValueError as e:  # parameters on several meshes: FSDP keeps its own
            log.warning("gradients of %s not checksummed: %s", type(m).__name__, e)
    return comm

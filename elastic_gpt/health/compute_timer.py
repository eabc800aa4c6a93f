"""How long this rank computes in the step it runs, with no wait for its peers in it: what the
straggler detector (health/stragglers.py) compares across ranks.

A rank's step time cannot tell a slow rank from its peers: every rank waits for the slowest in
FSDP's all-gathers and reduce-scatters, so all step times come out equal. The time a rank spends
*computing* does differ. So each FSDP unit of the model (a transformer block: the units that hold
no other unit) is timed from the moment FSDP has its weights gathered to the end of its forward,
and from the moment FSDP has them gathered again for backward to the moment the gradient of its
input is done, before FSDP's reduce-scatter. FSDP's waits for its peers fall outside those
sections by the order of the hooks: FSDP's pre-forward hook (where it waits for the all-gather)
runs before the one here, its pre-backward hook (the same wait) is registered on the block's
output before the one here, and its post-backward (the reduce-scatter) is an autograd node after
the gradient of the block's input.

On a GPU each section is a pair of CUDA events on the compute stream, so what is timed is the
device's own work on the block's kernels, as NVIDIA's resiliency extension scores GPUs by their
kernels' durations; the events are read at the step's end, when the step's host sync has already
waited for them. On a CPU a section is its wall time: a process starved by a noisy neighbour, a
throttled core or a stopped process computes slower, and the section shows it.

Not timed: the embeddings, the final norm and the loss (the same share of every rank's work), and
anything outside the model. Under tensor parallelism a block's own collectives are inside its
section: a slow rank slows its tensor-parallel peers' sections too, and the detector then names
the whole group, which is one node. Activation checkpointing's recompute runs inside the
backward section and is counted once.
"""

from __future__ import annotations

import time

import torch


def compute_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units that hold no other unit (the transformer blocks), in module order; [] for
    a model that FSDP did not shard."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return [u for u in units
            if not any(isinstance(m, FSDPModule) for m in u.modules() if m is not u)]


class ComputeTimer:
    """This rank's compute per step. `begin_step()` before the step's forward, `end_step()` after
    its backward (and its host sync): the seconds the step's sections took. Forwards outside a
    step (an evaluation) are timed too and dropped by the next `begin_step()`."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.units = compute_units(model)
        self._handles = []
        self._open = 0  # sections open now (a recompute inside a backward is not a new one)
        self._since = 0.0
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start_event: torch.cuda.Event | None = None
        self._ends_backward = False
        for unit in self.units:
            # After FSDP's own hooks: its pre-forward (prepended) waits for the all-gather first,
            # and its post-forward registers its pre-backward wait on the output first.
            self._handles.append(unit.register_forward_pre_hook(self._forward_begins))
            self._handles.append(unit.register_forward_hook(self._forward_ends))

    @property
    def active(self) -> bool:
        return bool(self.units)

    def begin_step(self) -> None:
        self._open, self._seconds, self._events, self._start_event = 0, 0.0, [], None

    def end_step(self) -> float:
        """The step's compute seconds (its sections' sum)."""
        if self.cuda:
            seconds = 0.0
            for start, end in self._events:
                end.synchronize()  # done already: the step's host sync waited for its kernels
                seconds += start.elapsed_time(end) / 1e3
            self._events = []
            return seconds
        return self._seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- the sections ---------------------------------------------------------------------

    def _begin(self) -> None:
        self._open += 1
        if self._open > 1:
            return
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._since = time.perf_counter()

    def _end(self) -> None:
        if self._open == 0:
            return
        self._open -= 1
        if self._open:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start_event, end))
        else:
            self._seconds += time.perf_counter() - self._since

    def _forward_begins(self, module, args):
        self._begin()
        self._ends_backward = False
        if torch.is_grad_enabled() and self._open == 1:
            # The backward section ends when the gradient of the unit's input is done: before
            # FSDP's post-backward node, which takes it next and reduce-scatters.
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if inputs:
                inputs[0].register_hook(self._backward_ends)
                self._ends_backward = True

    def _forward_ends(self, module, args, output):
        if self._open == 1 and self._ends_backward:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            first = next((o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad),
                         None)
            if first is not None:
                # After FSDP's pre-backward hook on the same tensor (registered in its
                # post-forward, which ran before this one): that hook waits for the all-gather.
                first.register_hook(self._backward_begins)
        self._end()

    def _backward_begins(self, grad):
        self._begin()
        return None

    def _backward_ends(self, grad):
        self._end()
        return None

"""Two bounds on a collective: a long one while an attempt starts, a short one once it steps.

A collective that waits longer than its process group's timeout fails the rank, which is how a
hung or vanished peer becomes a failure the controller restarts from. One bound cannot serve
both phases: an attempt's start waits legitimately for minutes at scale (communicators of
thousands of ranks, the first compile, the checkpoint read, the first checkpoint write with its
planning), while a steady step of a healthy run never waits more than seconds, so the start's
bound would leave a hung step undetected for as long. torchtitan sets a long `init_timeout_seconds`
and, after the first step, a short `train_timeout_seconds` the same way.
"""

from __future__ import annotations

from elastic_gpt.torch_internals import set_collective_timeout


class CollectiveTimeouts:
    """`startup_s` from the process group's creation (what it was made with) until the attempt's
    first step is done, and around its first checkpoint; `steady_s` for every other step."""

    def __init__(self, startup_s: float, steady_s: float):
        self.startup_s, self.steady_s = startup_s, steady_s
        self.current = startup_s
        self.saved = False

    def _set(self, seconds: float) -> None:
        if seconds != self.current:
            set_collective_timeout(seconds)
            self.current = seconds

    def step_done(self) -> None:
        self._set(self.steady_s)

    def before_save(self) -> None:
        """Until the attempt's first checkpoint is written, each save may be its first."""
        if not self.saved:
            self._set(self.startup_s)

    def after_save(self, saved: bool) -> None:
        self.saved = self.saved or saved
        self._set(self.steady_s)

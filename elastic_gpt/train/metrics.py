"""What the loop reports of each step, and of an attempt's start: tokens per second and MFU, the
step's metrics for the metric sink (C5 one MLflow run: one step numbering everywhere), the
progress line, and the time an attempt took to reach its first step, by part.

The loop hands over what it measured; everything computed from it, and where it goes, is here
(torchtitan's `MetricsProcessor` has the same role).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic_gpt.console import say
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.train.run_lines import progress_line

STARTUP_METRICS = {"controller_s": mn.STARTUP_CONTROLLER_S, "placement_s": mn.STARTUP_PLACEMENT_S,
                   "worker_start_s": mn.STARTUP_WORKER_START_S, "build_s": mn.STARTUP_BUILD_S,
                   "checkpoint_read_s": mn.STARTUP_CHECKPOINT_READ_S,
                   "to_first_step_s": mn.STARTUP_TO_FIRST_STEP_S}
"""An attempt's start by part, in order, and their metrics."""


def startup_breakdown(recovery: dict | None, startup: dict[str, float], started: float,
                      first_step_at: float) -> dict[str, float]:
    """An attempt's start by part, in order, from the marks its worker left in `startup`
    (elastic/worker.py; absent under a plain process group, where only the Trainer's parts are
    known):

        controller_s       the failure or restart request (`recovery["at"]`) to the group sized
                           (`planned_at`, the scaling policy's record)
        placement_s        its placement group made (the GCS's own timing)
        worker_start_s     to the Trainer's construction (`started`): the worker actors, their
                           imports, the process group, the ranks' node ids
        build_s            the Trainer's construction (`built_s`: data, mesh, model, optimizer)
        checkpoint_read_s  the restore
        to_first_step_s    the rest, to the first step's start

    Detection, the fault to the failure's record, is not known here (when a node was lost is
    known only to whoever lost it): bench/bench_node_loss.py measures it."""
    parts: dict[str, float] = {}
    planned = startup.get("planned_at")
    if planned is not None:
        if recovery and recovery.get("at") and planned >= recovery["at"]:
            parts["controller_s"] = planned - recovery["at"]
        if "placement_s" in startup:
            parts["placement_s"] = startup["placement_s"]
        parts["worker_start_s"] = max(0.0, started - planned - parts.get("placement_s", 0.0))
    if "built_s" in startup:
        parts["build_s"] = startup["built_s"]
    parts["checkpoint_read_s"] = startup["checkpoint_read_s"]
    parts["to_first_step_s"] = max(0.0, first_step_at - started - startup.get("built_s", 0.0)
                                   - startup["checkpoint_read_s"])
    return parts


def startup_line(parts: dict[str, float]) -> str:
    return ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {seconds:.1f} s"
                     for name, seconds in parts.items())


class TrainingMetrics:
    """Rank 0 of the group leading a step speaks (`speaks()`); every rank logs to its sink (a
    do-nothing one except on rank 0 of a tracked run)."""

    def __init__(self, sink, *, rank: int, max_steps: int, log_every: int, global_batch_size: int,
                 seq_len: int, flops_per_token: float, peak_flops: float, model_parallel: int,
                 data, order, speaks: Callable[[], bool]):
        """`peak_flops`: one worker's; `model_parallel`: the workers one data-parallel rank's
        model spans (tp x pp); `data` and `order`: the training data and its sample order (a
        mixture's samples are counted per source)."""
        self.sink, self.rank = sink, rank
        self.max_steps, self.log_every = max_steps, log_every
        self.global_batch_size = global_batch_size
        self.tokens_per_step = global_batch_size * seq_len
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.model_parallel, self.data, self.order, self.speaks = (model_parallel, data, order,
                                                                   speaks)
        self._startup: dict[str, float] = {}
        self._first = False  # the next step is an attempt's first

    def first_step(self, step: int, recovery: dict | None, startup: dict[str, float],
                   started: float) -> None:
        """At an attempt's first step: the recovery it ends (a resume's event, rank 0) and the
        attempt's start by part (`startup_breakdown`); both go with this step's metrics, and the
        first step's own time with the next call's."""
        if recovery and self.rank == 0:
            self.sink.log({mn.EVENT_RECOVERY_S: recovery["recovery_s"],
                           mn.EVENT_LOST_STEPS: recovery["lost_steps"]}, step)
        now = time.time()
        parts = startup_breakdown(recovery, startup, started, now)
        if self.rank == 0:
            say(f"[elastic-gpt] first step {now - started:.1f} s after the Trainer's start "
                f"(weight init {startup['init_s']:.1f} s, checkpoint read "
                f"{startup['checkpoint_read_s']:.1f} s)"
                + (f"; the attempt's start: {startup_line(parts)}" if parts else ""))
        self._startup = {mn.STARTUP_S: now - started, mn.STARTUP_INIT_S: startup["init_s"],
                         mn.STARTUP_CHECKPOINT_READ_S: startup["checkpoint_read_s"],
                         **{STARTUP_METRICS[k]: v for k, v in parts.items()}}
        self._first = True

    def step(self, step: int, result, *, step_time: float, data_wait: float, world_size: int,
             batch_degree: int, micro_batches: int) -> dict:
        """After committed step `step` (optimizer steps done, as the console and the checkpoint
        folders number it): its metrics, logged and returned. `batch_degree`: the data-parallel
        ranks the step's batch was split over (with replica groups every live group's, C7
        all-or-nothing step); `micro_batches`: per rank."""
        tokens_per_s = self.tokens_per_step / step_time
        samples_seen = step * self.global_batch_size
        metrics = {
            mn.TRAIN_LOSS: result.loss, mn.TRAIN_LR: result.metrics["lr"],
            mn.TRAIN_GRAD_NORM: result.grad_norm, mn.TRAIN_TOKENS_PER_S: tokens_per_s,
            mn.TRAIN_MFU: tokens_per_s * self.flops_per_token /
            (self.peak_flops * batch_degree * self.model_parallel),
            mn.TRAIN_WORLD_SIZE: world_size, mn.TRAIN_GRAD_ACCUM: micro_batches,
            mn.TRAIN_SAMPLES_SEEN: samples_seen, mn.TRAIN_STEP_TIME_S: step_time,
            mn.DATA_WAIT_S: data_wait, mn.DATA_FINGERPRINT: result.fingerprint, **self._startup,
        }
        if self._first:
            metrics[mn.STARTUP_FIRST_STEP_S] = step_time
        self._startup, self._first = {}, False
        if self.data.is_mixture and self.rank == 0:
            counts = self.order.source_counts(samples_seen)
            for source, count in zip(self.data.sources, counts):
                metrics[mn.source_samples_seen(source.name)] = count
        self.sink.log(metrics, step)
        # One line every log_every steps from the step after the first, and at the last one.
        if self.rank == 0 and self.speaks() and ((step - 1) % self.log_every == 0
                                                 or step == self.max_steps):
            say(progress_line(step, self.max_steps, metrics))
        return metrics

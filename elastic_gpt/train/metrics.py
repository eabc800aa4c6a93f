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

    def first_step(self, step: int, recovery: dict | None, startup: dict[str, float],
                   started: float) -> None:
        """At an attempt's first step: the recovery it ends (a resume's event, rank 0) and the
        time from the Trainer's start to here, by part; both go with this step's metrics."""
        if recovery and self.rank == 0:
            self.sink.log({mn.EVENT_RECOVERY_S: recovery["recovery_s"],
                           mn.EVENT_LOST_STEPS: recovery["lost_steps"]}, step)
        total = time.time() - started
        if self.rank == 0:
            say(f"[elastic-gpt] first step {total:.1f} s after start: weight init "
                f"{startup['init_s']:.1f} s, checkpoint read {startup['checkpoint_read_s']:.1f} "
                f"s, the rest {total - startup['init_s'] - startup['checkpoint_read_s']:.1f} s")
        self._startup = {mn.STARTUP_S: total, mn.STARTUP_INIT_S: startup["init_s"],
                         mn.STARTUP_CHECKPOINT_READ_S: startup["checkpoint_read_s"]}

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
        self._startup = {}
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

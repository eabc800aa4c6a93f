"""One optimizer step of one rank, on the device: the step's micro-batches forward and backward (or
the pipeline schedule over them), the gradients reduced over the live replica groups and
clipped, the step's statistics all-reduced, and the optimizer stepped unless the loss or the
gradient is not finite. Nothing here reads a value back to the host: the Trainer makes the step's
one host read of what `run` returns, and the dry run (elastic_gpt/dry_run/) runs the same code
on fake tensors, where no value exists to read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_gpt.config import Config
from elastic_gpt.data.fingerprint import split_fingerprint
from elastic_gpt.parallel.pipeline import Pipeline
from elastic_gpt.parallel.tensor import summed_token_loss
from elastic_gpt.train.layout import RunLayout
from elastic_gpt.train.optimizer import nonfinite_flag, step_unless
from elastic_gpt.train.schedule import lr_at


@dataclass
class DeviceStep:
    """What one step leaves on the device for the host to read at once."""

    stats: torch.Tensor
    """float64 [loss sum, fingerprint low, fingerprint high, stop flag, gradient norm, skipped]:
    summed over the group (and the live replica groups), then the norm and the skip flag."""
    committed: bool
    lr: float


class TrainStep:
    """The step of one rank of a group (`layout`), whose model, pipeline and optimizer are built.
    `fault_tolerance`: the mode (train/fault_tolerance.py); `stop_requested()`: whether the
    group must checkpoint and restart, carried to every rank in the step's all-reduce."""

    def __init__(self, cfg: Config, layout: RunLayout, *, model: torch.nn.Module,
                 pipeline: Pipeline | None, optimizer: torch.optim.Optimizer, seq_len: int,
                 tp_rank: int, fault_tolerance, stop_requested=lambda: False):
        self.cfg, self.layout = cfg, layout
        self.model, self.pipeline, self.optimizer = model, pipeline, optimizer
        self.seq_len, self.tp_rank = seq_len, tp_rank
        self.fault_tolerance, self.stop_requested = fault_tolerance, stop_requested
        self.device, self.dims = layout.device, layout.dims

    def prepare(self, batch_degree: int) -> None:
        """The pipeline's schedule for the step's split: its micro-batches per rank, the loss
        scaled as `forward_backward` scales it. With replica groups the split is over every live
        group's data-parallel ranks: a quorum that changes it makes a new one."""
        if self.pipeline is not None:
            split = self.layout.batch_split
            self.pipeline.prepare(split.slots(batch_degree), split.micro_batch_size,
                                  batch_degree / (split.global_batch_size * self.seq_len),
                                  self.device, self.layout.compute_dtype,
                                  self.dims.loss_parallel)

    def dropout_seed(self, step: int, micro_batch: int) -> int:
        """Dropout RNG from (seed, step, micro-batch): identical masks at any data-parallel
        degree. Under tensor parallelism every dropout runs on this rank's share (its sequence
        positions or its heads), so the rank is part of the seed: masks are independent across
        the shares and the same at any dp for one tp, not across tp degrees."""
        key = (self.cfg.train.seed, step, micro_batch)
        if self.dims.tp_enabled:
            key += (self.tp_rank,)
        return hash(key) & 0x7FFF_FFFF

    def forward_backward(self, batch, step: int, batch_rank: int,
                         batch_degree: int) -> torch.Tensor:
        """Accumulate this rank's gradients for one step; returns its summed token loss."""
        split, T = self.layout.batch_split, self.seq_len
        global_tokens = split.global_batch_size * T
        if self.pipeline is not None:  # one schedule for the step's micro-batches
            torch.manual_seed(self.dropout_seed(step, 0))
            return self.pipeline.forward_backward(batch.tokens, batch.weights, T,
                                                  self.layout.compute_dtype,
                                                  self.dims.loss_parallel, self.device)
        slots = len(batch.tokens)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        first_mb = split.rank_micro_batches(batch_rank, batch_degree).start
        memory = self.layout.memory
        for k, (tokens, weight) in enumerate(zip(batch.tokens, batch.weights)):
            tokens = tokens.to(self.device, non_blocking=True)
            x, y = tokens[:, :T], tokens[:, 1:T + 1]
            last = k == slots - 1
            # grad_sync=step: only the last backward reduce-scatters (one sync per step).
            self.model.set_requires_gradient_sync(last or memory.grad_sync == "microbatch")
            if not memory.reshard_after_forward:
                # The gathered weights live through each forward and backward already, so keeping
                # them between micro-batches adds no peak memory and saves one all-gather per
                # micro-batch; the last backward frees them before the optimizer step. (A forward
                # without backward, e.g. an evaluation, must call model.reshard() after it, or the
                # next step would compute with weights gathered before the optimizer step.)
                self.model.set_reshard_after_backward(last)
            torch.manual_seed(self.dropout_seed(step, first_mb + k))
            # No rank holds the (B, T, vocab) logits in fp32: the loss upcasts them chunk by
            # chunk, or under tensor parallelism runs on logits sharded over the vocabulary (the
            # loss and its backward run on the shards, and come out replicated).
            with summed_token_loss(self.model, x, y, compute_dtype=self.layout.compute_dtype,
                                   vocab_sharded=self.dims.loss_parallel) as summed:
                # Each rank's loss is its share of the mean over exactly G*T tokens. FSDP averages
                # gradients over the data-parallel ranks, so scaling by their number makes the
                # reduction a sum: the gradient is the mean over exactly G sequences at any
                # data-parallel degree, even with uneven micro-batches (C1 fixed global batch).
                # Across replica groups the degree is all live groups' ranks, and the cross-group
                # mean turns back into a sum the same way.
                (summed * (weight * batch_degree / global_tokens)).backward()
            if isinstance(summed, DTensor):
                summed = summed.to_local()
            loss_sum += summed.detach().double() * weight
        return loss_sum

    def clip_gradients(self) -> torch.Tensor:
        """Collective. Clip to train.grad_clip; returns the norm of the whole gradient. Every
        gradient is a DTensor on the data- (and tensor-) parallel mesh, so the norm is reduced
        over all of them, each element counted once, whatever the layout."""
        clip = self.cfg.train.grad_clip
        if self.pipeline is not None:  # over every stage, the tied embedding counted once
            return self.pipeline.clip_grad_norm(clip if clip > 0 else math.inf)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else math.inf, foreach=True)
        return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm

    def run(self, batch, step: int, batch_rank: int, batch_degree: int) -> DeviceStep:
        """Collective: the step after `step` steps, on the device."""
        t = self.cfg.train
        lr = lr_at(step, lr=t.lr, min_lr=t.min_lr if t.min_lr is not None else t.lr / 10,
                   warmup_steps=t.warmup_steps, max_steps=t.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = self.forward_backward(batch, step, batch_rank, batch_degree)
        self.fault_tolerance.reduce_gradients()  # over the live replica groups, if any
        grad_norm = self.clip_gradients()
        # One collective and one host read per step for the metrics, not one per micro-batch.
        lo, hi = split_fingerprint(batch.fingerprint)
        # The membership flag rides on the same all-reduce: every rank learns at the same step
        # boundary that the group must checkpoint and restart.
        stop = 1.0 if self.stop_requested() else 0.0
        # The tp ranks of a group hold the same loss and read the same samples: one counts them;
        # of a pipeline's stages, the last holds the loss and the first counts the samples.
        if self.tp_rank or (self.pipeline and not self.pipeline.first):
            lo = hi = 0
        if self.tp_rank or (self.pipeline and not self.pipeline.last):
            loss_sum = torch.zeros_like(loss_sum)
        stats = torch.tensor([0.0, lo, hi, stop], dtype=torch.float64, device=self.device)
        stats[0] = loss_sum
        dist.all_reduce(stats)
        self.fault_tolerance.reduce_stats(stats)  # over the live replica groups, if any
        # A non-finite loss or gradient skips the step, decided on the device from values every
        # rank holds alike (the reduced loss and norm), so every rank (and replica group) skips
        # it together, and the optimizer is launched before the host read: on a GPU the step's
        # kernels queue behind the backward instead of waiting for the host.
        found_inf = nonfinite_flag(stats[0], grad_norm)
        # C7 all-or-nothing step: the step is applied by every live replica group or by none (then
        # re-done). The restart path's answer is always yes, without a sync; torchft's vote waits
        # for the device and the other groups, so with replica groups it comes first.
        committed = self.fault_tolerance.should_commit(step, stats)
        if committed:
            step_unless(self.optimizer, found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        return DeviceStep(torch.cat([stats, grad_norm.detach().to(stats).reshape(1),
                                     found_inf.to(stats).reshape(1)]), committed, lr)

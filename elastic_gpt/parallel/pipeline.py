"""Pipeline parallelism: a decoder's layers split into stages over the `pp` ranks of a mesh, run
by `torch.distributed.pipelining`'s schedules (1F1B; interleaved 1F1B with several stages per
rank).

The model is cut into `pp x stages_per_rank` contiguous stages (cost_model/pipeline.py's
`stage_layers`, balanced by each part's forward FLOPs): the first holds the family's embedding
modules (model/families.py: GPT-2's token and position embeddings, Llama's token embedding),
the last its head (the final norm and the output layer) and the loss, every stage a run of
blocks. Rank r holds stages r, r + pp, ... (torchtitan's and Megatron's loop order), so one
micro-batch visits every rank once per loop.

A stage (`Stage`) is made of the very modules of a model built on "meta", under the names they
have in the whole model ("h.7.attn.c_attn.weight"), so the sharded checkpoint of any layout holds
the same keys as the unpipelined one, and resumes at any other (pp, tp, dp) and exports to
Hugging Face.

A tied output layer (GPT-2's, Llama's when tied) is the token embedding. The first and the last
stage then each hold `wte`: the first looks tokens up in it, the last multiplies by it. Both
start from the same values (the same init or checkpoint) and take the same update, because after
the backward their gradients are summed over the pair of ranks holding them (`TiedEmbedding`,
Megatron's embedding group), so they stay equal; the gradient norm counts that weight once
(`clip_grad_norm`). An untied output layer is the last stage's own weight.

The loss on the last stage is the summed cross-entropy of the micro-batch's logits, scaled by
the caller (the step's share of the mean over exactly G sequences, C1), so the schedule must not
scale the gradients again (`scale_grads=False`).

Nothing here knows about Ray or the Trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from elastic_gpt.cost_model.pipeline import PipelineLayoutError, rank_stages, stage_layers
from elastic_gpt.model.families import spec_of
from elastic_gpt.model.gpt import Decoder, plain_name, token_losses

SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
IGNORED = -100
"""The target of a padding row: cross-entropy's ignore_index, no loss and no gradient."""
"""`parallel.pp_schedule`: one stage per rank, or several (virtual stages, a smaller bubble)."""


class Stage(nn.Module):
    """Stage `index` of `num_stages` of `model` (a decoder built on "meta"): its modules, under
    the names they have in the whole model. forward: token ids (the first stage) or hidden
    states -> hidden states, or on the last stage the logits (B, T, vocab)."""

    def __init__(self, model: Decoder, index: int, num_stages: int, layers: range):
        super().__init__()
        self.cfg = model.cfg
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.layers = layers
        self.__dict__["runtime"] = None  # torch's PipelineStage, once a schedule is built
        self.__dict__["_whole"] = model  # its class's embedding and init, not a submodule
        spec = spec_of(model.cfg)
        self.tied = spec.tied(model.cfg)
        full = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        before = spec.first_stage(model.cfg) if self.first else ()
        after = spec.last_stage(model.cfg) if self.last else ()
        if self.holds_tied_embedding:
            self.wte = model.wte  # first, as in the whole model
        for name in before:
            setattr(self, name, getattr(model, name))
        self.h = nn.ModuleDict({str(i): model.h[i] for i in layers})
        for name in after:  # a tied lm_head reads wte's weight, held above
            if not hasattr(self, name):
                setattr(self, name, getattr(model, name))
        self._index_in_gpt = {name: full[name] for name, _ in self.named_parameters()}

    def parameter_index(self, name: str) -> int:
        """The parameter's position in the whole model: what its initial value is drawn from."""
        return self._index_in_gpt[plain_name(name)]

    def initial_value(self, *args, **kwargs) -> torch.Tensor:
        """The whole model's init, by name and position."""
        return self._whole.initial_value(*args, **kwargs)

    @property
    def holds_tied_embedding(self) -> bool:
        return self.tied and (self.first or self.last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            T = x.size(1)
            if T > self.cfg.seq_len:
                raise ValueError(f"sequence of {T} tokens is longer than model.seq_len="
                                 f"{self.cfg.seq_len}")
            x = type(self._whole).embed(self, x)  # the family's embedding, on this stage's modules
        for block in self.h.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_model(model: Decoder, pp_rank: int, pp: int, stages_per_rank: int) -> list[Stage]:
    """This pipeline rank's stages of `model` (on "meta"; the rest of the model is dropped)."""
    num_stages = pp * stages_per_rank
    layers = stage_layers(model.cfg, num_stages)
    return [Stage(model, i, num_stages, layers[i])
            for i in rank_stages(pp_rank, pp, stages_per_rank)]


def summed_loss(scale: float):
    """The last stage's loss of one micro-batch: its summed cross-entropy times `scale` (the
    caller's share of the step's mean)."""
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_losses(logits, targets) * scale
    return loss_fn


@dataclass(frozen=True)
class StageIO:
    """What crosses a stage boundary, given to torch's stages up front (static metadata: no shapes
    exchanged at the first step, no buffers sized from what arrives): a micro-batch of `rows`
    sequences of `seq_len` tokens; the residual stream in `dtype`, each tensor-parallel rank with
    its 1/tp of the positions (sequence parallelism); the last stage's logits, over the
    vocabulary's shards on `tp_mesh` when it is set (the vocab-parallel loss)."""

    rows: int
    seq_len: int
    dtype: torch.dtype
    tp_mesh: DeviceMesh | None = None

    def examples(self, stage: Stage) -> dict:
        """The keyword arguments of torch's PipelineStage that describe `stage`'s tensors."""
        cfg, tp = stage.cfg, self.tp_mesh.size() if self.tp_mesh is not None else 1
        # Hidden states carry gradients back across the boundary: they require grad.
        hidden = torch.empty(self.rows, self.seq_len // tp, cfg.n_embd, dtype=self.dtype,
                             device="meta", requires_grad=True)
        inputs = (torch.empty(self.rows, self.seq_len, dtype=torch.long, device="meta")
                  if stage.first else hidden)
        if not stage.last:
            return {"input_args": inputs, "output_args": hidden}
        if self.tp_mesh is None:
            logits = torch.empty(self.rows, self.seq_len, cfg.vocab_size, dtype=self.dtype,
                                 device="meta", requires_grad=True)
            return {"input_args": inputs, "output_args": logits}
        local = torch.empty(self.rows, self.seq_len, cfg.vocab_size // tp, dtype=self.dtype,
                            device="meta", requires_grad=True)
        logits = DTensor.from_local(local, self.tp_mesh, [Shard(2)], run_check=False)
        # A DTensor among them: torch needs the gradients' layout too.
        return {"input_args": inputs, "output_args": logits, "input_grads": inputs,
                "output_grads": logits}


def build_schedule(stages: list[Stage], pp_group: dist.ProcessGroup, device: torch.device,
                   n_microbatches: int, loss_fn, schedule: str, io: StageIO | None = None):
    """torch's schedule over this rank's stages; n_microbatches per step, at least pp. `io`:
    the tensors crossing the stages, given up front (else torch infers them at the first step,
    exchanging them between the ranks)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    pp = dist.get_world_size(pp_group)
    if schedule not in SCHEDULES:
        raise PipelineLayoutError(f"parallel.pp_schedule={schedule!r} is not one of "
                                  f"{', '.join(SCHEDULES)}")
    if n_microbatches < pp:
        raise PipelineLayoutError(
            f"a step of {n_microbatches} micro-batch(es) per pipeline cannot fill {pp} stages; "
            f"make train.global_batch_size / (data-parallel degree x train.micro_batch_size) "
            f">= parallel.pp")
    if schedule == "1f1b" and len(stages) != 1:
        raise PipelineLayoutError("parallel.pp_schedule=1f1b runs one stage per rank; use "
                                  "interleaved_1f1b for more")
    for s in stages:  # what runs each stage (its send and receive buffers, its cache)
        s.runtime = PipelineStage(s, s.index, s.num_stages, device, group=pp_group,
                                  **(io.examples(s) if io is not None else {}))
    pipeline_stages = [s.runtime for s in stages]
    if schedule == "1f1b":
        return Schedule1F1B(pipeline_stages[0], n_microbatches, loss_fn=loss_fn,
                            scale_grads=False)
    if schedule == "interleaved_zero_bubble":
        from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
        return ScheduleInterleavedZeroBubble(pipeline_stages, n_microbatches, loss_fn=loss_fn,
                                             scale_grads=False)
    return ScheduleInterleaved1F1B(pipeline_stages, n_microbatches, loss_fn=loss_fn,
                                   scale_grads=False)


def run_step(schedule, stages: list[Stage], x: torch.Tensor | None,
             y: torch.Tensor | None) -> torch.Tensor | None:
    """One step through the pipeline: forward and backward of every micro-batch of `x` (read
    by the first stage) against `y` (read by the last); returns the sum of the micro-batches'
    losses on the rank holding the last stage, else None."""
    first = any(s.first for s in stages)
    last = any(s.last for s in stages)
    losses: list[torch.Tensor] = []
    args = (x,) if first else ()
    # Only the losses are kept: with its outputs returned, the last stage would hold every
    # micro-batch's logits until the step ends (torch's default), m times what one needs.
    schedule.step(*args, target=y if last else None, losses=losses if last else None,
                  return_outputs=False)
    return _summed(losses) if last else None


def _summed(losses: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the micro-batches' losses (replicated DTensors under loss_parallel: local)."""
    total = sum(loss.detach() for loss in losses)
    return total.to_local() if isinstance(total, DTensor) else total


class TiedEmbedding:
    """The token embedding that the first stage looks up in and the last multiplies by: their
    gradients summed over the pair of ranks that hold them, every step, so both copies take the
    same update. Collective over the whole group at construction (each pair's process group)."""

    def __init__(self, mesh: DeviceMesh, stages: list[Stage], grid: list):
        """`mesh`: the whole named mesh, "pp" its first dim; `grid`: its ranks as nested lists,
        read when the pipeline was built (the mesh's rank tensor is made on each read, and under
        a dry run's fake tensors would have no values)."""
        pp = mesh.size(0)
        self.weight = next((s.wte.weight for s in stages if s.holds_tied_embedding), None)
        self.group = None
        if pp == 1 or not stages[0].tied:  # untied: each stage's weights are its own
            return
        if pp == 2:  # the pipeline's own group is the pair: no communicator more
            self.group = mesh["pp"].get_group()
            return
        first, last = _flat(grid[0]), _flat(grid[pp - 1])
        for column in range(len(first)):  # every rank makes every pair's group, in order
            pair = [first[column], last[column]]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                self.group = group

    def sum_gradients(self) -> None:
        """After the backward: each copy's gradient is the sum of both."""
        if self.group is None or self.weight is None or self.weight.grad is None:
            return
        grad = self.weight.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.group)


def _flat(nested) -> list[int]:
    if isinstance(nested, int):
        return [nested]
    return [r for item in nested for r in _flat(item)]


def clip_grad_norm(stages: list[Stage], max_norm: float, pp_group: dist.ProcessGroup,
                   ) -> torch.Tensor:
    """Clip every stage's gradients to `max_norm` by the norm of the whole model's gradient;
    returns that norm. This rank's part is one norm over all its stages' gradients, reduced over
    their data- and tensor-parallel shards as DTensor does for an unpipelined model (an
    all-reduce per placement, not per parameter), then its square over the pipeline; the tied
    embedding counts once (the first stage's)."""
    grads = [p.grad for s in stages for name, p in s.named_parameters()
             if p.grad is not None
             and not (s.holds_tied_embedding and s.last and not s.first and name == "wte.weight")]
    if grads:
        mine = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        mine = (mine.full_tensor() if isinstance(mine, DTensor) else mine).float()
    else:
        mine = torch.zeros((), dtype=torch.float32, device=_device(stages))
    total = mine * mine
    dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    # Scaled shard by shard: the coefficient is the same plain number on every rank.
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    shards = [g.to_local() if isinstance(g, DTensor) else g
              for s in stages for p in s.parameters() if (g := p.grad) is not None]
    torch._foreach_mul_(shards, coef)
    return norm


def _device(stages: list[Stage]) -> torch.device:
    p = next(stages[0].parameters())
    return p.to_local().device if isinstance(p, DTensor) else p.device


class RankModel(nn.Module):
    """What one pipeline rank holds of the model, its stages' modules registered under their
    whole-model names: the parameters, state dict and sharded checkpoint of a pipelined run have
    the unpipelined one's keys. Not called: the schedule runs the stages."""

    def __init__(self, stages: list[Stage]):
        super().__init__()
        for s in stages:  # the trunk's modules (a tied lm_head holds no parameter of its own)
            for name, module in s.named_children():
                if name != "h" and not hasattr(self, name):
                    setattr(self, name, module)
        self.h = nn.ModuleDict({k: b for s in stages for k, b in s.h.items()})
        self.cfg = stages[0].cfg
        self._index_in_gpt = {n: i for s in stages for n, i in s._index_in_gpt.items()}
        self.__dict__["_stages"] = stages  # not submodules: their modules are registered above

    def to_empty(self, *, device, recurse: bool = True) -> RankModel:
        """Through each stage: FSDP re-points its sharded parameters when its root is moved."""
        for stage in self._stages:
            stage.to_empty(device=device, recurse=recurse)
        return self

    parameter_index = Stage.parameter_index

    def initial_value(self, *args, **kwargs) -> torch.Tensor:
        return self._stages[0].initial_value(*args, **kwargs)


class Pipeline:
    """This rank's stages of a pipelined decoder and the schedule that runs them; built on "meta"
    from `gpt`, each stage handed to `parallelize` (tensor parallelism, FSDP, ...) as a model of
    its own. `model` is the rank's part as one module (`RankModel`)."""

    def __init__(self, gpt: Decoder, mesh: DeviceMesh, pp_rank: int, stages_per_rank: int,
                 schedule: str, parallelize):
        pp = mesh["pp"].size()
        self.stages = split_model(gpt, pp_rank, pp, stages_per_rank)
        for stage in self.stages:
            parallelize(stage)
        self.model = RankModel(self.stages)
        self.mesh, self.schedule_name = mesh, schedule
        self._rank_grid = mesh.mesh.tolist()
        self.first = any(s.first for s in self.stages)
        self.last = any(s.last for s in self.stages)
        self._schedule = None
        self._tied: TiedEmbedding | None = None
        self.micro_batches = self.micro_batch_rows = 0  # a step's, set by `prepare`
        self._scale = 0.0

    def forward_backward(self, tokens: list[torch.Tensor], weights: list[float], seq_len: int,
                         compute_dtype: torch.dtype, vocab_sharded: bool,
                         device: torch.device) -> torch.Tensor:
        """Collective over the pipeline (`prepare`d): every micro-batch of the step through the
        stages, its loss times the scale backpropagated; the tied embedding's gradients summed.
        Returns the step's summed token loss (float64) on the rank holding the last stage, else
        zero. A zero-weight slot (padding that keeps the collectives in step) has every target
        ignored: no loss, no gradient."""
        batch = torch.cat([t.to(device, non_blocking=True) for t in tokens])
        x, y = batch[:, :seq_len], batch[:, 1:seq_len + 1].clone()
        rows = tokens[0].size(0)
        for k, weight in enumerate(weights):
            if weight == 0.0:
                y[k * rows:(k + 1) * rows] = IGNORED
        with self._context(compute_dtype, vocab_sharded, device):
            loss = run_step(self._schedule, self.stages, x, y)
        self._tied.sum_gradients()
        return self._unscaled(loss, device)

    def prepare(self, n_microbatches: int, rows: int, scale: float, device: torch.device,
                compute_dtype: torch.dtype, vocab_sharded: bool) -> None:
        """Collective over the pipeline (the stages materialised): the schedule of
        `n_microbatches` of `rows` sequences per step with the loss times `scale`, and the tied
        embedding's pairs. Again when the step's split changes (a replica group's quorum: the
        live groups share the micro-batches): a new schedule, whose stages size their buffers
        for its micro-batches at its first step."""
        if (n_microbatches, rows, scale) == (self.micro_batches, self.micro_batch_rows,
                                             self._scale):
            return
        self.micro_batches, self.micro_batch_rows = n_microbatches, rows
        io = StageIO(rows, self.stages[0].cfg.seq_len, compute_dtype,
                     self.mesh["tp"] if vocab_sharded else None)
        self._schedule = build_schedule(
            self.stages, self.mesh["pp"].get_group(), device, n_microbatches,
            summed_loss(scale), self.schedule_name, io)
        self._scale = scale
        if self._tied is None:
            self._tied = TiedEmbedding(self.mesh, self.stages, self._rank_grid)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, compute_dtype: torch.dtype,
                 vocab_sharded: bool, device: torch.device) -> torch.Tensor:
        """Collective over the pipeline: the summed token loss of `x` against `y` (the step's
        micro-batch count of rows of the step's micro-batch size; IGNORED targets count for
        nothing) through the stages, forward only; on the last stage's rank, else zero. Every
        gathered weight is released after it, as a training step expects."""
        from torch.distributed.fsdp import FSDPModule

        losses: list[torch.Tensor] = []
        with self._context(compute_dtype, vocab_sharded, device):
            self._schedule.eval(*((x.to(device),) if self.first else ()),
                                target=y.to(device) if self.last else None,
                                losses=losses if self.last else None, return_outputs=False)
        for stage in self.stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return self._unscaled(_summed(losses) if self.last else None, device)

    def _unscaled(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if loss is None:
            return torch.zeros((), dtype=torch.float64, device=device)
        return loss.double() / self._scale

    @staticmethod
    def _context(compute_dtype: torch.dtype, vocab_sharded: bool, device: torch.device):
        from torch.distributed.tensor.parallel import loss_parallel

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device.type, dtype=compute_dtype,
                                           enabled=compute_dtype != torch.float32))
        if vocab_sharded:
            stack.enter_context(loss_parallel())
        return stack

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.stages, max_norm, self.mesh["pp"].get_group())

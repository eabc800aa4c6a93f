"""Tensor and sequence parallelism for a decoder of any family, Megatron style, through DTensor.

The residual stream between blocks is sharded over the sequence (`Shard(1)`): LayerNorm and
dropout run on T/tp positions per rank. Each attention and MLP block gathers its input over the
sequence, splits its first matmul by columns (heads, or the MLP's hidden units) and its second by
rows, and reduce-scatters the output back onto the sequence: per block and direction two
all-gathers and two reduce-scatters, no all-reduce. The embeddings are vocab- (wte) and
position- (wpe) parallel, and the logits stay sharded over the vocabulary into the loss
(`loss_context`, torch's loss_parallel), so no rank ever holds (B, T, vocab).

Which leaf gets which split is the family's (model/families.py: a plan of named styles per
block leaf and per trunk module; `STYLES` here turns each name into DTensor's style). Llama's
q, k and v are three Linears, each column-parallel by whole heads (tp divides the key/value
heads: parallel/tp_rules.py), its SwiGLU's gate and up column-parallel, down row-parallel; an
untied output layer holds its own vocab-sharded weight.

GPT-2's c_attn is one (3C, C) matrix holding [q | k | v]. Plain column sharding would give the
first rank all of q and some of k; `FusedColwiseParallel` gives each rank the same heads of all
three (a `_StridedShard` over the three parts), so the global parameter, and every checkpoint,
keeps GPT-2's layout and names. The tied output layer (`GPT.lm_head`) owns no weight: it reads
wte's, which the wte plan shards over the vocabulary (`Shard(0)`), the layout a column-parallel
output layer needs, so both uses share one DTensor parameter.

Order (torchtitan's): tensor parallelism first, then activation checkpointing and compile, then
FSDP over the data-parallel sub-mesh (parallel/fsdp.py). Nothing here knows about Ray or the
trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from elastic_gpt.model.families import spec_of
from elastic_gpt.model.gpt import token_losses
from elastic_gpt.torch_internals import StridedShard


class FusedColwiseParallel(ParallelStyle):
    """Column parallelism for a Linear whose output is `parts` equal tensors side by side: each
    rank gets the same 1/tp slice of every part (for c_attn: the same heads of q, k and v), as
    `_StridedShard(0, split_factor=parts)` of the weight. The bias (a few kB) stays replicated:
    DTensor slices it locally, so it needs no layout of its own in checkpoints. Input:
    replicated; output: the local slices, [q_r | k_r | v_r], as a plain tensor."""

    def __init__(self, parts: int):
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwiseParallel shards an nn.Linear, not {type(module).__name__}")
        return distribute_module(module, device_mesh, self._partition, self._prepare_input,
                                 self._prepare_output)

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = StridedShard(0, split_factor=self.parts) if pname == "weight" \
                else Replicate()
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement]), param.requires_grad))

    @staticmethod
    def _prepare_input(module, inputs, device_mesh):
        (x,) = inputs
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        # Redistribute only if needed: even a no-op redistribute turns the input's partial
        # gradient into a replicated one in backward (an all-reduce where the reduce-scatter of
        # the sequence-parallel region's entry suffices, as ColwiseParallel does).
        return x if x.placements == (Replicate(),) else x.redistribute(placements=(Replicate(),))

    def _prepare_output(self, module, output, device_mesh):
        # DTensor's matmul rule keeps the strided sharding on the output's last dim: the local
        # result is exactly this rank's slice of each part, computed without communication.
        expected = (StridedShard(output.ndim - 1, split_factor=self.parts),)
        if output.placements != expected:
            raise RuntimeError(f"fused column-parallel output has placements {output.placements}, "
                               f"expected {expected}: this torch shards the matmul differently")
        return output.to_local()


STYLES: dict[str, Callable[[], ParallelStyle]] = {
    # a norm (or dropout) on this rank's share of the sequence
    "sequence": SequenceParallel,
    # a branch's input, sequence-sharded, all-gathered whole for its column-parallel matmuls
    "gather_input": lambda: PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
    "colwise": ColwiseParallel,
    "fused_colwise_3": lambda: FusedColwiseParallel(3),
    # partial sums reduce-scattered back onto the sequence
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
    # vocab-parallel lookup; the partial sums are reduce-scattered onto the sequence
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    # positions are (T,) -> (T, C): the sequence is dim 0 of this output
    "position_embedding": lambda: RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(0)),
    # the output layer's weight sharded over the vocabulary (a tied one reads wte's, which the
    # embedding's plan shards so); the logits stay a DTensor sharded over the vocab
    "vocab_output": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                            use_local_output=False),
}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every block and the trunk over `tp_mesh` by the family's plan (see the module
    docstring). A pipeline stage has only some of the trunk's modules: each gets its plan if it
    is there."""
    spec = spec_of(model.cfg)
    outer = {name: style for name, style in spec.outer_tp_plan.items()
             if getattr(model, name, None) is not None}
    parallelize_module(model, tp_mesh, {name: STYLES[style]() for name, style in outer.items()})
    for name, style in outer.items():
        if style == "vocab_embedding":
            getattr(model, name).register_forward_hook(_settled_output)
    for block in (model.h.values() if isinstance(model.h, nn.ModuleDict) else model.h):
        parallelize_module(block, tp_mesh, {leaf: STYLES[style]()
                                            for leaf, style in spec.block_tp_plan.items()})


def _settled_output(module, inputs, output):
    """The vocab-parallel embedding's output as a plain tensor. RowwiseParallel hands back its
    reduce-scatter still in flight (an asynchronous collective's tensor, waited on by the next op
    that reads it). A compiled block that takes that tensor straight as its input (Llama's:
    nothing runs between the embedding and the first block, where GPT-2 adds its positions)
    sends back a gradient the collective's backward cannot take: the embedding's gradient is
    zero under FSDP, and without it the backward fails. A copy of this rank's (b, s / tp, h)
    waits for it in eager code and costs one activation's write."""
    return output.clone() if type(output) is not torch.Tensor else output


def local_boxes(t) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] | None:
    """This rank's data of a fused tensor-parallel DTensor (a `_StridedShard` over dim 0, e.g.
    c_attn's weight or its Adam moments) as boxes of the global tensor: (offsets, sizes, view
    of the local tensor), one per part. None for any other tensor, which is one box already.

    DCP describes each rank's share of a tensor as one box by default, and the rows of one rank's
    heads of q, k and v are three; the checkpoint planners (checkpoint/sharded.py) save and load
    these boxes instead, so the checkpoint holds the GPT-2 layout whatever the (dp, tp) layout,
    with no communication."""
    if not isinstance(t, DTensor):
        return None
    strided = [(m, p) for m, p in enumerate(t.placements)
               if isinstance(p, StridedShard) and p.split_factor != _shards_right_of(t, m, p.dim)]
    if not strided:
        return None  # FSDP's own strided shards (of a TP shard, on its left) are one box
    coordinate = t.device_mesh.get_coordinate()
    if len(strided) > 1 or strided[0][1].dim != 0 or coordinate is None:
        raise NotImplementedError(f"no checkpoint layout for placements {t.placements}")
    offsets, sizes = [0] * t.ndim, list(t.shape)
    for m, p in enumerate(t.placements):
        if isinstance(p, Shard):  # FSDP's dims: plain chunks of the other dims
            n, c, length = t.device_mesh.size(m), coordinate[m], t.shape[p.dim]
            if p.dim == 0 or offsets[p.dim] or sizes[p.dim] != length:
                raise NotImplementedError(f"no checkpoint layout for placements {t.placements}")
            step = -(-length // n)
            offsets[p.dim] = min(c * step, length)
            sizes[p.dim] = max(0, min(step, length - offsets[p.dim]))
    m, p = strided[0]
    n, c = t.device_mesh.size(m), coordinate[m]
    part = t.shape[0] // p.split_factor
    if t.shape[0] % p.split_factor or part % n:
        raise NotImplementedError(f"{p} of {tuple(t.shape)} over {n} ranks is uneven")
    local, rows = t.to_local(), part // n
    boxes = []
    if 0 in sizes:
        return boxes
    for j in range(p.split_factor):
        box_offsets = (j * part + c * rows, *offsets[1:])
        boxes.append((box_offsets, (rows, *sizes[1:]), local[j * rows:(j + 1) * rows]))
    return boxes


def _shards_right_of(t: DTensor, mesh_dim: int, tensor_dim: int) -> int:
    """How many pieces the mesh dims right of `mesh_dim` cut `tensor_dim` into: the split factor
    of a `_StridedShard` that only records sharding order (FSDP over a tensor-parallel shard)."""
    n = 1
    for m in range(mesh_dim + 1, t.device_mesh.ndim):
        p = t.placements[m]
        if isinstance(p, (Shard, StridedShard)) and p.dim == tensor_dim:
            n *= t.device_mesh.size(m)
    return n


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Around the loss and its backward: torch's loss_parallel when the logits are
    vocab-sharded DTensors (cross-entropy without gathering them), else nothing."""
    return loss_parallel() if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def summed_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                      compute_dtype: torch.dtype, vocab_sharded: bool) -> Iterator[torch.Tensor]:
    """The summed cross-entropy of the model on inputs `x` and targets `y`, for a backward (if
    any) inside the with-block: the one loss of training and evaluation.

    The forward runs under autocast in `compute_dtype`. Whole output weights: the model
    computes the loss from its last hidden states (`GPT.forward` with targets), the fp32 part
    chunk by chunk, so no rank holds (B, T, vocab) logits in fp32. Vocab-sharded ones (tensor
    parallelism): the model's logits are DTensors sharded over the vocabulary, 1/tp of the whole
    on each rank, and torch's loss_parallel computes the loss and its backward on the shards
    (`loss_context`); the result is a replicated DTensor."""
    with torch.autocast(x.device.type, dtype=compute_dtype,
                        enabled=compute_dtype != torch.float32):
        out = model(x) if vocab_sharded else model(x, targets=y)
    with loss_context(vocab_sharded):
        yield token_losses(out, y) if vocab_sharded else out

"""FSDP2, activation checkpointing and torch.compile for a decoder of any family (torchtitan's
order).

Order matters: tensor parallelism first (parallel/tensor.py: it swaps each layer's weights for
DTensors on the tensor-parallel mesh), then activation checkpointing and compile wrap each
block, then `fully_shard` shards each (wrapped) block and finally the root over the
data-parallel mesh, so one all-gather brings in one block's weights (its tensor-parallel shard).
Nothing here knows about Ray; the meshes come from the caller (parallel/mesh.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from elastic_gpt.model.families import spec_of
from elastic_gpt.parallel.tensor import apply_tensor_parallel
from elastic_gpt.torch_internals import StridedShard, checkpoint_wrapper, enable_async_tp, local_indices


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA (tensor cores) and fp32 on CPU (bf16 CPU matmuls are slow here).
    bf16 on a GPU without it (before Ampere: V100, T4) is one clear error: torch would emulate
    it far slower, and fp16 needs loss scaling, which this trainer does not do."""
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported(including_emulation=False):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no "
            f"bfloat16 tensor cores, which train.dtype={name} means on a GPU; set "
            "train.dtype=float32, or run on an Ampere or newer GPU (A100, A10G, L4, H100)")
    return dtype


def mixed_precision_policy(compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    # Params are gathered in the compute dtype, but gradients are reduced in fp32 and the sharded
    # master weights and Adam moments stay fp32: bf16 reductions over many ranks lose too much.
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def _selective_ops() -> set:
    """What per-op selective checkpointing keeps (torchtitan's list, plus the bias matmul GPT-2's
    linears run as): the outputs of the matmuls and of attention, the costly ops to recompute,
    and of the tensor-parallel reduce-scatter, which would otherwise be communicated again."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    return {aten.mm.default, aten.addmm.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            c10d.reduce_scatter_tensor.default, aten.max.default}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = _selective_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def blocks(model: nn.Module) -> list[tuple[int | str, nn.Module]]:
    """(key in `model.h`, block) of a decoder (a list of blocks) or of a pipeline stage (its blocks
    by their index in the whole model); `model.h[key] = wrapped` replaces one."""
    return list(model.h.items()) if isinstance(model.h, nn.ModuleDict) else list(enumerate(model.h))


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> None:
    """Recompute in backward what each block's forward made. full: everything (activation memory
    O(layers) -> O(1) blocks, ~+33% FLOPs); selective: all but the outputs of matmuls, attention
    and reduce-scatters (the cheap elementwise ops and norms are recomputed: most of the memory
    saved for a few percent more time)."""
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    for key, block in blocks(model):
        model.h[key] = checkpoint_wrapper(block, preserve_rng_state=True, **extra)


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: blocks are identical, so one graph is reused L times."""
    for key, block in blocks(model):
        model.h[key] = torch.compile(block, fullgraph=True)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard every block, then the family's trunk units (model/families.py `fsdp_units`), then
    the root.

    reshard_after_forward=True frees gathered weights after each block's forward and gathers again
    in backward (ZeRO-3 memory); the last block is kept gathered since backward starts with it.
    A tied trunk (GPT-2: wte, wpe, ln_f; wte is the lm_head's weight) is the root, which keeps
    FSDP's default for roots: gathered from forward into backward, since the tied lm_head is the
    first thing backward needs (one all-gather less per micro-batch, ~24% of the all-gather bytes
    of gpt2-124m, measured by bench/bench_planner.py). An untied one (Llama) is two units: the
    embedding, resharded after its forward, and the final norm with the output layer, kept from
    its forward into the backward that starts with it; a pipeline stage shards those it holds.
    """
    mp = mixed_precision_policy(compute_dtype)
    last = len(model.h) - 1
    for i, (_, block) in enumerate(blocks(model)):
        fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=shard_placement,
                    reshard_after_forward=reshard_after_forward and i < last)
    for unit in spec_of(model.cfg).fsdp_units(model.cfg):
        held = [getattr(model, name) for name in unit if getattr(model, name, None) is not None]
        if held:
            fully_shard(held, mesh=mesh, mp_policy=mp, shard_placement_fn=shard_placement,
                        reshard_after_forward=reshard_after_forward and "wte" in unit)
    fully_shard(model, mesh=mesh, mp_policy=mp, shard_placement_fn=shard_placement,
                reshard_after_forward=None if reshard_after_forward else False)
    # FSDP averages gradients over the data-parallel ranks; the train loop scales each rank's loss
    # by that degree to turn this back into a sum (a divide factor of 1 would need PREMUL_SUM,
    # which gloo lacks).
    return model


def shard_placement(param: torch.nn.Parameter) -> Shard | None:
    """FSDP's shard dim for a parameter: dim 0 (None), except for a weight that tensor
    parallelism splits into parts along dim 0 (c_attn's q, k, v: parallel/tensor.py). FSDP's
    chunk of such a rank's rows would cut across the parts, a layout DTensor cannot describe
    (so neither could checkpoints); its columns are untouched by tensor parallelism."""
    if isinstance(param, DTensor) and param.ndim > 1 and any(
            isinstance(p, StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def group_device_bytes(device: torch.device) -> int:
    """Collective: the smallest `device_memory_bytes` of the group's ranks. Settings resolved
    from memory (train/run_memory.py) must be the same on every rank, and workers on nodes of
    different sizes see different memory: one rank's backward re-gathers paired with another's
    next collective would hang or be wrong."""
    own = device_memory_bytes(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return own
    box = torch.tensor([float(own)], dtype=torch.float64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def reshard_label(resharded: bool, policy: str) -> str:
    """What a log line calls the resharding that ran: always or never, and " (auto)" when
    `train.reshard_after_forward: auto` chose it."""
    return ("always" if resharded else "never") + (" (auto)" if policy == "auto" else "")


def device_memory_bytes(device: torch.device) -> int:
    """The memory one worker may count on: its GPU's, or on CPU the host's shared by the workers
    of this node (Ray Train sets LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def apply_float8(model: nn.Module) -> int:
    """The blocks' linears as torchao's Float8Linear (dynamic tensorwise scaling: the matmuls in
    float8 with bf16 outputs, FSDP2 gathering the weights in float8, half the bytes of bf16), as
    torchtitan's float8 converter does; returns how many. The output layer stays in the compute
    dtype (torchtitan's choice: the logits' precision; a tied one's weight is the embedding's),
    and so does any linear whose dims float8 kernels cannot take (multiples of 16)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ValueError(f"train.float8 needs float8 tensor cores (compute capability 8.9+: "
                         f"L4, L40S, H100, H200, B200); {torch.cuda.get_device_name()} has "
                         f"{major}.{minor}; set train.float8=false")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError("train.float8 needs torchao: pip install 'elastic-gpt[float8]'") from None

    converted = []

    def take(module: torch.nn.Module, name: str) -> bool:
        ok = (isinstance(module, torch.nn.Linear) and name.startswith("h.")
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, module_filter_fn=take,
                               config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return len(converted)


def check_async_tp(tp_mesh: DeviceMesh | None, compile: bool) -> None:
    """parallel.async_tp needs what torch's micro-pipelined TP runs on: one clear line if not."""
    if tp_mesh is None:
        raise ValueError("parallel.async_tp overlaps tensor-parallel collectives: it needs "
                         "parallel.tp > 1; set parallel.async_tp=false")
    if not compile:
        raise ValueError("parallel.async_tp is a compiler pass: set train.compile=true, or "
                         "parallel.async_tp=false")
    if tp_mesh.device_type != "cuda":
        raise ValueError("parallel.async_tp needs CUDA GPUs (symmetric memory); set "
                         "parallel.async_tp=false")


def parallelize(model: nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype,
                activation_checkpointing: bool = False, compile: bool = False,
                reshard_after_forward: bool = True, tp_mesh: DeviceMesh | None = None,
                checkpointing_mode: str = "full", float8: bool = False,
                async_tp: bool = False) -> nn.Module:
    """float8 linears (if asked), tensor parallelism over `tp_mesh` (if given), then activation
    checkpointing and compile, then FSDP over `mesh` (the data-parallel sub-mesh: 2-D for
    HSDP)."""
    if float8:
        if tp_mesh is not None:
            raise ValueError("train.float8 with parallel.tp > 1 is not supported yet (its "
                             "linears would need torchao's float8 tensor-parallel plans); set "
                             "parallel.tp=1 or train.float8=false")
        apply_float8(model)
    if async_tp:
        check_async_tp(tp_mesh, compile)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
        if async_tp:  # torchtitan's async TP: the compiled blocks overlap matmul and collective
            enable_async_tp(tp_mesh.get_group().group_name)
    if activation_checkpointing:
        apply_activation_checkpointing(model, checkpointing_mode)
    if compile:
        apply_compile(model)
    return apply_fsdp(model, mesh, compute_dtype, reshard_after_forward=reshard_after_forward)


def init_sharded_weights(model: nn.Module, seed: int) -> None:
    """Fill each rank's shards with the values a single-process `init_weights(seed)` gives,
    drawing only the tiles of the weights its shards cover (model/gpt.py `init_tiles`): a run
    starts from identical weights at any world size and layout, each rank's cost is its shard's,
    and nothing is communicated."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            index = model.parameter_index(name)
            if isinstance(p, DTensor):
                held = local_indices(p.shape, p.device_mesh, p.placements)
                p.to_local().copy_(model.initial_value(index, name, p.shape, seed, held))
            else:
                p.copy_(model.initial_value(index, name, p.shape, seed))

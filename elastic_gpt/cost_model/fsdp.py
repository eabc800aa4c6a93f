"""FSDP2's share of a step, as the trainer runs it (parallel/fsdp.py): the model state each rank
holds (ZeRO-3 or blocks kept gathered, on top of tensor parallelism), and the all-gathers and
reduce-scatters of a step (HSDP's all-reduce across nodes with them), overlapped with compute as
FSDP2's prefetching allows, with the gradient accumulation and the optimizer step.

The model-state bytes follow Rajbhandari et al. 2020 (ZeRO, section 5).
"""

from __future__ import annotations

from elastic_gpt.cost_model.kernels import Kernels
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network, ring_bytes
from elastic_gpt.cost_model.shape import FP32, ModelShape, dtype_bytes
from elastic_gpt.cost_model.software import ModelStateStep
from elastic_gpt.hardware import GB

OPTIMIZER_BYTES_PER_PARAM = 16
"""fp32 sharded master params (4) + fp32 grads (4, reduce_dtype) + Adam m and v (4 + 4)."""
OPTIMIZER_STEP_BYTES_PER_PARAM = 28 + 4
"""Fused AdamW streams p, g, m, v in and p, m, v out (28 B/param) + the grad-norm read (4 B)."""


def fsdp_state_bytes(shape: ModelShape, tp: int, dp_shard: int, act_bytes: int, *,
                     grad_sync: str, micro_batches_per_rank: int,
                     reshard_after_forward: bool) -> tuple[float, float, float]:
    """(sharded state, gathered parameters and gradients, accumulated gradients) of one rank:
    FSDP2 (one unit per block, then the root) over `dp_shard` ranks, each unit the TP rank's part.

    The sharded state is `OPTIMIZER_BYTES_PER_PARAM` a parameter. A tied root stays gathered
    through forward and backward (FSDP2 never reshards the root after forward) and its grads (wte
    is tied, so from the lm_head on) live until the end of backward; an untied one (Llama) is
    two units, of which the larger is held so (`ModelShape.root_gathered_local`), or both when
    nothing is resharded. Blocks: the current and the
    prefetched one gathered (reshard_after_forward, ZeRO-3) or all L of them (kept gathered),
    plus in backward one block's grads in the compute dtype and their fp32 copy in the
    reduce-scatter buffer. Reducing once per step keeps unsharded fp32 gradients across
    micro-batches (no_sync)."""
    pb, L = act_bytes, shape.cfg.n_layer
    sharded = OPTIMIZER_BYTES_PER_PARAM * shape.local_params(tp) / dp_shard
    held_blocks = min(2, L) if reshard_after_forward else L
    block = shape.block_local(tp)
    held_params, reduced_params = held_blocks * block, block
    root = shape.root_gathered_local(tp) if reshard_after_forward else shape.root_local(tp)
    gathered = (root * (pb + pb + FP32)
                + held_params * pb + reduced_params * (pb + FP32))
    accumulated = (FP32 * shape.local_params(tp)
                   if grad_sync == "step" and micro_batches_per_rank > 1 else 0.0)
    return sharded, gathered, accumulated


def fsdp_step(shape: ModelShape, net: Network, mesh: Mesh, kernels: Kernels, micro_batches: int,
              *, block_forward_s: float, block_backward_s: float, dtype: str, grad_sync: str,
              reshard_after_forward: bool, efficiency: float | None) -> ModelStateStep:
    """FSDP2's collectives of one step on the slowest rank (`micro_batches` of them), its
    gradient accumulation and its optimizer step.

    Overlap (FSDP2's prefetching): the all-gather of block i+1 runs during block i's forward; in
    backward the gather of block i-1 and the reduce-scatter of block i+1 run during block i's
    backward. Exposed per block = max(0, comm - compute); the first gathers (root + block 0) of a
    micro-batch and the last reduce-scatters (block 0 + root) of a synced backward hide under
    nothing. Collectives share one network, so concurrent ones add up.

    reshard_after_forward=True (ZeRO-3): every micro-batch gathers root + L blocks in forward and
    L - 1 blocks again in backward (the last block is not resharded). False (the trainer's
    `never`, which also keeps the weights gathered between micro-batches): root + L blocks are
    gathered once per step, in the first micro-batch's forward, and never in backward.

    FSDP2 gathers and reduces the TP rank's part of each unit over the data-parallel ranks (tp
    such groups share a node's NICs). Under HSDP its groups are the data-parallel ranks of one
    node, and each gradient sync adds an all-reduce of the reduce-scattered shard across nodes
    (every GPU of a node in its own replicate group: they share the NICs)."""
    pb, L, k, tp = dtype_bytes(dtype), shape.cfg.n_layer, micro_batches, mesh.tp
    fwd_blk, bwd_blk = block_forward_s, block_backward_s
    shard_across = mesh.spans_nodes and not mesh.hsdp
    # FSDP's group: the ranks of one TP position, gpus_per_node / tp of them in each node.
    shard_per_node = net.gpus_per_node // tp if shard_across else mesh.dp_shard
    blk, root = shape.block_local(tp), shape.root_local(tp)

    # FSDP2 gathers float8 weights for the blocks' float8 linears (enable_fsdp_float8_all_gather)
    blk_pb = 1 if dtype == "float8" else pb

    def gather_s(elems: float, nbytes: int = pb) -> float:
        return net.ring_s(ring_bytes(nbytes * elems, mesh.dp_shard), ranks=mesh.dp_shard,
                          per_node=shard_per_node, nic_sharing=tp)

    def reduce_s(elems: float) -> float:  # reduce-scatter, then (HSDP) all-reduce of the shard
        rs = net.ring_s(ring_bytes(FP32 * elems, mesh.dp_shard), ranks=mesh.dp_shard,
                        per_node=shard_per_node, nic_sharing=tp)
        ar = net.ring_s(2 * ring_bytes(FP32 * elems / mesh.dp_shard, mesh.dp_replicate),
                        ranks=mesh.dp_replicate, per_node=1, nic_sharing=mesh.dp_shard * tp,
                        all_reduce=True)
        return rs + ar

    ag_blk, ag_root = gather_s(blk, blk_pb), gather_s(root)
    rs_blk, rs_root = reduce_s(blk), reduce_s(root)
    regathers = L - 1 if reshard_after_forward else 0  # the last block stays gathered

    def backward_exposed(sync: bool) -> tuple[float, float]:
        rs = rs_blk if sync else 0.0
        comm = regathers * ag_blk + (L * rs_blk + rs_root if sync else 0.0)
        per_block = (ag_blk if reshard_after_forward else 0.0) + rs
        exposed = (L - 1) * max(0.0, per_block - bwd_blk) + (rs_blk + rs_root if sync else 0.0)
        return comm, exposed

    fwd_comm = ag_root + L * ag_blk
    fwd_exposed = ag_root + ag_blk + (L - 1) * max(0.0, ag_blk - fwd_blk)
    n_fwd_gathers = k if reshard_after_forward else 1  # kept gathered: only the first micro-batch
    n_sync = k if grad_sync == "microbatch" else 1
    sync_comm, sync_exposed = backward_exposed(True)
    nosync_comm, nosync_exposed = backward_exposed(False)
    comm_s = n_fwd_gathers * fwd_comm + n_sync * sync_comm + (k - n_sync) * nosync_comm
    exposed_s = n_fwd_gathers * fwd_exposed + n_sync * sync_exposed + (k - n_sync) * nosync_exposed
    all_reduce_bytes = (n_sync * 2 * ring_bytes(FP32 * shape.local_params(tp) / mesh.dp_shard,
                                                mesh.dp_replicate) if mesh.hsdp else 0.0)

    # FSDP2 accumulates unsharded grads in the reduce dtype (fp32) when it syncs once per step:
    # after every micro-batch's backward but the first, `unsharded_accumulated_grad +=` the new
    # bf16 gradient (FSDPParam.accumulate_unsharded_grad_if_needed): it reads both and writes
    # the fp32 sum, over every parameter this rank holds unsharded.
    accumulated = grad_sync == "step" and k > 1
    accumulate_s = 0.0
    if efficiency is None and k > 1 and accumulated:
        accumulate_s = (k - 1) * kernels.memory_s((pb + 2 * FP32) * shape.local_params(tp))

    local = shape.local_params(tp)
    per_param = OPTIMIZER_STEP_BYTES_PER_PARAM
    optimizer_s = (per_param * local / mesh.dp_shard / (0.7 * kernels.gpu.hbm_gbps * GB)
                   if efficiency is not None
                   else kernels.memory_s(per_param * local / mesh.dp_shard))
    gather_bytes = (n_fwd_gathers * (pb * root + blk_pb * L * blk)
                    + k * regathers * blk_pb * blk)
    return ModelStateStep(
        comm_s=comm_s, exposed_comm_s=exposed_s,
        all_gather_bytes=ring_bytes(gather_bytes, mesh.dp_shard),
        reduce_scatter_bytes=n_sync * ring_bytes(FP32 * local, mesh.dp_shard),
        all_reduce_bytes=all_reduce_bytes, accumulate_s=accumulate_s, optimizer_s=optimizer_s,
        gradient_syncs=n_sync, sync_grad_bytes=FP32 if accumulated else pb)

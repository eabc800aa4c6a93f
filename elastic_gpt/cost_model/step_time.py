"""Step time: the network, the mesh, and one optimizer step's compute and communication.

FSDP2's all-gathers and reduce-scatters (ring collectives, overlapped with compute as its
prefetching allows), HSDP's all-reduce across nodes, the tensor-parallel collectives DTensor runs
(on the critical path), and the optimizer's memory traffic. A `LayoutCandidate` is one setting
of the search with the memory and step time predicted for it. Time to train is Narayanan et al.
2021, eq. (4). GPU peaks and bandwidths come from hardware.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_gpt.cost_model.kernels import Kernels, block_times, head_times
from elastic_gpt.cost_model.memory import FP32, Memory, ModelShape, dtype_bytes
from elastic_gpt.hardware import GB, GPU

MATMUL_EFFICIENCY = 0.6
"""The one fraction of peak FLOP/s the uncalibrated model runs every FLOP at (`plan
--efficiency 0.6`). The default, efficiency None, is the calibrated model instead: each kernel
by its size (cost_model/kernels.py) and each collective by NCCL's latency model, checked against
published runs (planner/published_runs.py)."""

NCCL_BASE_LATENCY_S = 8.4e-6
NCCL_NVLINK_HOP_S = 3.4e-6
NCCL_NET_HOP_S = 14e-6
"""NCCL's latency model of a ring collective in its Simple protocol, the one large messages use
(src/graph/tuning.cc, `baseLatencies` and `hwLatencies` for Ring/Simple): a base cost, then one
hop per step of the ring, an NVLink hop inside a node and a network hop between nodes. An
all-gather or reduce-scatter over N ranks on n nodes takes N - 1 steps, n - 1 of them between
nodes; an all-reduce twice as many."""


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra_node_gbps: float
    """NCCL bus bandwidth inside a node, GB/s."""
    inter_node_gbps: float
    """NCCL bus bandwidth between nodes: the node's aggregate NIC bandwidth, GB/s."""
    nccl_latency: bool = True
    """Cost each collective by NCCL's ring latency model (it grows with the ranks); False: a
    fixed `latency_s` each (the uncalibrated model)."""
    latency_s: float = 20e-6
    """The uncalibrated model's fixed cost per collective (launch + ring latency), seconds."""

    def nodes(self, n_gpus: int) -> int:
        return -(-n_gpus // self.gpus_per_node)

    def bus_gbps(self, n_gpus: int) -> float:
        """A ring spanning nodes moves every byte through each node's NICs: the slower link
        bounds it, so across nodes the inter-node bandwidth is the bottleneck."""
        if self.nodes(n_gpus) == 1:
            return self.intra_node_gbps
        return min(self.intra_node_gbps, self.inter_node_gbps)

    def ring_latency_s(self, ranks: int, per_node: int | None = None, *,
                       all_reduce: bool = False) -> float:
        """A ring collective's fixed cost over `ranks` ranks, `per_node` of them in each node
        (default: they fill nodes): `latency_s`, or with `nccl_latency` NCCL's model."""
        if ranks <= 1:
            return 0.0
        if not self.nccl_latency:
            return self.latency_s
        nodes = -(-ranks // (per_node or self.gpus_per_node))
        steps, net_steps = ranks - 1, nodes - 1
        if all_reduce:
            steps, net_steps = 2 * steps, 2 * net_steps
        return (NCCL_BASE_LATENCY_S + (steps - net_steps) * NCCL_NVLINK_HOP_S
                + net_steps * NCCL_NET_HOP_S)

    def send_latency_s(self, across_nodes: bool) -> float:
        """A point-to-point transfer's fixed cost: one ring step of NCCL's model (a network or an
        NVLink hop), or `latency_s`."""
        if not self.nccl_latency:
            return self.latency_s
        return NCCL_NET_HOP_S if across_nodes else NCCL_NVLINK_HOP_S

    def collective_s(self, full_bytes: float, n_gpus: int) -> float:
        """All-gather or reduce-scatter of a `full_bytes` tensor: each rank sends and receives
        (N-1)/N of it (ring algorithm)."""
        if n_gpus <= 1:
            return 0.0
        return (ring_bytes(full_bytes, n_gpus) / (self.bus_gbps(n_gpus) * GB)
                + self.ring_latency_s(n_gpus))

    def ring_s(self, bytes_per_gpu: float, *, ranks: int, per_node: int,
               nic_sharing: int = 1, all_reduce: bool = False) -> float:
        """A ring collective over `ranks` ranks, `per_node` of them in each node, in which each
        member sends `bytes_per_gpu`.

        Inside a node every GPU has its own NVLink/PCIe bandwidth. A ring across nodes pushes
        each member's bytes through every node's NICs once, and the NICs are the node's: when
        `nic_sharing` such rings run at once with members on the same nodes (one per tensor-
        parallel rank for FSDP's data-parallel groups, one per GPU for HSDP's replicate groups),
        they share them. With nic_sharing=1 this is `collective_s`."""
        if bytes_per_gpu <= 0 or ranks <= 1:
            return 0.0
        t = bytes_per_gpu / (self.intra_node_gbps * GB)
        if ranks > per_node:
            t = max(t, nic_sharing * bytes_per_gpu / (self.inter_node_gbps * GB))
        return t + self.ring_latency_s(ranks, per_node, all_reduce=all_reduce)


def ring_bytes(full_bytes: float, n_gpus: int) -> float:
    return (n_gpus - 1) / n_gpus * full_bytes


@dataclass(frozen=True)
class Mesh:
    """How the GPUs are laid out: world = pp x dp_replicate x dp_shard x tp, tp innermost (a TP
    group is consecutive ranks of one node), pp outermost (a pipeline stage is a run of
    consecutive ranks). FSDP2 shards over dp_shard and, under HSDP, replicates over dp_replicate
    (one replica per node of a stage); the data-parallel degree is dp_replicate x dp_shard."""

    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    spans_nodes: bool = False
    """Whether a pipeline stage's ranks span more than one node (FSDP's groups then cross nodes
    unless HSDP)."""
    pp: int = 1
    stages_per_rank: int = 1
    """Pipeline stages each rank holds: 1 for 1F1B, more for the interleaved schedule."""
    replicated: bool = False
    """Megatron-LM 2021's data parallelism instead of FSDP2 (`DATA_PARALLEL`): every
    data-parallel rank holds its tp x pp part of the model state whole (dp_shard = 1,
    dp_replicate = dp) and all-reduces the gradients once the step's backward is done."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage."""
        return self.dp * self.tp

    @property
    def data_parallel(self) -> str:
        return "megatron-2021" if self.replicated else "fsdp2"

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and not self.replicated

    @property
    def schedule(self) -> str:
        return "1f1b" if self.stages_per_rank == 1 else "interleaved_1f1b"

    def short(self) -> str:
        dp = (f"DDP {self.dp}" if self.replicated
              else f"HSDP {self.dp_shard}x{self.dp_replicate}" if self.hsdp else f"FSDP {self.dp}")
        pp = f" pp={self.pp}" + (f"x{self.stages_per_rank}" if self.stages_per_rank > 1
                                 else "") if self.pp > 1 else ""
        return f"tp={self.tp} {dp}{pp}"

    def label(self) -> str:
        if self.replicated:
            dp = (f"replicated over {self.dp}, gradients all-reduced after backward "
                  "as Megatron-LM 2021 did")
        elif self.hsdp:
            dp = (f"HSDP: FSDP over {self.dp_shard} in each node x {self.dp_replicate} replicas "
                  "across nodes")
        else:
            where = "across nodes" if self.spans_nodes else "in one node"
            dp = f"FSDP over {self.dp} {where}"
        if self.pp > 1:
            dp += (f"; pp={self.pp} stages, {self.schedule}"
                   + (f" with {self.stages_per_rank} stages per rank"
                      if self.stages_per_rank > 1 else ""))
        return f"tp={self.tp} x dp={self.dp} ({dp})"


MEGATRON_2021_OPTIMIZER_STEP_BYTES = 6 + 8 + 4 + 28 + 6
"""Bytes a parameter Megatron-LM 2021's optimizer step reads and writes
(`Float16OptimizerWithFloat16Params.step`, megatron/optimizer/optimizer.py at a8d172b3): the
16-bit gradient copied into a new fp32 one (`_copy_model_grads_to_main_grads`), unscaled in
place with the inf check (`_unscale_main_grads_and_check_for_nan`), read for the norm
(`clip_grad_norm_fp32`; scaled as well only when the norm is clipped, not counted), apex's
fused Adam (p, g, m, v in, p, m, v out), and the fp32 weights copied back into the 16-bit ones
(`_copy_main_params_to_model_params`). FSDP2's step is the fused Adam and the norm's read, 32."""

DATA_PARALLEL = ("fsdp2", "megatron-2021")
"""How data-parallel ranks hold the model state and sync gradients: this trainer's FSDP2
(sharded, its collectives overlapped with compute), or Megatron-LM's of 2021, which the
published Megatron-LM runs ran (`Mesh.replicated`: its `DistributedDataParallel` with
`--DDP-impl local`, the default, at a8d172b3, April 2021)."""


def make_mesh(n_gpus: int, tp: int = 1, hsdp: bool = False, gpus_per_node: int = 8,
              pp: int = 1, stages_per_rank: int = 1, data_parallel: str = "fsdp2") -> Mesh:
    """The mesh the trainer builds for n_gpus workers; hsdp on one node is plain FSDP. Under
    pipeline parallelism the data-parallel layout is one stage's (n_gpus / pp ranks).
    `data_parallel="megatron-2021"`: every data-parallel rank a replica (hsdp does not apply)."""
    stage = n_gpus // pp
    spans = stage > gpus_per_node
    if data_parallel == "megatron-2021":
        return Mesh(tp, 1, stage // tp, spans, pp, stages_per_rank, replicated=True)
    if hsdp and spans:
        return Mesh(tp, gpus_per_node // tp, stage // gpus_per_node, True, pp, stages_per_rank)
    return Mesh(tp, stage // tp, 1, spans, pp, stages_per_rank)


@dataclass
class StepTime:
    compute_s: float
    """Kernel time, recomputation included: every FLOP at peak x efficiency, or (efficiency
    None) each kernel as cost_model/kernels.py costs it, and FSDP2's gradient accumulation
    across micro-batches."""
    comm_s: float
    """All FSDP collective time if none of it overlapped compute."""
    exposed_comm_s: float
    """The part of comm_s compute does not hide."""
    optimizer_s: float
    all_gather_bytes: float
    """FSDP2's, per GPU per step (bytes this rank sends; it receives as many)."""
    reduce_scatter_bytes: float
    all_reduce_bytes: float = 0.0
    """HSDP's gradient all-reduce across nodes, per GPU per step."""
    tp_comm_s: float = 0.0
    """Tensor-parallel collectives: on the critical path, none of it overlapped."""
    tp_bytes: float = 0.0
    """Tensor-parallel all-gathers, reduce-scatters and all-reduces, per GPU per step."""
    bubble_s: float = 0.0
    """Pipeline parallelism: the time every rank idles while the pipeline fills and drains."""
    p2p_s: float = 0.0
    p2p_bytes: float = 0.0
    """Pipeline parallelism: the hidden states and their gradients a rank sends per step, and
    their time (on the critical path, none overlapped)."""

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.exposed_comm_s + self.tp_comm_s + self.optimizer_s
                + self.bubble_s + self.p2p_s)

    @property
    def overlapped_fraction(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s else 1.0


@dataclass(frozen=True)
class TPTraffic:
    """Tensor-parallel collectives of one micro-batch and of one gradient sync, as DTensor runs
    the trainer's plan (Megatron-style TP with sequence parallelism): counts and bytes per GPU."""

    all_gathers: int
    reduce_scatters: int
    all_reduces: int
    bytes_per_micro_batch: float
    sync_collectives: int
    bytes_per_sync: float


def tp_traffic(shape: ModelShape, micro_batch: int, tp: int, *, activation_checkpointing: bool,
               act_bytes: int, grad_bytes: int, kernel_set: str = "trainer") -> TPTraffic:
    """Per block, forward: the attention's and the MLP's inputs are all-gathered over the sequence
    (Shard(1) -> Replicate) and their row-parallel outputs reduce-scattered back (Partial ->
    Shard(1)): 2 all-gathers + 2 reduce-scatters of a (b, s, h) tensor. Backward mirrors each (the
    gradient of an all-gather is a reduce-scatter and back). Activation checkpointing runs the
    forward again but stops at the last tensor backward needs (torch's non-reentrant checkpoint
    stops early), the MLP's c_proj input, so the recomputation repeats 2 all-gathers and 1
    reduce-scatter. The root: wte and wpe are row-parallel embeddings whose outputs are
    reduce-scattered to Shard(1) (wpe's is (1, s, h): the positions are shared by the batch), the
    lm_head all-gathers its input, and the vocab-parallel loss all-reduces three fp32 values per
    token (max, sum of exponentials, the target's logit); backward mirrors the three activations
    and the loss needs none. Per gradient sync, the LayerNorm gradients (partial sums over the
    sequence shards) are all-reduced and c_attn's bias gradient (this rank's heads) all-gathered,
    one collective per tensor.

    kernel_set="megatron-2021" (no sequence parallelism; Megatron-LM's mpu at a8d172b3): each
    block all-reduces its attention's and its MLP's row-parallel outputs in forward
    (`reduce_from_tensor_model_parallel_region`) and its column-parallel inputs' gradients in
    backward (`copy_to_tensor_model_parallel_region`), and its checkpointed forward runs again
    whole, both of its all-reduces with it; the root all-reduces the vocab-parallel embedding's
    output (the position embedding is not split) and the lm_head input's gradient, and the loss
    its three fp32 values per token. Every rank computes the layer norms and the biases after
    the all-reduces on the same whole tensors: no gradient sync."""
    if tp <= 1:
        return TPTraffic(0, 0, 0, 0.0, 0, 0.0)
    cfg, L = shape.cfg, shape.cfg.n_layer
    act = micro_batch * cfg.seq_len * cfg.n_embd
    loss_values = 3 * 2 * ring_bytes(FP32 * micro_batch * cfg.seq_len, tp)
    if kernel_set == "megatron-2021":
        ar_blk = 4 + (2 if activation_checkpointing else 0)
        ar = L * ar_blk + 2
        return TPTraffic(0, 0, ar + 3, ar * 2 * ring_bytes(act_bytes * act, tp) + loss_values,
                         0, 0.0)
    pos = cfg.seq_len * cfg.n_embd
    ag_blk = 4 + (2 if activation_checkpointing else 0)
    rs_blk = 4 + (1 if activation_checkpointing else 0)
    ag = L * ag_blk + 3  # root: lm_head in forward, wte and wpe in backward
    rs = L * rs_blk + 3  # root: wte and wpe in forward, lm_head in backward
    ar = 3
    moved = ((L * (ag_blk + rs_blk) + 4) * ring_bytes(act_bytes * act, tp)
             + 2 * ring_bytes(act_bytes * pos, tp)
             + loss_values)
    norms = L * shape.block_norm_params + shape.root_replicated_params
    sync = (2 * ring_bytes(grad_bytes * norms, tp)
            + ring_bytes(grad_bytes * L * shape.block_fused_bias_params, tp))
    return TPTraffic(ag, rs, ar, moved, 4 * L + 2 + L, sync)


def step_time(shape: ModelShape, gpu: GPU, net: Network, n_gpus: int, micro_batch: int,
              micro_batches_per_rank: int, *, activation_checkpointing: bool,
              dtype: str = "bfloat16", grad_sync: str = "microbatch",
              efficiency: float | None = None, kernel_set: str = "trainer",
              reshard_after_forward: bool = True, tp: int = 1, hsdp: bool = False,
              data_parallel: str = "fsdp2") -> StepTime:
    """One optimizer step on the slowest rank (the one with ceil(M / dp) micro-batches).

    Overlap (FSDP2's prefetching): the all-gather of block i+1 runs during block i's forward; in
    backward the gather of block i-1 and the reduce-scatter of block i+1 run during block i's
    backward. Exposed per block = max(0, comm - compute); the first gathers (root + block 0) of a
    micro-batch and the last reduce-scatters (block 0 + root) of a synced backward hide under
    nothing. Collectives share one network, so concurrent ones add up.

    reshard_after_forward=True (ZeRO-3): every micro-batch gathers root + L blocks in forward and
    L - 1 blocks again in backward (the last block is not resharded). False (the trainer's
    `never`, which also keeps the weights gathered between micro-batches): root + L blocks are
    gathered once per step, in the first micro-batch's forward, and never in backward.

    tp > 1: each rank computes 1/tp of every matmul; FSDP2 gathers and reduces the TP rank's part
    of each unit over the data-parallel ranks (tp such groups share a node's NICs); the TP
    collectives (`tp_traffic`) run on the intra-node link between the matmuls that need them, so
    they are on the critical path (none overlapped). hsdp: FSDP2's groups are the data-parallel
    ranks of one node, and each gradient sync adds an all-reduce of the reduce-scattered shard
    across nodes (every GPU of a node in its own replicate group: they share the NICs).

    data_parallel="megatron-2021" (`DATA_PARALLEL`): no FSDP collectives; each rank holds its
    part whole, accumulates its 16-bit gradients over the micro-batches, and after the step's
    last backward all-reduces them over the data-parallel ranks in one collective that nothing
    overlaps (Megatron-LM's `train_step` calls `allreduce_gradients` once `forward_backward_func`
    returns; without `--accumulate-allreduce-grads-in-fp32`, which SC21's fp16 runs did not set,
    in the parameters' dtype). Its optimizer updates the whole part on every rank.
    """
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} must be one of "
                         f"{', '.join(DATA_PARALLEL)}")
    cfg, pb, L, k = shape.cfg, dtype_bytes(dtype), shape.cfg.n_layer, micro_batches_per_rank
    mesh = make_mesh(n_gpus, tp, hsdp, net.gpus_per_node, data_parallel=data_parallel)
    kernels = Kernels(gpu, pb, float8=dtype == "float8")
    if efficiency is not None:  # every FLOP at one fraction of peak
        flops_s = gpu.peak_flops * efficiency
        tokens = micro_batch * cfg.seq_len
        fwd_blk = shape.block_fwd_flops_per_token * tokens / tp / flops_s
        bwd_blk = (2 + activation_checkpointing) * fwd_blk
        head = 3 * shape.head_fwd_flops_per_token * tokens / tp / flops_s
    else:
        block = block_times(kernels, micro_batch, cfg.seq_len, cfg.n_embd, tp,
                            n_head=cfg.n_head, dropout=cfg.dropout, kernel_set=kernel_set)
        fwd_blk = block.forward_s
        bwd_blk = block.backward_s + (block.forward_s if activation_checkpointing else 0.0)
        head = 0.0
        if shape.head_fwd_flops_per_token:  # a pipeline's first rank has no output layer
            out = head_times(kernels, micro_batch, cfg.seq_len, cfg.n_embd, cfg.vocab_size, tp)
            head = out.forward_s + out.backward_s
    compute_mb = L * (fwd_blk + bwd_blk) + head

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
    if mesh.replicated:
        # The DP group is the ranks of one TP position: gpus_per_node / tp of them in each node,
        # and the tp groups of a node share its NICs.
        all_reduce_bytes = 2 * ring_bytes(pb * shape.local_params(tp), mesh.dp)
        comm_s = exposed_s = net.ring_s(
            all_reduce_bytes, ranks=mesh.dp,
            per_node=net.gpus_per_node // tp if mesh.spans_nodes else mesh.dp,
            nic_sharing=tp, all_reduce=True)

    # FSDP2 accumulates unsharded grads in the reduce dtype (fp32) when it syncs once per step:
    # after every micro-batch's backward but the first, `unsharded_accumulated_grad +=` the new
    # bf16 gradient (FSDPParam.accumulate_unsharded_grad_if_needed): it reads both and writes
    # the fp32 sum, over every parameter this rank holds unsharded.
    # Megatron-LM 2021's replicas accumulate in the 16-bit .grad (autograd's AccumulateGrad adds
    # each micro-batch's gradient in place: it reads both and writes one).
    accumulated = grad_sync == "step" and k > 1 and not mesh.replicated
    accumulate_s = 0.0
    if efficiency is None and k > 1 and (accumulated or mesh.replicated):
        per_param = 3 * pb if mesh.replicated else pb + 2 * FP32
        accumulate_s = (k - 1) * kernels.memory_s(per_param * shape.local_params(tp))
    tpt = tp_traffic(shape, micro_batch, tp, activation_checkpointing=activation_checkpointing,
                     act_bytes=pb, grad_bytes=FP32 if accumulated else pb, kernel_set=kernel_set)
    tp_bytes = k * tpt.bytes_per_micro_batch + n_sync * tpt.bytes_per_sync
    tp_s = 0.0
    if tp > 1:  # one node's ring; the sync's collectives counted as all-reduces, the larger
        n_ring = k * (tpt.all_gathers + tpt.reduce_scatters)
        n_all_reduce = k * tpt.all_reduces + n_sync * tpt.sync_collectives
        tp_s = (tp_bytes / (net.intra_node_gbps * GB) + n_ring * net.ring_latency_s(tp, tp)
                + n_all_reduce * net.ring_latency_s(tp, tp, all_reduce=True))

    # Fused AdamW streams p, g, m, v in and p, m, v out (28 B/param) + the grad-norm read (4 B).
    local = shape.local_params(tp)
    per_param = MEGATRON_2021_OPTIMIZER_STEP_BYTES if mesh.replicated else 32
    optimizer_s = (per_param * local / mesh.dp_shard / (0.7 * gpu.hbm_gbps * GB)
                   if efficiency is not None
                   else kernels.memory_s(per_param * local / mesh.dp_shard))
    gather_bytes = (n_fwd_gathers * (pb * root + blk_pb * L * blk)
                    + k * regathers * blk_pb * blk)
    fsdp_syncs = n_sync
    if mesh.replicated:  # none of FSDP's gathers and reduce-scatters
        gather_bytes, fsdp_syncs = 0.0, 0
    return StepTime(compute_s=k * compute_mb + accumulate_s, comm_s=comm_s, exposed_comm_s=exposed_s,
                    optimizer_s=optimizer_s,
                    all_gather_bytes=ring_bytes(gather_bytes, mesh.dp_shard),
                    reduce_scatter_bytes=fsdp_syncs * ring_bytes(FP32 * local, mesh.dp_shard),
                    all_reduce_bytes=all_reduce_bytes,
                    tp_comm_s=tp_s, tp_bytes=tp_bytes)


def time_to_train_s(tokens: float, flops_per_token_: float, n_gpus: int,
                    achieved_flops_per_gpu: float) -> float:
    """Narayanan et al. 2021, eq. (4): end-to-end time = tokens * FLOPs/token / (n * X).

    With FLOPs/token ~ 8P (6P + 2P for recomputation) this is their 8TP / (nX).
    """
    return tokens * flops_per_token_ / (n_gpus * achieved_flops_per_gpu)


@dataclass
class LayoutCandidate:
    """One layout the planner weighs: micro-batch, checkpointing, gradient sync and resharding,
    with the memory and step time it predicts for them."""
    micro_batch: int
    activation_checkpointing: bool
    grad_sync: str
    micro_batches_per_rank: int
    memory: Memory
    step: StepTime
    reshard_after_forward: bool = True
    """True: ZeRO-3 (the trainer's `always`); False: blocks stay gathered (`never`)."""
    mesh: Mesh = field(default_factory=Mesh)
    """Tensor parallelism and how FSDP2 spreads over the data-parallel ranks."""

    @property
    def reshard_policy(self) -> str:
        """The value of the trainer's `train.reshard_after_forward` that runs this candidate."""
        return "always" if self.reshard_after_forward else "never"

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def hsdp(self) -> bool:
        return self.mesh.hsdp

    def settings(self) -> str:
        return (f"micro-batch {self.micro_batch}, checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}, grads per {self.grad_sync}, "
                f"reshard {self.reshard_policy}")


def choice_key(c: LayoutCandidate) -> tuple:
    """Fastest step; ties (one GPU: no communication to save) go to the larger micro-batch, then
    the smaller footprint, then the simpler mesh."""
    return (c.step.step_s, -c.micro_batch, c.memory.total, c.tp, c.hsdp)

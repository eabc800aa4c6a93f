"""Step time: one optimizer step's compute and communication on the slowest rank, time to train,
and the candidates the planner weighs.

Compute is each kernel of a block by its size (kernels.py), at the speed a calibration
(calibration.py) says this software reaches, or every FLOP at one efficiency; the model state's
collectives, accumulation and optimizer step are the software's (software.py; this trainer's
FSDP2 and HSDP: fsdp.py); the tensor-parallel collectives DTensor runs (tensor_parallel.py) are
on the critical path. A `LayoutCandidate` is one setting of the search
with the memory and step time predicted for it. Time to train is Narayanan et al. 2021, eq.
(4). GPU peaks and bandwidths come from hardware.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_gpt.cost_model.calibration import DEFAULT_CALIBRATION, ComputeTerms
from elastic_gpt.cost_model.kernels import Kernels, head_times
from elastic_gpt.cost_model.memory import Memory
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.shape import ModelShape, dtype_bytes
from elastic_gpt.cost_model.software import Software
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import GB, GPU

MATMUL_EFFICIENCY = 0.6
"""The one fraction of peak FLOP/s the uncalibrated model runs every FLOP at (`plan
--efficiency 0.6`). The default, efficiency None, is the calibrated model instead: each kernel
by its size (cost_model/kernels.py) at the calibration's speed (cost_model/calibration.py) and
each collective by NCCL's latency model, checked against published runs (docs/planner.md)."""


@dataclass
class StepTime:
    compute_s: float
    """Kernel time, recomputation included: every FLOP at peak x efficiency, or (efficiency
    None) each kernel as cost_model/kernels.py costs it at the calibration's speed, and FSDP2's
    gradient accumulation across micro-batches."""
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


def step_time(shape: ModelShape, gpu: GPU, net: Network, n_gpus: int, micro_batch: int,
              micro_batches_per_rank: int, *, activation_checkpointing: bool,
              dtype: str = "bfloat16", grad_sync: str = "microbatch",
              efficiency: float | None = None, reshard_after_forward: bool = True, tp: int = 1,
              hsdp: bool = False, software: Software = TRAINER,
              calibration: ComputeTerms | None = None, compiled: bool | None = None) -> StepTime:
    """One optimizer step on the slowest rank (the one with ceil(M / dp) micro-batches): its
    micro-batches' compute, the model state's collectives, accumulation and optimizer step
    (`software.model_state_step`; this trainer's FSDP2: fsdp.py, with its overlap), and the
    tensor-parallel collectives.

    tp > 1: each rank computes 1/tp of every matmul; the TP collectives (`software.tp_traffic`)
    run on the intra-node link between the matmuls that need them, so they are on the critical
    path (none overlapped). hsdp: FSDP2's groups are the data-parallel ranks of one node
    (fsdp.py).

    calibration: the terms the kernels run at (calibration.py); None, the default calibration's
    for this GPU. compiled: whether the blocks are compiled; None, as a plan writes them
    (`train.compile` with float8 only), so bf16 blocks run eager.
    """
    cfg, pb, L, k = shape.cfg, dtype_bytes(dtype), shape.cfg.n_layer, micro_batches_per_rank
    mesh = software.mesh(n_gpus, tp, hsdp, net.gpus_per_node)
    terms = DEFAULT_CALIBRATION.for_gpu(gpu).terms if calibration is None else calibration
    eager = not (dtype == "float8" if compiled is None else compiled)
    kernels = Kernels(gpu, pb, float8=dtype == "float8",
                      elementwise_bandwidth=terms.eager_elementwise if eager else 1.0)
    if efficiency is not None:  # every FLOP at one fraction of peak
        flops_s = gpu.peak_flops * efficiency
        tokens = micro_batch * cfg.seq_len
        fwd_blk = shape.block_fwd_flops_per_token * tokens / tp / flops_s
        bwd_blk = (2 + activation_checkpointing) * fwd_blk
        head = 3 * shape.head_fwd_flops_per_token * tokens / tp / flops_s
    else:
        block = software.block_times(kernels, micro_batch, cfg, tp)
        fwd_blk = block.forward_s
        # the recomputed forward runs as a forward does
        bwd_blk = (block.backward_s / terms.backward
                   + (block.forward_s if activation_checkpointing else 0.0))
        head = 0.0
        if shape.head_fwd_flops_per_token:  # a pipeline's first rank has no output layer
            out = head_times(kernels, micro_batch, cfg.seq_len, cfg.n_embd, cfg.vocab_size, tp)
            head = out.forward_s + out.backward_s / terms.backward
    compute_mb = L * (fwd_blk + bwd_blk) + head

    state = software.model_state_step(
        shape, net, mesh, kernels, k, block_forward_s=fwd_blk, block_backward_s=bwd_blk,
        dtype=dtype, grad_sync=grad_sync, reshard_after_forward=reshard_after_forward,
        efficiency=efficiency)
    tpt = software.tp_traffic(shape, micro_batch, tp,
                              activation_checkpointing=activation_checkpointing, act_bytes=pb,
                              grad_bytes=state.sync_grad_bytes)
    tp_bytes = k * tpt.bytes_per_micro_batch + state.gradient_syncs * tpt.bytes_per_sync
    tp_s = 0.0
    if tp > 1:  # one node's ring; the sync's collectives counted as all-reduces, the larger
        n_ring = k * (tpt.all_gathers + tpt.reduce_scatters)
        n_all_reduce = k * tpt.all_reduces + state.gradient_syncs * tpt.sync_collectives
        tp_s = (tp_bytes / (net.intra_node_gbps * GB) + n_ring * net.ring_latency_s(tp, tp)
                + n_all_reduce * net.ring_latency_s(tp, tp, all_reduce=True))
    return StepTime(compute_s=k * compute_mb + state.accumulate_s, comm_s=state.comm_s,
                    exposed_comm_s=state.exposed_comm_s, optimizer_s=state.optimizer_s,
                    all_gather_bytes=state.all_gather_bytes,
                    reduce_scatter_bytes=state.reduce_scatter_bytes,
                    all_reduce_bytes=state.all_reduce_bytes, tp_comm_s=tp_s, tp_bytes=tp_bytes)


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

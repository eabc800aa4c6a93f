"""What the cost model asks of the software a step runs on (`Software`), and what it gets back
for the model state (`ModelStateStep`).

Memory and step time are arithmetic over the model's shape, the mesh and the GPU; the pieces a
training stack decides (how a block's kernels run, what tensor parallelism sends and keeps, how
data-parallel ranks hold the model state and sync gradients, how a pipeline is cut and what
crosses a stage boundary) are asked of a `Software`. This trainer's answers are
trainer_software.py's `TRAINER`, the default everywhere; the repository's validation/ wing
answers for the software published runs ran, to check the cost model against their
measurements, and nothing here knows of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from elastic_gpt.cost_model.kernels import BlockTimes, Kernels
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.shape import ModelShape
from elastic_gpt.cost_model.tensor_parallel import TPTraffic
from elastic_gpt.model.config import ModelConfig


@dataclass(frozen=True)
class ModelStateStep:
    """What holding the model state over the data-parallel ranks costs one rank in one step: the
    collectives that gather parameters and reduce gradients, the gradients kept across
    micro-batches, the optimizer step."""

    comm_s: float
    """The collectives' time if none of it overlapped compute."""
    exposed_comm_s: float
    """The part of comm_s compute does not hide."""
    all_gather_bytes: float
    reduce_scatter_bytes: float
    all_reduce_bytes: float
    """Per GPU per step (bytes this rank sends; it receives as many)."""
    accumulate_s: float
    """Adding each micro-batch's gradients to the ones kept from the micro-batches before."""
    optimizer_s: float
    gradient_syncs: int
    """Gradient syncs per step: the tensor-parallel gradient collectives run at each."""
    sync_grad_bytes: int
    """Bytes of a gradient element when it is synced (fp32 once accumulated in fp32)."""


class Software(Protocol):
    """The pieces of a step's cost that depend on the software running it."""

    def mesh(self, n_gpus: int, tp: int, hsdp: bool, gpus_per_node: int, pp: int = 1,
             stages_per_rank: int = 1) -> Mesh:
        """The layout the software builds for n_gpus ranks at this tp, HSDP and pipeline."""

    def block_times(self, kernels: Kernels, micro_batch: int, cfg: ModelConfig,
                    tp: int) -> BlockTimes:
        """One micro-batch through one transformer block on one tensor-parallel rank."""

    def activation_bytes(self, cfg: ModelConfig, micro_batch: int, tp: int,
                         act_bytes: int) -> tuple[float, float]:
        """(what one layer saves for its backward, one (b, s, h) tensor of the residual stream as
        a tensor-parallel rank holds it: what a checkpointed block keeps), bytes per rank."""

    def tp_traffic(self, shape: ModelShape, micro_batch: int, tp: int, *,
                   activation_checkpointing: bool, act_bytes: int,
                   grad_bytes: int) -> TPTraffic:
        """The tensor-parallel collectives of one micro-batch and of one gradient sync."""

    def model_state_bytes(self, shape: ModelShape, tp: int, dp_shard: int, act_bytes: int, *,
                          grad_sync: str, micro_batches_per_rank: int,
                          reshard_after_forward: bool) -> tuple[float, float, float]:
        """(the optimizer's state and master weights, the parameters and gradients held whole
        for compute, gradients kept across micro-batches), bytes per rank at its peak."""

    def model_state_step(self, shape: ModelShape, net: Network, mesh: Mesh, kernels: Kernels,
                         micro_batches: int, *, block_forward_s: float,
                         block_backward_s: float, dtype: str, grad_sync: str,
                         reshard_after_forward: bool,
                         efficiency: float | None) -> ModelStateStep:
        """The model state's part of one step on the slowest rank (`micro_batches` of them),
        against a block's forward and backward time (what its collectives can overlap)."""

    def pipeline_cut_problem(self, cfg: ModelConfig, pp: int,
                             stages_per_rank: int = 1) -> str | None:
        """Why the software cannot cut the model into pp ranks of `stages_per_rank` stages
        each (beyond a block per stage), or None."""

    def fills_pipeline(self, mesh: Mesh, micro_batches: int) -> bool:
        """Whether the schedule runs a step of `micro_batches` per pipeline."""

    def stage_receive_s(self, net: Network, mesh: Mesh, micro_batch: int, cfg: ModelConfig,
                        act_bytes: int) -> float:
        """Time a rank spends on one received hidden state beyond its transfer (nothing, or the
        gather of its parts over the tensor-parallel ranks)."""

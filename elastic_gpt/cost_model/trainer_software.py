"""This trainer as the cost model's `Software` (software.py): SDPA's flash attention, DTensor's
tensor parallelism with sequence parallelism (parallel/tensor.py), FSDP2 and HSDP
(parallel/fsdp.py), torch's pipeline schedules on stages balanced by cost (parallel/pipeline.py).
Each method says which module of the cost model holds the arithmetic."""

from __future__ import annotations

from elastic_gpt.cost_model.activations import activation_bytes_per_layer
from elastic_gpt.cost_model.fsdp import fsdp_state_bytes, fsdp_step
from elastic_gpt.cost_model.kernels import BlockTimes, Kernels, block_times
from elastic_gpt.cost_model.mesh import Mesh, make_mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.shape import ModelShape
from elastic_gpt.cost_model.software import ModelStateStep
from elastic_gpt.cost_model.tensor_parallel import TPTraffic, tp_traffic
from elastic_gpt.model.config import ModelConfig


def block_linear_shapes(cfg: ModelConfig) -> list[tuple[int, int, str]]:
    """(in, out, tensor-parallel split) of each of the family's block linears."""
    return [(lin.d_in, lin.d_out, lin.split) for lin in cfg.block_linears()]


class TrainerSoftware:
    """The software this repository trains with. validation/ subclasses it for the software of
    published runs, overriding the pieces that differ."""

    def mesh(self, n_gpus: int, tp: int, hsdp: bool, gpus_per_node: int, pp: int = 1,
             stages_per_rank: int = 1) -> Mesh:
        """parallel/mesh.py's layout (mesh.py `make_mesh`)."""
        return make_mesh(n_gpus, tp, hsdp, gpus_per_node, pp, stages_per_rank)

    def block_times(self, kernels: Kernels, micro_batch: int, cfg: ModelConfig,
                    tp: int) -> BlockTimes:
        """Flash attention, the layer norms on the sequence shard (kernels.py `block_times`),
        the family's linears and MLP activation (model/config.py's block description)."""
        return block_times(kernels, micro_batch, cfg.seq_len, cfg.n_embd, tp,
                           dropout=cfg.dropout, linears=block_linear_shapes(cfg),
                           mlp_width=cfg.mlp_elementwise_width)

    def activation_bytes(self, cfg: ModelConfig, micro_batch: int, tp: int,
                         act_bytes: int) -> tuple[float, float]:
        """activations.py's layer; the residual stream sequence-sharded over the TP ranks."""
        s, b, h = cfg.seq_len, micro_batch, cfg.n_embd
        per_layer = activation_bytes_per_layer(
            s, b, h, cfg.n_head, act_bytes=act_bytes, dropout=cfg.dropout > 0, tp=tp,
            qkv_width=h + 2 * cfg.n_kv_head * cfg.head_dim, mlp_saved_width=cfg.mlp_saved_width,
            norm_fp32_copies=cfg.norm_fp32_copies)
        return per_layer, act_bytes * s * b * h / tp

    def tp_traffic(self, shape: ModelShape, micro_batch: int, tp: int, *,
                   activation_checkpointing: bool, act_bytes: int,
                   grad_bytes: int) -> TPTraffic:
        """DTensor's collectives for the trainer's plan (tensor_parallel.py)."""
        return tp_traffic(shape, micro_batch, tp, activation_checkpointing=activation_checkpointing,
                          act_bytes=act_bytes, grad_bytes=grad_bytes)

    def model_state_bytes(self, shape: ModelShape, tp: int, dp_shard: int, act_bytes: int, *,
                          grad_sync: str, micro_batches_per_rank: int,
                          reshard_after_forward: bool) -> tuple[float, float, float]:
        """FSDP2's (fsdp.py `fsdp_state_bytes`)."""
        return fsdp_state_bytes(shape, tp, dp_shard, act_bytes, grad_sync=grad_sync,
                                micro_batches_per_rank=micro_batches_per_rank,
                                reshard_after_forward=reshard_after_forward)

    def model_state_step(self, shape: ModelShape, net: Network, mesh: Mesh, kernels: Kernels,
                         micro_batches: int, *, block_forward_s: float,
                         block_backward_s: float, dtype: str, grad_sync: str,
                         reshard_after_forward: bool,
                         efficiency: float | None) -> ModelStateStep:
        """FSDP2's (fsdp.py `fsdp_step`)."""
        return fsdp_step(shape, net, mesh, kernels, micro_batches,
                         block_forward_s=block_forward_s, block_backward_s=block_backward_s,
                         dtype=dtype, grad_sync=grad_sync,
                         reshard_after_forward=reshard_after_forward, efficiency=efficiency)

    def pipeline_cut_problem(self, cfg: ModelConfig, pp: int,
                             stages_per_rank: int = 1) -> str | None:
        """None: the trainer balances any cut by cost (pipeline.py `stage_layers`)."""
        return None

    def fills_pipeline(self, mesh: Mesh, micro_batches: int) -> bool:
        """Torch's schedules need at least pp micro-batches a step (config validation's rule)."""
        return micro_batches >= mesh.pp

    def stage_receive_s(self, net: Network, mesh: Mesh, micro_batch: int, cfg: ModelConfig,
                        act_bytes: int) -> float:
        """Nothing: each TP rank receives the sequence shard it computes on."""
        return 0.0


TRAINER = TrainerSoftware()
"""The cost model's default software: this trainer."""

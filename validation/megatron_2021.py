"""Megatron-LM as SC21's runs ran it, as the cost model's `Software`
(elastic_gpt/cost_model/software.py), read from its source at a8d172b3 (28 April 2021, the
month SC21 was posted). What differs from this trainer:

- kernels: QK^T and AV as batched matmuls around a softmax and a dropout over the (b, a/t, s, s)
  scores (as Calculon's Megatron block models them), and the layer norms, dropouts and residual
  adds over the whole sequence on every TP rank (sequence parallelism came in 2022);
- what a layer saves: Korthikanti et al. 2022's section 4.2.1, sbh(10 + 24/t + 5as/(ht)), the
  scores materialised; each checkpointed block's input whole on every TP rank
  (mpu/random.py `CheckpointFunction` splits it only with
  `--distribute-checkpointed-activations`, off by default and in the GPT-3 example script);
- tensor parallelism without sequence parallelism (mpu/mappings.py): each block all-reduces
  whole (s, b, h) activations, 2 in forward, 2 in backward and 2 again in the recomputed
  forward; no gradient sync of the layer norms;
- data parallelism (`--DDP-impl local`, the default): every data-parallel rank a replica of its
  tp x pp part, 16-bit params and grads, fp32 master params and Adam's moments (12 bytes a
  parameter, `Float16OptimizerWithFloat16Params`); gradients accumulated in place in the 16-bit
  `.grad` and all-reduced once, after the step's backward, in one collective nothing overlaps
  (`train_step` -> `allreduce_gradients`; in the params' dtype without
  `--accumulate-allreduce-grads-in-fp32`, which SC21's fp16 runs did not set); its optimizer
  step moves 52 bytes a parameter on every rank;
- pipelines: the same blocks on every stage (`ParallelTransformer` asserts num_layers % pp ==
  0), interleaved only past 2 stages (arguments.py) with each rank's blocks split evenly over
  its chunks and a multiple of pp micro-batches (training.py); every stage boundary sends 1/tp
  of the whole tensor from each TP rank and the receiver all-gathers it over NVLink
  (p2p_communication.py's scatter/gather, on by default).

`Megatron2021Kernels` is the first three on this trainer's FSDP2 (what SC21's software would
plan in this trainer's layouts, and the kernels of the ZeRO-3 runs); `Megatron2021` is all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.cost_model.kernels import (
    BlockTimes,
    Kernels,
    block_elementwise_s,
    block_linears_s,
)
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network, ring_bytes
from elastic_gpt.cost_model.shape import FP32, ModelShape, dtype_bytes
from elastic_gpt.cost_model.software import ModelStateStep
from elastic_gpt.cost_model.tensor_parallel import TPTraffic
from elastic_gpt.cost_model.trainer_software import TrainerSoftware
from elastic_gpt.hardware import GB
from elastic_gpt.model.config import GPTConfig

OPTIMIZER_BYTES_PER_PARAM = 12
"""Megatron-LM 2021's mixed-precision optimizer (`Float16OptimizerWithFloat16Params`): fp32
main params (4) + Adam m and v (4 + 4) beside the 16-bit params and grads. The fp32 copy of the
grads it makes for the step lives only in the step, after the activations are freed."""
OPTIMIZER_STEP_BYTES = 6 + 8 + 4 + 28 + 6
"""Bytes a parameter Megatron-LM 2021's optimizer step reads and writes
(`Float16OptimizerWithFloat16Params.step`, megatron/optimizer/optimizer.py): the 16-bit
gradient copied into a new fp32 one (`_copy_model_grads_to_main_grads`), unscaled in place with
the inf check (`_unscale_main_grads_and_check_for_nan`), read for the norm (`clip_grad_norm_fp32`;
scaled as well only when the norm is clipped, not counted), apex's fused Adam (p, g, m, v in, p,
m, v out), and the fp32 weights copied back into the 16-bit ones
(`_copy_main_params_to_model_params`). FSDP2's step is the fused Adam and the norm's read, 32."""


def materialised_activation_bytes(seq_len: int, micro_batch: int, n_embd: int, n_head: int, *,
                                  act_bytes: int = 2, dropout: bool = False, tp: int = 1,
                                  sequence_parallel: bool = False) -> float:
    """What one layer saves for backward with the attention scores materialised: Korthikanti et
    al. 2022's count, s*b*h*(34 + 5*a*s/h) bytes in 16 bits without tensor parallelism (section
    4.1: attention 11sbh + 5as^2b, MLP 19sbh, two LayerNorms 4sbh; 2sbh of the 34 the dropout
    masks, 5as^2b the scores, their softmax, its dropout mask and output).

    Under tensor parallelism without sequence parallelism (Megatron-LM 2021, section 4.2.1:
    sbh(10 + 24/t + 5as/(ht))) the LayerNorms' inputs, the column-parallel inputs and the two
    dropout masks are whole on every TP rank. With sequence parallelism (section 4.2.2,
    sbh(34/t + 5as/(ht))) as DTensor runs it, the column-parallel inputs stay whole (autograd
    keeps the gathered tensor: the trainer's elastic_gpt/cost_model/activations.py)."""
    s, b, h, a = seq_len, micro_batch, n_embd, n_head
    whole = 2  # c_attn's and c_fc's inputs (the gathered LayerNorm outputs under TP)
    split = (2 + 1  # attention: q and k, v ...
             + 1  # ... and c_proj's input
             + 4 + 4)  # MLP: GELU input, c_proj input
    norms = 2  # ln_1 and ln_2 inputs (the residual stream): sequence-sharded, or whole
    if sequence_parallel:
        split += norms
    else:
        whole += norms
    total = (whole + split / tp) * s * b * h * act_bytes
    if dropout:  # 1-byte masks after attention c_proj and after the MLP
        total += 2 * s * b * h / (tp if sequence_parallel else 1)
    total += (5 if dropout else 2) * a * s * s * b / tp  # 2-byte scores (+ mask + dropped copy)
    return total


class Megatron2021Kernels(TrainerSoftware):
    """Megatron-LM 2021's kernels, activations and tensor parallelism, on this trainer's FSDP2
    data parallelism and pipeline cuts."""

    def block_times(self, kernels: Kernels, micro_batch: int, cfg: GPTConfig,
                    tp: int) -> BlockTimes:
        """Unfused attention over materialised scores; the layer norms, dropouts and residual
        adds over the whole sequence on every TP rank."""
        k, b, s, h, t, pb = kernels, micro_batch, cfg.seq_len, cfg.n_embd, tp, kernels.act_bytes
        linears_fwd, linears_bwd = block_linears_s(k, b * s, h, t)
        row = b * s * h / t * pb  # one (b, s, h / t) tensor
        scores = b * cfg.n_head / t * s * s  # elements
        half = 2 * b * s * s * h / t  # FLOPs of QK^T, and of AV
        bmm = (half / (k.gpu.peak_flops * k.matrix_efficiency(half))
               + k.memory_s(2 * row + scores * pb))
        drop = cfg.dropout > 0
        attn_fwd = (2 * bmm + k.memory_s(2 * scores * pb)
                    + (k.memory_s(scores * (2 * pb + 1)) if drop else 0.0))
        attn_bwd = (4 * bmm + k.memory_s(3 * scores * pb)
                    + (k.memory_s(scores * (2 * pb + 1)) if drop else 0.0))
        forward, backward = block_elementwise_s(k, row, b * s * h * pb, cfg.dropout)
        return BlockTimes(forward_s=linears_fwd + attn_fwd + forward,
                          backward_s=linears_bwd + attn_bwd + backward)

    def activation_bytes(self, cfg: GPTConfig, micro_batch: int, tp: int,
                         act_bytes: int) -> tuple[float, float]:
        """Section 4.2.1's layer with the scores; the residual stream whole on every TP rank."""
        s, b, h = cfg.seq_len, micro_batch, cfg.n_embd
        per_layer = materialised_activation_bytes(s, b, h, cfg.n_head, act_bytes=act_bytes,
                                                  dropout=cfg.dropout > 0, tp=tp)
        return per_layer, float(act_bytes * s * b * h)

    def tp_traffic(self, shape: ModelShape, micro_batch: int, tp: int, *,
                   activation_checkpointing: bool, act_bytes: int,
                   grad_bytes: int) -> TPTraffic:
        """Each block all-reduces its attention's and its MLP's row-parallel outputs in forward
        (`reduce_from_tensor_model_parallel_region`) and its column-parallel inputs' gradients
        in backward (`copy_to_tensor_model_parallel_region`), and its checkpointed forward runs
        again whole, both of its all-reduces with it; the root all-reduces the vocab-parallel
        embedding's output (the position embedding is not split) and the lm_head input's
        gradient, and the loss its three fp32 values per token. Every rank computes the layer
        norms and the biases after the all-reduces on the same whole tensors: no gradient
        sync."""
        if tp <= 1:
            return TPTraffic(0, 0, 0, 0.0, 0, 0.0)
        cfg, L = shape.cfg, shape.cfg.n_layer
        act = micro_batch * cfg.seq_len * cfg.n_embd
        loss_values = 3 * 2 * ring_bytes(FP32 * micro_batch * cfg.seq_len, tp)
        ar_blk = 4 + (2 if activation_checkpointing else 0)
        ar = L * ar_blk + 2
        return TPTraffic(0, 0, ar + 3, ar * 2 * ring_bytes(act_bytes * act, tp) + loss_values,
                         0, 0.0)

    def stage_receive_s(self, net: Network, mesh: Mesh, micro_batch: int, cfg: GPTConfig,
                        act_bytes: int) -> float:
        """Every TP rank keeps whole (s, b, h) tensors: each sends its 1/tp and the receiver
        all-gathers them over the node's link (`gather_split_1d_tensor`)."""
        if mesh.tp <= 1:
            return 0.0
        whole = micro_batch * cfg.seq_len * cfg.n_embd * act_bytes
        return net.ring_s(ring_bytes(whole, mesh.tp), ranks=mesh.tp, per_node=mesh.tp)


@dataclass(frozen=True)
class ReplicatedMesh(Mesh):
    """Megatron-LM 2021's data parallelism: every data-parallel rank holds its tp x pp part of
    the model state whole (dp_shard = 1, dp_replicate = dp); not HSDP."""

    @property
    def hsdp(self) -> bool:
        return False

    def dp_short(self) -> str:
        return f"DDP {self.dp}"

    def dp_label(self) -> str:
        return (f"replicated over {self.dp}, gradients all-reduced after backward "
                "as Megatron-LM 2021 did")


class Megatron2021(Megatron2021Kernels):
    """Megatron-LM 2021 whole: its kernels, its replicas and its pipelines."""

    def mesh(self, n_gpus: int, tp: int, hsdp: bool, gpus_per_node: int, pp: int = 1,
             stages_per_rank: int = 1) -> Mesh:
        stage = n_gpus // pp
        return ReplicatedMesh(tp, 1, stage // tp, stage > gpus_per_node, pp, stages_per_rank)

    def model_state_bytes(self, shape: ModelShape, tp: int, dp_shard: int, act_bytes: int, *,
                          grad_sync: str, micro_batches_per_rank: int,
                          reshard_after_forward: bool) -> tuple[float, float, float]:
        """fp32 params and Adam's moments, and the 16-bit params and grads, of the rank's whole
        part; nothing gathered or accumulated apart."""
        local = shape.local_params(tp)
        return OPTIMIZER_BYTES_PER_PARAM * local, 2 * act_bytes * local, 0.0

    def model_state_step(self, shape: ModelShape, net: Network, mesh: Mesh, kernels: Kernels,
                         micro_batches: int, *, block_forward_s: float,
                         block_backward_s: float, dtype: str, grad_sync: str,
                         reshard_after_forward: bool,
                         efficiency: float | None) -> ModelStateStep:
        """One all-reduce of the 16-bit gradients after the step's backward, on the critical
        path: the data-parallel group is the ranks of one TP position, gpus_per_node / tp of
        them in each node, and the tp groups of a node share its NICs. The gradients accumulate
        in the 16-bit .grad (autograd's AccumulateGrad adds each micro-batch's gradient in place:
        it reads both and writes one)."""
        pb, k, tp = dtype_bytes(dtype), micro_batches, mesh.tp
        local = shape.local_params(tp)
        all_reduce_bytes = 2 * ring_bytes(pb * local, mesh.dp)
        comm_s = net.ring_s(all_reduce_bytes, ranks=mesh.dp,
                            per_node=net.gpus_per_node // tp if mesh.spans_nodes else mesh.dp,
                            nic_sharing=tp, all_reduce=True)
        accumulate_s = 0.0
        if efficiency is None and k > 1:
            accumulate_s = (k - 1) * kernels.memory_s(3 * pb * local)
        optimizer_s = (OPTIMIZER_STEP_BYTES * local / mesh.dp_shard
                       / (0.7 * kernels.gpu.hbm_gbps * GB) if efficiency is not None
                       else kernels.memory_s(OPTIMIZER_STEP_BYTES * local / mesh.dp_shard))
        return ModelStateStep(comm_s=comm_s, exposed_comm_s=comm_s, all_gather_bytes=0.0,
                              reduce_scatter_bytes=0.0, all_reduce_bytes=all_reduce_bytes,
                              accumulate_s=accumulate_s, optimizer_s=optimizer_s,
                              gradient_syncs=1, sync_grad_bytes=pb)

    def pipeline_cut_problem(self, cfg: GPTConfig, pp: int,
                             stages_per_rank: int = 1) -> str | None:
        L, v = cfg.n_layer, stages_per_rank
        if L % pp:
            return f"Megatron-LM 2021 needs --pp={pp} to divide the model's {L} blocks"
        if v > 1 and not (pp > 2 and (L // pp) % v == 0):
            return (f"Megatron-LM 2021 interleaves only pipelines of more than 2 stages whose "
                    f"{L // pp} blocks per rank split evenly into --pp-stages-per-rank={v} "
                    "chunks")
        return None

    def fills_pipeline(self, mesh: Mesh, micro_batches: int) -> bool:
        return micro_batches >= mesh.pp and (mesh.stages_per_rank == 1
                                             or micro_batches % mesh.pp == 0)


MEGATRON_2021_KERNELS = Megatron2021Kernels()
MEGATRON_2021 = Megatron2021()

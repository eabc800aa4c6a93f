"""What a transformer block's kernels take on one GPU: each matmul at the fraction of peak its
size reaches, each memory-bound kernel (layer norms, GELU, residual adds, the loss) at the
fraction of HBM bandwidth its size reaches.

The method and the curves are Calculon's (Isaev et al. 2023, "Calculon: a Methodology and Tool
for High-Level Co-Design of Systems and Large Language Models", SC23; its published A100-80GB
and H100 system files, systems/a100_80g.json and systems/h100_80g_nvl8.json): a kernel takes
its FLOPs at the matrix efficiency for its size plus its bytes at the memory efficiency for its
size, no overlap of the two (the "no_overlap" processing mode both files use). The curves are
steps: the first row whose size the kernel reaches gives its efficiency. Calculon's authors
validated this against Megatron-LM's measured iteration times on Selene (Korthikanti et al.
2022, Table 5); the planner's own check against those and other published runs is the
repository's validation/ wing. Calculon's A100 and H100 files give the same curves; their top is
scaled to each GPU's measured matmul ceiling (hardware.py `MAMF_CEILINGS`).

Per TP rank, with b the micro-batch, s the sequence, h the width, t the tensor-parallel degree
(parallel/tensor.py's plan: Megatron's column/row split with sequence parallelism, so the layer
norms, GELU's input aside, and the residual adds each see s / t of the sequence):

- matmuls (M x K times K x N, 2MKN FLOPs, (MK + KN + MN) elements moved): c_attn (bs, h, 3h/t),
  attn.c_proj (bs, h/t, h), mlp.c_fc (bs, h, 4h/t), mlp.c_proj (bs, 4h/t, h); backward runs two
  of each size (the input's and the weight's gradients). Biases are fused into the matmul.
- attention: flash (SDPA's kernel) takes 4 b s^2 h / t FLOPs as model/gpt.py counts them (QK^T
  and AV over the full sequence) and moves q, k, v and the output. Backward takes twice the
  matmul FLOPs.
- memory-bound: a layer norm reads and writes a row, GELU four rows, a residual add reads two
  and writes one, a dropout reads one and writes one and a one-byte mask; in backward each reads
  its input and the gradient and writes one.
- the output layer: the lm_head matmul (bs, h, V/t) and the loss over the (b, s, V/t) logits,
  which reads them, upcasts them to fp32 and writes their log-softmax (model/gpt.py's loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic_gpt.cost_model.shape import FP32
from elastic_gpt.hardware import (
    GB,
    GPU,
    UNMEASURED_FP8_MATMUL_CEILING,
    UNMEASURED_MATMUL_CEILING,
)

MATRIX_EFFICIENCY = ((128e9, 0.95), (16e9, 0.9), (1e9, 0.6), (0.0, 0.1))
"""(kernel FLOPs at least, fraction of peak): Calculon's A100-80GB and H100 matrix curves."""
MEMORY_EFFICIENCY = ((100e6, 0.9), (10e6, 0.75), (1e6, 0.6), (0.0, 0.3))
"""(kernel bytes at least, fraction of HBM bandwidth): Calculon's A100-80GB and H100 HBM
curves."""


def step_efficiency(curve: tuple[tuple[float, float], ...], size: float) -> float:
    return next(eff for least, eff in curve if size >= least)


@dataclass(frozen=True)
class Kernels:
    """The GPU and dtype a step runs in."""

    gpu: GPU
    act_bytes: int
    float8: bool = False
    """The blocks' linears in float8 (`train.float8`, torchao's dynamic tensorwise scaling):
    their matmuls at the float8 peak and ceiling, each bf16 operand read for its scale, read
    again and written in float8 first (5 bytes an element). Attention and the output layer stay
    in bf16."""
    elementwise_bandwidth: float = 1.0
    """The fraction of the modelled HBM bandwidth a block's elementwise kernels reach: below 1
    for eager blocks, each op its own kernel (cost_model/calibration.py `eager_elementwise`)."""

    def matrix_efficiency(self, flops: float, float8: bool = False) -> float:
        """Calculon's curve, its top scaled to the GPU's measured bf16 (or float8) matmul
        ceiling (hardware.py)."""
        ceiling = (self.gpu.fp8_matmul_ceiling or UNMEASURED_FP8_MATMUL_CEILING if float8
                   else self.gpu.matmul_ceiling or UNMEASURED_MATMUL_CEILING)
        return step_efficiency(MATRIX_EFFICIENCY, flops) * ceiling / MATRIX_EFFICIENCY[0][1]

    def matmul_s(self, m: float, k: float, n: float) -> float:
        flops = 2 * m * k * n
        return (flops / (self.gpu.peak_flops * self.matrix_efficiency(flops))
                + self.memory_s((m * k + k * n + m * n) * self.act_bytes))

    def linear_s(self, m: float, k: float, n: float) -> tuple[float, float]:
        """A block linear's forward and backward: (m, k) x (k, n), and in backward the input's
        and the weight's gradients, each a matmul of the same FLOPs."""
        if not self.float8:
            one = self.matmul_s(m, k, n)
            return one, 2 * one
        flops = 2 * m * k * n
        one = (flops / (self.gpu.fp8_peak_flops * self.matrix_efficiency(flops, float8=True))
               + self.memory_s(m * k + k * n + m * n * self.act_bytes))
        # forward casts the input; backward the output's gradient and the input again
        return (one + self.memory_s(5 * m * k),
                2 * one + self.memory_s(5 * m * n) + self.memory_s(5 * m * k))

    def memory_s(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.gpu.hbm_gbps * GB * step_efficiency(MEMORY_EFFICIENCY, nbytes))

    def elementwise_s(self, nbytes: float) -> float:
        """A block's elementwise kernel (norm, activation, residual add, dropout)."""
        return self.memory_s(nbytes) / self.elementwise_bandwidth


@dataclass(frozen=True)
class BlockTimes:
    """One micro-batch through one block (or the output layer) on one TP rank."""

    forward_s: float
    backward_s: float


def block_times(k: Kernels, micro_batch: int, seq_len: int, n_embd: int, tp: int, *,
                dropout: float = 0.0, linears: Sequence[tuple[int, int, str]] | None = None,
                mlp_width: float | None = None) -> BlockTimes:
    """A block as this trainer runs it: SDPA's flash attention, and under tensor parallelism the
    layer norms, dropouts and residual adds on the sequence shard (sequence parallelism).
    `linears` and `mlp_width`: the family's block (`block_linears_s`, `block_elementwise_s`);
    None: GPT-2's."""
    b, s, h, t, pb = micro_batch, seq_len, n_embd, tp, k.act_bytes
    linears_fwd, linears_bwd = block_linears_s(k, b * s, h, t, linears)
    row = b * s * h / t * pb  # one (b, s / t, h) or (b, s, h / t) tensor
    attn_flops = 4 * b * s * s * h / t
    attn_fwd = (attn_flops / (k.gpu.peak_flops * k.matrix_efficiency(attn_flops))
                + k.memory_s(4 * row))
    attn_bwd = 2 * attn_fwd
    forward, backward = block_elementwise_s(k, row, row, dropout,
                                            mlp_rows=mlp_width / h if mlp_width else 4)
    return BlockTimes(forward_s=linears_fwd + attn_fwd + forward,
                      backward_s=linears_bwd + attn_bwd + backward)


def block_linears_s(k: Kernels, tokens: int, n_embd: int, tp: int,
                    linears: Sequence[tuple[int, int, str]] | None = None) -> tuple[float, float]:
    """(forward, backward) of a block's linears on one TP rank, each (in, out, split): "col"
    split by output units, "row" by input units (Megatron's split). None: GPT-2's four, c_attn
    and mlp.c_fc by columns, the two c_proj by rows."""
    h, t = n_embd, tp
    if linears is None:
        linears = [(h, 3 * h, "col"), (h, h, "row"), (h, 4 * h, "col"), (4 * h, h, "row")]
    times = [k.linear_s(tokens, d_in, d_out / t) if split == "col"
             else k.linear_s(tokens, d_in / t, d_out) for d_in, d_out, split in linears]
    return sum(f for f, _ in times), sum(b for _, b in times)


def block_elementwise_s(k: Kernels, row: float, seq_row: float,
                        dropout: float, mlp_rows: float = 4) -> tuple[float, float]:
    """(forward, backward) of a block's memory-bound kernels: `row` the bytes of one (b, s / t,
    h) or (b, s, h / t) tensor, `seq_row` those of the tensors the layer norms, dropouts and
    residual adds run on (the sequence shard under sequence parallelism).

    Forward: a norm reads and writes a row, GELU four (`mlp_rows`: the MLP activation's width in
    rows, another family's), a residual add reads two and writes one; backward: a norm and a
    residual add read their input and the gradient and write one, GELU the same at four rows.
    Dropout (after attn.c_proj and mlp.c_proj) reads a row and writes it and a one-byte mask,
    forward and backward."""
    pb, ew = k.act_bytes, k.elementwise_s
    dropouts = 2 * ew(2 * seq_row + seq_row / pb) if dropout > 0 else 0.0
    forward = (2 * ew(2 * seq_row) + ew(2 * mlp_rows * row) + 2 * ew(3 * seq_row) + dropouts)
    backward = (2 * ew(3 * seq_row) + ew(3 * mlp_rows * row) + 2 * ew(3 * seq_row) + dropouts)
    return forward, backward


def head_times(k: Kernels, micro_batch: int, seq_len: int, n_embd: int, vocab_size: int,
               tp: int) -> BlockTimes:
    bs, t = micro_batch * seq_len, tp
    matmul = k.matmul_s(bs, n_embd, vocab_size / t)
    logits = bs * vocab_size / t
    loss_fwd = k.memory_s(logits * (k.act_bytes + FP32))  # read logits, write log-probs
    loss_bwd = k.memory_s(logits * (FP32 + k.act_bytes))  # read log-probs, write the gradient
    return BlockTimes(forward_s=matmul + loss_fwd, backward_s=2 * matmul + loss_bwd)

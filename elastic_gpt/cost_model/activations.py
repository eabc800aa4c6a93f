"""What a transformer block saves for its backward, as this trainer runs it (SDPA's flash
attention; under tensor parallelism DTensor's plan with sequence parallelism): Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sections 4.1 and
4.2.2, adapted to what flash attention and DTensor keep."""

from __future__ import annotations

from elastic_gpt.cost_model.shape import FP32


def activation_bytes_per_layer(seq_len: int, micro_batch: int, n_embd: int, n_head: int, *,
                               act_bytes: int = 2, dropout: bool = False,
                               tp: int = 1, qkv_width: int | None = None,
                               mlp_saved_width: int | None = None,
                               norm_fp32_copies: int = 0) -> float:
    """Activations one transformer layer saves for backward (Korthikanti et al. 2022, section 4.1).

    Their count for 16-bit activations, no tensor parallelism, is s*b*h*(34 + 5*a*s/h) bytes:
    attention 11sbh + 5as^2b, MLP 19sbh, two LayerNorms 4sbh, where 2sbh of the 34 are the 1-byte
    dropout masks and 5as^2b is the score matrix (softmax output 2, its dropout mask 1, dropout
    output 2). Adapted here: flash/SDPA attention stores no s*s scores, only the output (s*b*h, an
    extra tensor because the transpose to (B, T, C) copies it) and a fp32 log-sum-exp per row and
    head (4*a*s*b bytes); without dropout there are no masks.

    With tensor parallelism tp and sequence parallelism (their section 4.2.2: sbh(34/t + 5as/(ht)))
    every tensor is split tp ways except two: the inputs of c_attn and c_fc. They are the
    LayerNorm outputs all-gathered over the sequence, and autograd keeps the gathered tensor for
    the column-parallel weight's gradient (Megatron-LM keeps the shard and gathers it again in
    backward; DTensor's ColwiseParallel does not), so they stay whole.

    Another family's block (model/config.py's description of it) changes two counts: the width
    of q, k and v together (`qkv_width`; None: GPT-2's 3h; grouped-query attention's k and v are
    narrower) and what its MLP keeps per token (`mlp_saved_width`; None: GPT-2's GELU input and
    c_proj input, 8h; a SwiGLU keeps its gate, up, SiLU and product, four times its width),
    and `norm_fp32_copies`: fp32 rows per token its norms keep beyond their inputs (an RMSNorm
    that takes its mean square in fp32 keeps that copy), sequence-sharded like the norms.
    """
    s, b, h, a = seq_len, micro_batch, n_embd, n_head
    whole = 2  # c_attn's and c_fc's inputs (the gathered LayerNorm outputs under TP)
    split = ((qkv_width if qkv_width is not None else 3 * h) / h  # attention: q and k, v ...
             + 1  # ... and c_proj's input
             + (mlp_saved_width if mlp_saved_width is not None else 8 * h) / h  # MLP: GELU
             # input, c_proj input
             + 2)  # ln_1 and ln_2 inputs (the residual stream), sequence-sharded
    total = (whole + split / tp) * s * b * h * act_bytes
    if dropout:  # 1-byte masks after attention c_proj and after the MLP
        total += 2 * s * b * h / tp
    total += (act_bytes * s * b * h + FP32 * a * s * b) / tp  # SDPA output + log-sum-exp
    total += norm_fp32_copies * FP32 * s * b * h / tp
    return total

"""Pipeline parallelism's costs, as parallel/pipeline.py runs it: the bubble, the micro-batches
whose activations a stage keeps, and the point-to-point traffic between stages.

p = parallel.pp, v = stages per rank (1 for 1F1B), m = micro-batches per step of one pipeline.

- The bubble (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, sec. 2.2): a step's pipeline fills and drains once, idling
  every rank for (p - 1) forward-and-backward times of a stage; against the m such times of
  useful work that is (p - 1) / m for 1F1B, and (p - 1) / (v m) interleaved, whose stages are v
  times shorter.
- Activations kept (sec. 2.2.1; Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", sec. 4.2.3): under 1F1B the rank of stage i has at most
  min(p - i, m) micro-batches in flight, so the first stage keeps p micro-batches of its L / p
  layers, as many layers' activations as the whole model holds for one micro-batch; interleaving
  keeps (1 + (p - 1) / (p v)) times that on the first rank.
- Point-to-point: each micro-batch's hidden states cross every stage boundary forward and their
  gradient crosses it backward; a rank sends for each of its stages but the last stage (forward)
  and the first (backward). Under tensor parallelism each TP rank sends its sequence shard.
"""

from __future__ import annotations


def bubble_fraction(pp: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """The idle time of a step as a fraction of its useful compute (sec. 2.2 of SC21)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * micro_batches)


def in_flight(pp: int, micro_batches: int, stages_per_rank: int = 1,
              pp_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `pp_rank` keeps at its peak, in units of one
    micro-batch through all of that rank's layers. 1F1B: min(p - rank, m). Interleaved (the
    first rank, the most): min(p, m) (1 + (p - 1) / (p v))."""
    if pp <= 1:
        return 1.0
    if stages_per_rank == 1:
        return float(min(pp - pp_rank, micro_batches))
    return min(pp, micro_batches) * (1 + (pp - 1) / (pp * stages_per_rank))


def p2p_bytes(pp: int, micro_batches: int, *, micro_batch: int, seq_len: int, n_embd: int,
              act_bytes: int, tp: int = 1, stages_per_rank: int = 1,
              pp_rank: int | None = None) -> float:
    """Bytes pipeline rank `pp_rank` sends per step (None: the most any rank sends): one
    (micro_batch, seq_len / tp, n_embd) tensor per micro-batch per boundary it sends across."""
    if pp <= 1:
        return 0.0
    one = micro_batch * seq_len / tp * n_embd * act_bytes
    ranks = range(pp) if pp_rank is None else [pp_rank]
    sends = max(2 * stages_per_rank - (r == pp - 1) - (r == 0) for r in ranks)
    return sends * micro_batches * one

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

import dataclasses
import functools

from elastic_gpt.cost_model.memory import Memory, memory_per_gpu
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network
from elastic_gpt.cost_model.shape import ModelShape, dtype_bytes
from elastic_gpt.cost_model.software import Software
from elastic_gpt.cost_model.step_time import StepTime, step_time
from elastic_gpt.cost_model.trainer_software import TRAINER
from elastic_gpt.hardware import GB, GPU
from elastic_gpt.model.config import ModelConfig, block_matmul_params


class PipelineLayoutError(ValueError):
    """A pipeline the model or the batch cannot be cut into."""


# ---- where the layers go (parallel/pipeline.py cuts the model so) --------------------------------


def stage_costs(cfg: ModelConfig) -> tuple[float, float]:
    """(one block, the output layer and loss) in forward FLOPs per token: what `stage_layers`
    balances. A block's matmuls are twice its weights (GPT-2's 24 d^2; the family's linears,
    model/config.py) and its attention 4 T d; the output layer's 2 V d. The embedding lookups
    cost no FLOPs."""
    d, T, V = cfg.n_embd, cfg.seq_len, cfg.vocab_size
    return 2 * block_matmul_params(cfg) + 4 * T * d, 2 * V * d


def stage_layers(cfg: ModelConfig, num_stages: int) -> list[range]:
    """The blocks of each of `num_stages` contiguous stages, at least one each: the costliest
    stage (the last one counting the output layer) as cheap as it can be, and among the cuts
    that reach that, the most even one (the least sum of squared stage costs)."""
    L = cfg.n_layer
    if num_stages < 1:
        raise PipelineLayoutError(f"a pipeline needs at least one stage, got {num_stages}")
    if num_stages > L:
        raise PipelineLayoutError(
            f"{num_stages} pipeline stages need at least one block each, and model.n_layer is "
            f"{L}; use parallel.pp x stages per rank <= {L}")
    return list(_stage_layers(L, num_stages, *stage_costs(cfg)))


@functools.lru_cache(maxsize=256)
def _stage_layers(L: int, num_stages: int, block: float, head: float) -> tuple[range, ...]:
    def cost(s: int, blocks: int) -> float:
        return blocks * block + (head if s == num_stages - 1 else 0.0)

    def cut(bound: float) -> list[int] | None:
        """The cut of least sum of squares with every stage at most `bound`: the first block of
        each stage after the first, or None if there is none."""
        inf = float("inf")
        # best[s][i]: the least sum of squares of stages s.. holding blocks i..L-1.
        best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
        nxt = [[0] * (L + 1) for _ in range(num_stages + 1)]
        best[num_stages][L] = 0.0
        for s in range(num_stages - 1, -1, -1):
            after = num_stages - 1 - s  # stages after this one, one block each at least
            for i in range(s, L - after):
                most = min(L - after, i + max(1, int(bound // block)))
                for j in range(i + 1, most + 1):
                    c = cost(s, j - i)
                    if c <= bound and c * c + best[s + 1][j] < best[s][i]:
                        best[s][i], nxt[s][i] = c * c + best[s + 1][j], j
        if best[0][0] == inf:
            return None
        starts, i = [], 0
        for s in range(num_stages):
            i = nxt[s][i]
            starts.append(i)
        return starts

    # The least possible costliest stage is one of the stage costs there are: the smallest that
    # admits a cut (a larger bound admits every cut a smaller one does).
    bounds = sorted({cost(s, n) for s in (0, num_stages - 1) for n in range(1, L + 1)})
    lo, hi = 0, len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(bounds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    edges = [0, *cut(bounds[lo])]
    return tuple(range(edges[k], edges[k + 1]) for k in range(num_stages))


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds: pp_rank, pp_rank + pp, ..."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


# ---- the pipeline's terms -------------------------------------------------------------------------


def bubble_fraction(pp: int, micro_batches: int, stages_per_rank: int = 1) -> float:
    """The idle time of a step as a fraction of its useful compute (sec. 2.2 of SC21)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * micro_batches)


def in_flight(pp: int, micro_batches: int, stages_per_rank: int = 1,
              pp_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `pp_rank` keeps at its peak, in units of one
    micro-batch through all of that rank's layers. 1F1B: min(p - rank, m). Interleaved 1F1B
    (torch's `_get_warmup_ops`): a rank runs (v - 1) r + 2 (p - 1 - rank) forward chunks before
    its first backward, r the micro-batches of a round (p when m is a multiple of p), and holds
    one more at its peak: on the first rank about p (1 + (p - 1) / (p v)) micro-batches, on the
    last about p (1 - 1 / v) + 1 / v; never more than the step's m."""
    if pp <= 1:
        return 1.0
    if stages_per_rank == 1:
        return float(min(pp - pp_rank, micro_batches))
    v, m = stages_per_rank, micro_batches
    per_round = m // max(1, m // pp)
    warmup = (v - 1) * per_round + 2 * (pp - 1 - pp_rank)
    return min(warmup + 1, m * v) / v


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


# ---- a pipeline rank as the planner sees it ----------------------------------------------------


def rank_shape(shape: ModelShape, pp: int, stages_per_rank: int, pp_rank: int) -> ModelShape:
    """The model as pipeline rank `pp_rank` holds it: its blocks, as parallel/pipeline.py's
    `stage_layers` cuts them (stages r, r + pp, ...); a tied root on the first and the last rank
    (each holds the tied wte: the memory of the whole root is counted on both), an untied one
    split between them (the embedding on the first, the final norm and the output layer on the
    last), on no rank between; the output layer's FLOPs on the last only."""
    layers = stage_layers(shape.cfg, pp * stages_per_rank)
    blocks = sum(len(layers[i]) for i in rank_stages(pp_rank, pp, stages_per_rank))
    if shape.cfg.tie_embeddings:
        root = embedding = shape.root_params if pp_rank in (0, pp - 1) else 0
    else:
        embedding = shape.embedding_params if pp_rank == 0 else 0
        root = embedding + (shape.root_params - shape.embedding_params if pp_rank == pp - 1
                            else 0)
    return dataclasses.replace(
        shape, cfg=dataclasses.replace(shape.cfg, n_layer=blocks), root_params=root,
        embedding_params=embedding, params=root + blocks * shape.block_params,
        embeds=pp_rank == 0, heads=pp_rank == pp - 1,
        head_fwd_flops_per_token=shape.head_fwd_flops_per_token if pp_rank == pp - 1 else 0.0)


def rank_shapes(shape: ModelShape, pp: int, stages_per_rank: int = 1,
                ) -> dict[int, ModelShape]:
    """The model as the pipeline ranks that can be the costliest hold it (`rank_shape`), by rank:
    for each number of blocks a rank holds, the first rank that holds that many (under 1F1B it
    keeps the most micro-batches in flight of those), and the last rank (the output layer and the
    loss). When the blocks do not divide evenly a middle rank holds more than the first or the
    last, and it sets the pace."""
    layers = stage_layers(shape.cfg, pp * stages_per_rank)
    blocks = [sum(len(layers[i]) for i in rank_stages(r, pp, stages_per_rank)) for r in range(pp)]
    first_with: dict[int, int] = {}
    for rank, n in enumerate(blocks):
        first_with.setdefault(n, rank)
    return {r: rank_shape(shape, pp, stages_per_rank, r)
            for r in sorted({*first_with.values(), pp - 1})}


KEPT_GATHERED = dict(reshard_after_forward=False, grad_sync="step")
"""What torch's schedules do to an FSDP2 stage: no gradient sync and no resharding after any
micro-batch's backward but the last (`PipelineStage.backward_maybe_with_nosync`, then one
`perform_reduce_grad`), so from the first backward on the stage's weights stay gathered and its
gradients accumulate unsharded, in the reduce dtype: blocks kept gathered, one sync per step."""


def pipelined_memory(shape: ModelShape, mesh: Mesh, micro_batch: int, micro_batches: int,
                     **kw) -> Memory:
    """The peak of the pipeline ranks' memory: the first rank keeps the most micro-batches in
    flight, a middle rank may hold more blocks, the last the loss on whole logits
    (`memory_per_gpu`'s other settings in `kw`, its `software` among them; the resharding and the
    gradient sync are the schedules', `KEPT_GATHERED`)."""
    kw = {**kw, **KEPT_GATHERED}
    last = mesh.pp - 1
    return max((memory_per_gpu(s, mesh.stage_world, micro_batch, tp=mesh.tp,
                               dp_shard=mesh.dp_shard,
                               in_flight=in_flight(mesh.pp, micro_batches, mesh.stages_per_rank,
                                                   pp_rank=r),
                               loss="whole" if r == last else "none", **kw)
                for r, s in rank_shapes(shape, mesh.pp, mesh.stages_per_rank).items()),
               key=lambda m: m.total)


def pipelined_step_time(shape: ModelShape, gpu: GPU, net: Network, mesh: Mesh, micro_batch: int,
                        micro_batches: int, *, dtype: str = "bfloat16",
                        software: Software = TRAINER, **kw) -> StepTime:
    """One step of the slowest pipeline rank: its m micro-batches through its layers and the
    FSDP collectives of its stage's data-parallel group (`step_time`), the bubble of the
    schedule over that compute, and the hidden states it sends (across nodes when a pipeline
    spans them, on the intra-node link when one node holds it), with what the software does to
    each one it receives (`Software.stage_receive_s`)."""
    kw = {**kw, **KEPT_GATHERED}
    shapes = rank_shapes(shape, mesh.pp, mesh.stages_per_rank)
    one = {r: step_time(s, gpu, net, mesh.stage_world, micro_batch, micro_batches, dtype=dtype,
                        tp=mesh.tp, hsdp=mesh.hsdp, software=software, **kw)
           for r, s in shapes.items()}
    st = max(one.values(), key=lambda t: t.step_s)
    sent = p2p_bytes(mesh.pp, micro_batches, micro_batch=micro_batch,
                     seq_len=shape.cfg.seq_len, n_embd=shape.cfg.n_embd,
                     act_bytes=dtype_bytes(dtype), tp=mesh.tp,
                     stages_per_rank=mesh.stages_per_rank)
    one_node = mesh.world <= net.gpus_per_node
    # Every GPU of a node sends its own part at once, through the node's NICs.
    per_gpu_gbps = (net.intra_node_gbps if one_node
                    else net.inter_node_gbps / min(net.gpus_per_node, mesh.stage_world))
    sends = micro_batches * (2 * mesh.stages_per_rank)
    receive_s = sends * software.stage_receive_s(net, mesh, micro_batch, shape.cfg,
                                                 dtype_bytes(dtype))
    return dataclasses.replace(
        st, bubble_s=bubble_fraction(mesh.pp, micro_batches, mesh.stages_per_rank) * st.compute_s,
        p2p_bytes=sent, p2p_s=sent / (per_gpu_gbps * GB)
        + sends * net.send_latency_s(across_nodes=not one_node) + receive_s)

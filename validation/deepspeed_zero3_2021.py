"""DeepSpeed's ZeRO-3 as SC21's ZeRO-3 rows (Table 2) ran it: its memory as the cost model's
`Software` (`DEEPSPEED_ZERO3`), and what it sends in a step, counted from its source, a bound on
how much of those rows' throughput its own collectives can explain.

DeepSpeed at c83e49f9 (14 April 2021, v0.3.14; SC21 gives no version), runtime/zero/:

- parameters are gathered module by module, at most `stage3_max_live_parameters` at once, and
  gradients reduce-scattered in buckets of `reduce_bucket_size` (the defaults of DeepSpeed's
  configuration reference, deepspeed.ai/docs/config-json; SC21 gives no settings), where FSDP2
  (this trainer) gathers and reduces a whole block at once. The software counts only the memory
  this holds; its step is FSDP2's with Megatron-LM 2021's kernels (megatron_2021.py);
- a parameter of fewer than `stage3_param_persistence_threshold` elements (1e5) is never
  partitioned (stage3.py `persistent_parameters`): a block's norms and biases stay whole;
- when a module runs, each of its partitioned parameters is all-gathered, one `all_gather` per
  parameter (partition_parameters.py `_allgather_param`), and after it runs they are released
  unless the same module runs again within `stage3_max_reuse_distance` (1e9) elements of the
  parameters of the modules run in between, in the trace recorded of a step's forward and
  backward (stage3.py `_keep_for_later`, `PrefetchCoordinator._distance_in_numel`);
- every micro-batch's gradients are reduce-scattered one parameter at a time
  (`_reduce_scatter_gradients`), in the parameters' 16-bit dtype.

The trace is Megatron-LM's GPT (the model SC21's ZeRO-3 runs trained) with every block
recomputed: forward, then for the output layer and each block from the last, its recomputed
forward and its backward. ZeRO-3 overlapped its gathers (one module prefetched ahead) and its
reductions with compute by default (constants.py `ZERO3_OPTIMIZATION_OVERLAP_COMM_DEFAULT`):
the planner's compute plus every one of these collectives, none overlapped, is an upper bound
of the step they leave.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from elastic_gpt.cost_model.network import Network, ring_bytes
from elastic_gpt.cost_model.shape import FP32, ModelShape, dtype_bytes
from elastic_gpt.model.config import GPTConfig
from validation.megatron_2021 import Megatron2021Kernels

OPTIMIZER_BYTES_PER_PARAM = 16
"""fp32 sharded master params, fp32 grads, Adam m and v, as the trainer's FSDP2 holds them
(elastic_gpt/cost_model/fsdp.py): ZeRO's stage-3 total."""

PERSISTENCE_THRESHOLD = 100_000
"""`stage3_param_persistence_threshold`'s default at c83e49f9 (elements)."""
MAX_REUSE_DISTANCE = 1_000_000_000
"""`stage3_max_reuse_distance`'s default at c83e49f9 (elements)."""


@dataclass(frozen=True)
class DeepSpeedZero3(Megatron2021Kernels):
    """ZeRO-3 as DeepSpeed runs it: parameters gathered module by module, at most `live_params`
    of them at once (its `stage3_max_live_parameters`), and gradients reduce-scattered in
    buckets of `reduce_bucket_params` (its `reduce_bucket_size`); with Megatron-LM 2021's
    kernels. Only the memory held differs from FSDP2's; the more, smaller collectives are not
    modelled (`collectives` counts them for a bound)."""

    live_params: float
    reduce_bucket_params: float

    def model_state_bytes(self, shape: ModelShape, tp: int, dp_shard: int, act_bytes: int, *,
                          grad_sync: str, micro_batches_per_rank: int,
                          reshard_after_forward: bool) -> tuple[float, float, float]:
        """FSDP2's count (elastic_gpt/cost_model/fsdp.py `fsdp_state_bytes`) with the gathered
        parameters capped at `live_params` and the reduced gradients at a bucket when ZeRO-3
        reshards; blocks kept gathered hold every block whatever the gather unit."""
        pb, L = act_bytes, shape.cfg.n_layer
        sharded = OPTIMIZER_BYTES_PER_PARAM * shape.local_params(tp) / dp_shard
        held_blocks = min(2, L) if reshard_after_forward else L
        block = shape.block_local(tp)
        held_params, reduced_params = held_blocks * block, block
        if reshard_after_forward:
            held_params = min(held_params, self.live_params)
            reduced_params = min(block, self.reduce_bucket_params)
        gathered = (shape.root_local(tp) * (pb + pb + FP32)
                    + held_params * pb + reduced_params * (pb + FP32))
        accumulated = (FP32 * shape.local_params(tp)
                       if grad_sync == "step" and micro_batches_per_rank > 1 else 0.0)
        return sharded, gathered, accumulated


DEEPSPEED_ZERO3 = DeepSpeedZero3(live_params=1e9, reduce_bucket_params=5e8)
"""How SC21's ZeRO-3 runs held parameters: DeepSpeed's configuration reference's defaults."""

Module = tuple[str, tuple[str, ...]]
"""A module of the trace: its name and the parameters it uses (the output layer uses the word
embedding's)."""


def _parameters(cfg: GPTConfig) -> dict[str, int]:
    h = cfg.n_embd
    out = {"wte": cfg.vocab_size * h, "wpe": cfg.seq_len * h, "ln_f.w": h, "ln_f.b": h}
    for i in range(cfg.n_layer):
        out |= {f"{i}.ln_1.w": h, f"{i}.ln_1.b": h, f"{i}.qkv.w": 3 * h * h, f"{i}.qkv.b": 3 * h,
                f"{i}.proj.w": h * h, f"{i}.proj.b": h, f"{i}.ln_2.w": h, f"{i}.ln_2.b": h,
                f"{i}.fc.w": 4 * h * h, f"{i}.fc.b": 4 * h, f"{i}.fc_proj.w": 4 * h * h,
                f"{i}.fc_proj.b": h}
    return out


def _block(i: int) -> list[Module]:
    return [(f"{i}.{m}", (f"{i}.{m}.w", f"{i}.{m}.b"))
            for m in ("ln_1", "qkv", "proj", "ln_2", "fc", "fc_proj")]


def trace(cfg: GPTConfig, recompute: bool = True) -> list[Module]:
    """The modules one micro-batch runs, in order, forward and backward."""
    embedding: list[Module] = [("word", ("wte",)), ("position", ("wpe",))]
    head: list[Module] = [("ln_f", ("ln_f.w", "ln_f.b")), ("logits", ("wte",))]
    backward: list[Module] = head[::-1]
    for i in reversed(range(cfg.n_layer)):
        backward += (_block(i) if recompute else []) + _block(i)[::-1]
    return ([*embedding, *itertools.chain.from_iterable(map(_block, range(cfg.n_layer))),
             *head, *backward, *embedding[::-1]])


def gathers(cfg: GPTConfig, recompute: bool = True) -> list[tuple[str, int]]:
    """(parameter, elements) of each all-gather of one micro-batch, in order."""
    numel = _parameters(cfg)
    steps = trace(cfg, recompute)
    used = [sum(numel[p] for p in params) for _, params in steps]
    before = [0, *itertools.accumulate(used)]  # elements used by the steps before each step
    again: list[int | None] = [None] * len(steps)  # the step that runs the same module next
    last: dict[str, int] = {}
    for j in reversed(range(len(steps))):
        again[j] = last.get(steps[j][0])
        last[steps[j][0]] = j
    held: set[str] = set()
    out = []
    for j, (_, params) in enumerate(steps):
        for p in params:
            if numel[p] >= PERSISTENCE_THRESHOLD and p not in held:
                out.append((p, numel[p]))
                held.add(p)
        nxt = again[j]
        if nxt is None or before[nxt] - before[j + 1] >= MAX_REUSE_DISTANCE:
            held.difference_update(params)
    return out


@dataclass(frozen=True)
class Zero3Collectives:
    gathers: int
    reduce_scatters: int
    seconds: float
    """All of one micro-batch's collectives, one after another."""


def collectives(cfg: GPTConfig, n_gpus: int, net: Network, dtype: str = "float16",
                recompute: bool = True) -> Zero3Collectives:
    """One micro-batch's gathers and reduce-scatters over all `n_gpus` ranks (no model
    parallelism), each a ring collective of its own: its bytes and NCCL's ring latency."""
    nbytes = dtype_bytes(dtype)

    def ring_s(elems: int) -> float:
        return net.ring_s(ring_bytes(nbytes * elems, n_gpus), ranks=n_gpus,
                          per_node=net.gpus_per_node)

    gathered = [e for _, e in gathers(cfg, recompute)]
    reduced = list(_parameters(cfg).values())
    return Zero3Collectives(len(gathered), len(reduced),
                            sum(map(ring_s, gathered)) + sum(map(ring_s, reduced)))

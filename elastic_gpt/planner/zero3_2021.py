"""What DeepSpeed's ZeRO-3 of 2021 sends in a step, counted from its source: a bound on how much
of SC21's ZeRO-3 rows (Table 2) its own collectives can explain.

DeepSpeed at c83e49f9 (14 April 2021, v0.3.14; SC21 gives no version), runtime/zero/:

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

from elastic_gpt.cost_model.memory import dtype_bytes
from elastic_gpt.cost_model.step_time import Network, ring_bytes
from elastic_gpt.model.gpt import GPTConfig

PERSISTENCE_THRESHOLD = 100_000
"""`stage3_param_persistence_threshold`'s default at c83e49f9 (elements)."""
MAX_REUSE_DISTANCE = 1_000_000_000
"""`stage3_max_reuse_distance`'s default at c83e49f9 (elements)."""

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

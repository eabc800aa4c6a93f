"""The tensor-parallel rules: which degrees can split a model, and over which workers.

One home for them: config validation, the planner, `tune`, the mesh and the replica-group sizing
all ask here, so they cannot disagree (torchtitan keeps the same checks in `parallel_dims.py`).
Each check returns the reason in one line with its fix, or None; the caller raises its own error
type. `flag` is how the caller's user spells the degree (`parallel.tp` in a config, `--tp` on the
planner's command line), so the line names the key to change.

- The model: tensor parallelism splits attention heads (query heads, and grouped-query
  attention's key/value heads), the MLP's hidden width, the sequence between blocks (sequence
  parallelism) and the vocabulary (the sharded output layer and loss) into tp equal parts.
- The workers: a run's workers come in whole tensor-parallel groups.
- The nodes: a tensor-parallel group exchanges activations in every layer, so it stays inside one
  node (NVLink, never the network).
"""

from __future__ import annotations

from collections.abc import Iterable


def usable_degrees(n_head: int, seq_len: int, vocab_size: int | None = None,
                   candidates: Iterable[int] = (1, 2, 4, 8), *, n_kv_head: int | None = None,
                   ffn_hidden: int | None = None) -> list[int]:
    """The `candidates` that split this model's heads, key/value heads, MLP width, sequence and
    vocabulary evenly (None: not checked)."""
    sizes = [v for v in (n_head, seq_len, vocab_size, n_kv_head, ffn_hidden) if v is not None]
    return [t for t in candidates if not any(v % t for v in sizes)]


def model_problem(tp: int, *, n_head: int, seq_len: int, vocab_size: int | None = None,
                  n_kv_head: int | None = None, ffn_hidden: int | None = None,
                  flag: str = "parallel.tp", candidates: Iterable[int] = (1, 2, 4, 8)) -> str | None:
    """Why tp cannot split this model, or None. `vocab_size` None: not known yet (checked later);
    `n_kv_head`, `ffn_hidden` None: the family has none apart from n_head and 4 x the width."""
    if tp < 1:
        return f"{flag}={tp} must be at least 1"
    for key, value, why in (
            ("model.n_head", n_head, "each tensor-parallel rank needs whole attention heads"),
            ("model.n_kv_head", n_kv_head, "each tensor-parallel rank needs whole key/value heads "
                                           "of grouped-query attention"),
            ("model.ffn_hidden", ffn_hidden, "each tensor-parallel rank holds an equal part of "
                                             "the MLP's hidden units"),
            ("model.seq_len", seq_len, "sequence parallelism gives each tensor-parallel rank an "
                                       "equal part of the sequence"),
            ("model.vocab_size", vocab_size, "each tensor-parallel rank holds an equal part of the "
                                             "output layer")):
        if value is not None and value % tp:
            ok = usable_degrees(n_head, seq_len, vocab_size, candidates, n_kv_head=n_kv_head,
                                ffn_hidden=ffn_hidden)
            return (f"{flag}={tp} does not divide {key}={value} ({why}); use {flag} in "
                    f"{{{', '.join(map(str, ok))}}} or a {key} that tp divides")
    return None


def workers_problem(tp: int, counts: dict[str, int], *, flag: str = "parallel.tp",
                    unit: str = "tensor-parallel groups") -> str | None:
    """Why worker counts `counts` (a key -> its value, e.g. {"scaling.min_workers": 2}) do not
    come in whole `unit` (tensor-parallel groups, or pipelines) of tp ranks, or None."""
    bad = {k: v for k, v in counts.items() if v % tp or v < tp}
    if not bad:
        return None
    names = " and ".join(f"{k}={v}" for k, v in counts.items())
    fix = " ".join(f"{k}={max(tp, v // tp * tp)}" for k, v in counts.items())
    verb = "must be multiples" if len(counts) > 1 else "must be a multiple"
    return f"{names} {verb} of {flag}={tp} (workers come in whole {unit}); e.g. {fix}"


def nodes_problem(tp: int, per_node: Iterable[int], *, flag: str = "parallel.tp",
                  what: str = "workers", how: str = "") -> str | None:
    """Why `per_node` (ranks on each node) cannot hold tensor-parallel groups inside nodes, or
    None. `how`: what sets the ranks per node, for the fix."""
    per_node = list(per_node)
    if any(n % tp for n in per_node):
        return (f"{what} per node {per_node} are not all multiples of {flag}={tp} (a "
                "tensor-parallel group must stay inside one node); give every node a multiple of "
                f"tp {what}{f' ({how})' if how else ''} or lower {flag}")
    return None


def fsdp_columns_problem(tp: int, dp_shard: int, n_embd: int, *, fused_qkv: bool,
                         what: str = "") -> str | None:
    """Why FSDP cannot shard a fused q|k|v weight over `dp_shard` ranks at this `tp`, or None.
    Under tensor parallelism such a weight (GPT-2's c_attn) is FSDP-sharded on its columns, n_embd
    of them (parallel/fsdp.py `shard_placement`: its rows are tensor parallelism's parts), and
    FSDP2 shards a dim other than the first only evenly."""
    if tp > 1 and fused_qkv and n_embd % dp_shard:
        return (f"{what or f'dp_shard={dp_shard}'}: {dp_shard} FSDP shards do not divide "
                f"n_embd={n_embd}: under tensor parallelism "
                "c_attn's columns are what FSDP shards, and only evenly; use a data-parallel "
                f"degree that divides {n_embd}, or HSDP to shard within a node")
    return None

"""The layout of a step's GPUs as the cost model sees it: `Mesh`, pp x dp_replicate x dp_shard x tp,
and the one the trainer builds for a GPU count (`make_mesh`, as parallel/mesh.py's
`ParallelDims` lays its ranks out)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    """How the GPUs are laid out: world = pp x dp_replicate x dp_shard x tp, tp innermost (a TP
    group is consecutive ranks of one node), pp outermost (a pipeline stage is a run of
    consecutive ranks). FSDP2 shards over dp_shard and, under HSDP, replicates over dp_replicate
    (one replica per node of a stage); the data-parallel degree is dp_replicate x dp_shard."""

    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    spans_nodes: bool = False
    """Whether a pipeline stage's ranks span more than one node (FSDP's groups then cross nodes
    unless HSDP)."""
    pp: int = 1
    stages_per_rank: int = 1
    """Pipeline stages each rank holds: 1 for 1F1B, more for the interleaved schedule."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage."""
        return self.dp * self.tp

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def schedule(self) -> str:
        return "1f1b" if self.stages_per_rank == 1 else "interleaved_1f1b"

    def short(self) -> str:
        return f"tp={self.tp} {self.dp_short()}{self.pp_short()}"

    def dp_short(self) -> str:
        return f"HSDP {self.dp_shard}x{self.dp_replicate}" if self.hsdp else f"FSDP {self.dp}"

    def pp_short(self) -> str:
        if self.pp == 1:
            return ""
        return f" pp={self.pp}" + (f"x{self.stages_per_rank}" if self.stages_per_rank > 1 else "")

    def label(self) -> str:
        return f"tp={self.tp} x dp={self.dp} ({self.dp_label()}{self.pp_label()})"

    def dp_label(self) -> str:
        if self.hsdp:
            return (f"HSDP: FSDP over {self.dp_shard} in each node x {self.dp_replicate} replicas "
                    "across nodes")
        where = "across nodes" if self.spans_nodes else "in one node"
        return f"FSDP over {self.dp} {where}"

    def pp_label(self) -> str:
        if self.pp == 1:
            return ""
        return (f"; pp={self.pp} stages, {self.schedule}"
                + (f" with {self.stages_per_rank} stages per rank"
                   if self.stages_per_rank > 1 else ""))


def make_mesh(n_gpus: int, tp: int = 1, hsdp: bool = False, gpus_per_node: int = 8,
              pp: int = 1, stages_per_rank: int = 1) -> Mesh:
    """The mesh the trainer builds for n_gpus workers; hsdp on one node is plain FSDP. Under
    pipeline parallelism the data-parallel layout is one stage's (n_gpus / pp ranks)."""
    stage = n_gpus // pp
    spans = stage > gpus_per_node
    if hsdp and spans:
        return Mesh(tp, gpus_per_node // tp, stage // gpus_per_node, True, pp, stages_per_rank)
    return Mesh(tp, stage // tp, 1, spans, pp, stages_per_rank)

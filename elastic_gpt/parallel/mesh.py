"""The named device mesh: how the W ranks of a group split into pipeline, data and tensor
parallelism.

W = pp x dp_replicate x dp_shard x tp. `ParallelDims` holds the four degrees, checks them, builds
the DeviceMesh once (dims "pp", "dp_replicate", "dp_shard", "tp", torchtitan's order: tp innermost
so a tensor-parallel group is tp consecutive ranks, pp outermost so a stage's ranks are too)
and answers what the rest of the code asks instead of doing arithmetic on rank and world size:
which data-parallel rank this is and how many there are (what C1 fixed global batch and C2 data
order are stated over), which sub-mesh FSDP shards over, which one tensor parallelism uses,
whether the loss is vocab-parallel (torchtitan's `ParallelDims` is the model).

`ParallelDims.for_nodes` derives the degrees from where the ranks run: a tensor-parallel group
must stay inside one node (its collectives run every layer, on the fast intra-node link), and
HSDP shards within a node and replicates across nodes; a placement that breaks this is a
`PlacementError` (the controller retries it), not a layout error. Nodes are told apart by the id
the caller passes for each rank (Ray's node id under Ray Train), never by a node's IP address:
every node of a one-machine test cluster has the same IP.

Nothing here knows about Ray, the model or the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic_gpt.errors import FatalTrainingError, PlacementError
from elastic_gpt.parallel.tp_rules import nodes_problem
from elastic_gpt.torch_internals import bind_default_group, flatten_mesh

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


class ParallelLayoutError(FatalTrainingError, ValueError):
    """The configured layout cannot work at any placement (no restart can cure it). Where the
    workers landed is another matter: a `PlacementError`, which the controller retries."""


@dataclass
class ParallelDims:
    dp_replicate: int
    """Replicas of the FSDP-sharded model (HSDP across nodes); 1 without HSDP."""
    dp_shard: int
    """Ranks one FSDP shard group spans."""
    tp: int
    """Tensor-parallel degree: ranks one layer's weights are split over."""
    pp: int = 1
    """Pipeline stages' ranks: the model's layers are split over pp runs of W / pp ranks (the
    outermost dim: a stage's ranks are consecutive, as its data- and tensor-parallel groups are)."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    connected: list[str] | None = field(default=None, init=False, repr=False)
    """The mesh dims whose communicators build_mesh opened (None: it opened none)."""

    def __post_init__(self):
        for name in DIM_NAMES:
            if getattr(self, name) < 1:
                raise ParallelLayoutError(f"parallel degree {name}={getattr(self, name)} must be "
                                          "at least 1")

    @classmethod
    def for_nodes(cls, world_size: int, *, tp: int, hsdp: str,
                  rank_nodes: list[str] | None = None, pp: int = 1) -> ParallelDims:
        """The layout for `world_size` ranks whose node (by any id) is `rank_nodes[rank]`; None:
        all on one node. hsdp: on (replicate across nodes, shard within one), off, or auto (on
        when a pipeline stage's ranks span more than one node with the same number on each)."""
        nodes = list(rank_nodes) if rank_nodes is not None else ["node"] * world_size
        if len(nodes) != world_size:
            raise ValueError(f"{len(nodes)} node ids for {world_size} ranks")
        if tp < 1:
            raise ParallelLayoutError(f"parallel.tp={tp} must be at least 1")
        if tp > world_size:
            raise ParallelLayoutError(
                f"parallel.tp={tp} is more than the {world_size} worker(s) of this group; use "
                f"parallel.tp <= scaling.min_workers")
        if pp < 1 or world_size % (pp * tp):
            raise ParallelLayoutError(
                f"{world_size} worker(s) are not whole pipelines of parallel.pp={pp} x "
                f"parallel.tp={tp} ranks; use scaling.min_workers and max_workers that are "
                f"multiples of {max(pp, 1) * tp}")
        per_node = node_sizes(nodes)
        problem = nodes_problem(tp, per_node, how="scaling.cpus_per_worker / GPUs per node")
        if problem:
            raise PlacementError(problem, per_node, tp)
        # HSDP replicates across the nodes of one pipeline stage (every stage alike).
        stage = node_sizes(nodes[:world_size // pp])
        even = len(set(stage)) == 1
        if hsdp == "on" and not even:
            raise PlacementError(
                f"parallel.hsdp=on needs the same number of workers on every node, got "
                f"{per_node}; use parallel.hsdp=auto or off", per_node, tp)
        if hsdp == "on" or (hsdp == "auto" and len(stage) > 1 and even):
            replicate = len(stage)
        else:
            replicate = 1
        return cls(dp_replicate=replicate, dp_shard=world_size // (pp * replicate * tp), tp=tp,
                   pp=pp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: the groups of tp ranks that each read their own micro-batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def loss_parallel(self) -> bool:
        """Logits stay sharded over the vocabulary into the loss (torch's loss_parallel)."""
        return self.tp_enabled

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel rank global rank `rank` is: its tensor-parallel group's index
        within its pipeline stage."""
        return rank // self.tp % self.dp_degree

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline rank (the stages it holds) global rank `rank` is."""
        return rank // (self.dp_degree * self.tp)

    def describe(self) -> str:
        """For the setup line: "dp 2 (HSDP 2 x 1) x tp 2"."""
        dp = f"dp {self.dp_degree}"
        if self.hsdp:
            dp += f" (HSDP {self.dp_replicate} x {self.dp_shard})"
        return f"{dp} x tp {self.tp}" + (f" x pp {self.pp}" if self.pp_enabled else "")

    # ---- the mesh (collective: every rank builds it once) ------------------------------------

    def build_mesh(self, device_type: str, connect_on: torch.device | None = None) -> DeviceMesh:
        """Collective. The named mesh; with `connect_on`, every communicator of it opened now."""
        if self._mesh is None:
            if connect_on is not None:
                # Ray Train makes the default group without a device: bound now, the mesh's
                # groups are split from its communicator.
                bind_default_group(connect_on)
            self._mesh = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                mesh_dim_names=DIM_NAMES)
            if self.tp_enabled:
                # A sum over every shard of a parameter (the gradient norm) spans dp_shard and
                # tp; with this flattened dim DTensor does it in one all-reduce, not two.
                flatten_mesh(self._mesh["dp_shard", "tp"], "dp_shard_tp")
            if self.tp_enabled and self.pp_enabled:  # the ranks of one batch (`batch_group`)
                flatten_mesh(self._mesh["pp", "tp"], "pp_tp")
            if connect_on is not None:
                self.connected = connect_communicators(self._mesh, connect_on)
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not run on this rank")
        return self._mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What fully_shard shards over: dp_shard, or (dp_replicate, dp_shard) for HSDP, which
        all-gathers and reduce-scatters inside a node and all-reduces gradients across nodes."""
        return self.mesh["dp_replicate", "dp_shard"] if self.hsdp else self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    def batch_group(self) -> dist.ProcessGroup | None:
        """The ranks that train on the same micro-batches (one data-parallel rank's pipeline
        stages and tensor-parallel shares), which one of them reads for all; None if one rank."""
        if self.pp_enabled and self.tp_enabled:
            return self.mesh["pp_tp"].get_group()
        if self.pp_enabled or self.tp_enabled:
            return self.mesh["pp" if self.pp_enabled else "tp"].get_group()
        return None


def connect_communicators(mesh: DeviceMesh, device: torch.device) -> list[str]:
    """Collective: one tiny all-reduce on the default group and on every mesh dim's group of more
    than one rank, on `device`; the names of those dims. NCCL opens a group's communicator at its
    first collective: left to the first step, the set-up of thousands of ranks' communicators
    (minutes at scale) and its failures (a fabric that is not there) would land in FSDP's first
    all-gather. Here they come before anything is built, under the start-up timeout, each bound
    to the device Ray assigned."""
    dims = [name for name in mesh.mesh_dim_names if mesh[name].size() > 1]
    probe = torch.zeros(1, device=device)
    dist.all_reduce(probe)
    for name in dims:
        dist.all_reduce(probe, group=mesh[name].get_group())
    return dims


def node_sizes(rank_nodes: list[str]) -> list[int]:
    """Ranks per node in rank order; a node's ranks must be consecutive (a tensor-parallel group
    or an HSDP shard group is a run of consecutive ranks). Ray Train orders workers by node."""
    sizes: list[int] = []
    seen: set[str] = set()
    previous = None
    for node in rank_nodes:
        if node != previous:
            if node in seen:
                counts = {n: list(rank_nodes).count(n) for n in dict.fromkeys(rank_nodes)}
                raise PlacementError(
                    f"the ranks of node {node} are not consecutive ({list(rank_nodes)}); a "
                    "tensor-parallel group must be consecutive ranks of one node",
                    list(counts.values()), 1)
            seen.add(node)
            sizes.append(0)
            previous = node
        sizes[-1] += 1
    return sizes

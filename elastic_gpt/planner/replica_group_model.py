"""The replica-group cost model: `elastic.replica_groups: N` against the restart path.

Goodput with N groups (a lost group stalls the others, then they train without it until it
heals; losing the driver's node is the restart path), the cross-group gradient all-reduce
torchft's hook runs (parallel/replicate.py), and the comparison with the restart path on one
market. The runtime is elastic/replica_groups.py; the timeouts are the trainer's
(`elastic.replica_collective_timeout_s` from config.py). The search over N is search.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic_gpt.config import ElasticSection
from elastic_gpt.cost_model.memory import Memory
from elastic_gpt.cost_model.mesh import Mesh
from elastic_gpt.cost_model.network import Network, ring_bytes
from elastic_gpt.cost_model.shape import FP32, ModelShape
from elastic_gpt.cost_model.step_time import LayoutCandidate
from elastic_gpt.elastic.resize_rule import kept_fraction
from elastic_gpt.planner.inputs import HOUR
from elastic_gpt.planner.reliability import (
    Reliability,
    rollback_mtbf_s,
    spike_cost_s,
    young_interval_s,
)

COLLECTIVE_TIMEOUT_S = ElasticSection.replica_collective_timeout_s
"""The trainer's default `elastic.replica_collective_timeout_s`: a lost node's group is dropped
after its heartbeat, and the survivors' step in flight with it gives up after this."""


def replica_goodput(interval_s: float, ckpt_write_s: float, mtbf_s: float, *, stall_s: float,
                    absent_s: float, n_groups: int, groups_lost: int = 1,
                    degraded_speed: float | None = None, fallback_mtbf_s: float = math.inf,
                    fallback_recovery_s: float = 0.0) -> float:
    """Fraction of wall time spent on kept work with `elastic.replica_groups: N` (first order, the
    same form as `goodput`).

    Each cycle trains `interval_s`, then blocks `ckpt_write_s` for the checkpoint the fallback
    needs. Group losses arrive at rate 1/mtbf_s (one per node failure); each costs every live
    group `stall_s` (the heartbeat timeout, the discarded step in flight, and the heal, during
    which the peer sending the state blocks its quorum), and while the lost `groups_lost` groups
    are away (`absent_s`: restart and checkpoint read) the run goes on at `degraded_speed` of its
    throughput (default (N - m) / N): (1 - speed) * absent_s of work per loss.

    The fallback is modelled, not ignored, as the restart path at one node's failure rate:
    losing the driver's node (it holds the Lighthouse and every group's run task) loses every
    group at once, so at rate 1/fallback_mtbf_s the run pays `fallback_recovery_s` plus half a
    cycle, as in `goodput`. The driver's node is counted on top of the training nodes (a head
    node); where it is one of them, its failures are counted twice, on the pessimistic side.
    Losing every group through overlapping failures needs N - 1 more within one group's absence
    (rate ~ 1/M * (absent_s / M)**(N - 1)): second order, ignored, as `goodput` ignores failures
    during a recovery.
    """
    tau, delta = interval_s, ckpt_write_s
    if tau <= 0:
        return 0.0
    if not 1 <= groups_lost < n_groups:
        raise ValueError(f"groups_lost={groups_lost} must be at least 1 and fewer than the "
                         f"n_groups={n_groups}: some group has to survive a failure")
    speed = (n_groups - groups_lost) / n_groups if degraded_speed is None else degraded_speed
    per_loss = stall_s + (1.0 - speed) * absent_s
    fallback = (fallback_recovery_s + (tau + delta) / 2) / fallback_mtbf_s
    return max(0.0, tau / (tau + delta) * (1.0 - per_loss / mtbf_s - fallback))


def cross_group_allreduce(shape: ModelShape, net: Network, group: Mesh, n_groups: int,
                          n_syncs: int, total_gpus: int) -> tuple[float, float]:
    """(bytes each GPU sends, seconds) per step for the average over the replica groups.

    torchft's all-reduce hook (parallel/replicate.py) averages every FSDP unit's reduce-scattered
    fp32 gradient shard, 4 * P_tp / dp_shard bytes per GPU in all, over the N groups at each
    gradient sync: a ring all-reduce, 2 (N-1)/N of it per GPU. Every GPU of a group is in its own
    ring (one per position in the group), so across nodes the rings of a node's GPUs share its
    NICs. One ring latency (NCCL's) per unit (L blocks and the root) per sync.
    """
    if n_groups <= 1:
        return 0.0, 0.0
    shard = FP32 * shape.local_params(group.tp) / group.dp_shard
    per_sync = 2 * ring_bytes(shard, n_groups)
    sharing = min(group.world, net.gpus_per_node)
    # one rank per group in each ring; the groups fill nodes in order
    per_node = max(1, net.gpus_per_node // group.world)
    latency = net.ring_latency_s(n_groups, per_node, all_reduce=True)
    seconds = (net.ring_s(per_sync, ranks=n_groups, per_node=per_node, nic_sharing=sharing,
                          all_reduce=True) + shape.cfg.n_layer * latency)
    return n_syncs * per_sync, n_syncs * seconds


@dataclass
class ReplicaLayout:
    """`elastic.replica_groups: N`: N groups of `group_gpus` GPUs, each its own FSDP2 (and tp,
    and HSDP if it spans nodes) mesh holding the full sharded state, with the settings that
    fit a group; what does not depend on the market."""

    n_groups: int
    group_gpus: int
    candidate: LayoutCandidate
    """One group's mesh and settings (micro-batch, checkpointing, grad sync, resharding), its
    memory per GPU and its own step (FSDP2 and TP over group_gpus GPUs)."""
    groups_lost: int
    """Groups a node failure takes: 1 when a group is one or more whole nodes, else the groups
    sharing the node."""
    in_group_step_s: float
    """The step inside a group: candidate's, or with --achieved-tflops the measured one."""
    allreduce_bytes: float
    """Cross-group gradient all-reduce, per GPU per step."""
    allreduce_s: float
    """Counted as exposed: the hook's `dist.all_reduce` on torchft's managed process group waits
    for each unit's result before FSDP2's post-backward returns, so the rest of the backward does
    not run under it."""
    degraded_step_s: float
    """The step while groups_lost groups are away: the survivors take the whole global batch
    (more micro-batches per rank, C1 fixed global batch's ceil included)."""
    ckpt_write_s: float
    """The leading group writes the whole checkpoint through its own nodes; the others wait for
    it at the next quorum. (torchft's join timeout, two heartbeats, may let them go on without it,
    which then rejoins by healing: not modelled, so long writes are counted pessimistically.)"""
    ckpt_read_s: float
    """A restarted group reads the newest checkpoint before it heals (the lost groups of one node
    read through that node)."""
    heal_bytes: float
    """Per GPU: its shard of fp32 params + Adam moments (12 B/param), from a live peer."""
    heal_s: float

    @property
    def mesh(self) -> Mesh:
        return self.candidate.mesh

    @property
    def memory(self) -> Memory:
        return self.candidate.memory

    @property
    def step_s(self) -> float:
        return self.in_group_step_s + self.allreduce_s

    @property
    def degraded_speed(self) -> float:
        """Throughput while groups are away, relative to all N."""
        return self.step_s / self.degraded_step_s


@dataclass
class ReplicaReliability:
    """A ReplicaLayout's goodput on one market (its node MTBF)."""

    layout: ReplicaLayout
    mtbf_s: float
    """Cluster MTBF: one group loss per node failure."""
    fallback_mtbf_s: float
    """The driver's node: losing it is the restart path."""
    stall_s: float
    """Per loss, every live group: the larger of the heartbeat and the collective timeout + the
    discarded step in flight + heal."""
    absent_s: float
    """Per loss, the lost groups: restart + checkpoint read (the heal is in stall_s)."""
    fallback_recovery_s: float
    interval_s: float
    every_steps: int
    young_interval_s: float
    goodput: float
    spike_s: float = 0.0
    """What one loss spike costs: every live group rolls back, re-runs and rolls back together
    (train/health.py), from checkpoints as far apart as the fallback's interval."""


def replica_reliability(layout: ReplicaLayout, node_mtbf_h: float, nodes: int,
                        heartbeat_s: float, restart_s: float, every_steps: int | None = None,
                        max_steps: int | None = None, spike_every_steps: float | None = None
                        ) -> ReplicaReliability:
    """Goodput of `layout` on a market. Per group loss the survivors stall until the Lighthouse
    drops the silent group (its heartbeat timeout: a node lost on a cloud goes silent, nothing
    refuses a connection) and their collective with it gives up (the collective timeout), plus
    the attempt in flight, whose work is discarded (it runs into the gone peer and is not
    committed): at most one step
    (half of one on average; the bound is counted). Its redo is not counted again: it is a step
    at the survivors' speed, which the absence term already charges. Then the heal: torchft's
    quorum is synchronous (use_async_quorum=False), so the peer sending the state is inside its
    quorum call until the copy is done, and the others wait for it at the step's first
    cross-group all-reduce. The lost group is away for its restart and its read of the newest
    checkpoint (it restores that, then heals to the live step).

    Checkpoints are for the fallback and loss spikes only, so their interval is Young's for the
    fallback's MTBF and the spikes (`rollback_mtbf_s`) and the leading group's write time; a
    spike (`spike_every_steps`) costs what it costs the restart path at that interval
    (`spike_cost_s`): every group rolls back together."""
    mtbf, fallback_mtbf = node_mtbf_h * HOUR / nodes, node_mtbf_h * HOUR
    step = layout.step_s
    spike_every_s = spike_every_steps * step if spike_every_steps else math.inf
    young = young_interval_s(layout.ckpt_write_s, rollback_mtbf_s(fallback_mtbf, spike_every_s))
    if every_steps is None:
        every_steps = max(1, round(young / step))
        if max_steps is not None:
            every_steps = min(every_steps, max_steps)
    interval = every_steps * step
    stall = max(heartbeat_s, COLLECTIVE_TIMEOUT_S) + step + layout.heal_s
    absent = restart_s + layout.ckpt_read_s
    # every group restarts and reads at once, the groups of a node through it, as lost ones do
    fallback_recovery = restart_s + layout.ckpt_read_s
    g = replica_goodput(interval, layout.ckpt_write_s, mtbf, stall_s=stall, absent_s=absent,
                        n_groups=layout.n_groups, groups_lost=layout.groups_lost,
                        degraded_speed=layout.degraded_speed, fallback_mtbf_s=fallback_mtbf,
                        fallback_recovery_s=fallback_recovery)
    spike_s = 0.0
    if spike_every_steps:
        spike_s = spike_cost_s(interval, step, layout.ckpt_read_s)
        g *= kept_fraction(spike_s, spike_every_s)
    return ReplicaReliability(layout, mtbf, fallback_mtbf, stall, absent, fallback_recovery,
                              interval, every_steps, young, g, spike_s)


def replica_groups_problem(n_groups: int, n_gpus: int, tp: int, gpus_per_node: int) -> str | None:
    """Why N groups cannot split these GPUs (one line), or None: the launcher's rule (N divides
    the workers into groups of whole TP groups) and the planner's, that groups line up with nodes
    (a group is whole nodes, or a node holds whole groups) and a node failure leaves a survivor."""
    if n_gpus <= gpus_per_node:
        return (f"--gpus={n_gpus} is one node: a node failure takes every replica group, so "
                "none is left to keep training")
    if n_groups < 2:
        return (f"--replica-groups={n_groups}: one group is the restart path with torchft's "
                "overhead; use 2 or more, or off")
    if n_gpus % n_groups or (n_gpus // n_groups) % tp:
        return (f"--replica-groups={n_groups} must divide --gpus={n_gpus} into groups of a "
                f"multiple of tp={tp} GPUs (the launcher's rule)")
    g = n_gpus // n_groups
    if g % gpus_per_node and gpus_per_node % g:
        return (f"--replica-groups={n_groups} gives groups of {g} GPUs, which straddle the "
                f"{gpus_per_node}-GPU nodes: one node failure would take two groups")
    return None


@dataclass
class FaultTolerance:
    """The restart path against the best replica-group count on one market, by effective
    throughput (steady-state tokens/s x goodput): same GPUs, so also by wall time and cost."""

    market: str
    restart: Reliability
    restart_tokens_per_s: float
    replica: list[ReplicaReliability]
    """Every N that fits, highest effective throughput first."""
    tokens_per_step: int
    not_offered: list[str] = field(default_factory=list)
    """Why replica groups (or some N) are not weighed, one line each."""
    forced: bool = False
    """--replica-groups N: the written config uses N whatever the comparison says."""

    @property
    def best(self) -> ReplicaReliability | None:
        return self.replica[0] if self.replica else None

    @property
    def restart_effective(self) -> float:
        return self.restart_tokens_per_s * self.restart.goodput

    def replica_tokens_per_s(self, r: ReplicaReliability) -> float:
        return self.tokens_per_step / r.layout.step_s

    def replica_effective(self, r: ReplicaReliability) -> float:
        return self.replica_tokens_per_s(r) * r.goodput

    @property
    def use_replica_groups(self) -> bool:
        """Only when strictly better: the restart path needs neither torchft nor a Lighthouse."""
        b = self.best
        return b is not None and (self.forced
                                  or self.replica_effective(b) > self.restart_effective)

    def why(self) -> str:
        """One line: which mode, and the two losses that decided it."""
        b = self.best
        lost_restart = 1 - self.restart.goodput
        if b is None:
            return "restart path (not offered: " + "; ".join(self.not_offered[:1]) + ")"
        slower = b.layout.step_s * self.restart_tokens_per_s / self.tokens_per_step - 1
        ratio = self.replica_effective(b) / max(self.restart_effective, 1e-12)
        if self.use_replica_groups:
            mode = (f"replica groups (N={b.layout.n_groups}"
                    + (", as --replica-groups asks" if self.forced else "")
                    + f"), {ratio:.3f}x the restart path's effective throughput")
        elif ratio > 0:
            mode = (f"restart path, {1 / ratio:.3f}x replica groups' (N="
                    f"{b.layout.n_groups}) effective throughput")
        else:
            mode = f"restart path, where replica groups (N={b.layout.n_groups}) keep no goodput"
        restart_step = self.tokens_per_step / self.restart_tokens_per_s
        return (f"{mode}: the restart path loses {100 * lost_restart:.1f}% of wall time to "
                f"failures and checkpoints, replica groups {100 * (1 - b.goodput):.1f}%, at a "
                f"step time {100 * slower:+.1f}% (in the group "
                f"{b.layout.in_group_step_s - restart_step:+.3f} s, cross-group all-reduce "
                f"+{b.layout.allreduce_s:.3f} s)")

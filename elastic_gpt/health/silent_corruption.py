"""Silent data corruption: ranks that must hold the same state compare it.

Two kinds of ranks hold the same state: HSDP's replicas of a shard (`HsdpReplicaCheck`) and the
replica groups' copies of the whole state (`GroupCopiesCheck`).

Under HSDP every shard of the model and its optimizer state is held by `dp_replicate` ranks, one
per node, that apply the same averaged gradients and so hold the same bits (C3: the updates are
deterministic). A bit flipped in one of them (a memory error, a faulty device: Llama 3 counts
silent data corruption among its interruptions) goes unnoticed by the loss until it grows.

Every `health.sdc_every_steps` steps, before the forward, each rank's exact shard checksum
(`health/attribution.shard_checksum`: any one flipped bit changes it) is all-gathered over the whole group,
one integer per rank, and every rank compares the replicas of each shard the same way:

- all equal: nothing happens;
- a majority agrees: the others are corrupt. Their state (parameters and optimizer moments) is
  overwritten from a majority replica (a broadcast inside that shard's replicas), before the
  corrupted value reaches a forward, so training goes on exactly as if nothing had happened; an
  event names the ranks and their nodes are drained (the group restarts without them at the next
  step boundary and the autoscaler replaces them);
- no majority (two replicas that differ): no replica can be trusted, and the run rolls back to the
  newest checkpoint (health/recovery.py), every one of which was saved after a passing check.

Replica groups (torchft) hold the same state across groups the same way (`GroupCopiesCheck`):
each rank's checksum rides in the step's stats, which the groups sum anyway (no collective of
its own), and the vote to commit settles it. Copies that differ make every group vote no: the
step is applied nowhere. A group whose copy differs from the majority's is set a step behind
and healed from a live peer at the next quorum (torchft's recovery, as for a group that joins
late); its node is drained, and the checkpoints it wrote since the last check are deleted. With
no majority (two groups) no copy can be trusted: the checkpoints written since the last check are
deleted and every group fails, so each restarts from the newest checkpoint left.

The check costs one checksum pass over the shard (about a quarter of the optimizer step's memory
traffic) and one all-gather of a word per rank (with replica groups, two words per group added to
the step's stats).
"""

from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_gpt.config import HealthSection
from elastic_gpt.console import say


class HsdpReplicaCheck:
    """One rank's part of the HSDP replicas' comparison; every rank calls `check` at every step."""

    def __init__(self, cfg: HealthSection, dims, *, rank: int, world_size: int,
                 rank_nodes: list[str] | None = None, membership=None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.rank_nodes, self.membership = rank_nodes, membership
        self.sets: list[list[int]] = []
        self.group = None
        if dims.dp_replicate > 1:
            # The mesh is (pp, dp_replicate, dp_shard, tp): a shard's replicas differ only in
            # dp_replicate.
            ranks = dims.mesh.mesh  # global ranks, shaped like the mesh
            self.sets = ranks.permute(0, 2, 3, 1).reshape(-1, dims.dp_replicate).tolist()
            self.group = dims.mesh["dp_replicate"].get_group()
        self.corrupted = 0

    def due(self, step: int) -> bool:
        every = self.cfg.sdc_every_steps
        return bool(self.sets) and every > 0 and step % every == 0

    def check(self, step: int, checksum: torch.Tensor, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, ledger) -> str | None:
        """Collective when `due(step)`: None when the replicas agree, "healed" when the corrupt
        ones were overwritten from a majority, "no majority" when the run must roll back."""
        sums = torch.zeros(self.world_size, dtype=torch.int64, device=checksum.device)
        sums[self.rank] = checksum
        dist.all_reduce(sums)
        sums = sums.tolist()
        bad, sources, undecided = [], {}, []
        for replicas in self.sets:
            values = collections.Counter(sums[r] for r in replicas)
            if len(values) == 1:
                continue
            value, count = values.most_common(1)[0]
            if 2 * count <= len(replicas):
                undecided.append(replicas)
                continue
            wrong = [r for r in replicas if sums[r] != value]
            bad += wrong
            sources[tuple(replicas)] = next(r for r in replicas if sums[r] == value)
        if not bad and not undecided:
            return None
        self.corrupted += 1
        if undecided:
            self._record(ledger, step, sorted(r for s in undecided for r in s), None)
            return "no majority"
        for replicas, src in sources.items():
            if self.rank in replicas:
                _broadcast_state(model, optimizer, src, self.group)
        self._record(ledger, step, sorted(bad), sources)
        return "healed"

    def _record(self, ledger, step: int, ranks: list[int], sources: dict | None) -> None:
        nodes = sorted({self.rank_nodes[r] for r in ranks}) if self.rank_nodes else []
        healed = sources is not None
        detail = (f"after step {step}, rank(s) {ranks} held a shard that "
                  + (f"disagreed with the majority of its replicas: overwritten from rank(s) "
                     f"{sorted(set(sources.values()))}" if healed else
                     "differed between replicas with no majority: rolling back"))
        ledger.events.append({"at": time.time(), "kind": "silent data corruption",
                              "step": step, "detail": detail, "ranks": ranks, "nodes": nodes,
                              "action": "healed from the majority" if healed else "rollback"})
        if self.rank != 0:
            return
        say(f"[elastic-gpt] silent data corruption {detail}"
            + ("; draining the node(s) " + ", ".join(n[:12] for n in nodes)
               if healed and nodes else ""))
        if healed and self.membership is not None:
            for node in nodes:
                self.membership.drain_node(node, "silent data corruption: " + detail)


def _broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, src: int,
                     group) -> None:
    """Collective over a shard's replicas: every parameter and optimizer state tensor of this
    rank's shard from replica `src` (a global rank)."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(_local(p), src=src, group=group)
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    dist.broadcast(_local(value), src=src, group=group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GroupCopiesDiffer(RuntimeError):
    """The replica groups' copies of the state differ with no majority: every group fails, and
    each restarts from the newest checkpoint left (not fatal: Ray restarts them)."""


class GroupCopiesCheck:
    """One rank's part in comparing the replica groups' copies (the fault-tolerance mode,
    `train/fault_tolerance.ReplicaGroupPath`, carries the checksums; this acts on what it
    found)."""

    def __init__(self, cfg: HealthSection, fault_tolerance, *, rank: int, checkpointer,
                 rank_nodes: list[str] | None = None, membership=None):
        """`checkpointer`: the run's (checkpoint/checkpointer.py); the checkpoints written since
        the copies last agreed are discarded through it."""
        self.cfg, self.ft, self.rank = cfg, fault_tolerance, rank
        self.checkpointer, self.rank_nodes, self.membership = checkpointer, rank_nodes, membership

    def due(self, step: int) -> bool:
        every = self.cfg.sdc_every_steps
        return self.ft.compares_copies and every > 0 and step % every == 0

    def after_verdict(self, step: int, ledger) -> None:
        """Before the forward of the attempt after one whose copies differed (this group, if its
        copy was the one, has just been healed at the quorum)."""
        from elastic_gpt.parallel.replicate import (
            COPIES_MAJORITY,
            COPIES_MINORITY,
            COPIES_UNDECIDED,
        )

        verdict = self.ft.take_copies_verdict() if self.ft.compares_copies else None
        if verdict is None:
            return
        trusted = step - self.cfg.sdc_every_steps  # the copies last agreed on that step's state
        detail = (f"after step {step}, replica group(s) {verdict.groups} held a copy of the state "
                  "that differed from " + ("the others' with no majority"
                                           if verdict.seen == COPIES_UNDECIDED else
                                           "the majority's: healed from a live peer"))
        if verdict.led or verdict.seen == COPIES_UNDECIDED:
            discard_checkpoints_after(trusted, self.checkpointer)
        if verdict.seen == COPIES_UNDECIDED:
            raise GroupCopiesDiffer(f"silent data corruption {detail}; every group restarts "
                                      "from the newest checkpoint written before it")
        if verdict.seen == COPIES_MAJORITY and self.ft.leads:
            ledger.events.append({"at": time.time(), "kind": "silent data corruption",
                                  "step": step, "detail": detail, "groups": verdict.groups,
                                  "action": "healed from the majority"})
            if self.rank == 0:
                say(f"[elastic-gpt] silent data corruption {detail}")
        if verdict.rank_seen == COPIES_MINORITY and self.rank_nodes and self.membership:
            node = self.rank_nodes[self.rank]
            self.membership.drain_node(node, f"silent data corruption: {detail}")


def discard_checkpoints_after(step: int, checkpointer) -> None:
    """Every checkpoint newer than `step`, the last state the copies agreed on: one written since
    may hold a corrupt copy's shard."""
    for doomed in checkpointer.discard_after(step):
        say(f"[elastic-gpt] the checkpoint of step {doomed}, written after the corruption, is "
            "deleted")

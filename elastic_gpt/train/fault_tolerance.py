"""The fault-tolerance mode as the Trainer's loop sees it: one strategy object whose hooks
`Trainer.train()` calls at fixed points, so the loop itself carries no mode (torchtitan's shape).

Two modes (docs/replica-groups.md compares them; the planner weighs them):

* `RestartPath`, the default: the worker group is the unit of failure. A lost worker, a drain or
  a resize stops the whole group; Ray Train starts a new one (elastic/), which restores the newest
  committed checkpoint (C3 bit-identical resume, C4 atomic commit). Every step commits, and the
  one group saves and logs. It is the null object: each hook does nothing, or the plain thing.
* `ReplicaGroupPath`, with `elastic.replica_groups: N` (C7 all-or-nothing step): this worker's group
  is one of N that meet at the Lighthouse before every step. Its torchft side, `ReplicaGroup`
  (`parallel/replicate.py`), forms the quorum, heals a group that is behind and averages the
  gradients over the live groups; a step is applied by all of them or re-done by all; the group
  leading the quorum saves and logs; a drained group leaves the quorum.

The hooks, in the order the loop calls them:

    attach(model, optimizer, device, run_state)  once, when the model and optimizer are built
    on_start(step)                               after the restore, before the first step
    on_resume(event, step)                       rank 0, when this attempt continues another
    begin_step(step, dp_rank, dp_degree)         before each attempt: the step and its split
    take_copies_verdict(), note_state_checksum(c)  where `compares_copies`, before the forward:
                                                 what the last attempt found of the groups'
                                                 copies; this attempt's state checksum
    reduce_gradients(), reduce_stats(stats),     inside `Trainer.train_step`
      should_commit(step, stats)
    on_uncommitted(step)                         an attempt applied nowhere: it is re-done
    on_rollback(step)                            the loop restored the checkpoint of `step`
                                                 (a loss spike, health/recovery.py)
    on_stop()                                    the last step before a planned restart committed
    quorum_change()                              after each committed step
    leads, degraded                              after each committed step: who saves, the ledger
    writes_alone                                 whether this group is the checkpoints' only writer
    close()                                      on the way out, after an error too

and, for the straggler watch (health/stragglers.py), the replica groups' comparison of their
compute: `exchange_group_compute(every)` once, `offer_group_compute(seconds)` after a share,
`take_group_compute()` after each committed step (`group_count` 1: none, the restart path).

Nothing here imports Ray; torchft only when a `ReplicaGroup` is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from elastic_gpt.console import say
from elastic_gpt.tracking import metric_names as mn

if TYPE_CHECKING:
    import torch

    from elastic_gpt.parallel.replicate import ReplicaGroup
    from elastic_gpt.tracking.metric_logger import MetricLogger


@dataclass(frozen=True)
class QuorumChange:
    """A step's quorum had another number of live groups than the step before it."""

    before: int
    after: int
    groups: int
    """Groups the run was configured with."""
    waited_s: float
    """How long the step waited in that quorum: recovery, not productive time (the ledger)."""


@dataclass(frozen=True)
class CopiesVerdict:
    """The replica groups' copies of the state differed (`parallel/replicate.COPIES_*`)."""
    seen: int
    """The worst any rank of this group saw: this group's copy differed, another's, no majority."""
    groups: list[int]
    """The groups whose copy differed from the majority's (every live group without one)."""
    led: bool
    """This group led the attempt: the checkpoints it wrote are its copy's."""
    rank_seen: int
    """What this rank saw of its own shard."""


class FaultTolerance(Protocol):
    """What the Trainer's loop asks of a fault-tolerance mode (the module docstring has the order)."""

    leads: bool
    """This rank's group writes this step's checkpoint (and logs its metrics)."""
    degraded: bool
    """Fewer groups are live than the run was configured with: the ledger's degraded time."""
    group_name: str
    """This worker group's name in the run's files: "" on the restart path (one group)."""
    compares_copies: bool
    """Other groups hold copies of this rank's shard, compared by checksum in the step's stats."""
    writes_alone: bool
    """No other group writes checkpoints into the run's store (checkpoint/checkpointer.py: an
    uncommitted step found at the start is a leftover)."""

    def attach(self, model, optimizer, device: torch.device, run_state) -> None:
        """`run_state`: (get, set) of state that belongs to the run, not to a group (the goodput
        ledger, the health state): a replica group healed from a peer adopts the peer's."""

    def on_start(self, step: int) -> None:
        """This rank restored `step` (0 for a fresh run) and is about to train."""

    def on_resume(self, event: dict, step: int) -> None:
        """Rank 0, when the ledger says this attempt continues an earlier one: say how."""

    def begin_step(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int, int]:
        """Before each attempt at the step after `step`: (the step to train from, this rank's
        batch rank and the batch degree of its split). When they differ from the loop's, the
        loop re-plans its data stream from them (C1 fixed global batch, C2 data order)."""

    def reduce_gradients(self) -> None:
        """After the backward, before clipping."""

    def reduce_stats(self, stats: torch.Tensor) -> None:
        """`stats`: the step's loss sum, data fingerprint (two halves) and stop flag, already
        summed over this group's ranks."""

    def should_commit(self, step: int, stats: torch.Tensor) -> bool:
        """Whether the optimizer steps; False: nothing is applied and the step is re-done."""

    def note_state_checksum(self, checksum: torch.Tensor) -> None:
        """Before an attempt whose copies are compared: this rank's shard checksum."""

    def take_copies_verdict(self) -> CopiesVerdict | None:
        """Once, after the attempt that found the groups' copies differing: what was found."""

    def on_uncommitted(self, step: int) -> None:
        """The attempt at the step after `step` was applied nowhere; the loop re-does it."""

    def on_rollback(self, step: int) -> None:
        """The loop rolled back to the checkpoint of `step`; every live group did the same, at
        the same step (health/recovery.py), and trains on from there."""

    def on_stop(self) -> None:
        """The step before a planned restart (a drain, a resize) committed: this group takes
        part in no more steps. Called before that step's checkpoint is saved."""

    def quorum_change(self) -> QuorumChange | None:
        """After each committed step: the change in live groups at its quorum, if any."""

    def close(self) -> None:
        """The loop is over, or failed."""

    group_count: int
    """Replica groups the run was configured with (1 on the restart path)."""
    group_index: int
    """This group's index among them."""

    def exchange_group_compute(self, every: int) -> None:
        """The groups compare their compute per step every `every` steps (in the step after
        each share, inside its quorum)."""

    def offer_group_compute(self, seconds: float) -> None:
        """This group's figure for the next exchange (its slowest rank's; 0: none yet)."""

    def take_group_compute(self) -> list[float] | None:
        """Once, after the committed step that exchanged them: every group's figure, by group
        (0: none), else None."""


class RestartPath:
    """One worker group, restarted as a whole (the null object of `FaultTolerance`)."""

    leads = True
    degraded = False
    group_name = ""
    compares_copies = False
    writes_alone = True
    group_count, group_index = 1, 0

    def attach(self, model, optimizer, device: torch.device, run_state) -> None:
        pass

    def note_state_checksum(self, checksum: torch.Tensor) -> None:
        pass

    def take_copies_verdict(self) -> CopiesVerdict | None:
        return None

    def on_start(self, step: int) -> None:
        pass

    def on_resume(self, event: dict, step: int) -> None:
        say(f"[elastic-gpt] {event['kind']}: {event['detail']}; W {event['from_world_size']} "
            f"-> {event['to_world_size']}, resuming at step {step} ({event['lost_steps']} "
            "step(s) to redo)")

    def begin_step(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int, int]:
        return step, dp_rank, dp_degree

    def reduce_gradients(self) -> None:
        pass

    def reduce_stats(self, stats: torch.Tensor) -> None:
        pass

    def should_commit(self, step: int, stats: torch.Tensor) -> bool:
        return True

    def on_uncommitted(self, step: int) -> None:
        pass

    def on_rollback(self, step: int) -> None:
        pass

    def on_stop(self) -> None:
        pass  # the whole group restarts: nobody waits for it

    def quorum_change(self) -> QuorumChange | None:
        return None

    def close(self) -> None:
        pass

    def exchange_group_compute(self, every: int) -> None:
        pass

    def offer_group_compute(self, seconds: float) -> None:
        pass

    def take_group_compute(self) -> list[float] | None:
        return None


class ReplicaGroupPath:
    """This worker's part in `elastic.replica_groups: N` (C7 all-or-nothing step); `member` is its
    torchft side (`parallel/replicate.py`)."""

    writes_alone = False  # the group leading each step's quorum saves it

    def __init__(self, member: ReplicaGroup):
        self.member = member
        self.group_name = f"g{member.group}"
        self.compares_copies = member.groups > 1
        self._verdict: CopiesVerdict | None = None
        self._hand_over: Callable[[], None] = lambda: None
        self._store_sent: Callable[[float], bool] = lambda timeout_s: True
        self._step = 0  # the step the current attempt trains from (its quorum's)
        self._compute_every = 0  # the groups compare their compute every this many steps
        self._compute_offer = 0.0
        self._compute_got: list[float] | None = None

    def metric_sink(self, sink: MetricLogger) -> LeaderMetrics:
        """The metric sink of this group's rank 0 in a tracked run: each committed step's
        metrics reach the one MLflow run once, from the group leading its quorum or, when that
        group is lost before it stored them, from the group leading after it (C5 one MLflow
        run)."""
        metrics = LeaderMetrics(sink, self)
        self._hand_over, self._store_sent = metrics.hand_over, metrics.flush
        return metrics

    @property
    def leads(self) -> bool:
        """The group leading this step's quorum saves (and logs): each step once (C5 one MLflow
        run)."""
        return self.member.leads

    @property
    def live_groups(self) -> int:
        return self.member.live_groups

    @property
    def degraded(self) -> bool:
        return self.member.live_groups < self.member.groups

    def attach(self, model, optimizer, device: torch.device, run_state) -> None:
        self.member.attach(model, optimizer, device, run_state=run_state)

    def on_start(self, step: int) -> None:
        # The quorum's step is the checkpoint's: a group behind its live peers is healed from
        # them at its first quorum.
        self.member.set_step(step)

    def on_resume(self, event: dict, step: int) -> None:
        say(f"[elastic-gpt] replica group restarted ({event['kind']}: "
            f"{event['detail'][:120]}); restored step {step}, healing from a live "
            "peer at its first quorum if the others are ahead")

    def begin_step(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int, int]:
        # The quorum fixes the step (a healed group jumps to its peers') and the split: this
        # rank's place among every live group's data-parallel ranks.
        planned = self.member.begin_step(dp_rank, dp_degree)
        self._step = planned[0]
        return planned

    def reduce_gradients(self) -> None:
        self.member.reduce_gradients()

    def reduce_stats(self, stats: torch.Tensor) -> None:
        self.member.reduce_stats(stats)
        every = self._compute_every
        if every and self._step and self._step % every == 0:
            self._exchange_compute(stats)

    @property
    def group_count(self) -> int:
        return self.member.groups

    @property
    def group_index(self) -> int:
        return self.member.group

    def exchange_group_compute(self, every: int) -> None:
        self._compute_every = every

    def offer_group_compute(self, seconds: float) -> None:
        self._compute_offer = seconds

    def take_group_compute(self) -> list[float] | None:
        got, self._compute_got = self._compute_got, None
        return got

    def _exchange_compute(self, stats: torch.Tensor) -> None:
        """Every live group's compute figure, a slot each, summed over the groups (inside the
        step's quorum, so a group lost meanwhile only makes the step re-done). Every group calls
        it at the same steps, by the step number, whether it has a figure or not: a group that
        joined since the last share offers 0, and one healing in this step adds zeros (torchft
        zeroes what a group that does not take part sends)."""
        import torch.distributed as dist

        figures = stats.new_zeros(self.member.groups)
        figures[self.member.group] = self._compute_offer
        self.member.manager.allreduce(figures, reduce_op=dist.ReduceOp.SUM).wait()
        self._compute_got = figures.tolist()

    def should_commit(self, step: int, stats: torch.Tensor) -> bool:
        return self.member.should_commit(step, stats)

    def note_state_checksum(self, checksum: torch.Tensor) -> None:
        self.member.note_state_checksum(checksum)

    def take_copies_verdict(self) -> CopiesVerdict | None:
        verdict, self._verdict = self._verdict, None
        return verdict

    def on_uncommitted(self, step: int) -> None:
        from elastic_gpt.parallel.replicate import COPIES_AGREE

        # Was it the groups' copies that differed? The group agrees on what its ranks saw (a
        # group whose copy differed is set to heal at the next quorum).
        led = self.member.leads
        seen = self.member.settle_copies()
        if seen != COPIES_AGREE:
            self._verdict = CopiesVerdict(seen, self.member.copies_differed_anywhere, led,
                                          self.member.copies_seen)
        elif self.member.group_rank == 0:
            say(f"[elastic-gpt] step {step + 1} not committed by the replica groups' quorum; "
                "re-doing it")

    def on_rollback(self, step: int) -> None:
        # Every live group restored the same checkpoint: the next quorum finds them all at its
        # step, and heals none of them back to the abandoned trajectory.
        self.member.set_step(step)

    def on_stop(self) -> None:
        # A drained group: the others' next quorum forms without waiting for its heartbeat to
        # time out. Its metric sink stops first: the group leading after it logs what it did not
        # store (LeaderMetrics).
        self._hand_over()
        self.member.leave()

    def quorum_change(self) -> QuorumChange | None:
        change = self.member.quorum_change()
        if change is None:
            return None
        before, after = change
        if after > before:
            # A group joined: the steps this group logged before it are in no other group's
            # hands (the joiner never held them), so they are stored before the run goes on.
            self._store_sent(LeaderMetrics.HAND_OVER_S)
        return QuorumChange(before, after, self.member.groups, self.member.quorum_s)

    def close(self) -> None:
        # Also after an error: the group leaves the quorum first (its metric sink stopped
        # before, as in on_stop), then stops.
        self._hand_over()
        self.member.shutdown()


class LeaderMetrics:
    """Rank 0's metric sink with replica groups: every committed step's metrics reach MLflow
    exactly once, even when the group that logs them is lost mid-step (C5 one MLflow run).

    The group leading a step's quorum logs the step, with the number of live groups. Its logger
    ships in the background, so a leader killed after a commit can take the last few steps'
    records with it. The other groups therefore hold their own record of each step they committed
    until the leader has stored it: the leader says how far it has (`MetricLogger.logged_through`)
    in each step's stats sum (`ReplicaGroup.leader_logged_through`). A group that logs while
    leading and still holds records has taken the lead from a group that is gone (the leader is
    the quorum's lowest replica id, so the one it held records for is not in the quorum): it logs
    each held step that the store does not have yet (`MetricLogger.log_missing`, keyed by step).
    A record's values are this group's (its own step time), but for any step only one record is
    stored.

    Steps a group committed while no other group was live are held by nobody else: when a group
    joins, every group stores what its sink was given before going on (`quorum_change`; at most
    `HAND_OVER_S`, a join is rare and already waits for the heal), so a leader lost after that
    takes none of them with it.

    Nothing logs a step twice as long as nothing of the old leader lands after the new one has
    looked: a killed process sends nothing, and a group that leaves (a drain, an error, the end)
    stops its sink before the Lighthouse hears it leave (`hand_over`, from
    ReplicaGroupPath.on_stop and close), after shipping what it could. What is left: a leader that
    the Lighthouse dropped by its heartbeat while it still runs and still reaches the store (cut
    off from the Lighthouse alone) may store a step that the next leader logged too. Writers
    that share each step's values and timestamps would let MLflow's own dedupe absorb that (it
    drops a row equal in key, step, timestamp and value), at N times the writes: not done."""

    HAND_OVER_S = 5.0
    """How long a leaving group's sink ships what it holds (a checkpoint waits as long for the
    metrics before its commit)."""
    HELD = 10_000
    """Records held at most: more steps than a leader's logger keeps unsent (100,000 values)."""

    def __init__(self, sink: MetricLogger, replica_groups: ReplicaGroupPath):
        self.sink, self.replica_groups = sink, replica_groups
        self._held: list[tuple[int, int, dict]] = []
        replica_groups.member.logged_through = sink.logged_through

    def log(self, metrics: dict, step: int) -> None:
        groups = self.replica_groups
        record = {**metrics, mn.TRAIN_REPLICA_GROUPS: groups.live_groups}
        if groups.leads:
            if self._held:  # the lead taken over: what the lost leader may not have stored
                self.sink.log_missing(self._held)
                self._held = []
            self.sink.log(record, step)
            return
        stored = groups.member.leader_logged_through
        self._held = [r for r in self._held[-self.HELD + 1:] if r[0] > stored]
        self._held.append((step, int(time.time() * 1000), record))

    def hand_over(self) -> None:
        """This group leaves the quorum: ship what it can, then nothing more."""
        self.sink.stop_sending(self.HAND_OVER_S)
        self._held = []

    def log_params(self, params: dict[str, str]) -> None:
        self.sink.log_params(params)

    def flush(self, timeout_s: float) -> bool:
        return self.sink.flush(timeout_s)

    def close(self) -> None:
        self.sink.close()

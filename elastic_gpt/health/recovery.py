"""Loss spikes and non-finite losses, handled without a person.

What a person did by hand in the published large runs (OPT-175B's logbook, PaLM's restarts from
~100 steps before a spike with 200-500 batches skipped), and what Megatron's re-run state machine
automates in part, as one loop the health checks run after every committed step:

1. **Detect** (health/spikes.py): a loss far above the running median of the healthy ones, for
   `health.spike_steps` steps, or a non-finite one at once.
2. **Roll back** to the newest committed checkpoint from before every update the spike may have
   come from: the first flagged loss was computed on weights its previous step's update made (a
   bad batch, or faulty hardware: a checkpoint of that step holds the damage). The checkpoints
   after it hold the spiked trajectory and are discarded.
3. **Attribute by re-running** (`health.rerun`): the steps from the checkpoint to the detection
   are trained again on the same samples, with no checkpoint saved. The same losses mean the
   data caused the spike; different ones mean the hardware did, and the rank whose own work
   differs first (health/attribution.py) has its node drained (Ray re-places the group without
   it and the autoscaler replaces it). Nothing is skipped: the re-run is the trajectory from
   then on.
4. **Skip the data** (a reproduced spike): roll back to the checkpoint again and leave out the
   flagged steps' batches and `health.skip_steps_before` before them (the loss at step t is
   computed on weights that step t-1's batch updated). The skip is written to the run record
   at once (data/skips.py): every later restart, resize or resume reads the same order.
5. **Budgets.** More than `health.max_rollbacks_per_hour` rollbacks in an hour, or more than
   `health.max_skipped_steps` batches skipped in all, stop the run with one line: it keeps
   diverging, and skipping more data will not cure it.

Every decision is made from values every rank holds alike (the step's reduced loss), so all
ranks act at the same step without a collective of their own; the rank attribution is one small
all-reduce, once per hardware verdict. With replica groups every group holds the same loss (the
groups sum it) and the same detector state (`state_dict`: a group healed from a peer adopts the
peer's, a restarted one reads its checkpoint's), so every live group rolls back to the same
checkpoint at the same step, re-runs and skips alike, and their quorum stays whole (C7).
Spikes, rollbacks, skips and verdicts are ledger events (they travel with the checkpoints and
reach MLflow's events.jsonl) and `system/health/*` metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_gpt.config import HealthSection
from elastic_gpt.console import say
from elastic_gpt.data.skips import DataSkips
from elastic_gpt.errors import FatalTrainingError
from elastic_gpt.health.attribution import RerunAttribution, shard_checksum
from elastic_gpt.health.spikes import Spike, SpikeDetector
from elastic_gpt.tracking import metric_names as mn

RUN_INFO_SKIPS = "data_skips"  # the run record's key (checkpoint/store.py's run.json)
class TrainingDiverged(FatalTrainingError):
    """A health budget is spent: the run keeps diverging (its newest checkpoint is intact)."""


@dataclass
class _Rerun:
    spike: Spike
    checkpoint: int
    losses: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Rollback:
    """What the Trainer does next: load the checkpoint of `to_step` and train on from it."""

    to_step: int
    url: str
    restart: str | None = None
    """Restart the worker group from that checkpoint, for this reason, instead of training on:
    a node was drained for a device that computes wrong, and must not take part again."""


class SpikeRecovery:
    """One rank's part of the loop in the module docstring. Every rank calls `before_step` and
    `after_step` at each step; rank 0 alone writes the run record, the events and the metrics."""

    def __init__(self, cfg: HealthSection, *, rank: int, world_size: int, store, skips: DataSkips,
                 global_batch_size: int, keep_steps: int, rank_nodes: list[str] | None = None,
                 metrics=None, membership=None, speaks: Callable[[], bool] | None = None):
        """`keep_steps`: how far back a rollback can reach (the checkpoints kept, in steps):
        each rank's checksums and step times are kept that long. `speaks()`: whether this rank
        says what it does (rank 0; of replica groups, the leading group's alone)."""
        self.cfg, self.rank, self.world_size, self.store = cfg, rank, world_size, store
        self.skips, self.global_batch_size = skips, global_batch_size
        self.action = cfg.spike_action
        self.speaks = speaks or (lambda: rank == 0)
        self.rank_nodes, self.metrics, self.membership = rank_nodes, metrics, membership
        self.detector = SpikeDetector(cfg.spike_window, cfg.spike_deviations, cfg.spike_min_rise,
                                      cfg.spike_steps, cfg.spike_min_history)
        self.keep_steps = max(keep_steps, cfg.spike_steps + 1)
        self.attribution = RerunAttribution(rank=rank, world_size=world_size,
                                            keep_steps=self.keep_steps)
        self.step_seconds: dict[int, float] = {}
        self.rerun: _Rerun | None = None
        self.totals = {"spikes": 0, "rollbacks": 0, "hardware_faults": 0}
        self.check_devices: Callable[[int, object], tuple[list[int], bool]] | None = None
        """Collective: every rank's device probed for its known answer (health/stragglers.py):
        (the ranks computing wrong, whether their nodes are drained). Asked before a reproduced
        spike is blamed on the data."""

    @property
    def rolls_back(self) -> bool:
        """Whether a non-finite loss is this loop's to handle (else train.nan_patience's)."""
        return self.action == "rollback"

    @property
    def rerunning(self) -> bool:
        """Re-running suspect steps: nothing is saved until the verdict."""
        return self.rerun is not None

    # ---- the run's state, not a rank's -------------------------------------------------------

    def state_dict(self) -> dict:
        """The detector's window, the totals, the skips and a re-run in progress: what every rank
        holds alike, made from the losses every rank holds alike. A replica group healed from a
        live peer adopts it, so every group decides alike at the same step (C7 all-or-nothing
        step); a checkpoint keeps it, so a resumed run flags a spike at once, not after
        `spike_min_history` steps. Plain lists: it travels in a checkpoint's JSON."""
        rerun = self.rerun
        return {"history": [list(h) for h in self.detector.history],
                "flagged": sorted(self.detector.flagged.items()), "totals": dict(self.totals),
                "skips": self.skips.to_list(),
                "rerun": None if rerun is None else {
                    "first": rerun.spike.first, "last": rerun.spike.last,
                    "losses": sorted(rerun.spike.losses.items()), "median": rerun.spike.median,
                    "threshold": rerun.spike.threshold, "checkpoint": rerun.checkpoint,
                    "rerun_losses": sorted(rerun.losses.items())}}

    def load_state_dict(self, state: dict, skips: bool = True) -> None:
        """`skips=False` keeps this rank's skips (a checkpoint's: the run record read at the
        start is newer)."""
        self.detector.history.clear()
        self.detector.history.extend((int(s), v) for s, v in state["history"])
        self.detector.flagged = {int(s): v for s, v in state["flagged"]}
        self.totals.update(state["totals"])
        if skips:
            self.skips = DataSkips.from_list(state["skips"])
        r = state["rerun"]
        self.rerun = None if r is None else _Rerun(
            Spike(r["first"], r["last"], {int(s): v for s, v in r["losses"]}, r["median"],
                  r["threshold"]), r["checkpoint"], {int(s): v for s, v in r["rerun_losses"]})

    # ---- every step --------------------------------------------------------------------------

    def before_step(self, model: torch.nn.Module, step: int, checksum: bool = False,
                    corrupt_gradient: bool = False) -> torch.Tensor | None:
        """Before the forward of the step after `step` steps: this rank's shard checksum when the
        re-run attribution keeps one, or `checksum` asks (health/silent_corruption.py); else
        None. `corrupt_gradient`: a test's injected fault in this step's backward."""
        if self.keeps_checksums:
            return self.attribution.before_step(model, step, rerun=self.rerun is not None,
                                                corrupt_gradient=corrupt_gradient)
        return shard_checksum(model) if checksum else None

    @property
    def keeps_checksums(self) -> bool:
        """The re-run attribution keeps each rank's checksums (its parameters', its gradients')."""
        return self.action == "rollback" and self.cfg.rerun

    def after_step(self, step: int, loss: float, nonfinite: bool, seconds: float,
                   ledger) -> Rollback | None:
        """After committed step `step` (steps done, as the metrics number it; its loss; whether
        its loss or gradient was non-finite; its wall time): None to go on, or the rollback to
        make."""
        if self.action == "off":
            return None
        if self.keeps_checksums:
            self.attribution.after_step(step, rerun=self.rerun is not None)
        if nonfinite:
            loss = math.nan
        elif not math.isfinite(loss):  # skipped, and tolerated by train.nan_patience
            return None
        self.step_seconds[step] = seconds
        for old in [s for s in self.step_seconds if s < step - self.keep_steps]:
            del self.step_seconds[old]
        if self.rerun is not None:
            return self._rerun_step(step, loss, ledger)
        spike = self.detector.observe(step, loss)
        if spike is None:
            return None
        self.totals["spikes"] += 1
        if self.action == "report":
            self._event(ledger, {"kind": "loss spike", "detail": spike.describe(),
                                 "step": spike.last, "first_step": spike.first,
                                 "action": "reported (health.spike_action=report)"})
            if self.speaks():
                say(f"[elastic-gpt] warning: {spike.describe()}; reported, not rolled back")
            self._log_totals(step)
            return None
        return self._roll_back_for(spike, ledger)

    # ---- decisions ---------------------------------------------------------------------------

    def _roll_back_for(self, spike: Spike, ledger) -> Rollback:
        self._check_rollback_budget(ledger, spike.describe())
        # The first flagged loss was computed on the weights of step first - 1, which that
        # step's update made: from a bad batch (skip_steps_before) or faulty hardware, and a
        # checkpoint of that step holds it. The state to trust is from before that update.
        trusted = spike.first - 1 - max(1, self.cfg.skip_steps_before)
        target = self._checkpoint_at_or_before(trusted)
        if target is None:
            raise TrainingDiverged(
                f"{spike.describe()} with no committed checkpoint at or before step "
                f"{trusted} to roll back to; keep more checkpoints (checkpoint.keep) or save "
                "more often (checkpoint.every_steps), or lower health.skip_steps_before; this "
                "early in a run, lower train.lr or raise train.warmup_steps")
        rerun = self.cfg.rerun
        action = f"rolled back to step {target.step}" + (
            f", re-running steps {target.step + 1}-{spike.last} to attribute it" if rerun else "")
        self._event(ledger, {"kind": "loss spike", "detail": spike.describe(),
                             "step": spike.last, "first_step": spike.first,
                             "losses": {str(k): v for k, v in spike.losses.items()},
                             "median": spike.median, "threshold": spike.threshold,
                             "action": action})
        if self.speaks():
            say(f"[elastic-gpt] {spike.describe()}: {action}")
        if rerun:
            self.rerun = _Rerun(spike, target.step)
            self.attribution.start_rerun()
            return self._rollback(target, ledger, spike.last, "spike")
        return self._skip_and_roll_back(spike, target, ledger)

    def _rerun_step(self, step: int, loss: float, ledger) -> Rollback | None:
        rerun = self.rerun
        if step >= rerun.spike.first:
            rerun.losses[step] = loss
        else:  # the healthy steps before the spike: back into the window
            self.detector.observe(step, loss)
        if step < rerun.spike.last:
            return None
        self.rerun = None
        first = rerun.spike.losses
        same = all(_same_loss(first[s], rerun.losses.get(s, math.nan), self.cfg.rerun_tolerance)
                   for s in first)
        shown = ", ".join(f"step {s}: {first[s]:.6g} then {rerun.losses.get(s, math.nan):.6g}"
                          for s in sorted(first))
        if same:
            # A fault that reproduces itself (a device that computes wrong every time) looks like
            # bad data to a re-run: the devices' known answer tells them apart.
            wrong, drained = self.check_devices(step, ledger) if self.check_devices \
                else ([], False)
            if wrong:
                if self.speaks():
                    say(f"[elastic-gpt] the re-run reproduced the spike ({shown}), but rank(s) "
                        f"{wrong} compute a wrong known answer: a persistent hardware fault, "
                        "not the data; nothing skipped")
                # The losses before the spike were right: its checkpoint is trusted.
                return self.device_fault(wrong, drained, rerun.checkpoint, step, ledger,
                                         roll_back=True)
            if self.speaks():
                say(f"[elastic-gpt] the re-run reproduced the spike ({shown}): the data caused "
                    "it")
            target = self._checkpoint_at_or_before(rerun.checkpoint)
            return self._skip_and_roll_back(rerun.spike, target, ledger, rerun_losses=shown)
        for s, v in rerun.losses.items():  # the re-run is the trajectory now
            self.detector.observe(s, v)
        culprits = self.attribution.first_diverged_ranks(rerun.checkpoint, step - 1)
        nodes = sorted({self.rank_nodes[r] for r in culprits}) if self.rank_nodes else []
        self.totals["hardware_faults"] += 1
        where = (f"rank(s) {culprits} (node {', '.join(n[:12] for n in nodes)})" if nodes else
                 f"rank(s) {culprits}") if culprits else "no single rank (every shard changed)"
        self._event(ledger, {"kind": "hardware fault", "step": step,
                             "detail": f"re-running steps {rerun.checkpoint + 1}-{step} changed the "
                                       f"losses ({shown}); first diverged: {where}",
                             "ranks": culprits, "nodes": nodes, "skipped_steps": 0})
        if self.rank == 0:
            # Of replica groups, the group holding the culprits says so too (it drains them).
            if culprits or self.speaks():
                say(f"[elastic-gpt] the re-run did not reproduce the spike ({shown}): a "
                    f"hardware fault, first seen on {where}; nothing skipped"
                    + (", draining its node" if nodes else ""))
            for node in nodes:
                if self.membership is not None:
                    self.membership.drain_node(node, f"hardware fault found by re-running steps "
                                                     f"{rerun.checkpoint + 1}-{step}")
        self._log_totals(step)
        return None

    def _skip_and_roll_back(self, spike: Spike, target, ledger, rerun_losses: str = ""
                            ) -> Rollback:
        # Skips count in steps done: the batch of step k is the one trained after k - 1 steps.
        start = max(target.step, spike.first - 1 - self.cfg.skip_steps_before)
        steps = spike.last - start
        if self.skips.skipped_steps() + steps > self.cfg.max_skipped_steps:
            raise TrainingDiverged(
                f"{spike.describe()}: skipping {steps} more step(s) of data would pass "
                f"health.max_skipped_steps={self.cfg.max_skipped_steps} (already "
                f"{self.skips.skipped_steps()}); the run keeps diverging: lower train.lr, or "
                "raise the budget if the data is known to be dirty")
        self.skips = self.skips.add(start, steps)
        positions = self.skips.positions(len(self.skips.skips) - 1, self.global_batch_size)
        if self.rank == 0:
            info = self.store.read_run_info() or {}
            info[RUN_INFO_SKIPS] = self.skips.to_list()
            self.store.write_run_info(info)  # before training on: a restart reads it
            say(f"[elastic-gpt] skipping the batches of steps {start + 1}-{spike.last} (samples "
                f"{positions.start}-{positions.stop - 1} of the order) and rolling back to step "
                f"{target.step}")
        self._event(ledger, {"kind": "data skipped", "step": spike.last,
                             "detail": f"{spike.describe()}; batches of steps {start + 1}-"
                                       f"{spike.last} skipped"
                                       + (f" (re-run: {rerun_losses})" if rerun_losses else ""),
                             "from_step": start, "skipped_steps": steps,
                             "sample_positions": [positions.start, positions.stop]})
        return self._rollback(target, ledger, spike.last, "skip")

    def _rollback(self, target, ledger, last: int, why: str) -> Rollback:
        lost = [s for s in self.step_seconds if s > target.step]
        ledger.on_rollback(len(lost), sum(self.step_seconds[s] for s in lost))
        for s in lost:
            del self.step_seconds[s]
        self.detector.forget_from(target.step + 1)
        self.totals["rollbacks"] += 1
        self._event(ledger, {"kind": "rollback", "step": last, "resumed_from_step": target.step,
                             "detail": f"to step {target.step} ({why})",
                             "lost_steps": len(lost)})
        self._log_totals(last)
        return Rollback(target.step, target.url)

    def device_fault(self, ranks: list[int], drained: bool, trusted: int, step: int, ledger,
                     roll_back: bool = False) -> Rollback | None:
        """Collective: `ranks`' devices compute wrong (health/stragglers.py's known answer).
        Drained, the group restarts without their nodes from the newest checkpoint at or before
        `trusted`, the last step known good (a checkpoint since may hold their work: the last
        probe every answer was right at, the replicas' last agreement, the checkpoint before a
        spike), nothing skipped. Not drained (reported): None, or with `roll_back` (the state is
        known to be corrupt) a rollback to that checkpoint, on the same devices."""
        self.totals["hardware_faults"] += 1
        if not (drained or roll_back):
            self._log_totals(step)
            return None
        target = self._checkpoint_at_or_before(trusted)
        if target is None:
            raise TrainingDiverged(
                f"rank(s) {ranks} compute wrong since step {trusted} and no committed checkpoint "
                "is from before: run again from the start without their node(s)")
        rollback = self._rollback(target, ledger, step, "a device that computes wrong")
        if not drained:
            return rollback
        return Rollback(rollback.to_step, rollback.url, restart=(
            f"preemption: rank(s) {ranks} compute wrong (the device probe's known answer); "
            f"their node(s) drained, restarting from step {target.step}"))

    def roll_back_to_newest(self, step: int, ledger, why: str) -> Rollback:
        """Collective: back to the newest committed checkpoint at or before `step`, for a fault
        found outside the loss (replicas that disagree with no majority to heal from), within
        the rollback budget (a fault that recurs would roll back for ever)."""
        self._check_rollback_budget(ledger, why, "a device keeps corrupting the state: the "
                                    "events name the ranks and nodes; run without them")
        target = self._checkpoint_at_or_before(step)
        if target is None:
            raise TrainingDiverged(f"{why}, and no committed checkpoint to roll back to; run "
                                   "again from the start")
        return self._rollback(target, ledger, step, why)

    def _checkpoint_at_or_before(self, step: int):
        """Collective: the newest committed checkpoint at or before `step` (rank 0 lists)."""
        box = [self.store.latest(before=step + 1) if self.rank == 0 else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _check_rollback_budget(self, ledger, what: str,
                               advice: str = "the run keeps diverging: lower train.lr or raise "
                                             "train.warmup_steps") -> None:
        hour_ago = time.time() - 3600
        recent = [e for e in ledger.events if e.get("kind") == "rollback"
                  and e.get("at", 0) > hour_ago]
        # Each spike costs one rollback, or two when its re-run blames the data.
        if len(recent) + 1 > self.cfg.max_rollbacks_per_hour * (2 if self.cfg.rerun else 1):
            raise TrainingDiverged(
                f"{what}: {len(recent)} rollback(s) in the last hour already, the budget of "
                f"health.max_rollbacks_per_hour={self.cfg.max_rollbacks_per_hour:g} is spent; "
                f"{advice}")

    # ---- records -----------------------------------------------------------------------------

    def _event(self, ledger, event: dict) -> None:
        ledger.events.append({"at": time.time(), **event})

    def _log_totals(self, step: int) -> None:
        if self.metrics is not None:
            self.metrics.log({mn.HEALTH_SPIKES: self.totals["spikes"],
                              mn.HEALTH_ROLLBACKS: self.totals["rollbacks"],
                              mn.HEALTH_SKIPPED_STEPS: self.skips.skipped_steps(),
                              mn.HEALTH_HARDWARE_FAULTS: self.totals["hardware_faults"]}, step)


def load_skips(store, rank: int, checkpoint_state: dict | None) -> DataSkips:
    """Collective: the run's skips, from the run record (written when a skip is made), else
    from the checkpoint resumed (rank 0 reads; every rank gets them)."""
    box = [None]
    if rank == 0:
        info = store.read_run_info() or {}
        items = info.get(RUN_INFO_SKIPS)
        if items is None and checkpoint_state is not None:
            items = (checkpoint_state.get("data") or {}).get("skips")
        box = [items or []]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return DataSkips.from_list(box[0])


def _same_loss(a: float, b: float, tolerance: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= tolerance * max(abs(a), abs(b))

"""The Trainer's training health behind the two calls its loop makes, `before_forward` (the
state's checksum: HSDP's replicas and the replica groups' copies compared,
health/silent_corruption.py; the step's compute timed from here) and `after_step` (loss spikes,
health/recovery.py; stragglers and the devices' known answer, health/stragglers.py). Either
may answer with a `Rollback`, which the Trainer makes (it owns the model, the optimizer and the
data stream).

Everything it acts through is handed in: the checkpointer (the run record it reads and writes,
the checkpoints it discards), the fault-tolerance mode, the membership (nodes to drain), the
metric sink, and a test's injected faults (health/faults.py; none in a run).
"""

from __future__ import annotations

import os

import torch

from elastic_gpt.config import Config, run_log_dir
from elastic_gpt.data.skips import DataSkips
from elastic_gpt.health.faults import FaultInjection, NoFaults
from elastic_gpt.health.recovery import Rollback, SpikeRecovery, load_skips
from elastic_gpt.health.silent_corruption import (
    GroupCopiesCheck,
    HsdpReplicaCheck,
    discard_checkpoints_after,
)
from elastic_gpt.health.stragglers import StragglerWatch


class TrainingHealth:
    def __init__(self, cfg: Config, *, rank: int, world_size: int, dims, device: torch.device,
                 checkpointer, resume_state: dict | None, rank_nodes: list[str] | None, metrics,
                 membership, fault_tolerance, faults: FaultInjection = NoFaults()):
        """Collective (the run's skips are read by rank 0 and sent to every rank).
        `fault_tolerance` is the Trainer's mode (replica groups: the groups' copies compared, a
        probe file per group); `checkpointer` the run's (checkpoint/checkpointer.py)."""
        self.rank, self.checkpointer, self.faults = rank, checkpointer, faults
        self.fault_tolerance = fault_tolerance
        store = checkpointer.store
        group_name = fault_tolerance.group_name
        common = dict(rank=rank, world_size=world_size, rank_nodes=rank_nodes,
                      membership=membership)
        self.spikes = SpikeRecovery(
            cfg.health, store=store, skips=load_skips(store, rank, resume_state),
            global_batch_size=cfg.train.global_batch_size,
            # back to the oldest checkpoint a rollback may reach
            keep_steps=cfg.checkpoint.every_steps * max(cfg.checkpoint.keep, 2)
            + cfg.health.skip_steps_before, metrics=metrics,
            speaks=lambda: rank == 0 and fault_tolerance.leads, **common)
        if resume_state and "health" in resume_state:  # the run record's skips are newer
            self.spikes.load_state_dict(resume_state["health"], skips=False)
        self.replicas = HsdpReplicaCheck(cfg.health, dims, **common)
        self.copies = GroupCopiesCheck(cfg.health, fault_tolerance, rank=rank,
                                       checkpointer=checkpointer, rank_nodes=rank_nodes,
                                       membership=membership)
        # The per-rank probe times go to the run's folder, once the launcher has set it.
        probes = f"probes-{group_name}.jsonl" if group_name else "probes.jsonl"
        record = os.path.join(run_log_dir(cfg), probes) if cfg.run.storage_path else None
        self.stragglers = StragglerWatch(cfg.health, device=device, metrics=metrics,
                                         record_path=record, faults=faults,
                                         groups=fault_tolerance, **common)
        self.spikes.check_devices = lambda step, ledger: self.stragglers.wrong_answers(
            step, ledger, "before blaming a spike on the data")
        # Where the known answer may be asked for, each rank's first one is what it must keep.
        self.stragglers.baseline |= self.spikes.keeps_checksums or bool(self.replicas.sets)

    def state_dict(self) -> dict:
        """The run's health state (health/recovery.py `SpikeRecovery.state_dict`): in every
        checkpoint, and adopted by a replica group healed from a peer."""
        return self.spikes.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.spikes.load_state_dict(state)

    @property
    def skips(self) -> DataSkips:
        """The steps of the order the run leaves out (C2 with the skips)."""
        return self.spikes.skips

    @property
    def rolls_back(self) -> bool:
        """Whether a non-finite loss is rolled back here (else train.nan_patience stops it)."""
        return self.spikes.rolls_back

    @property
    def rerunning(self) -> bool:
        """Re-running suspect steps: the Trainer saves no checkpoint until the verdict."""
        return self.spikes.rerunning

    def before_forward(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       step: int, ledger) -> Rollback | None:
        """Before the forward of the step after `step` steps: the rollback to make when the
        HSDP replicas disagree with no majority, else None (a corrupt replica is healed here)."""
        self.copies.after_verdict(step, ledger)
        self.stragglers.before_step(model)  # this step's compute is timed from here
        due, copies_due = self.replicas.due(step), self.copies.due(step)
        checksum = self.spikes.before_step(model, step, checksum=due or copies_due,
                                           corrupt_gradient=self.faults.corrupt_gradient(step + 1))
        if copies_due:
            self.fault_tolerance.note_state_checksum(checksum)
        if not due:
            return None
        verdict = self.replicas.check(step, checksum, model, optimizer, ledger)
        # The replicas last agreed at the previous check: the corruption was made by an update
        # since, and a checkpoint written since may hold it (the corrupt replica may have
        # written that shard).
        trusted = step - self.replicas.cfg.sdc_every_steps
        if verdict == "healed":
            self.spikes.before_step(model, step)  # the healed state's checksum
            discard_checkpoints_after(trusted, self.checkpointer)
        elif verdict == "no majority":
            # Which replica is wrong? A device that computes wrong says so by its known answer.
            wrong, drained = self.stragglers.wrong_answers(step, ledger,
                                                            "replicas disagree with no majority")
            if wrong:
                return self.spikes.device_fault(wrong, drained, trusted, step, ledger,
                                                roll_back=True)
            return self.spikes.roll_back_to_newest(trusted, ledger,
                                                   "replicas disagree with no majority")
        return None

    def after_step(self, step: int, loss: float, nonfinite: bool, seconds: float,
                   ledger, model: torch.nn.Module) -> Rollback | None:
        """After committed step `step`, before its checkpoint: the rollback a spike asks for, or a
        device that computes wrong (a restart without it), else None (a straggler is probed
        for, and evicted, here)."""
        self.faults.after_update(model, step)
        rollback = self.spikes.after_step(step, loss, nonfinite, seconds, ledger)
        if rollback is None:
            self.stragglers.after_step(step, ledger)
            wrong = self.stragglers.take_wrong_answers()
            if wrong:  # a device computes wrong: restart without it from before its work
                rollback = self.spikes.device_fault(*wrong, self.stragglers.last_right_step,
                                                    step, ledger)
        return rollback

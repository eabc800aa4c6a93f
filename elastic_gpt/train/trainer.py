"""One worker's share of a run: build, restore, step, report.

The `Trainer` runs under any torch process group that is already up: a Ray Train worker
(elastic/worker.py makes one there), a test's gloo ranks, a benchmark in one process. It imports
no Ray: what it needs from the cluster comes in as collaborators with do-nothing defaults, a
`MetricSink` (where step metrics go), a `Membership` (whether the group must checkpoint and
restart) and a `FaultTolerance` mode (`train/fault_tolerance.py`: the restart path, or a replica
group, C7 all-or-nothing step), and a planned restart is raised as `errors.ElasticRestart`.

The loop states no policy: the checkpointer decides when and whether to save and which
checkpoints go (checkpoint/checkpointer.py), the health checks whether to roll back
(health/monitor.py), the metrics what is reported (train/metrics.py), the mode who leads.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic_gpt.checkpoint.checkpointer import make_checkpointer
from elastic_gpt.checkpoint.sharded import CheckpointLoadError, load_sharded
from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.config import Config
from elastic_gpt.console import say
from elastic_gpt.data.fingerprint import join_fingerprint
from elastic_gpt.data.mixture import open_training_data
from elastic_gpt.data.stream import open_step_stream
from elastic_gpt.data.tokenizers import get_tokenizer, save_tokenizer, tokenizer_name
from elastic_gpt.errors import ElasticRestart, NonFiniteLossError, check_checkpoint_shape
from elastic_gpt.health.faults import FaultInjection, NoFaults
from elastic_gpt.health.monitor import TrainingHealth
from elastic_gpt.health.recovery import Rollback
from elastic_gpt.model.config import flops_per_token
from elastic_gpt.train.collaborators import (
    Membership,
    MetricSink,
    NullMembership,
    NullMetricSink,
)
from elastic_gpt.train.collective_timeouts import CollectiveTimeouts
from elastic_gpt.train.device import worker_device
from elastic_gpt.train.evaluate import EvalResult, open_evaluator
from elastic_gpt.train.fault_tolerance import FaultTolerance, RestartPath
from elastic_gpt.train.goodput import GoodputLedger
from elastic_gpt.train.group_batches import GroupBroadcastBatches
from elastic_gpt.train.layout import resolve_layout
from elastic_gpt.train.metrics import TrainingMetrics
from elastic_gpt.train.model_build import build_parallel_model, materialise
from elastic_gpt.train.model_config import model_config_for
from elastic_gpt.train.optimizer import (
    NonfiniteStreak,
    build_optimizer,
)
from elastic_gpt.train.run_lines import record_memory_settings, say_against_gzip, setup_line
from elastic_gpt.train.step import TrainStep
from elastic_gpt.train.throughput import peak_flops

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    fingerprint: int
    metrics: dict = field(default_factory=dict)
    committed: bool = True
    """False: a replica group's quorum refused the step (C7 all-or-nothing step); nothing was
    applied, re-do it."""
    nonfinite: bool = False
    """The loss or the gradient was not finite (the optimizer step was skipped) for more steps
    in a row than train.nan_patience tolerates."""


class Trainer:
    """One worker's share of the run. All ranks construct it and call `train()` together.

    `rank_nodes` names each rank's node (any id; Ray's node id under Ray Train); None: one node.
    `device`: the one the cluster assigned this worker (Ray's); None: from LOCAL_RANK.
    The layout (train/layout.py) keeps tensor-parallel groups inside nodes and HSDP across them.
    The batch split, the data stream, the loss scale and the metrics use the data-parallel rank
    and degree; the tensor-parallel ranks of one group train on the same micro-batches.
    `faults`: a test's injected hardware faults for this rank (health/faults.py; none in a
    run)."""

    def __init__(self, cfg: Config, *, rank: int, world_size: int, mlflow_run_id: str | None,
                 metrics: MetricSink = NullMetricSink(), membership: Membership = NullMembership(),
                 rank_nodes: list[str] | None = None,
                 fault_tolerance: FaultTolerance = RestartPath(),
                 device: torch.device | None = None, faults: FaultInjection = NoFaults()):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.fault_tolerance = fault_tolerance
        # The null defaults hold no state, so one instance can serve every Trainer.
        self.metrics, self.membership = metrics, membership
        self.mlflow_run_id = mlflow_run_id
        self.started = time.time()
        self.device = worker_device(device)
        threads = cfg.train.threads_per_worker or cfg.scaling.cpus_per_worker
        torch.set_num_threads(threads)
        # One dataset (data.path) or a weighted mixture (data.sources); the reference manifest
        # fixes the tokenizer, vocabulary and seq_len.
        self.data = open_training_data(cfg.data)
        self.manifest = self.data.manifest
        self.data_order = self.data.make_order(cfg.data.seed, cfg.data.shuffle_window)
        self.gpt_cfg = model_config_for(cfg, self.manifest)
        self.layout = resolve_layout(cfg, self.gpt_cfg, world_size=world_size,
                                     rank_nodes=rank_nodes, device=self.device, threads=threads)
        self.dims, self.batch_split = self.layout.dims, self.layout.batch_split
        self.compute_dtype = self.layout.compute_dtype
        self.dp_rank, self.dp_degree = self.dims.dp_rank(rank), self.dims.dp_degree
        self.tp_rank = self.dims.tp_rank(rank)
        # Replica groups (C7 all-or-nothing step) split a step over every live group's ranks:
        # the batch rank and degree are this rank's place in that split, which the mode's
        # `begin_step` says; on the restart path the data-parallel ones.
        self.batch_rank, self.batch_degree = self.dp_rank, self.dp_degree
        self.dims.build_mesh(self.device.type, connect_on=self.device)  # communicators now
        self.store = CheckpointStore(cfg.checkpoint.path)
        # Decided before building: a resume reads every weight from its checkpoint, so it skips
        # the random init (CPU draws of the whole shard, on every rank, at every restart).
        self.resume_from = self._newest_checkpoint()
        built = build_parallel_model(cfg, self.gpt_cfg, self.layout, rank=rank)
        self.model, self.pipeline, self.n_params = built.model, built.pipeline, built.n_params
        self.startup = {"checkpoint_read_s": 0.0, "init_s": materialise(
            self.model, self.device, initialise=self.resume_from is None, seed=cfg.train.seed,
            init_from=cfg.checkpoint.init_from)}
        # Fused AdamW: one kernel over all shards, on CUDA and on CPU alike.
        self.optimizer = build_optimizer(self.model, cfg, fused=True)
        self.stepper = TrainStep(cfg, self.layout, model=self.model, pipeline=self.pipeline,
                                 optimizer=self.optimizer, seq_len=self.gpt_cfg.seq_len,
                                 tp_rank=self.tp_rank, fault_tolerance=fault_tolerance,
                                 stop_requested=lambda: bool(membership.reason))
        self._prepare_pipeline()
        self.step = 0
        self.ledger = GoodputLedger(_attempt_started=self.started)
        self.stop_reason: str | None = None
        self.nonfinite = NonfiniteStreak(cfg.train.nan_patience)
        self.timeouts = CollectiveTimeouts(cfg.elastic.init_timeout_s, cfg.elastic.hang_timeout_s)
        # Of replica groups, the one leading a step's quorum saves it; nothing is saved while
        # suspect steps are re-run (a re-run may hold a spike).
        self.checkpointer = make_checkpointer(
            cfg.checkpoint, self.store, rank=rank, model=self.model, optimizer=self.optimizer,
            trainer_state=self.trainer_state, before_save=self._flush_metrics,
            on_blocked=lambda seconds: self.ledger.on_checkpoint(seconds),
            extra_files=self._save_tokenizer, collective_timeout_s=cfg.elastic.hang_timeout_s,
            may_save=lambda: fault_tolerance.leads and not self.health.rerunning,
            timeouts=self.timeouts, writes_alone=fault_tolerance.writes_alone)
        # Spikes, corrupt replicas, stragglers; the data skips the run has made (C2 with them).
        self.health = TrainingHealth(
            cfg, rank=rank, world_size=world_size, dims=self.dims, device=self.device,
            checkpointer=self.checkpointer, resume_state=self.resume_from and self.resume_from.state,
            rank_nodes=rank_nodes, metrics=metrics, membership=membership,
            fault_tolerance=fault_tolerance, faults=faults)
        # The ledger and the health state are the run's, not a group's: a replica group healed
        # from a peer adopts the peer's, so it stays one account whichever group leads (C5 one
        # MLflow run) and every group decides alike on a spike (C7 all-or-nothing step).
        self.fault_tolerance.attach(self.model, self.optimizer, self.device, run_state=(
            lambda: {"ledger": self.ledger.to_dict(), "health": self.health.state_dict()},
            lambda d: (self.ledger.adopt(d["ledger"]), self.health.load_state_dict(d["health"]))))
        self.evaluator = open_evaluator(
            cfg, self.manifest, micro_batch_size=self.batch_split.micro_batch_size,
            seq_len=self.gpt_cfg.seq_len, dp_rank=self.dp_rank, dp_degree=self.dp_degree,
            count_rank=self.tp_rank == 0 and (self.pipeline is None or self.pipeline.last),
            rank=rank, world_size=world_size, device=self.device)
        self.last_eval: EvalResult | None = None
        self.report = TrainingMetrics(
            metrics, rank=rank, max_steps=cfg.train.max_steps, log_every=cfg.train.log_every,
            global_batch_size=self.batch_split.global_batch_size, seq_len=self.gpt_cfg.seq_len,
            flops_per_token=flops_per_token(self.gpt_cfg),
            peak_flops=(cfg.train.peak_tflops * 1e12 if cfg.train.peak_tflops
                        else peak_flops(self.device, threads)),
            model_parallel=self.dims.tp * self.dims.pp, data=self.data, order=self.data_order,
            speaks=lambda: fault_tolerance.leads)

    def _eval_due(self, steps_done: int) -> bool:
        every = self.cfg.eval.every_steps
        return self.evaluator is not None and (
            steps_done == self.cfg.train.max_steps or bool(every and steps_done % every == 0))

    def evaluate(self, step: int) -> EvalResult:
        """Collective: the held-out metrics after `step` optimizer steps (the step metrics'
        numbering), logged through the metric sink; its wall time is the ledger's eval_s, not
        productive time."""
        result = self.evaluator.evaluate(self.model, compute_dtype=self.compute_dtype,
                                         loss_parallel=self.dims.loss_parallel,
                                         pipeline=self.pipeline)
        self.ledger.on_eval(result.seconds)
        self.metrics.log(result.metrics(), step)
        if self.rank == 0:
            say(result.line(step))
            if step == self.cfg.train.max_steps and result.bits_per_byte is not None:
                say_against_gzip(self.evaluator, result)
        self.last_eval = result
        return result

    def setup_line(self) -> str:
        """What this group runs, so a log shows the choices `auto` settings made."""
        t = self.cfg.train
        return setup_line(self.layout, self.n_params, t.reshard_after_forward, t.grad_sync)

    # ---- restore -----------------------------------------------------------------------------

    def _newest_checkpoint(self):
        """Collective: the newest committed checkpoint (checked against this model's shape on
        rank 0), or None."""
        latest = None
        if self.rank == 0:
            latest = self.store.latest()
            if latest is not None:
                check_checkpoint_shape(latest.state, self.gpt_cfg, latest.url)
        return _broadcast(latest)

    def restore(self) -> None:
        """Resume from the checkpoint found before building (`resume_from`), resharding if the
        world size changed."""
        latest = self.resume_from
        if latest is None:
            return
        t0 = time.perf_counter()
        while True:
            try:
                # A checkpoint imported from Hugging Face holds weights only: the optimizer
                # starts fresh, as it would have at step 0.
                optimizer = self.optimizer if latest.state.get("optimizer", True) else None
                load_sharded(latest.url, self.model, optimizer)  # collective: all or none
                break
            except CheckpointLoadError:
                # Retention may have removed it since it was chosen, before the build: another
                # replica group went on saving meanwhile. A newer committed step is as good (it
                # overwrites every weight the skipped init would have drawn); none is an error.
                newer = self._newest_checkpoint()
                if newer is None or newer.step <= latest.step:
                    raise
                log.warning("checkpoint %s was removed while this group started; loading the "
                            "newest, %s", latest.url, newer.url)
                latest = self.resume_from = newer
        self.startup["checkpoint_read_s"] = time.perf_counter() - t0
        state = latest.state
        self.step = state["step"]
        self.ledger = GoodputLedger.from_dict(state.get("ledger"))
        assert state["samples_seen"] == self.step * self.batch_split.global_batch_size, \
            "the global batch size changed inside a run (C1 fixed global batch); the checkpoint's " \
            "cursor disagrees"
        if self.rank == 0:
            say(f"[elastic-gpt] resumed from {latest.url} at step {self.step} "
                f"(saved by {state['world_size']} workers at tp {state.get('tp', 1)}, now "
                f"{self.world_size} at tp {self.dims.tp})")

    # ---- the step ---------------------------------------------------------------------------

    def forward_backward(self, batch) -> torch.Tensor:
        """Accumulate this rank's gradients for one step; returns its summed token loss."""
        return self.stepper.forward_backward(batch, self.step, self.batch_rank, self.batch_degree)

    def clip_gradients(self) -> torch.Tensor:
        return self.stepper.clip_gradients()

    def _prepare_pipeline(self) -> None:
        self.stepper.prepare(self.batch_degree)

    def train_step(self, batch) -> StepResult:
        """Collective: the step on the device (train/step.py), then its one host read."""
        device_step = self.stepper.run(batch, self.step, self.batch_rank, self.batch_degree)
        committed = device_step.committed
        # The step's only host read: everything the host needs in one transfer.
        loss_total, fp_lo, fp_hi, stop, grad_norm, skipped = device_step.stats.tolist()
        if stop > 0:
            self.stop_reason = self.membership.reason or "membership change"
        loss = loss_total / (self.batch_split.global_batch_size * self.gpt_cfg.seq_len)
        # Non-finite for longer than train.nan_patience tolerates (a step applied nowhere, C7,
        # counts neither way).
        diverged = committed and self.nonfinite.after(bool(skipped))
        if diverged and not self.health.rolls_back:  # else health/recovery.py rolls back
            raise NonFiniteLossError(
                f"loss is {loss} (grad norm {grad_norm}) at step {self.step} for "
                f"{self.nonfinite.count} step(s), beyond train.nan_patience="
                f"{self.cfg.train.nan_patience}; lower train.lr or raise train.warmup_steps")
        fingerprint = join_fingerprint(fp_lo, fp_hi)
        return StepResult(self.step, loss, grad_norm, fingerprint, {"lr": device_step.lr},
                          committed, nonfinite=diverged)

    def _open_stream(self):
        """This rank's batches from self.step on, for its place in the step's split. Under
        tensor or pipeline parallelism the first rank of the ranks that train on the same
        micro-batches reads them and the others receive them."""
        group = self.dims.batch_group()
        if group is None:
            return self._open_reader()
        return GroupBroadcastBatches(
            self._open_reader() if dist.get_rank(group) == 0 else None,
            group=group, batch_split=self.batch_split,
            batch_rank=self.batch_rank, batch_degree=self.batch_degree,
            record_tokens=self.manifest.record_tokens, start_step=self.step, device=self.device)

    def _open_reader(self):
        cfg = self.cfg
        return open_step_stream(
            self.data, batch_split=self.batch_split, rank=self.batch_rank, world_size=self.batch_degree,
            start_step=self.step, seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window,
            prefetch_steps=cfg.data.prefetch_steps, pin_memory=self.device.type == "cuda",
            read_block_bytes=cfg.data.read_block_bytes, skips=self.health.skips)

    # ---- checkpoint --------------------------------------------------------------------------

    def _flush_metrics(self) -> None:
        # The metrics of every step up to a checkpoint are made durable before the checkpoint is
        # committed, so a hard kill right after a commit loses no step's record (C5 one MLflow run).
        if not self.metrics.flush(5.0):
            log.warning("step metrics not yet stored in MLflow at the step-%d checkpoint", self.step)

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "samples_seen": self.step * self.batch_split.global_batch_size,
            "epoch": self.step * self.batch_split.global_batch_size // self.data.epoch_samples,
            "world_size": self.world_size,
            "tp": self.dims.tp,
            "mlflow_run_id": self.mlflow_run_id,
            "model_shape": self.gpt_cfg.shape(),
            "data": {**self.data.describe(), "seed": self.cfg.data.seed,
                     "shuffle_window": self.cfg.data.shuffle_window,
                     "skips": self.health.skips.to_list()},
            "train_seed": self.cfg.train.seed,
            "global_batch_size": self.batch_split.global_batch_size,
            "ledger": self.ledger.to_dict(), "health": self.health.state_dict(),
            "tokenizer": {"name": tokenizer_name(self.tokenizer), "eos_id": self.manifest.eos_id,
                          "vocab_size": self.manifest.vocab_size},
            "saved_at": time.time(),
        }

    @functools.cached_property
    def tokenizer(self):
        return get_tokenizer(self.manifest.tokenizer, base=self.manifest.url)

    def _save_tokenizer(self, step_url: str) -> None:
        """Each checkpoint carries its tokenizer: `generate` and `export-hf` need nothing but the
        checkpoint, even after the dataset is gone."""
        save_tokenizer(self.tokenizer, step_url)

    # ---- the loop ----------------------------------------------------------------------------

    def train(self) -> dict:
        """The step loop. The fault-tolerance mode's hooks are called at fixed points (their
        order: train/fault_tolerance.py); everything else is the same in every mode."""
        ft = self.fault_tolerance
        self._start()
        stream = self._open_stream()
        end = min(self.cfg.train.max_steps, self.cfg.run.stop_at_step or self.cfg.train.max_steps)
        first_step, last = self.step, None
        try:
            while self.step < end:
                if self.step == first_step:
                    self.report.first_step(self.step, self.ledger.on_first_step_started(),
                                           self.startup, self.started)
                t0 = time.perf_counter()
                stream = self._split_for_step(stream)
                batch = next(stream)
                assert batch.step == self.step, f"data stream at step {batch.step}, not {self.step}"
                t_data = time.perf_counter() - t0
                rollback = self.health.before_forward(self.model, self.optimizer, self.step,
                                                      self.ledger)
                if rollback is not None:
                    stream = self._roll_back(rollback, stream)
                    continue
                result = self.train_step(batch)
                step_time = time.perf_counter() - t0
                if not result.committed:
                    # Applied by no replica group (C7 all-or-nothing step): re-done from its own
                    # batch; the prefetched ones are ahead of it.
                    self.ledger.on_lost_attempt(step_time)
                    ft.on_uncommitted(self.step)
                    stream.close()
                    stream = self._open_stream()
                    continue
                self.step += 1
                if self.stop_reason:
                    # Before the save: a drained replica group leaves the quorum now, so the
                    # others' next quorum need not wait for it (C7 all-or-nothing step).
                    ft.on_stop()
                waited = self._note_quorum_change()
                self.ledger.on_step(step_time - waited, degraded=ft.degraded)
                last = self.report.step(
                    self.step, result, step_time=step_time, data_wait=t_data,
                    world_size=self.world_size, batch_degree=self.batch_degree,
                    micro_batches=self.batch_split.slots(self.batch_degree))
                rollback = self.health.after_step(self.step, result.loss, result.nonfinite,
                                                  step_time, self.ledger, self.model)
                if rollback is not None:
                    stream = self._roll_back(rollback, stream)
                    continue
                if self._eval_due(self.step):  # before the save: a resume never skips one
                    self.evaluate(self.step)
                self.timeouts.step_done()
                # The last step, and the step a planned restart resumes from, are always saved.
                self.checkpointer.save(self.step, last_step=self.step == end or bool(self.stop_reason))
                self.membership.publish(self.step, step_time, self.ledger.to_dict())
                if self.stop_reason:
                    self.checkpointer.finish()  # the restart resumes from this step
                    self.membership.record_restart(self.stop_reason, self.step)
                    raise ElasticRestart(self.stop_reason, self.step)
            self.checkpointer.finish()  # the last step is committed before we return
        finally:
            stream.close()
            self.fault_tolerance.close()
        return {"step": self.step, "last": last, "ledger": self.ledger, "eval": self.last_eval}

    def _start(self) -> None:
        """Before the first step: the setup said, the checkpoint restored, the mode and the
        checkpointer told, and (rank 0) the attempt's place in the run's ledger published."""
        if self.rank == 0:
            say(self.setup_line())
            record_memory_settings(self.metrics, self.layout.memory, self.world_size)
        self.restore()
        self.fault_tolerance.on_start(self.step)
        self.checkpointer.start()
        if self.rank == 0:
            event = self.ledger.on_resume(
                restored_step=self.step, world_size=self.world_size,
                previous=self.membership.previous, cause=self.membership.cause,
                attempt_started=self.started)
            if event:
                self.fault_tolerance.on_resume(event, self.step)
            # At once: an attempt that dies before its first step hands the next one what it
            # restored, and the steps lost before it are not counted twice.
            self.membership.publish(self.step, None, self.ledger.to_dict())

    def _split_for_step(self, stream):
        """The mode's step and split for the next attempt; a new quorum (or a healed step) cut
        the prefetched batches for another split or step: the stream is re-planned from this
        step (C1 fixed global batch, C2 data order)."""
        planned = self.fault_tolerance.begin_step(self.step, self.dp_rank, self.dp_degree)
        if planned == (self.step, self.batch_rank, self.batch_degree):
            return stream
        stream.close()
        self.step, self.batch_rank, self.batch_degree = planned
        self._prepare_pipeline()  # the new split's schedule
        return self._open_stream()

    def _roll_back(self, rollback: Rollback, stream):
        """Collective: back to the committed checkpoint of `rollback.to_step` (health/recovery.py);
        the checkpoints after it hold the abandoned trajectory and are discarded. Returns the
        stream from there."""
        stream.close()
        self.checkpointer.discard_after(rollback.to_step)
        if rollback.restart:  # without a drained node: the restart reads it, nothing is saved
            self.membership.record_restart(rollback.restart, rollback.to_step)
            raise ElasticRestart(rollback.restart, rollback.to_step)
        load_sharded(rollback.url, self.model, self.optimizer)
        self.step = rollback.to_step
        self.fault_tolerance.on_rollback(self.step)
        self.nonfinite.reset()
        return self._open_stream()

    def _note_quorum_change(self) -> float:
        """Replica groups (C7 all-or-nothing step): a group left or joined at this step's quorum;
        the run went on. Returns the seconds this step waited in that quorum (0 without a
        change): recovery in the ledger, not productive time."""
        change = self.fault_tolerance.quorum_change()
        if change is None:
            return 0.0
        event = self.ledger.on_quorum_change(change.before, change.after, change.groups, self.step,
                                          waited_s=change.waited_s)
        if self.rank == 0 and self.fault_tolerance.leads:
            say(f"[elastic-gpt] {event['kind']}: {change.before} -> {change.after} of "
                f"{change.groups} replica groups live at step {self.step} (waited "
                f"{change.waited_s:.2f} s in its quorum)")
        return change.waited_s


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

"""The per-worker training function: build, restore, step, checkpoint, report.

Runs inside a Ray Train worker (`train_loop_per_worker`) with the torch process group already up;
`run_worker` holds everything else so it reads without Ray in mind.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from elastic_gpt.checkpoint.async_save import AsyncCheckpointer
from elastic_gpt.checkpoint.store import CheckpointStore, load_sharded, save_sharded, step_dirname
from elastic_gpt.config import Config, config_from_dict
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.order import BatchPlan
from elastic_gpt.data.stream import open_step_stream
from elastic_gpt.elastic.controller import ElasticRestart
from elastic_gpt.errors import NonFiniteLossError, check_checkpoint_shape
from elastic_gpt.model.gpt import GPT, GPTConfig, flops_per_token, token_losses
from elastic_gpt.parallel.fsdp import (
    agree_on_resharding,
    init_sharded_weights,
    parallelize,
    resolve_dtype,
    resolve_reshard_after_forward,
)
from elastic_gpt.train.goodput import GoodputLedger
from elastic_gpt.train.metrics import (
    join_fingerprint,
    lr_at,
    peak_flops,
    split_fingerprint,
)

log = logging.getLogger("elastic_gpt")


def model_config_for(cfg: Config, manifest) -> GPTConfig:
    """Preset shape, then explicit model.* keys; seq_len and vocab come from the data if unset."""
    from elastic_gpt.model.gpt import PRESETS, pad_vocab
    m = cfg.model
    fields = dict(PRESETS[m.preset])
    fields.update({k: v for k, v in dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)
                   .items() if v is not None})
    fields["seq_len"] = m.seq_len or manifest.seq_len
    fields["vocab_size"] = m.vocab_size or pad_vocab(manifest.vocab_size)
    manifest.check_model(fields["vocab_size"])
    if manifest.seq_len < fields["seq_len"]:
        raise ValueError(f"dataset samples have {manifest.seq_len} tokens but model.seq_len="
                         f"{fields['seq_len']}; unset model.seq_len or re-run prepare-data with "
                         f"--seq-len {fields['seq_len']}")
    return GPTConfig(**fields, dropout=m.dropout)


def build_optimizer(model: torch.nn.Module, cfg: Config, fused: bool) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (GPT-2/3 practice: no decay on biases and LayerNorm)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    t = cfg.train
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused)


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    fingerprint: int
    metrics: dict = field(default_factory=dict)


class Trainer:
    """One worker's share of the run. All ranks construct it and call `train()` together."""

    def __init__(self, cfg: Config, *, rank: int, world_size: int, mlflow_run_id: str | None,
                 report=None, membership=None, flush_metrics=None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.report = report or (lambda metrics, step: None)
        # Rank 0's view of cluster membership (elastic.WorkerMembership): `.reason` turns
        # non-None when this group should checkpoint and restart; `.publish()` shares progress.
        self.membership = membership
        # Makes the metrics of every step up to a checkpoint durable before the checkpoint is
        # committed, so a hard kill right after a commit loses no step's record (C5).
        self.flush_metrics = flush_metrics
        self.mlflow_run_id = mlflow_run_id
        self.started = time.time()
        self.device = _device()
        threads = cfg.train.threads_per_worker or cfg.scaling.cpus_per_worker
        torch.set_num_threads(threads)
        self.threads = threads
        self.plan = BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        self.manifest = load_manifest(cfg.data.path)
        self.gpt_cfg = model_config_for(cfg, self.manifest)
        self.compute_dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.model = self._build_model()
        # Fused AdamW: one kernel over all shards, on CUDA and (torch >= 2.4) on CPU alike.
        self.optimizer = build_optimizer(self.model, cfg, fused=True)
        self.store = CheckpointStore(cfg.checkpoint.path)
        self.step = 0
        self.ledger = GoodputLedger(_attempt_started=self.started)
        self.stop_reason: str | None = None
        self.flops_per_token = flops_per_token(self.gpt_cfg)
        self.peak = peak_flops(self.device, threads) * 1  # per worker
        self._nonfinite_streak = 0
        self.async_checkpointer: AsyncCheckpointer | None = None  # made at the first async save

    def _build_model(self) -> GPT:
        # Build on "meta" (no memory), shard, then materialise only this rank's shards.
        with torch.device("meta"):
            model = GPT(self.gpt_cfg)
        t = self.cfg.train
        self.n_params = sum(p.numel() for p in model.parameters())
        self.reshard_after_forward = agree_on_resharding(resolve_reshard_after_forward(
            t.reshard_after_forward, self.n_params, self.compute_dtype, self.device), self.device)
        parallelize(model, self.mesh, compute_dtype=self.compute_dtype,
                    activation_checkpointing=t.activation_checkpointing, compile=t.compile,
                    reshard_after_forward=self.reshard_after_forward)
        model.to_empty(device=self.device)
        init_sharded_weights(model, seed=t.seed)
        return model

    def setup_line(self) -> str:
        """What this group runs, so a log shows the choices `auto` settings made."""
        t = self.cfg.train
        policy = "always" if self.reshard_after_forward else "never"
        if t.reshard_after_forward == "auto":
            policy += " (auto)"
        return (f"[elastic-gpt] {self.world_size} worker(s) on {self.device.type} "
                f"({dist.get_backend()}), {self.threads} thread(s) each | "
                f"model {self.n_params / 1e6:,.1f}M params, "
                f"{str(self.compute_dtype).removeprefix('torch.')} | global batch "
                f"{self.plan.global_batch_size} = micro-batches of {self.plan.micro_batch_size}, "
                f"{self.plan.slots(self.world_size)} per worker | "
                f"FSDP2 reshard_after_forward={policy}, grad_sync={t.grad_sync}")

    # ---- restore -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Resume from the newest committed checkpoint, resharding if the world size changed."""
        latest = None
        if self.rank == 0:
            latest = self.store.latest()
            if latest is not None:
                check_checkpoint_shape(latest.state, self.gpt_cfg, latest.url)
        latest = _broadcast(latest)
        if latest is None:
            return
        load_sharded(latest.url, self.model, self.optimizer)
        state = latest.state
        self.step = state["step"]
        self.ledger = GoodputLedger.from_dict(state.get("ledger"))
        assert state["samples_seen"] == self.step * self.plan.global_batch_size, \
            "the global batch size changed inside a run (C1); the checkpoint's cursor disagrees"
        if self.rank == 0:
            say(f"[elastic-gpt] resumed from {latest.url} at step {self.step} "
                f"(saved by {state['world_size']} workers, now {self.world_size})")

    # ---- the step ----------------------------------------------------------------------------

    def forward_backward(self, batch) -> torch.Tensor:
        """Accumulate this rank's gradients for one step; returns its summed token loss."""
        cfg, plan = self.cfg, self.plan
        T = self.gpt_cfg.seq_len
        global_tokens = plan.global_batch_size * T
        slots = len(batch.tokens)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        first_mb = plan.rank_micro_batches(self.rank, self.world_size).start
        per_micro_batch_sync = cfg.train.grad_sync == "microbatch"
        for k, (tokens, weight) in enumerate(zip(batch.tokens, batch.weights)):
            tokens = tokens.to(self.device, non_blocking=True)
            x, y = tokens[:, :T], tokens[:, 1:T + 1]
            last = k == slots - 1
            # grad_sync=step: only the last backward reduce-scatters (one sync per step).
            self.model.set_requires_gradient_sync(last or per_micro_batch_sync)
            if not self.reshard_after_forward:
                # The gathered weights live through each forward and backward already, so keeping
                # them between micro-batches adds no peak memory and saves one all-gather per
                # micro-batch; the last backward frees them before the optimizer step. (A forward
                # without backward, e.g. an evaluation, must call model.reshard() after it, or the
                # next step would compute with weights gathered before the optimizer step.)
                self.model.set_reshard_after_backward(last)
            # Dropout RNG from (seed, step, micro-batch): identical masks at any world size.
            torch.manual_seed(hash((cfg.train.seed, self.step, first_mb + k)) & 0x7FFF_FFFF)
            with torch.autocast(self.device.type, dtype=self.compute_dtype,
                                enabled=self.compute_dtype != torch.float32):
                logits = self.model(x)
            summed = token_losses(logits, y)
            # Each rank's loss is its share of the mean over exactly G*T tokens. FSDP averages
            # gradients over the W ranks, so scaling by W makes the reduction a sum: the gradient
            # is the mean over exactly G sequences at any W, even with uneven micro-batches (C1).
            (summed * (weight * self.world_size / global_tokens)).backward()
            loss_sum += summed.detach().double() * weight
        return loss_sum

    def train_step(self, batch) -> StepResult:
        cfg = self.cfg
        lr = lr_at(self.step, lr=cfg.train.lr, min_lr=_min_lr(cfg),
                   warmup_steps=cfg.train.warmup_steps, max_steps=cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = self.forward_backward(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf,
            foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        # One collective and one host sync per step for the metrics, not one per micro-batch.
        lo, hi = split_fingerprint(batch.fingerprint)
        # The membership flag rides on the same all-reduce: every rank learns at the same step
        # boundary that the group must checkpoint and restart.
        stop = 1.0 if self.membership is not None and self.membership.reason else 0.0
        stats = torch.tensor([0.0, lo, hi, stop], dtype=torch.float64, device=self.device)
        stats[0] = loss_sum
        dist.all_reduce(stats)
        # The step's only host sync: everything the host needs in one transfer.
        loss_total, fp_lo, fp_hi, stop, grad_norm = torch.cat(
            [stats, grad_norm.detach().to(stats).reshape(1)]).tolist()
        if stop > 0:
            self.stop_reason = (self.membership.reason if self.membership is not None
                                and self.membership.reason else "membership change")
        loss = loss_total / (self.plan.global_batch_size * self.gpt_cfg.seq_len)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self._nonfinite_streak = 0
        else:
            self._nonfinite_streak += 1
            if self._nonfinite_streak > cfg.train.nan_patience:
                raise NonFiniteLossError(
                    f"loss is {loss} (grad norm {grad_norm}) at step {self.step} for "
                    f"{self._nonfinite_streak} step(s), beyond train.nan_patience="
                    f"{cfg.train.nan_patience}; lower train.lr or raise train.warmup_steps")
        self.optimizer.zero_grad(set_to_none=True)
        fingerprint = join_fingerprint(fp_lo, fp_hi)
        return StepResult(self.step, loss, grad_norm, fingerprint, {"lr": lr})

    # ---- checkpoint --------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        t0 = time.time()
        if self.flush_metrics is not None and not self.flush_metrics(5.0):
            log.warning("step metrics not yet stored in MLflow at the step-%d checkpoint", self.step)
        if self.cfg.checkpoint.async_save:
            # Blocks only to wait for the previous save and copy the shards to CPU; rank 0 commits
            # in the background once every rank's shard is durable (see async_checkpoint.py).
            if self.async_checkpointer is None:  # collective (new process group): all ranks here
                self.async_checkpointer = AsyncCheckpointer(self.store, self.cfg.checkpoint.keep,
                                                            rank=self.rank)
            self.async_checkpointer.save(self.step, self.model, self.optimizer, self.trainer_state())
            self.ledger.on_checkpoint(time.time() - t0)
            return
        if self.rank == 0:
            self.store.prepare_step_dir(self.step)
        dist.barrier()
        url = self.store.url(step_dirname(self.step))
        save_sharded(url, self.model, self.optimizer)
        self.ledger.on_checkpoint(time.time() - t0)
        if self.rank == 0:
            self.store.commit(self.step, self.trainer_state())
            self.store.retain(self.cfg.checkpoint.keep)
        dist.barrier()  # nobody runs ahead of a commit they might need to resume from

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "samples_seen": self.step * self.plan.global_batch_size,
            "epoch": self.step * self.plan.global_batch_size // self.manifest.num_samples,
            "world_size": self.world_size,
            "mlflow_run_id": self.mlflow_run_id,
            "model_shape": self.gpt_cfg.shape(),
            "data": {"url": self.manifest.url, "seed": self.cfg.data.seed,
                     "shuffle_window": self.cfg.data.shuffle_window},
            "train_seed": self.cfg.train.seed,
            "global_batch_size": self.plan.global_batch_size,
            "ledger": self.ledger.to_dict(),
            "saved_at": time.time(),
        }

    # ---- the loop ----------------------------------------------------------------------------

    def train(self) -> dict:
        cfg = self.cfg
        if self.rank == 0:
            say(self.setup_line())
        self.restore()
        if self.rank == 0:  # at a start nothing is in flight: uncommitted dirs are leftovers (C4)
            self.store.remove_uncommitted()
        if self.rank == 0 and self.membership is not None:
            event = self.ledger.on_resume(
                restored_step=self.step, world_size=self.world_size,
                previous=self.membership.previous, cause=self.membership.cause,
                attempt_started=self.started)
            if event:
                say(f"[elastic-gpt] {event['kind']}: {event['detail']}; W "
                    f"{event['from_world_size']} -> {event['to_world_size']}, resuming at step "
                    f"{self.step} ({event['lost_steps']} step(s) to redo)")
        stream = open_step_stream(
            cfg.data.path, plan=self.plan, rank=self.rank, world_size=self.world_size,
            start_step=self.step, seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window,
            prefetch_steps=cfg.data.prefetch_steps, pin_memory=self.device.type == "cuda")
        tokens_per_step = self.plan.global_batch_size * self.gpt_cfg.seq_len
        last = None
        try:
            end = min(cfg.train.max_steps, cfg.run.stop_at_step or cfg.train.max_steps)
            first_step = self.step
            while self.step < end:
                if self.step == first_step:
                    event = self.ledger.on_first_step_started()
                    if event and self.rank == 0:
                        self.report({"event_recovery_s": event["recovery_s"],
                                     "event_lost_steps": event["lost_steps"]}, self.step)
                t0 = time.perf_counter()
                batch = next(stream)
                assert batch.step == self.step, f"data stream at step {batch.step}, not {self.step}"
                t_data = time.perf_counter() - t0
                result = self.train_step(batch)
                step_time = time.perf_counter() - t0
                self.step += 1
                self.ledger.on_step(step_time)
                tokens_per_s = tokens_per_step / step_time
                metrics = {
                    "loss": result.loss, "lr": result.metrics["lr"], "grad_norm": result.grad_norm,
                    "tokens_per_s": tokens_per_s,
                    "mfu": tokens_per_s * self.flops_per_token / (self.peak * self.world_size),
                    "world_size": self.world_size, "grad_accum": self.plan.slots(self.world_size),
                    "samples_seen": self.step * self.plan.global_batch_size,
                    "step_time_s": step_time, "data_wait_s": t_data,
                    "data_fingerprint": result.fingerprint,
                }
                self.report(metrics, result.step)
                if self.rank == 0 and (result.step % cfg.train.log_every == 0
                                       or self.step == cfg.train.max_steps):
                    say(_progress_line(result.step, cfg.train.max_steps, metrics))
                if self.async_checkpointer is not None:
                    self.async_checkpointer.poll()  # a failed background write raises here
                if self.step % cfg.checkpoint.every_steps == 0 or self.step == end \
                        or self.stop_reason:
                    self.save_checkpoint()
                if self.membership is not None:
                    self.membership.publish(self.step, step_time, self.ledger.to_dict())
                last = metrics
                if self.stop_reason:
                    if self.async_checkpointer is not None:
                        self.async_checkpointer.finish()  # the restart resumes from this step
                    if self.membership is not None:
                        self.membership.record_restart(self.stop_reason, self.step)
                    raise ElasticRestart(self.stop_reason, self.step)
            if self.async_checkpointer is not None:
                self.async_checkpointer.finish()  # the last step is committed before we return
        finally:
            stream.close()
        return {"step": self.step, "last": last, "ledger": self.ledger}


def say(line: str) -> None:
    """One line to the job's output. Not print(): Ray Train patches print into its logger, which
    echoes each line twice in `ray job logs`."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _progress_line(step: int, max_steps: int, m: dict) -> str:
    return (f"[elastic-gpt] step {step + 1}/{max_steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} "
            f"| grad {m['grad_norm']:.2f} | {m['tokens_per_s']:,.0f} tok/s | mfu {m['mfu']:.1%} "
            f"| W={m['world_size']} accum={m['grad_accum']} | {m['step_time_s']:.2f}s/step "
            f"(data {m['data_wait_s'] / m['step_time_s']:.1%})")


def _min_lr(cfg: Config) -> float:
    return cfg.train.min_lr if cfg.train.min_lr is not None else cfg.train.lr / 10


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: everything a worker needs arrives in `loop_config` by value."""
    import ray
    import ray.train

    from elastic_gpt.elastic.controller import WorkerMembership
    from elastic_gpt.tracking.mlflow_tracking import MetricLogger

    ctx = ray.train.get_context()
    cfg = config_from_dict(loop_config["config"])
    run_id = loop_config.get("mlflow_run_id")
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    logger = MetricLogger(cfg.tracking.uri, run_id) if rank == 0 and run_id else None
    # Every rank says which node it is on; rank 0 watches those nodes for drains.
    nodes = [None] * world
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    membership = WorkerMembership(loop_config["run_key"], nodes, world) if rank == 0 else None
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=run_id,
                      report=(lambda m, s: logger.log(m, s)) if logger else None,
                      membership=membership, flush_metrics=logger.flush if logger else None)
    try:
        summary = trainer.train()
    finally:
        if membership:
            membership.close()
        if logger:
            logger.close()
    ray.train.report({"step": summary["step"]})  # the ledger travels in the checkpoints

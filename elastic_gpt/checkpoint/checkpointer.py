"""When, whether and how the training loop saves, and which checkpoints go: one interface, a
synchronous and an asynchronous implementation, and `make_checkpointer`, which picks one from the
config once. No code outside checkpoint/ deletes a checkpoint: callers say what happened, the
checkpointer decides what that means for the steps on storage.

The loop calls only these, the same way whichever implementation it got:

    start()                 once, after the restore: leftovers of interrupted saves removed
                            where nothing else can be writing (`writes_alone`)
    save(step, last_step=)  at every step boundary: a failed background write raises here; then
                            saves when this group saves (`may_save`: of replica groups, the one
                            leading the step's quorum, and never while suspect steps are re-run)
                            and `step` is a multiple of checkpoint.every_steps, or
                            checkpoint.every_minutes of wall time have passed since the last
                            save, or it is the last step (of the run, or before a planned
                            restart)
    discard_after(step)     a rollback abandoned every step after `step`: the saves in flight
                            land, then those steps are deleted (rank 0)
    finish()                before the loop returns or restarts: the last save is committed

Synchronous: every rank writes its DCP shard, then rank 0 commits (trainer state, then the commit
marker last) and applies retention, and no rank goes on before the commit.

Asynchronous: the loop blocks only to wait for the previous save and copy the shards into CPU
staging buffers (reused across saves); a background thread writes them (fsynced), DCP gathers
every rank's write result on rank 0, which writes `.metadata` and commits. At most one save is in
flight. The background collectives run on a dedicated gloo process group, so they never
interleave with the training collectives on the default group (two threads issuing collectives on
one group can pair up the wrong calls). A step whose write fails or is killed midway has no commit
marker, so resume never sees it, and `CheckpointStore.retain` / `remove_uncommitted` delete it
later (C4 atomic commit).

The clock cadence (every_minutes) is rank 0's: its clock decides, and one byte broadcast from it
on a gloo group of the checkpointer's own tells every rank, so all of them save at the same step
whatever their own clocks say. The broadcast is made only where the clock is the only reason left
to save (not at a step the step cadence or `force` already saves), on the CPU (no device sync),
on a group of its own (it never pairs up with a training collective or with the async writer's).
Both cadences may be set: a save is due when either is, and a save of any kind restarts the
clock. Elapsed time is counted from the end of the last save (from the checkpointer's
construction before the first): the time the loop trained, the interval of Young/Daly's model.

Each rank writes its shards as checkpoint.write_streams files at once (`sharded.shard_writer`).

Knows the store and DCP, not the Trainer: what the trainer state holds, and what must happen just
before a save (making the step metrics durable), come in as callables.
"""

from __future__ import annotations

import copy
import datetime
import errno
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_gpt.checkpoint.sharded import (
    BoxSavePlanner,
    save_sharded,
    shard_writer,
    training_state_dict,
)
from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname
from elastic_gpt.errors import StorageFullError
from elastic_gpt.torch_internals import _copy_state_dict, _create_cpu_state_dict

if TYPE_CHECKING:
    from elastic_gpt.config import CheckpointSection


class SaveTimeouts(Protocol):
    """Told around each save that may be taken (train/collective_timeouts.py: the attempt's
    first save plans its writes collectively, and may take as long as the attempt's start)."""

    def before_save(self) -> None: ...

    def after_save(self, saved: bool) -> None: ...


class _NoTimeouts:
    def before_save(self) -> None:
        pass

    def after_save(self, saved: bool) -> None:
        pass


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the step it was writing stays uncommitted."""


class Checkpointer:
    """Saves a model and optimizer (and the trainer state beside them) into a store. Every rank
    constructs one with the same settings and calls its methods at the same step boundaries.

    `trainer_state()` is read while a save is taken and committed beside its shards.
    `extra_files(step_url)` runs on rank 0 after the shards are written and before the commit, so
    what it writes into the step folder (the tokenizer) is listed in the commit marker too.
    `before_save()` runs first, on every save. `on_blocked(seconds)` is told how long the save
    held the loop up: from before `before_save()` to the end of the shards' write for a
    synchronous save, to the end of the copy to CPU for an asynchronous one. `clock` is where
    rank 0 reads the wall time for `every_minutes` (seconds; tests pass a fake one).
    `collective_timeout_s` bounds the clock's broadcast (a hung peer fails it, as it fails the
    training collectives; None: torch's default for gloo groups). `may_save()`: whether this
    group saves at this step boundary (the same answer on every rank of the group). `timeouts`
    are told around each save that may be taken. `writes_alone`: no other group writes into
    this store (the restart path), so an uncommitted step found at the start is a leftover.
    """

    in_flight = False
    """True while a save is still being written in the background."""

    def __init__(self, store: CheckpointStore, *, every_steps: int, keep: int, rank: int,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 trainer_state: Callable[[], dict], every_minutes: float = 0.0,
                 streams: int = 1, storage_options: dict | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 collective_timeout_s: float | None = None,
                 before_save: Callable[[], None] = lambda: None,
                 on_blocked: Callable[[float], None] = lambda seconds: None,
                 extra_files: Callable[[str], None] = lambda step_url: None,
                 may_save: Callable[[], bool] = lambda: True,
                 timeouts: SaveTimeouts = _NoTimeouts(), writes_alone: bool = True):
        self.store, self.every_steps, self.keep, self.rank = store, every_steps, keep, rank
        self.may_save, self.timeouts, self.writes_alone = may_save, timeouts, writes_alone
        self.every_minutes, self.streams = every_minutes, streams
        self.storage_options = storage_options or {}
        self.model, self.optimizer = model, optimizer
        self.trainer_state, self.before_save, self.on_blocked = (trainer_state, before_save,
                                                                 on_blocked)
        self.extra_files, self.clock = extra_files, clock
        self.collective_timeout_s = collective_timeout_s
        self._last_save = clock()
        self._clock_group: dist.ProcessGroup | None = None

    def start(self) -> None:
        """After the restore, before the first step: where this group writes alone, nothing is
        in flight, so every uncommitted step folder is a leftover (C4 atomic commit). With other
        writers (replica groups) one may be the leading group's save in flight: kept, and
        removed by retention once a newer step is committed."""
        if self.writes_alone and self.rank == 0:
            self.store.remove_uncommitted()

    def save(self, step: int, *, last_step: bool = False) -> bool:
        """Collective. At the boundary after `step` steps: raise a failed background save's
        error, then checkpoint the state if this group saves and a cadence says so or it is
        the `last_step` (of the run, or before a planned restart); returns whether it saved."""
        self.poll()
        if not self.may_save():
            return False
        self.timeouts.before_save()
        saved = last_step or self.due(step)
        if saved:
            t0 = time.perf_counter()
            self.before_save()
            self._save(step, t0)
            self._last_save = self.clock()
        self.timeouts.after_save(saved)
        return saved

    def discard_after(self, step: int) -> list[int]:
        """Every checkpoint of a step after `step`, committed or not, is deleted: a rollback
        abandoned the trajectory they hold (health/recovery.py), and a restart must not resume
        from it. The saves in flight land first (they belong to that trajectory). Rank 0
        deletes and returns the steps deleted; other ranks return []."""
        self.wait()
        return self.store.discard_after(step) if self.rank == 0 else []

    def due(self, step: int) -> bool:
        """Whether a cadence asks for a save after `step` steps; the same answer on every rank.
        Collective when checkpoint.every_minutes is set and the step cadence does not save here."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_minutes:
            return False
        return self._rank0_says(self.clock() - self._last_save >= 60.0 * self.every_minutes)

    def _rank0_says(self, verdict: bool) -> bool:
        """Rank 0's `verdict`, on every rank (one byte from rank 0, see the module docstring)."""
        if self._clock_group is None:  # collective: all ranks, same order
            timeout = (None if self.collective_timeout_s is None
                       else datetime.timedelta(seconds=self.collective_timeout_s))
            self._clock_group = dist.new_group(backend="gloo", timeout=timeout)
        flag = torch.tensor([verdict], dtype=torch.uint8)
        dist.broadcast(flag, group=self._clock_group, group_src=0)
        return bool(flag.item())

    def poll(self) -> None:
        """Raise the error of a failed background save, if one has failed; never blocks."""

    def wait(self) -> None:
        """Block until an in-flight save is written (and on rank 0 committed); saving goes on."""

    def finish(self) -> None:
        """Collective. Block until the last save is committed (and raise its error)."""

    def _save(self, step: int, t0: float) -> None:
        raise NotImplementedError

    def _full_disk(self, step: int) -> StorageFullError | None:
        """After a failed write: a StorageFullError if the disk has no room for a checkpoint.
        Asked of the disk, because torch's zip writer reports a full disk as a bare
        `unexpected pos` RuntimeError, without the ENOSPC under it."""
        free = self.store.free_bytes()
        latest = self.store.latest()
        need = self.store.committed_bytes(latest.step) if latest else 0
        if free is None or free >= max(need, 1 << 20):
            return None
        kept = (f"the checkpoint of step {latest.step} at {latest.url} is intact" if latest
                else "no earlier checkpoint exists")
        full = StorageFullError(
            f"storage is full under {self.store.root_url} ({free:,} bytes free, a checkpoint "
            f"takes about {need:,}): step {step} was not committed, and {kept}; free space (or "
            "raise the quota) and run the same command again to resume")
        full.errno = errno.ENOSPC
        return full


class SyncCheckpointer(Checkpointer):
    """Writes and commits within `save`: the loop waits for the whole checkpoint."""

    def _save(self, step: int, t0: float) -> None:
        if self.rank == 0:
            self.store.prepare_step_dir(step)
        dist.barrier()  # no rank writes into the directory before rank 0 has cleared a leftover
        try:
            save_sharded(self.store.url(step_dirname(step)), self.model, self.optimizer,
                         storage_options=self.storage_options, streams=self.streams)
        except (Exception, CheckpointException) as e:
            full = self._full_disk(step)
            if full is not None:
                raise full from e
            raise
        self.on_blocked(time.perf_counter() - t0)
        if self.rank == 0:
            self.extra_files(self.store.url(step_dirname(step)))
            self.store.commit(step, self.trainer_state())
            self.store.retain(self.keep)
        dist.barrier()  # nobody runs ahead of a commit they might need to resume from


class AsyncCheckpointer(Checkpointer):
    """Writes and commits in a background thread after a copy to CPU memory (see the module
    docstring). Its process group is made at the first save, which every rank reaches at the same
    step."""

    def __init__(self, store: CheckpointStore, *, writer_factory: Callable | None = None,
                 **kwargs):
        super().__init__(store, **kwargs)
        # Tests pass a writer factory to hold a write open (kill-while-in-flight); default: fsspec.
        self.writer_factory = writer_factory or (
            lambda url: shard_writer(url, self.streams, self.storage_options))
        self.pg: dist.ProcessGroup | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._staging: dict | None = None
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self.last_stage_s = 0.0
        self.last_write_s = 0.0

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def poll(self) -> None:
        if self._inflight is not None and self._inflight.done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save is written and (on rank 0) committed; raise its error."""
        fut, step = self._inflight, self._inflight_step
        self._inflight, self._inflight_step = None, None
        if fut is None:
            return
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # DCP's error derives from BaseException
            full = self._full_disk(step)
            if full is not None:
                raise full from e
            raise CheckpointWriteError(
                f"asynchronous checkpoint of step {step} to {self.store.url(step_dirname(step))} "
                f"failed: {type(e).__name__}: {e}; the step stays uncommitted and resume uses the "
                "previous committed checkpoint") from e

    def finish(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def _save(self, step: int, t0: float) -> None:
        # Copied now: the background commit writes the state of this step, not of a later one.
        state = copy.deepcopy(self.trainer_state())
        if self.pg is None:
            self.pg = dist.new_group(backend="gloo")  # collective: all ranks, same order
        self.wait()
        if self.rank == 0:
            self.store.prepare_step_dir(step)
        # Nothing runs in the background now, so the writer group is free for this barrier: no
        # rank writes into the directory before rank 0 has cleared a leftover of it.
        dist.barrier(group=self.pg)
        t1 = time.perf_counter()
        self._stage(training_state_dict(self.model, self.optimizer))
        self.last_stage_s = time.perf_counter() - t1
        self._inflight_step = step
        self._inflight = self._executor.submit(self._write_and_commit, step,
                                               self.store.url(step_dirname(step)), state)
        self.on_blocked(time.perf_counter() - t0)

    @torch.no_grad()
    def _stage(self, state_dict: dict) -> None:
        """Copy every local shard into CPU buffers allocated once (pinned on CUDA, for fast D2H).
        The copy is a snapshot: the optimizer may update the live tensors right after we return."""
        if self._staging is None:
            self._staging = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        self._staging = _copy_state_dict(state_dict, self._staging, type_check=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the D2H copies land before the writer thread reads them

    def _write_and_commit(self, step: int, url: str, trainer_state: dict) -> None:
        t0 = time.perf_counter()
        # DCP gathers every rank's write result on rank 0 (over self.pg) before it writes the
        # `.metadata`: when this returns on rank 0, every rank's shard is durable (fsynced).
        dcp.save(self._staging, storage_writer=self.writer_factory(url), process_group=self.pg,
                 planner=BoxSavePlanner())
        if self.rank == 0:
            self.extra_files(url)
            self.store.commit(step, trainer_state)  # commit marker last (C4 atomic commit)
            self.store.retain(self.keep)
        self.last_write_s = time.perf_counter() - t0


def resolve_async_save(setting: str | bool, device_type: str) -> bool:
    """checkpoint.async_save: `auto` is asynchronous where the model trains on CUDA, synchronous
    on the CPU. On a GPU the host's cores sit idle while the device trains, the copy to pinned
    memory is fast, and a large model's write takes minutes the loop would otherwise wait. On the
    CPU the background write's serialization takes cores from the training itself (steps slow
    down while it is in flight, docs/performance.md), the staging copy doubles the state's host
    memory, and the checkpoint of a model that trains on a CPU is small. On a GPU the staging
    buffers are pinned host memory the size of the rank's shard of the parameters and Adam
    moments, for as long as the run lasts: the node's RAM must hold that for each of its GPUs."""
    if setting == "auto":
        return device_type == "cuda"
    return bool(setting)


def make_checkpointer(cfg: CheckpointSection, store: CheckpointStore, *, model: torch.nn.Module,
                      **kwargs) -> Checkpointer:
    """The checkpointer the config asks for (checkpoint.async_save, resolved for the device the
    model is on), with the config's cadences, retention and write streams; `kwargs` as for
    `Checkpointer`."""
    device = next(model.parameters()).device.type
    kind = AsyncCheckpointer if resolve_async_save(cfg.async_save, device) else SyncCheckpointer
    return kind(store, every_steps=cfg.every_steps, every_minutes=cfg.every_minutes,
                keep=cfg.keep, streams=cfg.write_streams, model=model, **kwargs)

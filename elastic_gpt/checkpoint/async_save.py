"""Asynchronous sharded checkpoints: the loop blocks only for a copy to CPU memory (C4 kept).

    save(step)   every rank: wait for the previous save, copy its shards into CPU staging buffers
                 (reused across saves), hand them to a background thread, return
    background   every rank writes its DCP shard (fsynced); DCP gathers every rank's write result
                 on rank 0, which writes `.metadata`, then commits the step (trainer state, then
                 the COMMITTED.json marker last) and applies retention
    poll()       at each step boundary: a failed background write raises here, in the loop
    finish()     at the end of training: wait, so the last step is committed before returning

At most one save is in flight. The background collectives run on a dedicated gloo process group
created collectively up front, so they never interleave with the training collectives on the
default group (two threads issuing collectives on one group can pair up the wrong calls). A step
whose write fails or is killed midway has no commit marker, so resume never sees it, and
`CheckpointStore.retain` / `remove_uncommitted` delete it later.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname, training_state_dict

log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the step it was writing stays uncommitted."""


class AsyncCheckpointer:
    """One per trainer; every rank constructs it at the same point (it creates a process group)."""

    def __init__(self, store: CheckpointStore, keep: int, *, rank: int,
                 storage_options: dict | None = None, writer_factory=None):
        self.store, self.keep, self.rank = store, keep, rank
        self.storage_options = storage_options or {}
        # Tests pass a writer factory to hold a write open (kill-while-in-flight); default: fsspec.
        self.writer_factory = writer_factory or (
            lambda url: FsspecWriter(url, sync_files=True, **self.storage_options))
        self.pg = dist.new_group(backend="gloo")  # collective: all ranks, same order
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._staging: dict | None = None
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self.last_stage_s = 0.0
        self.last_write_s = 0.0

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def save(self, step: int, model: torch.nn.Module, optimizer, trainer_state: dict) -> float:
        """Collective. Returns the seconds this call blocked the caller (waiting + staging)."""
        t0 = time.perf_counter()
        self.wait()
        if self.rank == 0:
            self.store.prepare_step_dir(step)
        # Nothing runs in the background now, so the writer group is free for this barrier: no
        # rank writes into the directory before rank 0 has cleared a leftover of it.
        dist.barrier(group=self.pg)
        t1 = time.perf_counter()
        self._stage(training_state_dict(model, optimizer))
        self.last_stage_s = time.perf_counter() - t1
        url = self.store.url(step_dirname(step))
        self._inflight_step = step
        self._inflight = self._executor.submit(self._write_and_commit, step, url,
                                              copy.deepcopy(trainer_state))
        return time.perf_counter() - t0

    def poll(self) -> None:
        """Non-blocking: raise the background failure, if the in-flight save has failed."""
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
            raise CheckpointWriteError(
                f"asynchronous checkpoint of step {step} to {self.store.url(step_dirname(step))} "
                f"failed: {type(e).__name__}: {e}; the step stays uncommitted and resume uses the "
                "previous committed checkpoint") from e

    def finish(self) -> None:
        """End of training: the last save is committed before the caller returns."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    # ---- internals ---------------------------------------------------------------------------

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
        dcp.save(self._staging, storage_writer=self.writer_factory(url), process_group=self.pg)
        if self.rank == 0:
            self.store.commit(step, trainer_state)  # commit marker last (C4)
            self.store.retain(self.keep)
        self.last_write_s = time.perf_counter() - t0

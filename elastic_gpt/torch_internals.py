"""The private PyTorch APIs elastic-gpt relies on, imported here and nowhere else.

PyTorch may move or change these between releases without notice, which is why pyproject.toml
pins torch to the range the tests ran on. tests/unit/test_torch_internals.py checks every signature and
attribute the code uses, so an upgrade fails there, by name, rather than mid-run; an import that
moved fails here, at import, naming the torch version.

- `FsspecWriter` / `FsspecReader`: DCP storage on any fsspec URL (local, s3://, gs://); the
  writer's `thread_count` writes a rank's shards as that many files at once. The
  checkpoint code subclasses the reader to unpickle the metadata index safely, which uses its
  `fs`, `load_id` and `_get_metadata_path`.
- `set_element`: how DCP's default load planner puts a loaded value back into a nested state dict.
- `_create_cpu_state_dict` / `_copy_state_dict`: pinned CPU staging buffers for async saves,
  reused across saves.
- `checkpoint_wrapper` / `CheckpointWrapper`: activation checkpointing of one module
  (torchtitan's way; no public equivalent wraps a module).
- `flatten_mesh` (`DeviceMesh._flatten`): one process group over several mesh dims, which
  DTensor then uses for a reduction over all of them at once (the gradient norm under tensor
  parallelism: one all-reduce instead of one per dim, which torch warns about).
- `StridedShard` (torch's `_StridedShard`): the DTensor placement that gives each tensor-parallel
  rank the same slice of each of the parts of a fused matrix (GPT-2's [q | k | v] c_attn); DTensor's
  matmul keeps it on the output, FSDP2 shards on top of it, DCP saves and reshards it.
- `local_indices`: which elements of a DTensor a rank holds, through each placement's
  `local_shard_size_and_offset` (a strided shard's every offset, `StridedShardOffsetMode.ALL`):
  what DTensor computes for itself, kept per element instead of as a first offset.
- `enable_async_tp` (inductor's `_micro_pipeline_tp` and `enable_symm_mem_for_group`): the
  compiler splits each tensor-parallel matmul to overlap it with its all-gather or
  reduce-scatter over symmetric memory (torchtitan's async TP).
- `bind_default_group` (`bound_device_id` and `eager_connect_single_device` on the default
  group): what `init_process_group(device_id=...)` does, for a default group made without it.
- `pipeline_sends` (`torch.distributed.pipelining.schedules._batch_p2p`, through which every
  schedule sends and receives): the bytes a rank sends across stage boundaries, for the tests
  and benchmark that check the planner's count of them.
- `DefaultReduceScatter` (FSDP2's default reduce-scatter, `_fsdp_collectives`): subclassed to
  checksum each rank's gradients on their way into the reduce-scatter, installed through the
  public `FSDPModule.set_custom_reduce_scatter` (parallel/gradient_checksum.py).
- `set_collective_timeout` (`_set_pg_timeout` over every group in `_world.pg_map`): a new
  timeout for the collectives of every process group this rank is in, the default one and the
  device mesh's, on gloo and NCCL alike; `collective_timeouts` reads back what each group's
  backends have (their `options._timeout`).

- The dry run's pieces (elastic_gpt/dry_run/), imported only when one runs:
  `fake_process_group` (torch's fake process group, `torch.testing._internal.distributed.fake_pg`:
  one rank of any world size in one process, every collective a no-op), `fake_tensors`
  (`FakeTensorMode`: tensors with shapes and no storage), `memory_tracker` (FSDP2's
  `FSDPMemTracker`: every allocation by category, at its peak), `collective_of` (the process group
  and bytes of a collective op, `fake_collectives.CollectiveOp`), and `fake_tensor_patches`, the
  corrections torch needs to run the trainer's step on fake tensors: DTensor's sharding
  propagation runs each op on whole (unsharded) fake tensors to learn its output's shape, which the
  memory tracker would count as allocations (`ShardingPropagator._propagate_tensor_meta_non_cached`
  is run with the tracker set aside); a strided shard's offsets are computed from a tensor of
  indices that must hold values (`_StridedShard.local_shard_size_and_offset` runs outside the
  fake mode); and a pipeline schedule's first step votes over the stages whether their shapes
  are given up front (`_PipelineSchedule._warmup_p2p`, which reads the vote's value): on the fake
  group no vote can be read, and the trainer gives every stage's shapes (parallel/pipeline.py
  `StageIO`), so every stage is set static without one.

The names are torch's own, so a reader can look them up. Nothing here knows about elastic-gpt.
"""

from __future__ import annotations

import contextlib

import torch

try:
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        checkpoint_wrapper,
    )
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout, _world
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
    from torch.distributed.tensor.placement_types import (
        _StridedShardOffsetMode as StridedShardOffsetMode,
    )
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as e:
    raise ImportError(f"torch {torch.__version__}: a private API elastic-gpt uses moved ({e}); "
                      "install a torch in the range pyproject.toml states") from e

__all__ = ["CheckpointWrapper", "DefaultReduceScatter", "FsspecReader", "FsspecWriter",
           "StridedShard", "TorchDispatchMode", "StridedShardOffsetMode", "_copy_state_dict",
           "_create_cpu_state_dict",
           "bind_default_group", "checkpoint_wrapper", "collective_timeouts", "enable_async_tp",
           "flatten_mesh", "local_indices", "set_collective_timeout",
           "set_element", "fake_process_group", "fake_tensors", "memory_tracker", "collective_of",
           "fake_tensor_patches"]


def enable_async_tp(group_name: str) -> None:
    """Compiled tensor-parallel matmuls overlap their collectives over the group `group_name`
    (CUDA only: symmetric memory)."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)


def bind_default_group(device: torch.device) -> bool:
    """Bind the default process group to `device` and open its communicator there now, as
    `init_process_group(device_id=device)` would have; returns whether it did (accelerators whose
    backend splits communicators: NCCL). Every group made afterwards, a device mesh's, is then
    split from that communicator (ncclCommSplit) instead of being set up from scratch."""
    if device.type == "cpu":
        return False
    group = _get_default_group()
    if group.bound_device_id is None:
        backend = group._get_backend(device)
        if not backend.supports_splitting:
            return False
        group.bound_device_id = device
        backend.eager_connect_single_device(device)
    return True


@contextlib.contextmanager
def pipeline_sends():
    """Every point-to-point send torch's pipeline schedules make while in the with-block, as
    (peer in the pipeline group, bytes), appended to the list it yields: what crosses the
    stage boundaries (`torch.distributed.pipelining.schedules._batch_p2p`, their one door)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    sent: list[tuple[int, int]] = []
    original = schedules._batch_p2p

    def counting(p2p_ops, desc=None):
        sent.extend((op.group_peer, op.tensor.numel() * op.tensor.element_size())
                    for op in p2p_ops if op.op is dist.isend)
        return original(p2p_ops, desc)

    schedules._batch_p2p = counting
    try:
        yield sent
    finally:
        schedules._batch_p2p = original


def set_collective_timeout(seconds: float) -> int:
    """The timeout of every process group this rank belongs to, from now on; returns how many.
    A collective already waiting keeps the timeout it started with."""
    import warnings
    from datetime import timedelta

    groups = list(_world.pg_map)
    with warnings.catch_warnings():  # a group of another backend (torchft's) keeps its own
        warnings.filterwarnings("ignore", message="Set timeout is now only supported")
        for group in groups:
            _set_pg_timeout(timedelta(seconds=seconds), group)
    return len(groups)


def collective_timeouts() -> set[float]:
    """The collective timeouts, in seconds, that the backends of the process groups this rank
    belongs to have now: one value while every group has the same."""
    seconds = set()
    for group in _world.pg_map:
        for device in group._device_types:
            timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
            if timeout is not None:  # a backend besides gloo and NCCL may keep it elsewhere
                seconds.add(timeout.total_seconds())
    return seconds


def flatten_mesh(mesh, name: str):
    """Collective. `mesh` (a slice of several dims of a named mesh) as one flattened dim `name`,
    registered with its root mesh."""
    return mesh._flatten(name)


def local_indices(shape, mesh, placements) -> list[torch.Tensor]:
    """Per dim of a tensor of global `shape` placed on `mesh` by `placements`, the global indices
    of the elements this rank's local tensor holds, in local order. Sharding goes left to right
    over the mesh dims, each placement splitting what the previous ones left (a strided shard
    takes a slice of each of its parts), as DTensor's own shape and offset computation does."""
    from torch.distributed.tensor import Shard
    coordinate = mesh.get_coordinate()
    indices = [torch.arange(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, StridedShard):
            d = placement.dim
            size, offsets = placement.local_shard_size_and_offset(
                len(indices[d]), mesh.size(mesh_dim), coordinate[mesh_dim],
                StridedShardOffsetMode.ALL)
            indices[d] = indices[d][torch.tensor(offsets[:size], dtype=torch.long)]
        elif isinstance(placement, Shard):
            d = placement.dim
            size, offset = Shard.local_shard_size_and_offset(
                len(indices[d]), mesh.size(mesh_dim), coordinate[mesh_dim])
            indices[d] = indices[d][offset:offset + size]
    return indices


# ---- the dry run's pieces (imported when a dry run runs) -----------------------------------


def dry_run_api_problems() -> list[str]:
    """What has changed in the private pieces the dry run overrides or reads, one line each
    (empty: all as this code expects): the parameters of each method it replaces or calls, and
    the memory tracker's state it reads."""
    import inspect

    from torch.distributed._tools.fake_collectives import CollectiveOp
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    expected = [
        (FSDPMemTracker, "_fsdp_state_pre_forward", ("self", "fsdp_mod", "orig_fsdp_state_pre_fw")),
        (FSDPMemTracker, "_update_peak_stats", ("self", "peak_state")),
        (FSDPMemTracker, "get_tracker_snapshot", ("self", "type")),
        (CollectiveOp, "get_process_group", ("func", "args")),
        (CollectiveOp, "get_comm_tensor_size", ("func", "res", "args", "kwargs")),
        (_PipelineSchedule, "_warmup_p2p", ("self", "stages", "has_backward", "p2p_done")),
        (ShardingPropagator, "_propagate_tensor_meta_non_cached", ("self", "op_schema")),
    ]
    problems = []
    for owner, name, params in expected:
        got = tuple(inspect.signature(getattr(owner, name)).parameters)
        if got != params:
            problems.append(f"{owner.__name__}.{name} takes ({', '.join(got)}), not "
                            f"({', '.join(params)})")
    made = inspect.getsource(FSDPMemTracker.__init__) + inspect.getsource(MemTracker.__init__)
    problems += [f"FSDPMemTracker no longer sets self.{a}" for a in (
        "_mod_tracker", "memory_tracking", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap",
        "_root_mod") if f"self.{a}" not in made]
    return problems


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` on torch's fake process group for the
    with-block: every collective returns at once and moves nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_tensors():
    """A FakeTensorMode: tensors made in it have shapes, dtypes and devices, and no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def memory_tracker(roots: list[torch.nn.Module], optimizer: torch.optim.Optimizer):
    """FSDP2's memory tracker of the FSDP roots `roots` (the model, or a pipeline rank's stages)
    and `optimizer`: a context manager that counts every allocation by category; `peak()` gives
    them at the peak of the device's total. torch's tracker takes one root module (it walks its
    `_root_mod.modules()`): several are given to it as one module list. It follows one forward
    and backward of a root (`_fsdp_state_pre_forward` refuses a second); a step runs one per
    micro-batch, so a root's record starts again at each of its forwards, and the peak over the
    whole step is kept."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class Tracker(FSDPMemTracker):
        def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

            def again(*args, **kwargs):
                parents = self._mod_tracker.parents - {self._mod_tracker.get_known_fqn(fsdp_mod)}
                if (fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw
                        and parents == {"Global"}):
                    # This root's record only: a pipeline's other micro-batches are still
                    # between their forward and backward, their blocks' records in use.
                    del self.memory_tracking[fsdp_mod]
                return inner(*args, **kwargs)
            return again

        # An FSDP unit of several modules (an untied output layer with its final norm) has one
        # parameter group, which torch's tracker wraps once per module; its record is made by
        # the forward of the module that runs first. A module whose forward never runs (the
        # output layer whose weight the chunked loss reads) has no record: its wrapper hands the
        # group's backward to the other module's.
        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
            return self._if_recorded(fsdp_mod, orig,
                                     super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            return self._if_recorded(fsdp_mod, orig,
                                     super()._fsdp_param_group_post_backward(fsdp_mod, orig))

        def _if_recorded(self, fsdp_mod, orig, tracked):
            def call(*args, **kwargs):
                return (tracked if fsdp_mod in self.memory_tracking else orig)(*args, **kwargs)
            return call

        def _deregister_module_and_optimizer_hooks(self) -> None:
            # Restored in the reverse order of wrapping, so a group wrapped twice gets its own
            # methods back, not the first module's wrapper.
            saved = list(self._fsdp_mod_to_saved_methods.items())
            self._fsdp_mod_to_saved_methods = dict(reversed(saved))
            super()._deregister_module_and_optimizer_hooks()

        def _update_peak_stats(self, peak_state) -> None:
            # Only the device's peak is read (`peak()`): torch's also walks every module's record
            # on every op for per-module peaks, which at 96 checkpointed blocks is most of the
            # dry run's time.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        def peak(self) -> dict[str, int]:
            snapshot = self.get_tracker_snapshot("peak")
            by_device = next(iter(snapshot.values()), {})
            return {str(getattr(k, "value", k)): int(v) for k, v in by_device.items()}

    tracker = Tracker(roots[0], optimizer)
    if len(roots) > 1:
        tracker._root_mod = torch.nn.ModuleList(roots)
    return tracker


def collective_of(func, args, kwargs, result):
    """(process group, bytes of the tensor it moves) of a collective op seen in a dispatch mode,
    or None for any other op. Bytes: the whole tensor an all-gather makes, the whole tensor a
    reduce-scatter starts from, an all-reduce's tensor, a send's or receive's tensor."""
    from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops

    if func not in collective_ops or func in sync_ops:
        return None
    return (CollectiveOp.get_process_group(func, args),
            CollectiveOp.get_comm_tensor_size(func, result, args, kwargs))


@contextlib.contextmanager
def fake_tensor_patches():
    """The corrections of the module docstring, for the with-block."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    offsets = StridedShard.local_shard_size_and_offset
    vote = _PipelineSchedule._warmup_p2p

    def static_without_a_vote(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    def propagate_aside(self, op_schema):
        with _disable_current_modes():  # no tracker: shapes only
            return propagate(self, op_schema)

    def offsets_with_values(*args, **kwargs):
        with unset_fake_temporarily():
            return offsets(*args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate_aside
    StridedShard.local_shard_size_and_offset = offsets_with_values
    _PipelineSchedule._warmup_p2p = static_without_a_vote
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        StridedShard.local_shard_size_and_offset = offsets
        _PipelineSchedule._warmup_p2p = vote

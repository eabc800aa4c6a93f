"""A training state as DCP shards: save and load the model and optimizer under any world size,
reading nothing from storage but plain tensors.

Every function here is a collective (every rank calls it) except `load_model_weights`, which
loads just the model in one process (generate, export-hf). Nothing is unpickled beyond plain
tensors: DCP's `.metadata` is read with an allow-list unpickler, and optimizer hyper-parameters
are not saved (they come from the config at load time). Where the shards go inside a checkpoint
root, and when they count as committed, is the store's business (store.py), not this module's.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from elastic_gpt.console import last_line
from elastic_gpt.parallel.tensor import local_boxes
from elastic_gpt.torch_internals import FsspecReader, FsspecWriter, set_element


def training_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Model + optimizer moments as (sharded) tensors only. Optimizer param_groups (lr, betas) are
    plain Python values that DCP would pickle; they are rebuilt from the config instead."""
    if optimizer is None:
        return {"model": get_state_dict(model, [], options=StateDictOptions())[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd["state"]}


def shard_writer(url: str, streams: int = 1, storage_options: dict | None = None) -> FsspecWriter:
    """DCP's fsspec writer, writing each rank's shards as `streams` files at once: one thread per
    file, each file its own upload to an object store (s3fs uploads the parts of one file one
    after another, so one file per rank is one stream per rank). The shards are split between the
    files by size; a load reads them from whichever file holds them, at any world size.

    fsync on a local disk only: an object store's upload is durable once its close returns, and
    for a stream without a file descriptor torch falls back to os.sync(), a flush of the whole
    machine's page cache, once per file."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    return FsspecWriter(url, sync_files=protocol in ("file", "local"), thread_count=streams,
                        **(storage_options or {}))


def save_sharded(url: str, model, optimizer, storage_options: dict | None = None,
                 streams: int = 1) -> None:
    dcp.save(training_state_dict(model, optimizer),
             storage_writer=shard_writer(url, streams, storage_options), planner=BoxSavePlanner())


def load_sharded(url: str, model, optimizer, storage_options: dict | None = None) -> None:
    """Load into the current (possibly differently sharded) model and optimizer: DCP reshards."""
    sd = training_state_dict(model, optimizer)
    _dcp_load(sd, url, storage_options)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=sd["model"], optim_state_dict={})
        return
    _, current_optim = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=sd["model"],
                   optim_state_dict={"state": sd["optim"],
                                     "param_groups": current_optim["param_groups"]})


def load_model_weights(url: str, model: torch.nn.Module,
                       storage_options: dict | None = None) -> None:
    """Single-process load of just the model (generate, export-hf): no process group needed."""
    sd = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # One process without a process group is exactly what we mean here: DCP's warning that
        # it is "assuming the intent" would be printed on every generate and export.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load(sd, url, storage_options,
                  no_dist=not (dist.is_available() and dist.is_initialized()))
    model.load_state_dict(sd["model"])


def _dcp_load(sd: dict, url: str, storage_options: dict | None, **kwargs) -> None:
    """dcp.load, with its BaseException-derived CheckpointException turned into one readable
    ValueError naming the checkpoint and the first rank's root cause."""
    try:
        dcp.load(sd, storage_reader=SafeFsspecReader(url, **(storage_options or {})),
                 planner=SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()] or [e]
        # DCP nests each rank's real error at the end of its own message
        text = "; ".join(dict.fromkeys(last_line(c) for c in causes))
        raise CheckpointLoadError(f"cannot load checkpoint {url}: {text}") from None


class CheckpointLoadError(ValueError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its `.metadata` index. Allow only the classes such an index holds, so a
    checkpoint from untrusted storage cannot run code on load."""

    _ALLOWED = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                ("builtins", "slice"), ("torch", "Size"), ("torch.serialization", "_get_layout")}

    def find_class(self, module: str, name: str):
        allowed = (module, name) in self._ALLOWED or module.startswith(
            "torch.distributed.checkpoint.") or (module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype))
        if allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP index never holds: "
            "the checkpoint is corrupt or was tampered with")


class SafeFsspecReader(FsspecReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default planner, except that a tensor whose local data is several boxes of the
    global tensor (a fused tensor-parallel weight, `parallel.tensor.local_boxes`) is written as
    one item per box, at its place in the global (GPT-2) layout."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self._boxes: dict[tuple, torch.Tensor] = {}
        items = []
        for item in plan.items:
            boxes = local_boxes(self.state_dict.get(item.index.fqn))
            if boxes is None:
                items.append(item)
                continue
            for offsets, sizes, view in boxes:
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                items.append(dataclasses.replace(
                    item, index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
                    tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk)))
                self._boxes[item.index.fqn, tuple(offsets)] = view
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        box = self._boxes.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return box.contiguous() if box is not None else super().resolve_data(write_item)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with weights_only=False; we save none,
    and refuse anything but plain data if one turns up. Tensors held as several boxes
    (`BoxSavePlanner`) are read box by box, from whatever layout the checkpoint was saved in."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self._boxes: dict[tuple, torch.Tensor] = {}
        boxed = {fqn: boxes for fqn, obj in self.state_dict.items()
                 if (boxes := local_boxes(obj)) is not None}
        if not boxed:
            return plan
        items = [item for item in plan.items if item.dest_index.fqn not in boxed]
        for fqn, boxes in boxed.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in boxes]
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], chunks)
            self._boxes.update({(fqn, tuple(o)): view for o, _, view in boxes})
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index):
        box = self._boxes.get((index.fqn, tuple(index.offset or ())))
        return box if box is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

"""The private PyTorch APIs in elastic_gpt/torch_internals.py still do what the code relies on.

Each test uses an API the way elastic-gpt does (no process group needed) and fails naming the torch
version and what changed, so a torch upgrade shows here what to fix before any run misbehaves.
Also: no other module imports a private torch API, and pyproject's torch range holds this torch.
"""

from __future__ import annotations

import ast
import copy
import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from packaging.requirements import Requirement
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from elastic_gpt.torch_internals import (
    CheckpointWrapper,
    FsspecReader,
    FsspecWriter,
    _copy_state_dict,
    _create_cpu_state_dict,
    checkpoint_wrapper,
    set_element,
)

REPO = Path(__file__).resolve().parents[2]


def changed(what: str) -> str:
    return (f"torch {torch.__version__}: {what}. elastic-gpt uses it through "
            "elastic_gpt/torch_internals.py and is tested with the torch range in pyproject.toml")


def params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_pyproject_states_the_torch_range_these_tests_run_on():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert torch_req.specifier, "pyproject.toml must bound torch: private APIs are in use"
    assert torch_req.specifier.contains(torch.__version__), changed(
        f"not in pyproject's range {torch_req.specifier}")


def test_fsspec_storage_saves_and_loads_and_exposes_the_metadata_path(tmp_path):
    assert {"path", "sync_files", "thread_count"} <= params(FsspecWriter.__init__), \
        changed("FsspecWriter()")
    assert params(FsspecWriter.write_data) >= {"plan", "planner"}, changed("write_data()")
    url = str(tmp_path / "ckpt")
    saved = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    dcp.save(saved, storage_writer=FsspecWriter(url, sync_files=True), no_dist=True)

    loaded = {"w": torch.zeros(2, 3)}
    dcp.load(loaded, storage_reader=FsspecReader(url), no_dist=True)
    assert torch.equal(loaded["w"], saved["w"]), changed("FsspecWriter/FsspecReader round trip")
    # thread_count: one file per thread for each rank (the checkpoint's write streams).
    two = {"a": torch.ones(4), "b": torch.zeros(4)}
    dcp.save(two, storage_writer=FsspecWriter(f"{url}2", thread_count=2), no_dist=True)
    assert len([f for f in os.listdir(f"{url}2") if f.endswith(".distcp")]) == 2, \
        changed("FsspecWriter(thread_count=2): not one file per thread")

    # What the checkpoint code's safe reader uses to unpickle the index itself.
    reader = FsspecReader(url)
    assert "rank" in params(reader._get_metadata_path), changed("FsspecReader._get_metadata_path")
    with reader.fs.create_stream(reader._get_metadata_path(None), "rb") as f:
        assert f.read(), changed("FsspecReader.fs.create_stream on the metadata path")
    assert isinstance(reader.load_id, str), changed("FsspecReader.load_id")


def test_the_default_load_planner_keeps_what_the_safe_planner_reads():
    planner = DefaultLoadPlanner()
    assert params(planner.load_bytes) == {"read_item", "value"}, changed("load_bytes()")
    nested = {"model": {"w": torch.zeros(2)}}
    planner.set_up_planner(nested, None, False)
    assert planner.flatten_state_dict, changed("DefaultLoadPlanner flattens by default")
    assert planner.original_state_dict is nested, changed("DefaultLoadPlanner.original_state_dict")
    fqn = next(iter(planner.state_dict))
    set_element(planner.original_state_dict, planner.mappings[fqn], torch.ones(2))
    assert torch.equal(nested["model"]["w"], torch.ones(2)), changed("set_element / mappings")


def test_cpu_staging_buffers_are_made_once_and_copied_into():
    assert "pin_memory" in params(_create_cpu_state_dict), changed("_create_cpu_state_dict()")
    assert "type_check" in params(_copy_state_dict), changed("_copy_state_dict()")
    state = {"model": {"w": torch.randn(4)}, "optim": {"step": torch.tensor(3.0)}}
    staging = _create_cpu_state_dict(state, pin_memory=False)
    assert staging["model"]["w"] is not state["model"]["w"], changed("_create_cpu_state_dict")
    buffer = staging["model"]["w"]
    state["model"]["w"].add_(1.0)
    staging = _copy_state_dict(state, staging, type_check=False)
    assert staging["model"]["w"] is buffer, changed("_copy_state_dict reuses the buffers")
    assert torch.equal(buffer, state["model"]["w"]), changed("_copy_state_dict copies values")


def test_checkpoint_wrapper_recomputes_without_changing_grads_or_state_dict_keys():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), preserve_rng_state=True)
    assert isinstance(wrapped, CheckpointWrapper), changed("checkpoint_wrapper's return type")
    # Checkpoints must not depend on whether activation checkpointing was on.
    assert wrapped.state_dict().keys() == plain.state_dict().keys(), changed(
        "CheckpointWrapper's state_dict keys")
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.allclose(a.grad, b.grad), changed("checkpoint_wrapper's gradients")


def _private_torch_imports(path: Path) -> list[str]:
    def private(module: str, name: str = "") -> bool:
        return (module.split(".")[0] == "torch"
                and (any(p.startswith("_") for p in module.split(".")) or name.startswith("_")))

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{node.module}.{a.name}" for a in node.names if private(node.module, a.name)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if private(a.name)]
    return found


def test_a_dispatch_mode_sees_every_op_with_its_args():
    """bench/bench_planner.py counts DTensor's collectives with a TorchDispatchMode subclass."""
    from elastic_gpt.torch_internals import TorchDispatchMode

    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.overloadpacket.__name__, [a.shape for a in args
                                                        if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    with Recorder():
        torch.ones(2, 3).sum()
    assert ("sum", [torch.Size([2, 3])]) in seen, changed(f"TorchDispatchMode saw {seen}")


def test_async_tp_turns_on_the_micro_pipeline_pass_and_symmetric_memory(monkeypatch):
    """enable_async_tp sets what torchtitan's async TP sets (both CUDA-only at run time)."""
    import importlib

    from elastic_gpt.torch_internals import enable_async_tp

    inductor_config = importlib.import_module("torch._inductor.config")
    assert hasattr(inductor_config, "_micro_pipeline_tp"), changed("inductor's _micro_pipeline_tp")
    enabled = []
    monkeypatch.setattr("torch.distributed._symmetric_memory.enable_symm_mem_for_group",
                        enabled.append)
    monkeypatch.setattr(inductor_config, "_micro_pipeline_tp", False)
    enable_async_tp("tp-group")
    assert inductor_config._micro_pipeline_tp is True and enabled == ["tp-group"], changed(
        "enable_symm_mem_for_group")


def test_no_other_module_imports_private_torch():
    door = REPO / "elastic_gpt/torch_internals.py"
    assert _private_torch_imports(door), "the door itself imports them"
    offenders = [f"{p.relative_to(REPO)}: {hits}"
                 for folder in ("elastic_gpt", "tests", "bench")
                 for p in sorted((REPO / folder).rglob("*.py"))
                 if p != door and (hits := _private_torch_imports(p))]
    assert not offenders, "import them from elastic_gpt.torch_internals:\n" + "\n".join(offenders)


def test_fsdp_reduce_scatter_can_be_replaced_by_a_subclass_of_its_default():
    """parallel/gradient_checksum.py subclasses FSDP2's default reduce-scatter and installs it
    with the public setter; FSDP calls it with these arguments (the two-rank health test checks
    that it sees every gradient)."""
    from torch.distributed.fsdp import FSDPModule

    from elastic_gpt.torch_internals import DefaultReduceScatter

    comm = DefaultReduceScatter()
    assert {"output_tensor", "input_tensor", "group", "op", "async_op"} <= params(comm.__call__), \
        changed("DefaultReduceScatter.__call__'s arguments")
    assert callable(getattr(comm, "allocate", None)), changed("DefaultReduceScatter.allocate")
    assert "comm" in params(FSDPModule.set_custom_reduce_scatter), changed(
        "FSDPModule.set_custom_reduce_scatter")



def test_the_dry_runs_private_pieces_have_the_names_and_signatures_it_uses(monkeypatch):
    """What the dry run overrides or reads of torch's memory tracker, fake collectives, pipeline
    schedule, sharding propagation and strided shard: checked by name, so an upgrade fails here.
    A changed signature is named."""
    from elastic_gpt.torch_internals import dry_run_api_problems

    assert dry_run_api_problems() == []
    monkeypatch.setattr("torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p",
                        lambda self, stages: None)
    assert dry_run_api_problems() == [
        "_PipelineSchedule._warmup_p2p takes (self, stages), not (self, stages, has_backward, "
        "p2p_done)"]

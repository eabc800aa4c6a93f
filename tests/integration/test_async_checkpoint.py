"""Async checkpoints with 2 real ranks (separate processes, gloo) writing real files.

- A run checkpointing asynchronously, stopped and resumed from its async checkpoint, ends in the
  same state (params and Adam moments, to the bit) as an uninterrupted run with synchronous saves.
- The staged copy is a snapshot: steps taken while the write is held open do not leak into it.
- A failed background write raises at the next step boundary on every rank; the step stays invisible.
- SIGKILL of both ranks while a write is in flight: the previous commit stays the newest, the torn
  step is never visible to resume, and cleanup removes it.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname
from elastic_gpt.testing.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- rank processes ------------------------------------------------------------------------------

def _rank_main() -> None:
    """Entry point of one rank: MODE, RANK, WORLD_SIZE, MASTER_PORT, CKPT (+ DATA, OVERRIDES)."""
    import torch.distributed as dist
    mode, rank, world = os.environ["MODE"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        {"trainer": _trainer_job, "snapshot": _snapshot_job, "fail": _fail_job,
         "kill": _kill_job}[mode](rank, world)
    finally:
        if mode != "kill":
            dist.destroy_process_group()


def _trainer_job(rank: int, world: int) -> None:
    from elastic_gpt.config import load_config
    from elastic_gpt.train.trainer import Trainer
    cfg = load_config(os.path.join(ROOT, "jobs/configs/mini.yaml"), [
        "model.preset=tiny", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.max_steps=6", "train.warmup_steps=2", "train.lr=3e-3", "train.log_every=100",
        "checkpoint.every_steps=2", "checkpoint.keep=5", f"data.path={os.environ['DATA']}",
        f"checkpoint.path={os.environ['CKPT']}", *os.environ.get("OVERRIDES", "").split()])
    Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None).train()


def _toy_state():
    """A tiny GPT under FSDP2 on the default group and one AdamW step."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.model.config import GPTConfig
    from elastic_gpt.model.gpt import GPT
    from elastic_gpt.parallel.fsdp import init_sharded_weights, parallelize
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64))
    parallelize(model, init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),)),
                compute_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_sharded_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, seed: int) -> None:
    from elastic_gpt.model.gpt import token_losses
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 17), generator=g)
    token_losses(model(x[:, :16]), x[:, 1:]).backward()
    opt.step()
    opt.zero_grad()


class _HookedWriter:
    """A real fsspec DCP writer whose shard write runs `hook` after the bytes are on disk."""

    def __new__(cls, url: str, hook):
        from elastic_gpt.torch_internals import FsspecWriter

        class Writer(FsspecWriter):
            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                fut.wait()
                hook()
                return fut
        return Writer(url, sync_files=True)


def _checkpointer(rank: int, model, opt, state: dict, hook_for=lambda url: lambda: None):
    """An AsyncCheckpointer that saves at every step, committing `state` as its trainer state,
    whose shard writes run `hook_for(url)` once the bytes are on disk."""
    from elastic_gpt.checkpoint.checkpointer import AsyncCheckpointer
    return AsyncCheckpointer(CheckpointStore(os.environ["CKPT"]), every_steps=1, keep=3, rank=rank,
                             model=model, optimizer=opt, trainer_state=lambda: state,
                             writer_factory=lambda url: _HookedWriter(url, hook_for(url)))


def _snapshot_job(rank: int, world: int) -> None:
    import threading

    model, opt = _toy_state()
    _step(model, opt, seed=1)
    expected = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    release = threading.Event()
    ckpt = _checkpointer(rank, model, opt, {"step": 1}, hook_for=lambda url: release.wait)
    assert ckpt.save(1)
    assert ckpt.in_flight
    for seed in (2, 3):  # the live weights move on while the write is held open
        _step(model, opt, seed=seed)
    release.set()
    ckpt.finish()
    if rank == 0:
        torch.save(expected, os.environ["OUT"])


def _any_rank(flag: bool) -> bool:
    import torch.distributed as dist
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _fail_job(rank: int, world: int) -> None:
    from elastic_gpt.checkpoint.checkpointer import CheckpointWriteError
    model, opt = _toy_state()

    def disk_full():
        raise OSError(errno.ENOSPC, "No space left on device (injected on rank 1)")
    hook = disk_full if rank == 1 else (lambda: None)
    state = {"step": 1}
    ckpt = _checkpointer(rank, model, opt, state, hook_for=lambda url: (
        hook if url.endswith(step_dirname(2)) else (lambda: None)))
    ckpt.save(1)
    ckpt.wait()
    _step(model, opt, seed=1)
    state["step"] = 2
    ckpt.save(2)
    # Training goes on while the write is in flight; the next step boundary after the failure
    # raises. The ranks agree each step on whether to go on (the trainer's steps are in lock
    # step): a rank leaving alone would take the other's next collective down with it.
    while _any_rank(ckpt.in_flight):
        _step(model, opt, seed=2)
    try:
        ckpt.poll()
    except CheckpointWriteError as e:
        assert "step 2" in str(e) and "uncommitted" in str(e), e
        print(f"rank {rank} raised: {e}", flush=True)
    else:
        raise AssertionError("a failed background write did not raise at poll()")


def _kill_job(rank: int, world: int) -> None:
    model, opt = _toy_state()
    flag = os.path.join(os.environ["OUT"], f"inflight-{rank}")

    def hold():  # the shard of step 2 is on disk, the save is not finished: signal, then hang
        open(flag, "w").close()
        time.sleep(600)
    state = {"step": 1}
    ckpt = _checkpointer(rank, model, opt, state, hook_for=lambda url: (
        hold if url.endswith(step_dirname(2)) else (lambda: None)))
    ckpt.save(1)
    ckpt.wait()
    _step(model, opt, seed=1)
    state["step"] = 2
    ckpt.save(2)
    while True:  # training continues until the test kills us
        _step(model, opt, seed=2)


# ---- test side -----------------------------------------------------------------------------------

def _start(mode: str, ckpt: str, world: int = 2, **env) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        e = {**os.environ, "MODE": mode, "RANK": str(rank), "WORLD_SIZE": str(world),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CKPT": ckpt,
             "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
             **{k: str(v) for k, v in env.items()}}
        procs.append(subprocess.Popen(
            [sys.executable, "-c",
             "from tests.integration.test_async_checkpoint import _rank_main; _rank_main()"],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _run(mode: str, ckpt: str, timeout: float = 120, **env) -> list[str]:
    procs = _start(mode, ckpt, **env)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"rank exited {p.returncode}:\n{out[-3000:]}"
    return outs


def _full_state(url: str) -> dict:
    """Every tensor of a committed DCP step (model and optimizer), loaded without ranks."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(url.removeprefix("file://"), f"{d}/full.pt")
        return torch.load(f"{d}/full.pt", weights_only=True)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _assert_bit_identical(a: dict, b: dict) -> None:
    a, b = _flatten(a), _flatten(b)
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} differs"
        else:
            assert a[k] == b[k], k


def test_async_resume_equals_uninterrupted_sync_run_bit_for_bit(stdlib_dataset, tmp_path):
    sync_root, async_root = str(tmp_path / "sync"), str(tmp_path / "async")
    _run("trainer", sync_root, DATA=stdlib_dataset, OVERRIDES="checkpoint.async_save=false")
    # Async run stopped after step 4 (its last async save committed by finish()), then resumed.
    _run("trainer", async_root, DATA=stdlib_dataset,
         OVERRIDES="checkpoint.async_save=true run.stop_at_step=4")
    a = CheckpointStore(async_root)
    assert a.latest().step == 4 and sorted(a.step_dirs()) == [2, 4]
    _run("trainer", async_root, DATA=stdlib_dataset, OVERRIDES="checkpoint.async_save=true")
    s = CheckpointStore(sync_root)
    assert sorted(a.step_dirs()) == sorted(s.step_dirs()) == [2, 4, 6]
    for step in (2, 4, 6):
        assert a.verify(step) is None
        _assert_bit_identical(_full_state(a.url(step_dirname(step))),
                              _full_state(s.url(step_dirname(step))))
        assert a.read_state(step)["samples_seen"] == s.read_state(step)["samples_seen"] == step * 8


def test_staged_copy_is_a_snapshot_while_training_continues(tmp_path):
    out = tmp_path / "expected.pt"
    _run("snapshot", str(tmp_path / "ckpt"), OUT=out)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.latest().step == 1
    saved = _full_state(store.url(step_dirname(1)))["model"]
    expected = torch.load(out, weights_only=True)
    assert saved.keys() == expected.keys()
    for name in expected:
        assert torch.equal(saved[name], expected[name]), f"{name}: later steps leaked into the save"


def test_failed_background_write_raises_at_next_step_and_stays_invisible(tmp_path):
    outs = _run("fail", str(tmp_path / "ckpt"))
    for rank, out in enumerate(outs):
        assert f"rank {rank} raised" in out, out[-2000:]
    assert "No space left on device" in outs[1]
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.latest().step == 1
    assert store.verify(2) == "not committed"


def test_sigkill_during_async_write_keeps_previous_commit_newest(tmp_path):
    ckpt, flags = str(tmp_path / "ckpt"), tmp_path / "flags"
    flags.mkdir()
    procs = _start("kill", ckpt, OUT=flags)
    try:
        deadline = time.time() + 90
        while len(list(flags.iterdir())) < 2:  # both ranks' step-2 shards written, save unfinished
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[0][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.1)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    store = CheckpointStore(ckpt)
    assert sorted(store.step_dirs()) == [1, 2]
    assert any(n.endswith(".distcp") for n in os.listdir(f"{ckpt}/{step_dirname(2)}"))  # torn
    assert store.verify(2) == "not committed"
    latest = store.latest()
    assert latest.step == 1 and latest.state == {"step": 1}
    assert _full_state(latest.url)["model"]  # the previous commit is intact and loadable
    assert store.remove_uncommitted() == [2] and sorted(store.step_dirs()) == [1]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])

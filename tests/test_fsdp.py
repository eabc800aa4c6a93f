"""FSDP2 data parallelism (C1) with real gloo process groups: the loss and the full gradient of a
step are the same at W=1, 2 and 4 (4 divides the 6 micro-batches unevenly: 2, 2, 1, 1 with a
zero-weight repeat), and accumulating 6 micro-batches equals one batch of 12, with every
reshard_after_forward / grad_sync choice."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from elastic_gpt.config import load_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    import torch.distributed as dist

    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_config("jobs/configs/mini.yaml", overrides)
        trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
        stream = open_step_stream(cfg.data.path, plan=trainer.plan, rank=rank, world_size=world,
                                  start_step=0, seed=cfg.data.seed)
        batch = next(stream)
        stream.close()
        loss_sum = trainer.forward_backward(batch)
        dist.all_reduce(loss_sum)
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in trainer.model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss_sum / (12 * trainer.gpt_cfg.seq_len), "grads": grads}, out)
    finally:
        dist.destroy_process_group()


def run(world: int, micro_batch: int, data: str, tmp_path, extra: tuple[str, ...] = ()) -> dict:
    out = str(tmp_path / f"w{world}-m{micro_batch}.pt")
    overrides = ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=12",
                 f"train.micro_batch_size={micro_batch}", f"scaling.max_workers={world}",
                 "scaling.min_workers=1", "checkpoint.path=" + str(tmp_path / "unused"), *extra]
    mp.start_processes(_worker, args=(world, _free_port(), overrides, out), nprocs=world,
                       start_method="spawn")
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def single(stdlib_dataset, tmp_path_factory):
    return run(1, 2, stdlib_dataset, tmp_path_factory.mktemp("w1"))


# auto resolves to never for this model (the gathered weights keep across micro-batches); always is
# ZeRO-3's re-gather in backward; microbatch reduce-scatters after every micro-batch.
@pytest.mark.parametrize("world,extra", [
    (2, ()),
    pytest.param(4, (), marks=pytest.mark.slow),  # 4 processes oversubscribe a small machine
    (2, ("train.reshard_after_forward=always",)),
    pytest.param(4, ("train.reshard_after_forward=always", "train.grad_sync=microbatch"),
                 marks=pytest.mark.slow),
    (2, ("train.reshard_after_forward=never", "train.grad_sync=microbatch")),
])
def test_data_parallel_step_equals_single_process(single, world, extra, stdlib_dataset, tmp_path):
    got = run(world, 2, stdlib_dataset, tmp_path, extra)
    torch.testing.assert_close(got["loss"], single["loss"], rtol=1e-6, atol=1e-6)
    assert got["grads"].keys() == single["grads"].keys()
    for name, g in single["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_accumulation_equals_one_large_batch(single, stdlib_dataset, tmp_path):
    big = run(1, 12, stdlib_dataset, tmp_path)  # one micro-batch of all 12 sequences
    torch.testing.assert_close(big["loss"], single["loss"], rtol=1e-6, atol=1e-6)
    for name, g in single["grads"].items():
        torch.testing.assert_close(big["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)


def _agree_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from elastic_gpt.parallel.fsdp import agree_on_resharding
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mixed = agree_on_resharding(rank == 1, torch.device("cpu"))  # only rank 1 lacks memory
        neither = agree_on_resharding(False, torch.device("cpu"))
        torch.save({"mixed": mixed, "neither": neither}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_agree_to_reshard_when_any_one_needs_to(tmp_path):
    out = str(tmp_path / "agree")
    mp.start_processes(_agree_worker, args=(_free_port(), out), nprocs=2, start_method="spawn")
    for rank in range(2):
        assert torch.load(f"{out}.{rank}") == {"mixed": True, "neither": False}

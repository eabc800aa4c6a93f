"""FSDP2 data parallelism (C1 fixed global batch) with real gloo process groups: the loss and the
full gradient of a step are the same at W=1, 2 and 4 (4 divides the 6 micro-batches unevenly: 2, 2,
1, 1 with a zero-weight repeat), and accumulating 6 micro-batches equals one batch of 12, with every
reshard_after_forward / grad_sync choice. The ranks run under elastic_gpt.testing.gloo.run_gloo,
which must fail the test when any rank fails."""

from __future__ import annotations

import os

import pytest
import torch

from elastic_gpt.config import load_config
from elastic_gpt.testing.gloo import run_gloo


def _worker(rank: int, world: int, overrides: list[str]) -> dict | None:
    import torch.distributed as dist

    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config("jobs/configs/mini.yaml", overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None)
    stream = open_step_stream(cfg.data.path, batch_split=trainer.batch_split, rank=rank, world_size=world,
                              start_step=0, seed=cfg.data.seed)
    batch = next(stream)
    stream.close()
    loss_sum = trainer.forward_backward(batch)
    dist.all_reduce(loss_sum)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in trainer.model.named_parameters()}
    if rank == 0:
        return {"loss": loss_sum / (12 * trainer.gpt_cfg.seq_len), "grads": grads}
    return None


def run(world: int, micro_batch: int, data: str, tmp_path, extra: tuple[str, ...] = ()) -> dict:
    overrides = ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=12",
                 f"train.micro_batch_size={micro_batch}", f"scaling.max_workers={world}",
                 "scaling.min_workers=1", "checkpoint.path=" + str(tmp_path / "unused"), *extra]
    return run_gloo(_worker, world, overrides)[0]


@pytest.fixture(scope="module")
def single(stdlib_dataset, tmp_path_factory):
    return run(1, 2, stdlib_dataset, tmp_path_factory.mktemp("w1"))


# auto resolves to never for this model (the gathered weights keep across micro-batches); always is
# ZeRO-3's re-gather in backward; microbatch reduce-scatters after every micro-batch.
@pytest.mark.parametrize("world,extra", [
    (2, ()),
    pytest.param(4, ()),  # 4 processes oversubscribe a small machine
    pytest.param(2, ("train.reshard_after_forward=always",)),
    pytest.param(4, ("train.reshard_after_forward=always", "train.grad_sync=microbatch")),
    pytest.param(2, ("train.reshard_after_forward=never", "train.grad_sync=microbatch")),
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


def _device_bytes_worker(rank: int, world: int) -> dict:
    from elastic_gpt.parallel.fsdp import device_memory_bytes, group_device_bytes
    # As on nodes of different sizes: rank 1 shares its host with 3 other workers.
    os.environ["LOCAL_WORLD_SIZE"] = "4" if rank == 1 else "1"
    return {"own": device_memory_bytes(torch.device("cpu")),
            "group": group_device_bytes(torch.device("cpu"))}


def test_ranks_resolve_memory_settings_from_the_smallest_device_of_the_group():
    got = run_gloo(_device_bytes_worker, 2)
    assert got[1]["own"] < got[0]["own"]
    assert [g["group"] for g in got] == [got[1]["own"]] * 2


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gave up")


def test_a_failing_rank_fails_the_run():
    with pytest.raises(Exception, match="rank 1 gave up"):
        run_gloo(_fails_on_rank_1, 2)

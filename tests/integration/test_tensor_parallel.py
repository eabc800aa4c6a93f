"""Tensor parallelism and HSDP with real gloo process groups (C1 fixed global batch, C2 data order,
C3 bit-identical resume over the data-parallel rank and degree):

- a step's loss, every parameter's full gradient and the clipped norm are the same at tp=2
  (W=2), dp=2 x tp=2 (W=4) and HSDP 2 x 2 (two "nodes" named by rank_nodes) as at W=1;
- a run checkpointed at (dp=2, tp=1), resumed at (dp=1, tp=2) and back at (dp=2, tp=1) sees the
  same samples at every step and the losses of an uninterrupted run (DCP reshards c_attn's
  per-head boxes and everything else);
- export-hf of the tensor-parallel checkpoint gives the logits the tensor-parallel model gave.
"""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.config import load_config
from elastic_gpt.testing.gloo import run_gloo


def _step_worker(rank: int, world: int, overrides: list[str], nodes: list[str] | None) -> dict:
    import torch.distributed as dist

    from elastic_gpt.data.stream import open_step_stream
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config("jobs/configs/mini.yaml", overrides)
    trainer = Trainer(cfg, rank=rank, world_size=world, mlflow_run_id=None, rank_nodes=nodes)
    stream = open_step_stream(cfg.data.path, batch_split=trainer.batch_split, rank=trainer.dp_rank,
                              world_size=trainer.dp_degree, start_step=0, seed=cfg.data.seed)
    batch = next(stream)
    stream.close()
    loss_sum = trainer.forward_backward(batch)
    if trainer.tp_rank:  # the ranks of a tensor-parallel group hold the same loss
        loss_sum.zero_()
    dist.all_reduce(loss_sum)
    # (Names as in the state dict: activation checkpointing's and compile's wrappers add a level.)
    grads = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""):
             p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    norm = trainer.clip_gradients()
    return {"loss": loss_sum / (12 * trainer.gpt_cfg.seq_len), "grads": grads, "norm": norm,
            "setup": trainer.setup_line()}


def step(world: int, data: str, tmp_path, tp: int = 1, nodes: str | None = None,
         extra: tuple[str, ...] = ()) -> dict:
    overrides = ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=12",
                 "train.micro_batch_size=2", f"scaling.max_workers={world}",
                 f"scaling.min_workers={tp}", f"parallel.tp={tp}",
                 "checkpoint.path=" + str(tmp_path / "unused"), *extra]
    return run_gloo(_step_worker, world, overrides, nodes.split(",") if nodes else None)[0]


@pytest.fixture(scope="module")
def single(stdlib_dataset, tmp_path_factory):
    return step(1, stdlib_dataset, tmp_path_factory.mktemp("w1"))


# The last cases recompute each block (activation checkpointing: the recompute runs the
# tensor-parallel collectives again), re-gather in backward and reduce-scatter per micro-batch,
# and compile each tensor-parallel block (fullgraph, DTensor traced).
@pytest.mark.parametrize("world,tp,nodes,layout,extra", [
    (2, 2, None, "dp 1 x tp 2", ()),
    pytest.param(4, 2, None, "dp 2 x tp 2", ()),
    pytest.param(4, 1, "a,a,b,b", "dp 4 (HSDP 2 x 2) x tp 1", ()),
    pytest.param(4, 2, "a,a,b,b", "dp 2 (HSDP 2 x 1) x tp 2", ()),
    pytest.param(2, 2, None, "dp 1 x tp 2", ("train.activation_checkpointing=true",
                                            "train.reshard_after_forward=always",
                                            "train.grad_sync=microbatch")),
    pytest.param(2, 2, None, "dp 1 x tp 2", ("train.compile=true",)),
])
def test_parallel_step_equals_single_process(single, world, tp, nodes, layout, extra,
                                             stdlib_dataset, tmp_path):
    got = step(world, stdlib_dataset, tmp_path, tp, nodes, extra)
    assert f"{world} worker(s)" in got["setup"] and layout in got["setup"]
    torch.testing.assert_close(got["loss"], single["loss"], rtol=1e-6, atol=1e-6)
    assert got["grads"].keys() == single["grads"].keys()
    for name, g in single["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(got["norm"], single["norm"], rtol=1e-5, atol=1e-7)


def _block_comms_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from elastic_gpt.model.config import GPTConfig
    from elastic_gpt.model.gpt import GPT
    from elastic_gpt.parallel.tensor import apply_tensor_parallel

    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, seq_len=16, vocab_size=128))
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    x = torch.randn(2, 16 // world, 32, requires_grad=True)  # this rank's sequence positions
    with CommDebugMode() as forward:
        y = model.h[0](x)
    with CommDebugMode() as backward:
        y.sum().backward()
    return {name: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
            for name, mode in (("forward", forward), ("backward", backward))}


def test_a_block_communicates_as_megatron_sequence_parallelism():
    """Per block and direction: the attention's and the MLP's input all-gathered over the
    sequence and their outputs reduce-scattered back, and nothing else (no all-reduce)."""
    want = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert run_gloo(_block_comms_worker, 2)[0] == {"forward": want, "backward": want}


# ---- resharding across (dp, tp) through checkpoints --------------------------------------------

STEPS = 6


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from elastic_gpt.testing.step_recorder import train_recorded

    trainer, recorder = train_recorded(overrides, rank, world)
    x = torch.arange(2 * 64).reshape(2, 64) % trainer.gpt_cfg.vocab_size
    with torch.no_grad():
        logits = trainer.model(x)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"seen": recorder.seen, "logits": logits, "setup": trainer.setup_line()}


def train(data: str, ckpt, tp: int, stop_at: int) -> dict:
    overrides = ["model.preset=tiny", f"data.path={data}", "train.global_batch_size=8",
                 "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.warmup_steps=2",
                 "train.lr=3e-3", "train.log_every=100", "checkpoint.every_steps=2",
                 "checkpoint.keep=5", f"checkpoint.path={ckpt}", "scaling.min_workers=2",
                 "scaling.max_workers=2", f"parallel.tp={tp}", f"run.stop_at_step={stop_at}"]
    return run_gloo(_train_worker, 2, overrides)[0]


def test_checkpoints_reshard_between_data_and_tensor_parallel(stdlib_dataset, tmp_path):
    from transformers import GPT2LMHeadModel

    from elastic_gpt.inference.hf_export import export_hf

    whole = train(stdlib_dataset, tmp_path / "whole", tp=1, stop_at=STEPS)["seen"]
    ckpt = tmp_path / "resharded"
    seen = train(stdlib_dataset, ckpt, tp=1, stop_at=2)["seen"]  # (dp 2, tp 1)
    tp_session = train(stdlib_dataset, ckpt, tp=2, stop_at=4)  # (dp 1, tp 2) from its step 2
    assert "dp 1 x tp 2" in tp_session["setup"]
    seen.update(tp_session["seen"])
    seen.update(train(stdlib_dataset, ckpt, tp=1, stop_at=STEPS)["seen"])  # back, from step 4
    assert sorted(seen) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert seen[s][1] == whole[s][1], f"step {s} trained on other samples (C2 data order)"
        assert seen[s][0] == pytest.approx(whole[s][0], abs=2e-3), f"step {s}"

    # The tensor-parallel session's last checkpoint holds GPT-2's layout: Hugging Face's model
    # made from it computes the logits the tensor-parallel model did.
    export_hf(str(ckpt / "step_00000004"), str(tmp_path / "hf"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.arange(2 * 64).reshape(2, 64) % hf.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, tp_session["logits"], rtol=1e-4, atol=1e-4)

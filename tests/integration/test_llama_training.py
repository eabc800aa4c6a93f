"""The Llama family through the whole trainer on real gloo ranks:

- one step's loss, every full gradient and the clipped norm under FSDP (dp=2), tensor
  parallelism with separate q/k/v column splits (tp=2 over 4 query and 2 key/value heads),
  dp=2 x tp=2, pipelines (1F1B; interleaved, two stages per rank; a tied output layer across the
  first and last stage) and activation checkpointing (full, selective) are the one-process
  step's (C1 fixed global batch);
- a compiled tensor-parallel block (fullgraph, DTensor traced) right behind the vocab-parallel
  embedding gives the embedding the one-process gradient;
- float8 converts every block linear and leaves the output layer in the compute dtype;
- a run resized through checkpoints, (dp 2) -> (tp 2) -> (pp 2) -> one worker, trains every step
  on the uninterrupted run's samples (C2 data order: the same fingerprints) with its losses, and
  the resized run's checkpoint exports to LlamaForCausalLM with the logits the trainer computed
  and generates text.
"""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.testing.gloo import run_gloo
from tests.trainer_steps import one_trainer_step

LLAMA = ["model.preset=llama3-tiny", "model.n_layer=4", "model.n_embd=32"]


def step(world: int, data: str, tmp_path, extra: tuple[str, ...] = ()) -> list[dict]:
    overrides = [*LLAMA, f"data.path={data}", "train.global_batch_size=12",
                 "train.micro_batch_size=2", f"scaling.max_workers={world}",
                 f"scaling.min_workers={world}", "eval.samples=0",
                 "checkpoint.path=" + str(tmp_path / "unused"), *extra]
    return run_gloo(one_trainer_step, world, overrides)


@pytest.fixture(scope="module")
def single(stdlib_dataset, tmp_path_factory):
    return {tied: step(1, stdlib_dataset, tmp_path_factory.mktemp("w1"),
                       (f"model.tie_embeddings={tied}",))[0] for tied in ("false", "true")}


@pytest.mark.parametrize("world,layout,extra", [
    (2, "dp 2", ()),
    (2, "dp 1 x tp 2", ("parallel.tp=2",)),
    (4, "dp 2 x tp 2", ("parallel.tp=2",)),
    (2, "pp 2", ("parallel.pp=2",)),
    (2, "pp 2", ("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                 "parallel.pp_stages_per_rank=2")),
    (2, "pp 2", ("parallel.pp=2", "model.tie_embeddings=true")),
    (2, "dp 1 x tp 2", ("parallel.tp=2", "train.activation_checkpointing=true",
                        "train.activation_checkpointing_mode=selective")),
    (2, "dp 2", ("train.activation_checkpointing=true", "train.reshard_after_forward=always",
                 "train.grad_sync=microbatch")),
], ids=["fsdp", "tp2", "dp2xtp2", "pp2-1f1b", "pp2-interleaved", "pp2-tied", "tp2-selective-ac",
        "fsdp-full-ac"])
def test_a_parallel_llama_step_is_the_one_process_step(single, world, layout, extra,
                                                       stdlib_dataset, tmp_path):
    tied = "model.tie_embeddings=true" in extra
    ref = single["true" if tied else "false"]
    ranks = step(world, stdlib_dataset, tmp_path, extra)
    assert all(r["family"] == "llama" for r in ranks)
    assert any(layout in r["setup"] for r in ranks), ranks[0]["setup"]
    held = set().union(*(r["grads"] for r in ranks))
    assert held == set(ref["grads"])
    assert ("lm_head.weight" in held) != tied  # untied: the output layer is a weight of its own
    for r in ranks:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)


def _compiled_block_worker(rank: int, world: int) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.model.config import LlamaConfig
    from elastic_gpt.model.llama import Llama
    from elastic_gpt.parallel.tensor import apply_tensor_parallel

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, seq_len=8,
                              vocab_size=64))
    idx = torch.randint(0, 64, (2, 8))
    weights = torch.randn(2, 8, 32)  # a loss that reads every hidden unit of every position
    ref = copy.deepcopy(model)
    hidden = ref.h[0](ref.embed(idx))
    (hidden * weights).sum().backward()

    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    # The graph capture (dynamo, then AOT autograd) is what drops the gradient of its
    # input; inductor's code generation changes nothing here and costs ~15 s on a CPU.
    model.h[0] = torch.compile(model.h[0], fullgraph=True, backend="aot_eager")
    hidden = model.h[0](model.embed(idx))  # this rank's share of the sequence
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    (hidden * weights[:, rows]).sum().backward()
    return {"wte": model.wte.weight.grad.full_tensor(), "ref": ref.wte.weight.grad}


def test_a_compiled_tensor_parallel_block_passes_the_embedding_its_gradient():
    """Llama's first block reads the vocab-parallel embedding's reduce-scattered output with
    nothing between them (GPT-2 adds its positions first); compiled, it must still send the
    gradient back through that collective, or the embedding never learns."""
    for r in run_gloo(_compiled_block_worker, 2):
        assert r["wte"].abs().sum() > 0
        torch.testing.assert_close(r["wte"], r["ref"], rtol=1e-5, atol=1e-6)


def test_float8_converts_the_block_linears_and_keeps_the_output_layer():
    pytest.importorskip("torchao")
    from elastic_gpt.model.config import LlamaConfig
    from elastic_gpt.model.llama import Llama
    from elastic_gpt.parallel.fsdp import apply_float8

    model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, seq_len=16,
                              vocab_size=128))
    assert apply_float8(model) == 2 * 7  # q, k, v, o, gate, up, down in each block
    assert type(model.lm_head) is torch.nn.Linear


# ---- elastic resize through checkpoints ---------------------------------------------------------

STEPS = 8


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from elastic_gpt.testing.step_recorder import train_recorded

    trainer, recorder = train_recorded(overrides, rank, world)
    x = torch.arange(2 * 64).reshape(2, 64) % trainer.gpt_cfg.vocab_size
    logits = None
    if trainer.pipeline is None:
        with torch.no_grad():
            logits = trainer.model(x)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"seen": recorder.seen, "logits": logits, "setup": trainer.setup_line()}


def train(data: str, ckpt, stop_at: int, world: int = 2, extra: tuple[str, ...] = ()) -> dict:
    overrides = [*LLAMA, f"data.path={data}", "train.global_batch_size=8",
                 "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.warmup_steps=2",
                 "train.lr=3e-3", "train.log_every=100", "checkpoint.every_steps=2",
                 "checkpoint.keep=5", f"checkpoint.path={ckpt}", f"scaling.min_workers={world}",
                 f"scaling.max_workers={world}", f"run.stop_at_step={stop_at}", "eval.samples=0",
                 *extra]
    ranks = run_gloo(_train_worker, world, overrides)
    seen = {}
    for r in ranks:
        seen.update(r["seen"])
    return {**ranks[0], "seen": seen}


def test_a_resized_llama_run_keeps_the_data_order_and_the_losses(stdlib_dataset, tmp_path):
    from transformers import LlamaForCausalLM

    from elastic_gpt.inference.generate import sample_text
    from elastic_gpt.inference.hf_export import export_hf

    whole = train(stdlib_dataset, tmp_path / "whole", stop_at=STEPS)["seen"]
    ckpt = tmp_path / "resized"
    seen = train(stdlib_dataset, ckpt, stop_at=2)["seen"]  # dp 2
    tp_session = train(stdlib_dataset, ckpt, stop_at=4, extra=("parallel.tp=2",))
    assert "dp 1 x tp 2" in tp_session["setup"]
    seen.update(tp_session["seen"])
    pp_session = train(stdlib_dataset, ckpt, stop_at=6, extra=("parallel.pp=2",))
    assert "pp 2" in pp_session["setup"]
    seen.update(pp_session["seen"])
    seen.update(train(stdlib_dataset, ckpt, stop_at=STEPS, world=1)["seen"])  # one worker
    assert sorted(seen) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert seen[s][1] == whole[s][1], f"step {s} trained on other samples (C2 data order)"
        assert seen[s][0] == pytest.approx(whole[s][0], abs=2e-3), f"step {s}"

    # The tensor-parallel session's checkpoint exports to transformers' Llama, which computes
    # the logits the tensor-parallel model did; the last one generates.
    export_hf(str(ckpt / "step_00000004"), str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.arange(2 * 64).reshape(2, 64) % hf.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, tp_session["logits"], rtol=1e-4, atol=1e-4)
    text = sample_text(str(ckpt), "def ", max_new_tokens=8, temperature=0)
    assert text.startswith("def ") and len(text) > len("def ")


# ---- evaluation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world,extra", [
    (2, ("parallel.tp=2", "scaling.min_workers=2")),  # vocab-parallel loss on the untied head
    (2, ("parallel.pp=2", "scaling.min_workers=2")),  # through the stages
])
def test_llama_evaluation_is_the_same_at_any_layout(world, extra, dataset_with_val, tmp_path):
    from tests.integration.test_eval import _eval_worker, _overrides

    llama = ("model.preset=llama3-tiny", *extra)
    single = run_gloo(_eval_worker, 1, _overrides(dataset_with_val, 1, str(tmp_path / "w1"),
                                                  ("model.preset=llama3-tiny",)))[0]
    got = run_gloo(_eval_worker, world, _overrides(dataset_with_val, world, str(tmp_path),
                                                   llama))
    losses = [r["loss"] for r in got]
    assert all(v == pytest.approx(single["loss"], rel=1e-6) for v in losses)
    assert all(r["bpb"] == pytest.approx(single["bpb"], rel=1e-6) for r in got)
    assert all(r["training"] and r["same_step_after_eval"] for r in got)

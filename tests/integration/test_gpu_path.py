"""The bf16 / FSDP2 path on a gloo group of one (W=1, what a single-GPU run has with nccl):
bf16 compute with fp32 master weights and gradients, the chunked loss, the wrapping order, SDPA
called causally, float8 linears close to bf16 and their checkpoint a plain one, the Trainer's
autocast and setup line, and async tensor parallelism refused where torch cannot run it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from elastic_gpt.config import load_config
from elastic_gpt.model.config import GPTConfig, preset_config
from elastic_gpt.model.gpt import GPT, token_losses
from elastic_gpt.parallel.fsdp import (
    init_sharded_weights,
    parallelize,
)
from elastic_gpt.testing.gloo import gloo_group
from elastic_gpt.torch_internals import CheckpointWrapper

SMALL = GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=16, vocab_size=64)


@pytest.fixture(scope="module")
def world1():
    """A real gloo process group of one rank (what a single-GPU run has, with nccl)."""
    with gloo_group():
        yield init_device_mesh("cpu", (1,))


def _sharded(cfg: GPTConfig, mesh, dtype, **kw) -> GPT:
    with torch.device("meta"):
        model = GPT(cfg)
    parallelize(model, mesh, compute_dtype=dtype, **kw)
    model.to_empty(device="cpu")
    init_sharded_weights(model, seed=0)
    return model


@pytest.mark.parametrize("reshard", [True, False])
def test_blocks_reshard_after_forward_as_asked_and_the_root_never(world1, reshard):
    model = _sharded(SMALL, world1, torch.float32, reshard_after_forward=reshard)
    model(torch.zeros(1, SMALL.seq_len, dtype=torch.long))  # FSDP settles the root's policy here
    groups = [b._get_fsdp_state()._fsdp_param_group for b in model.h]
    # The last block's weights are the first backward needs: never freed in between.
    assert [g.post_forward_mesh_info is not None for g in groups] == [reshard] * 2 + [False]
    assert model._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None


def _float8_step(rank: int, world: int, float8: bool) -> dict:
    """One bf16 training step of a small GPT under FSDP2 (gloo), its linears float8 or not."""
    from elastic_gpt.parallel.fsdp import parallelize

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, seq_len=32, vocab_size=128)
    with torch.device("meta"):
        model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    parallelize(model, mesh, compute_dtype=torch.bfloat16, float8=float8)
    model.to_empty(device="cpu")
    init_sharded_weights(model, seed=0)
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)})
    idx = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        loss = token_losses(model(idx[:, :-1]), idx[:, 1:]).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "kinds": kinds}


def test_float8_linears_train_under_fsdp2_close_to_bf16():
    """train.float8: the blocks' linears become torchao Float8Linear (the tied lm_head stays),
    FSDP2 gathers their weights in float8, and two steps' losses stay within float8's rounding
    of the bf16 run's (torch runs float8 matmuls on CPU too)."""
    from elastic_gpt.testing.gloo import run_gloo

    bf16, f8 = run_gloo(_float8_step, 2, False)[0], run_gloo(_float8_step, 2, True)[0]
    assert "Float8Linear" in f8["kinds"] and "Float8Linear" not in bf16["kinds"]
    assert "TiedLMHead" in f8["kinds"]  # the output layer keeps the embedding's weight
    for a, b in zip(bf16["losses"], f8["losses"]):
        assert math.isfinite(b) and abs(a - b) < 0.05 * a, (bf16["losses"], f8["losses"])
    assert f8["losses"][1] < f8["losses"][0]  # it learns


def _float8_checkpoint(rank: int, world: int, url: str) -> dict:
    """A float8 model's checkpoint loads into a bf16 one and back: the same names and values."""
    from elastic_gpt.checkpoint.sharded import load_sharded, save_sharded
    from elastic_gpt.parallel.fsdp import parallelize

    def build(float8: bool, seed: int):
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, seq_len=32, vocab_size=128))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        parallelize(model, mesh, compute_dtype=torch.bfloat16, float8=float8)
        model.to_empty(device="cpu")
        init_sharded_weights(model, seed=seed)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def values(model):
        return {k.replace("_checkpoint_wrapped_module.", ""): v.full_tensor().clone()
                for k, v in model.state_dict().items()}

    f8, f8_opt = build(True, seed=0)
    save_sharded(url + "/f8", f8, f8_opt)
    plain, plain_opt = build(False, seed=1)
    load_sharded(url + "/f8", plain, plain_opt)
    save_sharded(url + "/plain", plain, plain_opt)
    back, back_opt = build(True, seed=2)
    load_sharded(url + "/plain", back, back_opt)
    a, b, c = values(f8), values(plain), values(back)
    return {"keys": sorted(a) == sorted(b) == sorted(c),
            "equal": all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)}


def test_a_float8_models_checkpoint_is_a_plain_one(tmp_path):
    """train.float8 changes how the matmuls run, not what a checkpoint holds: its checkpoint
    resumes without float8 (and export-hf reads it), and a plain one resumes with it."""
    from elastic_gpt.testing.gloo import run_gloo

    for got in run_gloo(_float8_checkpoint, 2, str(tmp_path)):
        assert got == {"keys": True, "equal": True}


@pytest.fixture(scope="module")
def trainers(world1, stdlib_dataset, tmp_path_factory):
    """The real Trainer at W=1 in fp32 and in bf16 (the GPU dtype), on the same data."""
    from elastic_gpt.train.trainer import Trainer
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config("jobs/configs/mini.yaml", [
            "model.preset=tiny", f"data.path={stdlib_dataset}", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=2", "train.warmup_steps=1",
            f"train.dtype={dtype}", f"checkpoint.path={tmp_path_factory.mktemp(dtype)}"])
        out[dtype] = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None)
    return out


def test_bf16_compute_fp32_master_weights_and_fp32_gradients(world1):
    model = _sharded(SMALL, world1, torch.bfloat16)
    seen = {}
    model.h[0].attn.c_attn.register_forward_hook(
        lambda m, args, out: seen.update(weight=m.weight.dtype, out=out.dtype))
    x = torch.randint(0, 64, (2, 17))
    logits = model(x[:, :16])
    assert seen == {"weight": torch.bfloat16, "out": torch.bfloat16}  # gathered in bf16
    assert logits.dtype == torch.bfloat16
    token_losses(logits, x[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name  # every parameter is an FSDP2 shard
        assert p.dtype == torch.float32, f"{name}: master weights must stay fp32"
        assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}: grads reduce in fp32"
        assert torch.isfinite(p.grad.to_local()).all(), name


def test_chunked_loss_under_fsdp2_bf16_matches_the_whole_logits_loss(world1, monkeypatch):
    """The trainer's loss (`GPT.forward` with targets) on FSDP2's gathered bf16 weights, under
    autocast: the loss of whole logits, and every fp32-reduced gradient (the tied wte's
    included) within bf16 rounding of theirs; the root's gathered weight is read inside its
    forward, so the loss needs no gather of its own."""
    from elastic_gpt.model import gpt
    monkeypatch.setattr(gpt, "LOSS_CHUNK_LOGITS", 5 * SMALL.vocab_size)  # 7 chunks of 32 tokens
    model = _sharded(SMALL, world1, torch.bfloat16)
    x = torch.randint(0, 64, (2, 17))
    losses, grads = {}, {}
    for chunked in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[:, :16], targets=x[:, 1:]) if chunked else model(x[:, :16])
        losses[chunked] = out if chunked else token_losses(out, x[:, 1:])
        (losses[chunked] / 32).backward()
        grads[chunked] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-6, atol=1e-5)
    assert "wte.weight" in grads[True]
    for name, g in grads[False].items():
        assert grads[True][name].dtype == torch.float32, name
        assert (grads[True][name] - g).norm() / g.norm() < 1.6e-2, name


def test_wrapping_order_ac_and_compile_inside_fully_shard_per_block_root_last(world1):
    with torch.device("meta"):
        model = GPT(SMALL)
    parallelize(model, world1, compute_dtype=torch.bfloat16, activation_checkpointing=True,
                compile=True)
    root_group = model._get_fsdp_state()._fsdp_param_group
    root_params = {id(fp.sharded_param) for fp in root_group.fsdp_params}
    block_param_ids = set()
    last = len(model.h) - 1
    for i, block in enumerate(model.h):
        # fully_shard(compile(checkpoint_wrapper(Block))): one all-gather per block, compiled
        # and recomputed inside it.
        assert isinstance(block, FSDPModule), i
        assert isinstance(block, torch._dynamo.eval_frame.OptimizedModule), i
        assert isinstance(block._orig_mod, CheckpointWrapper), i
        group = block._get_fsdp_state()._fsdp_param_group
        ids = {id(fp.sharded_param) for fp in group.fsdp_params}
        assert ids == {id(p) for p in block.parameters()}, f"block {i} owns exactly its params"
        block_param_ids |= ids
        # Backward starts with the last block: it stays gathered after forward.
        assert (group.post_forward_mesh_info is None) == (i == last), i
    assert isinstance(model, FSDPModule)  # the root, sharded last, holds the rest
    assert root_params == {id(p) for p in model.parameters()} - block_param_ids
    assert {id(model.wte.weight), id(model.wpe.weight), id(model.ln_f.weight)} <= root_params


def test_attention_calls_sdpa_causally_with_no_mask_in_bf16(world1, monkeypatch):
    """Flash attention needs: SDPA, is_causal with no explicit mask, fp16/bf16 q/k/v, head_dim
    a multiple of 8 and <= 256 (true for every GPU preset)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.dtype, q.shape, args, kwargs))
        return real(q, k, v, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = _sharded(SMALL, world1, torch.bfloat16)
    model(torch.randint(0, 64, (2, 16)))
    assert len(calls) == SMALL.n_layer
    for dtype, shape, args, kwargs in calls:
        assert dtype == torch.bfloat16 and shape == (2, SMALL.n_head, 16, SMALL.head_dim)
        assert kwargs.get("is_causal") is True and kwargs.get("attn_mask") is None and not args
    for name in ("gpt2-124m", "gpt2-350m", "gpt3-1.3b"):
        hd = preset_config(name).head_dim
        assert hd % 8 == 0 and hd <= 256, (name, hd)


def test_the_setup_line_says_what_auto_chose(trainers):
    # A 4-layer model is far below 1/8 of this host's memory: auto keeps it gathered.
    assert not trainers["float32"].layout.memory.reshard_after_forward
    line = trainers["bfloat16"].setup_line()
    assert "1 worker(s) on cpu (gloo)" in line and "bfloat16" in line
    assert "reshard_after_forward=never (auto), grad_sync=step" in line


def test_trainer_on_cpu_is_fused_and_autocasts_only_for_bf16(trainers, stdlib_dataset):
    from elastic_gpt.data.stream import open_step_stream
    losses = {}
    for dtype, tr in trainers.items():
        assert tr.optimizer.defaults["fused"]  # fused on CPU too: one kernel, ~30 ms/step less
        autocast = []
        tr.model.h[0].register_forward_pre_hook(lambda m, a, seen=autocast: seen.append(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
        stream = open_step_stream(stdlib_dataset, batch_split=tr.batch_split, rank=0, world_size=1,
                                  start_step=0, seed=tr.cfg.data.seed)
        try:
            result = tr.train_step(next(stream))
        finally:
            stream.close()
        assert all(e == (dtype == "bfloat16") for e, _ in autocast) and autocast
        if dtype == "bfloat16":
            assert all(d == torch.bfloat16 for _, d in autocast)
        assert all(p.dtype == torch.float32 for p in tr.model.parameters())
        state = tr.optimizer.state[next(iter(tr.model.parameters()))]
        assert state["exp_avg"].dtype == torch.float32
        losses[dtype] = result.loss
    assert all(map(torch.isfinite, map(torch.tensor, losses.values())))
    # The same batch and weights: bf16 compute shifts the loss by bf16 rounding only.
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.02 * losses["float32"], losses


def test_async_tp_is_refused_where_torch_cannot_run_it(world1):
    """parallel.async_tp: one clear line without tensor parallelism, without the compiler or off
    CUDA, from `parallelize` before anything is changed (what it switches on:
    tests/unit/test_torch_internals.py)."""
    def model():
        with torch.device("meta"):
            return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=8, vocab_size=64))

    for tp_mesh, compile, says in ((None, True, "needs parallel.tp > 1"),
                                   (world1, False, "set train.compile=true"),
                                   (world1, True, "needs CUDA GPUs")):
        untouched = model()
        with pytest.raises(ValueError, match=says):
            parallelize(untouched, world1, compute_dtype=torch.float32, compile=compile,
                        tp_mesh=tp_mesh, async_tp=True)
        assert not isinstance(untouched.h[0], FSDPModule)
        assert not isinstance(untouched.lm_head.weight, DTensor)

"""Every piece of the bf16 / FSDP2 / NCCL path that can run without a GPU, so `bench/gpu.sh` on a
real GPU is a confirmation, not a first try: dtypes under the mixed-precision policy, wrapping
order, dtype and optimizer choices per device, autocast in the trainer's step, and a bf16 step
through FSDP2 (gloo, W=1) whose loss matches fp32."""

from __future__ import annotations

import logging
import math
import os

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
    device_memory_bytes,
    init_sharded_weights,
    mixed_precision_policy,
    parallelize,
    resolve_dtype,
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


def test_resolve_dtype_picks_bf16_only_on_cuda():
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32


def test_a_worker_counts_on_its_gpu_or_its_share_of_the_host(monkeypatch):
    gib = 1 << 30
    # The GPU's memory: a stand-in for torch.cuda, which this machine lacks (80 GiB, an H100).
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": 80 * gib})())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert device_memory_bytes(torch.device("cuda", 0)) == 80 * gib
    # On CPU the host's memory is shared by the workers of the node.
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert device_memory_bytes(torch.device("cpu")) == host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert device_memory_bytes(torch.device("cpu")) == host // 2


@pytest.mark.parametrize("reshard", [True, False])
def test_blocks_reshard_after_forward_as_asked_and_the_root_never(world1, reshard):
    model = _sharded(SMALL, world1, torch.float32, reshard_after_forward=reshard)
    model(torch.zeros(1, SMALL.seq_len, dtype=torch.long))  # FSDP settles the root's policy here
    groups = [b._get_fsdp_state()._fsdp_param_group for b in model.h]
    # The last block's weights are the first backward needs: never freed in between.
    assert [g.post_forward_mesh_info is not None for g in groups] == [reshard] * 2 + [False]
    assert model._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None


def test_a_gpu_without_bf16_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    for name in ("auto", "bfloat16"):
        with pytest.raises(ValueError) as e:
            resolve_dtype(name, torch.device("cuda", 0))
        assert str(e.value).startswith("Tesla V100-SXM2-16GB (compute capability 7.0) has no "
                                       "bfloat16") and "train.dtype=float32" in str(e.value)
        assert "\n" not in str(e.value)
    assert resolve_dtype("float32", torch.device("cuda", 0)) == torch.float32


def test_mfu_uses_each_variants_own_peak():
    """H100 PCIe and NVL are not the SXM part; GH200, H800 and B200 have no planner row but do
    have a peak (NVIDIA datasheets, dense = half the 'with sparsity' figure)."""
    from elastic_gpt.hardware import GPUS
    from elastic_gpt.train.throughput import gpu_peak_flops

    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL") == 835e12
    assert gpu_peak_flops("NVIDIA H200 NVL") == 835e12
    assert gpu_peak_flops("NVIDIA H200") == GPUS["H200"].peak_flops == 989e12
    assert gpu_peak_flops("NVIDIA GH200 480GB") == 989e12
    assert gpu_peak_flops("NVIDIA H800") == 989e12
    assert gpu_peak_flops("NVIDIA B200") == 2250e12


def test_mfu_divides_by_the_planners_gpu_table_and_an_unknown_gpu_gets_nan(caplog):
    from elastic_gpt.hardware import GPUS
    from elastic_gpt.train.throughput import gpu_peak_flops

    # Names as torch.cuda.get_device_name reports them on each chip.
    assert gpu_peak_flops("NVIDIA A10G") == GPUS["A10G"].peak_flops == 70e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == GPUS["A100-80GB"].peak_flops
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == GPUS["H100"].peak_flops
    assert gpu_peak_flops("NVIDIA L40S") == GPUS["L40S"].peak_flops != GPUS["L4"].peak_flops
    assert gpu_peak_flops("NVIDIA L4") == GPUS["L4"].peak_flops
    # An A10 is not an A10G (125 vs 70 TFLOP/s): no row, so no figure rather than a wrong one.
    with caplog.at_level(logging.WARNING, logger="elastic_gpt.train.throughput"):
        assert all(math.isnan(gpu_peak_flops("NVIDIA A10")) for _ in range(3))
    warned = [r.getMessage() for r in caplog.records if "'NVIDIA A10'" in r.getMessage()]
    assert len(warned) == 1, warned  # once per process, not once per Trainer
    assert "MFU is logged as NaN" in warned[0] and "elastic_gpt/hardware.py" in warned[0]


def test_mixed_precision_policy_computes_in_bf16_and_reduces_in_fp32():
    mp = mixed_precision_policy(torch.bfloat16)
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert mixed_precision_policy(torch.float32).reduce_dtype == torch.float32


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


def test_gpu_run_uses_nccl_and_one_gpu_per_worker():
    from elastic_gpt.elastic.launcher import build_trainer_factory
    cfg = load_config("jobs/configs/mini.yaml", ["data.path=unused", "scaling.use_gpu=true"])
    trainer = build_trainer_factory(cfg)(None)
    assert trainer.backend_config.backend == "nccl"
    assert trainer.scaling_config.use_gpu and trainer.scaling_config.resources_per_worker["GPU"] == 1
    cfg = load_config("jobs/configs/mini.yaml", ["data.path=unused", "scaling.use_gpu=false"])
    assert build_trainer_factory(cfg)(None).backend_config.backend == "gloo"


def test_workers_get_the_fabric_nccl_and_allocator_settings_and_no_credentials(monkeypatch):
    """The driver's NCCL_*, FI_* (EFA), TORCH_NCCL_* and allocator settings reach every worker
    of a GPU job, over defaults a large run needs (expandable segments, the NCCL flight recorder
    dumped on a collective timeout); credentials never do."""
    from elastic_gpt.elastic.launcher import build_trainer_factory
    from elastic_gpt.elastic.worker_group_job import worker_env

    for key in list(os.environ):
        if key.startswith(("NCCL_", "FI_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF")):
            monkeypatch.delenv(key)
    defaults = worker_env()
    assert defaults["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert int(defaults["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert defaults["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("FI_EFA_USE_DEVICE_RDMA", "1")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "4000")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-workers")
    cfg = load_config("jobs/configs/mini.yaml", ["data.path=unused", "scaling.use_gpu=true"])
    env = build_trainer_factory(cfg)(None).run_config.worker_runtime_env["env_vars"]
    assert env["NCCL_DEBUG"] == "INFO" and env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "4000"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"  # the driver's wins
    assert "AWS_SECRET_ACCESS_KEY" not in env and "PYTHONPATH" in env


def test_a_worker_trains_on_the_device_it_was_assigned(monkeypatch):
    """Under Ray Train the device is Ray's assignment, not LOCAL_RANK's guess."""
    from elastic_gpt.train.device import worker_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert worker_device(torch.device("cpu")) == torch.device("cpu")
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    assert worker_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert set_to == [torch.device("cuda", 1)]


def test_fused_adamw_runs_and_matches_the_unfused_step():
    """The GPU path asks for fused AdamW; torch has a fused CPU kernel too, so check it here."""
    from elastic_gpt.train.optimizer import build_optimizer
    cfg = load_config("jobs/configs/mini.yaml", ["data.path=unused"])
    models = [GPT(SMALL), GPT(SMALL)]
    opts = [build_optimizer(models[0], cfg, fused=True), build_optimizer(models[1], cfg, fused=False)]
    assert opts[0].defaults["fused"] is True and not opts[1].defaults["fused"]
    x = torch.randint(0, 64, (2, 17))
    for m, o in zip(models, opts):
        token_losses(m(x[:, :16]), x[:, 1:]).backward()
        o.step()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_batches_for_a_gpu_arrive_pinned(stdlib_dataset):
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    with open_step_stream(stdlib_dataset, batch_split=BatchSplit(4, 2), rank=0, world_size=1,
                          start_step=0, seed=1, pin_memory=True) as stream:
        assert all(t.is_pinned() for t in next(stream).tokens)


def test_batches_for_the_cpu_are_not_pinned(stdlib_dataset):
    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream
    with open_step_stream(stdlib_dataset, batch_split=BatchSplit(4, 2), rank=0, world_size=1,
                          start_step=0, seed=1) as stream:
        assert not any(t.is_pinned() for t in next(stream).tokens)


def test_selective_checkpointing_recomputes_the_cheap_ops_and_keeps_the_matmuls():
    """Per-op selective activation checkpointing (train.activation_checkpointing_mode=selective):
    the same loss and gradients as no checkpointing, with no matmul or attention run again in
    backward, where full checkpointing reruns every one of them."""

    from elastic_gpt.parallel.fsdp import apply_activation_checkpointing
    from elastic_gpt.torch_internals import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    # No dropout, as in pretraining: attention runs as one fused kernel (with dropout, CPU
    # attention decomposes into batched matmuls, which selective checkpointing recomputes).
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64)
    models = {mode: GPT(cfg) for mode in ("none", "full", "selective")}
    for mode in ("full", "selective"):
        models[mode].load_state_dict(models["none"].state_dict())
        apply_activation_checkpointing(models[mode], mode)
    idx = torch.randint(0, 64, (3, 16))
    losses, grads, backward_ops = {}, {}, {}
    for mode, model in models.items():
        loss = token_losses(model(idx[:, :-1]), idx[:, 1:]).mean()
        with Count() as seen:
            loss.backward()
        losses[mode] = loss.item()
        grads[mode] = {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                       for n, p in model.named_parameters()}
        backward_ops[mode] = seen.ops
    for mode in ("full", "selective"):
        assert losses[mode] == losses["none"], mode
        for name, g in grads["none"].items():
            assert torch.allclose(grads[mode][name], g, atol=1e-6), (mode, name)

    def matmuls(ops):
        return sum(op in ("mm", "addmm", "bmm") or "scaled_dot_product" in op for op in ops)

    rerun = {mode: matmuls(backward_ops[mode]) - matmuls(backward_ops["none"])
             for mode in ("full", "selective")}
    assert rerun["full"] > 0 and rerun["selective"] == 0, rerun
    # ...while the elementwise ops (GELU, layer norm) are recomputed.
    assert len(backward_ops["selective"]) > len(backward_ops["none"])


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


def test_float8_with_tensor_parallelism_is_one_clear_line():
    from elastic_gpt.parallel.fsdp import parallelize

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=8, vocab_size=64))
    with pytest.raises(ValueError, match="train.float8 with parallel.tp > 1 is not supported"):
        parallelize(model, None, compute_dtype=torch.bfloat16, float8=True, tp_mesh=object())


def test_async_tp_is_refused_where_torch_cannot_run_it(world1):
    """parallel.async_tp: one clear line without tensor parallelism, without the compiler or off
    CUDA, from `parallelize` before anything is changed (what it switches on:
    tests/test_torch_internals.py)."""
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


def test_the_gpu_benchmark_runs_on_the_cpu_with_cuda_hidden(tmp_path):
    """bench/gpu.sh's measurement script, every code path of it (bf16 and float8, the host-read
    window, the GEMM ceiling, the planner's memory): a GPU minute never goes to a Python error."""
    import json
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, "bench/gpu_mfu.py", "--cpu-dry-run", "--models", "tiny",
                    "--float8-models", "tiny", "--steps", "1", "--warmup", "1", "--no-compile",
                    "--json", str(out)], check=True, timeout=300, capture_output=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": "0"})
    got = json.loads(out.read_text())
    assert [r["float8"] for r in got["results"]] == [False, True]
    assert got["gemm_ceiling_tflops"] > 0 and got["environment"]["device"] == "cpu"
    for r in got["results"]:
        assert r["tokens_per_s"] > 0 and r["host_sync_tokens_per_s"] > 0
        assert r["predicted_mem_gb"] > 0 and math.isfinite(r["last_loss"])
    # One bf16 step profiled into its parts; every part of a GPT step is there.
    profile = got["results"][0]["profile"]
    assert {"gemm", "attention", "loss", "optimizer", "fsdp_copies_and_collectives"} <= set(
        k for k, v in profile["seconds"].items() if v > 0), profile
    assert sum(profile["share"].values()) == pytest.approx(1.0)
    assert 0 < profile["busy_s"] <= profile["wall_s"] * 1.05
    # The tensor-parallel path on a one-rank mesh gives the plain model's losses and norms.
    smoke = got["tp_compile_smoke"]
    assert smoke["equal"] and len(smoke["tp"]["losses"]) == 3, smoke


def test_the_step_profile_names_cuda_kernels_by_part_of_the_step():
    """The GPU's kernel names, which this machine cannot produce: each lands in its part."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_profile", "bench/gpu_profile.py")
    gpu_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_profile)
    part = gpu_profile.categorise
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas"
    assert part(["cudaLaunchKernel", gemm, "aten::mm"], ["elastic_gpt::loss"]) == "gemm"
    assert part(["aten::mm", "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTT"]) == "gemm"
    assert part(["aten::_flash_attention_backward",
                 "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"]) == "attention"
    assert part(["cudaLaunchKernel", "ncclDevKernel_AllGather_RING_LL"],
                ["FSDP::all_gather"]) == "fsdp_copies_and_collectives"
    assert part(["aten::split_with_sizes_copy", "split_with_sizes_copy_out_contiguous_no_cast"],
                ["FSDP::post_backward"]) == "fsdp_copies_and_collectives"
    assert part(["aten::_fused_adamw_", "multi_tensor_apply_kernel"],
                ["Optimizer.step#AdamW.step"]) == "optimizer"
    assert part(["aten::_foreach_mul_", "multi_tensor_apply_kernel"],
                ["Optimizer.step#AdamW.step"]) == "optimizer"
    assert part(["aten::exp_", "vectorized_elementwise_kernel"],
                ["aten::sub_", "elastic_gpt::loss"]) == "loss"
    assert part(["triton_red_fused__log_softmax_0"], ["CompiledFunction"]) == "loss"
    assert part(["triton_poi_fused_gelu_1"], ["CompiledFunction"]) == "other"


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


def test_the_gpu_trainer_check_runs_on_the_cpu_with_cuda_hidden(tmp_path):
    """bench/gpu.sh's Trainer check (learns, saves asynchronously, resumes), on the CPU: the
    same assertions the GPU run makes."""
    import json
    import subprocess
    import sys

    out = tmp_path / "trainer.json"
    subprocess.run([sys.executable, "bench/gpu_trainer_check.py", "--cpu-dry-run", "--steps",
                    "6", "--json", str(out)], check=True, timeout=300, capture_output=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": "0"})
    got = json.loads(out.read_text())
    assert got["resumed_at"] == 3 and got["committed"] == 6
    assert got["loss_late"] < got["loss_early"]

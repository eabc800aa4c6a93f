"""Every piece of the bf16 / FSDP2 / NCCL path that can be checked without a GPU or a process
group, so `bench/gpu.sh` on a real GPU is a confirmation, not a first try: dtypes and optimizer
choices per device, the mixed-precision policy, NCCL and one GPU per worker, the workers'
environment, pinned batches, selective checkpointing, float8's limits, the step profile."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from elastic_gpt.config import load_config
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT, token_losses
from elastic_gpt.parallel.fsdp import (
    device_memory_bytes,
    mixed_precision_policy,
    parallelize,
    resolve_dtype,
)

SMALL = GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=16, vocab_size=64)


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


def test_float8_with_tensor_parallelism_is_one_clear_line():

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=8, vocab_size=64))
    with pytest.raises(ValueError, match="train.float8 with parallel.tp > 1 is not supported"):
        parallelize(model, None, compute_dtype=torch.bfloat16, float8=True, tp_mesh=object())


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



"""Throughput, MFU, learning-rate schedule and the data fingerprint arithmetic."""

from __future__ import annotations

import math
import time

import torch

FINGERPRINT_BITS = 52  # exact in a float64, so MLflow stores it without rounding (C5)
FINGERPRINT_MOD = 1 << FINGERPRINT_BITS

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' datasheets.
GPU_PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12,
}


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps: a pure function of the step,
    so resuming needs no scheduler state beyond the step counter (C3)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def peak_flops(device: torch.device, threads: int) -> float:
    """The denominator of MFU: the chip's bf16 peak on GPU; on CPU, the fp32 matmul rate these
    threads actually reach (a CPU has no datasheet figure that means the same thing)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_BF16.items():
            if key in name:
                return flops
        return 989e12
    return measure_cpu_matmul_flops(threads)


_cpu_peak_cache: dict[int, float] = {}


def measure_cpu_matmul_flops(threads: int, n: int = 512, seconds: float = 0.3) -> float:
    """Best-of-several fp32 GEMM rate: an upper bound the model's matmuls can approach."""
    if threads in _cpu_peak_cache:
        return _cpu_peak_cache[threads]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(prev)
    _cpu_peak_cache[threads] = best
    return best


def split_fingerprint(fp: int) -> tuple[float, float]:
    """Two 26-bit halves: sums of a few of them stay exact in the float64 all-reduce."""
    return float(fp & ((1 << 26) - 1)), float(fp >> 26)


def join_fingerprint(lo: float, hi: float) -> int:
    return (int(round(lo)) + (int(round(hi)) << 26)) % FINGERPRINT_MOD

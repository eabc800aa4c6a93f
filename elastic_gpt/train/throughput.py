"""The denominator of MFU: what one worker's device could do at best.

On a GPU, the dense bf16 peak from the hardware table (elastic_gpt/hardware.py, the table the
planner reads too); on a CPU, the fp32 matmul rate these threads reach. Nothing here knows about
the Trainer or the process group.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from elastic_gpt.hardware import gpu_for_device, variant_peak_flops

log = logging.getLogger(__name__)

_warned: set[str] = set()


def peak_flops(device: torch.device, threads: int) -> float:
    """FLOP/s one worker can reach at best; NaN for a GPU the hardware table lacks."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return measure_cpu_matmul_flops(threads)


def gpu_peak_flops(device_name: str) -> float:
    """The table's bf16 peak for this GPU. A GPU it lacks gets NaN, so its MFU is logged as NaN:
    any other guess (another chip's peak) would log a number that looks right and is not."""
    variant = variant_peak_flops(device_name)
    if variant is not None:
        return variant
    gpu = gpu_for_device(device_name)
    if gpu is not None:
        return gpu.peak_flops
    if device_name not in _warned:
        _warned.add(device_name)
        log.warning("MFU is logged as NaN: GPU %r is not in the hardware table; add a row to GPUS "
                    "in elastic_gpt/hardware.py named by one word of that name (its model number) "
                    "with the chip's dense bf16 peak", device_name)
    return math.nan


_cpu_peak_cache: dict[int, float] = {}


def measure_cpu_matmul_flops(threads: int, n: int = 512, seconds: float = 0.3) -> float:
    """Best-of-several fp32 GEMM rate (a CPU has no datasheet figure that means the same thing):
    an upper bound the model's matmuls can approach."""
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

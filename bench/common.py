"""Helpers shared by the bench scripts: the benchmark dataset, medians, the machine's load, the
one-rank process group of the GPU checks."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The benchmark model: preset `small` (6 layers x 384 wide, 10.7M params) on the byte tokenizer
# (vocab 256), 256-token samples: big enough that matmuls dominate a step, small enough that a
# step takes about a second on one core.
PRESET, SEQ_LEN, TOKENIZER = "small", 256, "bytes"


def prepare_dataset(out_dir: str, max_bytes: int = 2 << 20) -> str:
    """~2 MB of the standard library's own source, byte-tokenized (cached between runs)."""
    from data_pipelines.tokenize_job import prepare_data
    path = os.path.join(out_dir, f"stdlib-{TOKENIZER}-{SEQ_LEN}")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        stdlib = sysconfig.get_paths()["stdlib"]
        files = sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py"))
        prepare_data(files, path, tokenizer=TOKENIZER, seq_len=SEQ_LEN, engine="local",
                     progress=False, max_bytes=max_bytes)
    return path


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def load_average() -> float:
    return os.getloadavg()[0]


@contextlib.contextmanager
def one_rank_group(cpu_dry_run: bool, script: str, port: int, bind_device: bool = True):
    """A process group of one rank, and the device it runs on: NCCL on GPU 0, made with the
    device bound (`bind_device`) or without it as Ray Train makes it (the trainer binds it), or
    gloo on the CPU for a dry run of the same code. No GPU and no dry run: the script exits with
    one line."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if cpu_dry_run:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        if not torch.cuda.is_available():
            sys.exit(f"{script} needs an NVIDIA GPU (or --cpu-dry-run)")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1,
                                device_id=device if bind_device else None)
    try:
        yield device
    finally:
        dist.destroy_process_group()

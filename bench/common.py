"""Helpers shared by the bench scripts: the benchmark dataset, medians, the machine's load."""

from __future__ import annotations

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

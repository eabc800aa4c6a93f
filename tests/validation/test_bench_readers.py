"""The readers bench/bench_data.py compares with the trainer's: the Ray Data reader must read the
same steps (C2 data order), or the comparison would not be of like with like."""

from __future__ import annotations

import importlib.util
import os

import torch

from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.data.stream import open_step_stream

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ray_data_reader_gives_the_trainers_steps(stdlib_dataset, ray_local):
    reader = _bench_module("ray_data_stream").RayDataStepStream
    plan = BatchSplit(global_batch_size=12, micro_batch_size=2)
    for rank in range(2):
        kw = dict(batch_split=plan, rank=rank, world_size=2, start_step=3, seed=7,
                  shuffle_window=64)
        with open_step_stream(stdlib_dataset, **kw) as a, \
                reader(load_manifest(stdlib_dataset), chunk_steps=4, **kw) as b:
            for _ in range(6):  # chunk_steps=4: crosses a chunk boundary
                x, y = next(a), next(b)
                assert (x.step, x.fingerprint, x.weights) == (y.step, y.fingerprint, y.weights)
                assert all(torch.equal(p, q) for p, q in zip(x.tokens, y.tokens))

"""Real faults for the training-health tests (health/recovery.py): a dataset whose samples at known
steps are garbage, as a bad crawl or a broken tokenizer run would leave them. (Faults of the
hardware are injected by `hardware_faults.py`.)"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

import numpy as np

from elastic_gpt.data.fingerprint import sample_hashes
from elastic_gpt.data.manifest import load_manifest
from elastic_gpt.data.order import SampleOrder


def corrupt_steps(dataset: str, out: str, steps: range, global_batch_size: int, seed: int,
                  window: int, rng_seed: int = 0) -> list[int]:
    """A copy of local dataset `dataset` at `out` whose samples at the run positions of `steps`
    (the order of data.seed `seed`, data.shuffle_window `window`) are uniform random tokens,
    with their checksums and the manifest updated as prepare-data would have written them (the
    reader finds nothing wrong: the data, not the storage, is bad). Returns those positions."""
    shutil.copytree(dataset, out)
    m = load_manifest(out)
    order = SampleOrder(m.shard_sizes, seed, window)
    positions = list(range(steps.start * global_batch_size, steps.stop * global_batch_size))
    rng = np.random.default_rng(rng_seed)
    by_shard: dict[int, list[int]] = {}
    for shard, record in order.samples_at(positions[0], positions[-1] + 1):
        by_shard.setdefault(shard, []).append(record)
    shards = list(m.shards)
    for k, records in by_shard.items():
        info = shards[k]
        path, index = os.path.join(out, info.path), os.path.join(out, info.index_path)
        data = np.fromfile(path, dtype=m.dtype).reshape(info.num_samples, m.record_tokens)
        for r in records:
            data[r] = rng.integers(0, m.vocab_size, m.record_tokens)
        data.tofile(path)
        sample_hashes(data).astype("<u8").tofile(index)
        shards[k] = dataclasses.replace(info, sha256=_sha256(path), index_sha256=_sha256(index))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        f.write(dataclasses.replace(m, shards=tuple(shards), url=m.url).to_json())
    return positions


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()

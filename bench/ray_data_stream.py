"""The trainer's per-rank steps read by Ray Data tasks (possibly on other nodes) instead of a
thread in the trainer process: the same order, the same reads, the same checks, for
bench/bench_data.py to compare with the reader the Trainer uses (elastic_gpt/data/stream.py). It
costs object-store copies and a pipeline start per chunk of steps; docs/data.md says why the
trainer reads per rank instead.
"""

from __future__ import annotations

import json

import numpy as np

from elastic_gpt.data.manifest import Manifest, load_manifest
from elastic_gpt.data.order import DEFAULT_SHUFFLE_WINDOW, BatchSplit, SampleOrder
from elastic_gpt.data.stream import ShardReader, StepBatch, assemble_step, rank_samples

_REMOTE_READERS: dict[str, tuple[SampleOrder, ShardReader]] = {}


def _read_steps(batch: dict, cfg: str) -> dict:
    """Ray Data map_batches function: read this rank's samples of the steps in `batch["id"]`."""
    if cfg not in _REMOTE_READERS:  # one order + reader (index cache) per worker process
        c = json.loads(cfg)
        m = load_manifest(c["url"], c["storage_options"])
        _REMOTE_READERS[cfg] = (SampleOrder(m.shard_sizes, c["seed"], c["window"]),
                                ShardReader(m, c["storage_options"]))
    c = json.loads(cfg)
    order, reader = _REMOTE_READERS[cfg]
    batch_split = BatchSplit(c["G"], c["m"])
    out = {"step": [], "records": [], "hashes": [], "bytes": []}
    for step in batch["id"]:
        before = reader.bytes_read
        records, hashes = reader.read(rank_samples(order, batch_split, c["rank"], c["W"], int(step)))
        out["step"].append(int(step))
        out["records"].append(records)
        out["hashes"].append(hashes.astype(np.int64))  # < 2**52: int64 is exact
        out["bytes"].append(reader.bytes_read - before)
    return {k: np.stack(v) if k in ("records", "hashes") else np.array(v) for k, v in out.items()}


class RayDataStepStream:
    """`StepStream` interface over Ray Data: steps are read in chunks of `chunk_steps` by a
    Ray Data pipeline (`preserve_order`, so rows arrive in step order). Needs `ray.init()`."""

    def __init__(self, manifest: Manifest, *, batch_split: BatchSplit, rank: int, world_size: int,
                 start_step: int, seed: int, shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
                 prefetch_steps: int = 4, storage_options: dict | None = None,
                 chunk_steps: int = 256, num_readers: int = 1):
        batch_split.check_world_size(world_size)
        self.manifest, self.batch_split, self.rank, self.world_size = manifest, batch_split, rank, world_size
        self.next_step = start_step
        self.bytes_read = 0
        self._cfg = json.dumps({
            "url": manifest.url, "storage_options": storage_options, "seed": seed,
            "window": shuffle_window, "G": batch_split.global_batch_size, "m": batch_split.micro_batch_size,
            "rank": rank, "W": world_size}, sort_keys=True)
        self._chunk, self._readers, self._prefetch = chunk_steps, num_readers, prefetch_steps
        self._it = None

    def _open_chunk(self, start: int):
        import logging

        import ray.data

        logging.getLogger("ray.data").setLevel(logging.WARNING)  # no banner per chunk
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # C2 data order: rows in step order
        ctx.enable_progress_bars = False
        ds = ray.data.range(self._chunk, override_num_blocks=max(1, self._chunk // 4))
        ds = ds.map_batches(lambda b, s=start: {"id": b["id"] + s}, batch_size=None)
        ds = ds.map_batches(_read_steps, fn_kwargs={"cfg": self._cfg}, batch_size=4,
                            compute=ray.data.TaskPoolStrategy(size=self._readers), num_cpus=0.5)
        for b in ds.iter_batches(batch_size=1, batch_format="numpy",
                                 prefetch_batches=self._prefetch):
            yield {k: v[0] for k, v in b.items()}

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        if self._it is None:
            self._it = self._open_chunk(self.next_step)
        try:
            row = next(self._it)
        except StopIteration:
            self._it = self._open_chunk(self.next_step)
            row = next(self._it)
        assert int(row["step"]) == self.next_step, (row["step"], self.next_step)
        self.next_step += 1
        self.bytes_read += int(row["bytes"])
        return assemble_step(int(row["step"]), row["records"], row["hashes"].astype(np.uint64),
                             self.batch_split, self.rank, self.world_size)

    def close(self) -> None:
        self._it = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""Where the tokenization job's parts run: in this process, or as a Ray Data job.

`--engine local` builds the parts one after another here; `--engine ray` maps them over a pool of
Ray tasks (`map_batches`, one part per batch, one tokenizer per worker process) on the connected
cluster, or on a small local Ray instance it starts and stops; `auto` picks Ray when a cluster is
connected or RAY_ADDRESS is set, or when the pending input is large. Parts are independent and a
shard is a pure function of its part (tokenize_part.py), so the engine never changes the output.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from data_pipelines.sources import InputFile
from data_pipelines.tokenize_part import build_part_or_error

ENGINES = ("auto", "ray", "local")
AUTO_RAY_BYTES = 32 << 20


def tokenize_parts(batch: dict, output: str, options: dict,
                   storage_options: dict | None) -> dict:
    """Ray Data `map_batches` function: build the parts of a batch (one part per batch).
    A plain function, not an actor class: tasks run in Ray's pre-started worker processes, and
    the tokenizer is still built once per process (get_tokenizer is cached)."""
    results = []
    for index, files_json in zip(batch["index"], batch["files"]):
        files = [InputFile(**f) for f in json.loads(files_json)]
        results.append(json.dumps(build_part_or_error(
            int(index), files, output, options, storage_options)))
    return {"result": np.array(results, dtype=object)}


class Progress:
    """The job's progress bar (documents, tokens and MB/s of the parts built) and its clock."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.t0 = time.perf_counter()
        self.docs = self.tokens = self.bytes = 0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data",
                            file=sys.stderr, dynamic_ncols=True)

    def start(self) -> None:
        """Rates count from here: cluster start-up is not tokenization."""
        self.t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.reset()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def update(self, stats: dict, nbytes: int) -> None:
        self.docs += stats["docs"]
        self.tokens += stats["tokens"]
        self.bytes += nbytes
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"docs={self.docs:,} tokens={self.tokens:,} "
                                     f"{self.bytes / dt / 1e6:.1f} MB/s", refresh=False)
            self.bar.update(nbytes)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_parts_local(todo, output, options, storage_options, on_done, bar):
    bar.start()
    for index, files in todo:
        on_done(index, files, build_part_or_error(index, files, output, options, storage_options))


def run_parts_ray(todo, output, options, storage_options, on_done, num_workers, bar):
    import ray

    started = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            tmp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray_prepare_data")
            ray.init(address="local", num_cpus=num_workers or min(2, os.cpu_count() or 1),
                     object_store_memory=100 << 20, include_dashboard=False,
                     _temp_dir=tmp, log_to_driver=False)
        started = True
    try:
        import logging

        import ray.data

        logging.getLogger("ray.data").setLevel(logging.ERROR)  # our bar replaces its chatter
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours reports docs/tokens/MB/s instead
        ctx.print_on_execution_start = False
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        local = [u for u in (output, *(f.url for _, fs_ in todo[:1] for f in fs_)) if "://" not in u
                 or u.startswith("file://")]
        if len(nodes) > 1 and local:
            raise ValueError(
                f"{local[0]} is a local path but the Ray cluster has {len(nodes)} nodes, whose "
                "workers cannot all see it; use shared storage (s3://, gs://) or --engine local")
        cpus = int(ray.cluster_resources().get("CPU", 1))
        n = max(1, min(num_workers or cpus, len(todo)))
        by_index = dict(todo)
        items = [{"index": i, "files": json.dumps([f.__dict__ for f in fs_])} for i, fs_ in todo]
        bar.start()
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            tokenize_parts, batch_size=1, compute=ray.data.TaskPoolStrategy(size=n), num_cpus=1,
            fn_kwargs={"output": output, "options": options, "storage_options": storage_options})
        for row in ds.iter_rows():
            result = json.loads(row["result"])
            index = result.get("index")
            on_done(index, by_index.get(index), result)
    finally:
        if started:
            ray.shutdown()


def choose_engine(engine: str, pending_bytes: int) -> str:
    """The engine `auto` stands for: ray when a cluster is connected or RAY_ADDRESS is set, or
    when `pending_bytes` of input are left to tokenize (a fresh Ray instance costs more to start
    than a few MB take to tokenize), else local."""
    if engine != "auto":
        return engine
    ray = sys.modules.get("ray")  # a connected driver has imported it; importing costs seconds
    connected = ray is not None and ray.is_initialized()
    if connected or os.environ.get("RAY_ADDRESS") or pending_bytes >= AUTO_RAY_BYTES:
        return "ray"
    return "local"

"""Object-store requests per trained sample of a streamed run, counted by a real S3-protocol server
on loopback (moto), for this checkout and, with `--code`, another one side by side.

    .venv/bin/python bench/bench_data_requests.py [--code OLD_CHECKOUT] [--steps 60]

Each layout runs its W = dp x tp ranks as real processes of one gloo group, each reading what the
trainer's ranks read: every rank its data-parallel rank's batches, or, where the checkout has
one, a tensor-parallel group's batches read by its first rank and broadcast. The server counts
every request it answers (GET, HEAD); the figure is requests over samples trained, all ranks
together. `--code DIR` runs the same layouts on another checkout (e.g. a worktree of the commit
before the change) against the same server and dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_ENV = "BENCH_DATA_REQUESTS_CODE"  # the checkout a worker (and its spawned ranks) imports
sys.path.insert(0, os.environ.get(CODE_ENV, ROOT))

LAYOUTS = [(1, 1), (2, 1), (8, 1), (4, 2)]  # (dp, tp): one rank, two, an 8-GPU node two ways
GLOBAL_BATCH, MICRO_BATCH = 64, 4


def _rank(rank: int, world: int, url: str, options: dict, dp: int, tp: int, steps: int,
          window: int) -> int:
    """What one trainer rank reads for `steps` steps; returns the bytes it read."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.data.order import BatchSplit
    from elastic_gpt.data.stream import open_step_stream

    split = BatchSplit(GLOBAL_BATCH, MICRO_BATCH)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    try:
        from elastic_gpt.train.group_batches import GroupBroadcastBatches
    except ImportError:  # an older checkout: every rank reads for itself
        GroupBroadcastBatches = None

    def reader():
        return open_step_stream(url, batch_split=split, rank=dp_rank, world_size=dp,
                                start_step=0, seed=1, shuffle_window=window, prefetch_steps=0,
                                storage_options=options)

    if tp > 1 and GroupBroadcastBatches is not None:
        stream = GroupBroadcastBatches(reader() if tp_rank == 0 else None,
                                       group=mesh["tp"].get_group(), batch_split=split,
                                       batch_rank=dp_rank, batch_degree=dp,
                                       record_tokens=1025, start_step=0,
                                       device=torch.device("cpu"))
    else:
        stream = reader()
    with stream:
        for _ in range(steps):
            next(stream)
        return stream.bytes_read


def _layouts(code: str, url: str, options: dict, steps: int, window: int) -> None:
    """Worker mode: every layout on the checkout at `code`, one gloo group each; prints JSON
    lines of bytes read, the parent reads the server's counts between them."""
    import elastic_gpt

    assert os.path.dirname(os.path.dirname(os.path.abspath(elastic_gpt.__file__))) == code, \
        f"measuring {elastic_gpt.__file__}, not the checkout at {code}"
    from elastic_gpt.testing.gloo import run_gloo

    for dp, tp in LAYOUTS:
        input(f"ready {dp} {tp}\n")  # the parent resets the server's counts
        read = run_gloo(_rank, dp * tp, url, options, dp, tp, steps, window)
        print(json.dumps({"bytes": sum(read)}), flush=True)


def _measure(code: str, server, url: str, steps: int, window: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": code, CODE_ENV: code}
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", code, "--url", url,
         "--options", json.dumps(server.storage_options()), "--steps", str(steps),
         "--window", str(window)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env, cwd=code)
    rows = []
    for dp, tp in LAYOUTS:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        server.reset_requests()
        proc.stdin.write("\n")
        proc.stdin.flush()
        got = json.loads(proc.stdout.readline())
        counts = server.requests()
        samples = steps * GLOBAL_BATCH
        rows.append({"dp": dp, "tp": tp, "requests": sum(counts.values()), **counts,
                     "requests_per_sample": sum(counts.values()) / samples,
                     "bytes_per_trained_byte": got["bytes"] / (samples * 1025 * 2)})
    assert proc.wait() == 0
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", default=None, help="an older checkout to measure beside this one")
    ap.add_argument("--corpus", default=os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"))
    ap.add_argument("--max-bytes", default="32MB")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=4096,
                    help="shuffle window: smaller than the dataset, as in any real corpus")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--options", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _layouts(args.worker, args.url, json.loads(args.options), args.steps, args.window)
        return 0

    from data_pipelines.cli import parse_size
    from data_pipelines.tokenize_job import prepare_data
    from elastic_gpt.data.manifest import load_manifest
    from elastic_gpt.testing.s3_server import S3Server

    server = S3Server()
    try:
        server.make_bucket()
        with tempfile.TemporaryDirectory() as out:
            prepare_data(args.corpus, os.path.join(out, "ds"), "gpt2", 1024, engine="local",
                         progress=False, max_bytes=parse_size(args.max_bytes))
            server.filesystem().put(os.path.join(out, "ds") + "/", "corpus/ds/", recursive=True)
        url = "s3://corpus/ds"
        m = load_manifest(url, server.storage_options())
        print(f"dataset: {m.num_samples:,} records of 1,025 gpt2 tokens in {len(m.shards)} "
              f"shards; window {args.window}, global batch {GLOBAL_BATCH}, {args.steps} steps")
        runs = {"this": _measure(ROOT, server, url, args.steps, args.window)}
        if args.code:
            runs["old"] = _measure(os.path.abspath(args.code), server, url, args.steps,
                                   args.window)
    finally:
        server.stop()
    for i, (dp, tp) in enumerate(LAYOUTS):
        new = runs["this"][i]
        line = (f"dp={dp} tp={tp}: {new['requests_per_sample']:.4f} requests/sample "
                f"({new['requests']} requests), {new['bytes_per_trained_byte']:.2f} bytes read "
                "per byte trained")
        if "old" in runs:
            old = runs["old"][i]
            line += (f" | old {old['requests_per_sample']:.3f} requests/sample, "
                     f"{old['bytes_per_trained_byte']:.2f} bytes/byte | "
                     f"{old['requests'] / max(1, new['requests']):.0f}x fewer requests")
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

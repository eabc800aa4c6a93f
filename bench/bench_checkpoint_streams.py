"""Checkpoint write throughput per rank: 1 upload stream vs N, to a loopback S3 server.

    .venv/bin/python bench/bench_checkpoint_streams.py [--preset gpt2-124m] [--world 2]
        [--streams 1,2,4,8] [--rounds 3] [--optimizer] [--json out.json]

`--world` ranks (processes, one gloo group) hold the preset's weights sharded by FSDP2 (with
`--optimizer`, AdamW's two moments too: what a training checkpoint holds) and write them as one
DCP checkpoint to a moto S3 server on 127.0.0.1, in a process of its own, through the code the
checkpointers use (`checkpoint.sharded.save_sharded`), once per stream count per round, the
stream counts in a different order each round so that drift in the machine's load falls on all of
them. Per save and rank: the rank's shard bytes / the save's wall time (plan, write, metadata: the
whole collective, as the loop sees it). Each save is deleted before the next, so the server holds
one checkpoint at a time. The server's CPU time during each save, over the save's wall time, says
how close the server itself was to the end of what it can take (its request handling holds one
GIL: about 1.0 is one core, saturated).

Also measured: the per-step cost of `checkpoint.every_minutes`'s agreement (rank 0's clock
broadcast on a gloo group of the checkpointer's) against a step-count cadence, which needs none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import ROOT, median

BUCKET = "ckpt-bench"


def start_s3_server() -> tuple[subprocess.Popen, str]:
    """moto in a process of its own (its request handling would otherwise share the writers'
    GIL); returns the process and its endpoint URL."""
    code = ("import sys; from elastic_gpt.testing.s3_server import S3Server; s = S3Server(); "
            f"s.make_bucket({BUCKET!r}); print(s.endpoint, flush=True); sys.stdin.read(); s.stop()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "AWS_DEFAULT_REGION": "us-east-1"})
    return proc, proc.stdout.readline().strip()


def storage_options(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def _sharded_state(preset: str, world: int, optimizer: bool):
    """The preset under FSDP2 over `world` ranks, weights (and AdamW moments) random, on CPU."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.model.config import preset_config
    from elastic_gpt.model.gpt import GPT
    from elastic_gpt.parallel.fsdp import parallelize
    with torch.device("meta"):
        model = GPT(preset_config(preset))
    parallelize(model, init_device_mesh("cpu", (world,)), compute_dtype=torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    opt = None
    if optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # creates the moments (and the step counters)
        opt.zero_grad(set_to_none=True)
    return model, opt


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux's /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _rank(rank: int, world: int, endpoint: str, server_pid: int, preset: str, optimizer: bool,
          streams: list[int], rounds: int, steps: int) -> dict:
    import fsspec
    import torch
    import torch.distributed as dist

    from elastic_gpt.checkpoint.checkpointer import SyncCheckpointer
    from elastic_gpt.checkpoint.sharded import save_sharded, training_state_dict
    from elastic_gpt.checkpoint.store import CheckpointStore

    torch.set_num_threads(1)
    opts = storage_options(endpoint)
    model, opt = _sharded_state(preset, world, optimizer)
    local = [t.to_local() if hasattr(t, "to_local") else t
             for t in _leaves(training_state_dict(model, opt))]
    shard_bytes = sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))
    fs = fsspec.filesystem("s3", **opts)
    times: dict[int, list[float]] = {n: [] for n in streams}
    server_busy: dict[int, list[float]] = {n: [] for n in streams}
    files: dict[int, int] = {}
    for r in range(rounds):
        order = streams[r % len(streams):] + streams[:r % len(streams)]
        for n in order:
            url = f"s3://{BUCKET}/round{r}-streams{n}"
            dist.barrier()
            t0, c0 = time.perf_counter(), _cpu_s(server_pid)
            save_sharded(url, model, opt, storage_options=opts, streams=n)
            times[n].append(time.perf_counter() - t0)
            server_busy[n].append((_cpu_s(server_pid) - c0) / times[n][-1])
            dist.barrier()
            if rank == 0:
                files[n] = sum(f.endswith(".distcp") for f in fs.ls(url, detail=False, refresh=True))
                fs.rm(url, recursive=True)
    # The clock cadence's agreement per step (no save is due) against the step cadence's none.
    store = CheckpointStore(f"s3://{BUCKET}/cadence", storage_options=opts)
    per_step = {}
    for label, kw in (("every_steps", {"every_steps": 10**9}),
                      ("every_minutes", {"every_steps": 0, "every_minutes": 10**6})):
        ckpt = SyncCheckpointer(store, keep=1, rank=rank, model=model, optimizer=opt,
                                trainer_state=dict, **kw)
        ckpt.save(1)  # the first call makes the agreement's group
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(2, steps + 2):
            ckpt.save(step)
        per_step[label] = (time.perf_counter() - t0) / steps
    return {"shard_bytes": shard_bytes, "times": times, "files": files, "per_step_s": per_step,
            "server_busy": server_busy}


def _leaves(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def run(args) -> dict:
    from elastic_gpt.testing.gloo import run_gloo

    streams = [int(s) for s in args.streams.split(",")]
    server, endpoint = start_s3_server()
    try:
        per_rank = run_gloo(_rank, args.world, endpoint, server.pid, args.preset, args.optimizer,
                            streams, args.rounds, args.cadence_steps)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    out = {"preset": args.preset, "world": args.world, "optimizer": args.optimizer,
           "rounds": args.rounds, "streams": {}}
    for n in streams:
        mbps = [r["shard_bytes"] / t / 1e6 for r in per_rank for t in r["times"][n]]
        out["streams"][n] = {
            "files_per_checkpoint": per_rank[0]["files"][n],
            "save_s_median": median(t for r in per_rank for t in r["times"][n]),
            "server_cpu_per_wall_median": median(per_rank[0]["server_busy"][n]),
            "mb_per_s_per_rank_median": median(mbps),
            "mb_per_s_per_rank": [[round(r["shard_bytes"] / t / 1e6, 1) for t in r["times"][n]]
                                  for r in per_rank]}
    base = out["streams"][streams[0]]["mb_per_s_per_rank_median"]
    for n in streams:
        out["streams"][n]["vs_first"] = out["streams"][n]["mb_per_s_per_rank_median"] / base
    out["shard_mb_per_rank"] = [round(r["shard_bytes"] / 1e6, 1) for r in per_rank]
    out["cadence_per_step_us"] = {k: 1e6 * median(r["per_step_s"][k] for r in per_rank)
                                  for k in per_rank[0]["per_step_s"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--optimizer", action="store_true", help="AdamW's moments too")
    ap.add_argument("--cadence-steps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    res = run(args)
    print(f"{args.preset}, W={args.world}, {res['shard_mb_per_rank']} MB per rank, "
          f"{args.rounds} rounds, loopback S3 (moto)")
    print(f"{'streams':>8} {'files':>6} {'save s':>8} {'MB/s per rank':>14} {'vs 1':>6} "
          f"{'server CPU/wall':>16}")
    for n, s in res["streams"].items():
        print(f"{n:>8} {s['files_per_checkpoint']:>6} {s['save_s_median']:>8.2f} "
              f"{s['mb_per_s_per_rank_median']:>14.1f} {s['vs_first']:>6.2f} "
              f"{s['server_cpu_per_wall_median']:>16.2f}")
    print("cadence check per step (us): " + ", ".join(
        f"{k} {v:.0f}" for k, v in res["cadence_per_step_us"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

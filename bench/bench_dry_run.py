"""`elastic-gpt dry-run` at full scale: the trainer's own build and step of large plans on one
CPU, each rank that differs beside the planner.

    .venv/bin/python bench/bench_dry_run.py [--cases 175b-1024,175b-64,...] [--out FILE.json]

Each case is one `elastic-gpt dry-run ... --json` in a process of its own (its ranks run side by
side, each in its own process), timed from the command's start to its exit. Per rank it prints
the peak memory of the step, dry run against planner ("planner/dry": the planner's total over
the dry run's, the issue's 10% bound) and whether every collective the planner counts moved the
planner's bytes (to 0.1%). The cases are the plans the planner is checked against at full scale:
GPT-3 175B on 1,024 A100s (the layout plan chooses: pipelined, interleaved) and on 64 (the chosen
one and a pipelined alternative), the 1T model of Narayanan et al. (SC21) on 3,072, and a 13B
HSDP plan. The first is the one that must finish in under 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import ROOT, load_average

ONE_T = ["--n-layer", "128", "--n-head", "160", "--n-embd", "25600", "--seq-len", "2048",
         "--vocab-size", "51200", "--global-batch-size", "3072"]
CASES = {
    "175b-1024": ["--model", "gpt3-175b", "--gpu", "A100-80GB", "--gpus", "1024"],
    "175b-64": ["--model", "gpt3-175b", "--gpu", "A100-80GB", "--gpus", "64"],
    "175b-64-pp8": ["--model", "gpt3-175b", "--gpu", "A100-80GB", "--gpus", "64", "--pp", "8"],
    "1t-3072": [*ONE_T, "--gpu", "A100-80GB", "--gpus", "3072"],
    "13b-hsdp-64": ["--model", "gpt3-13b", "--gpu", "A100-80GB", "--gpus", "64", "--hsdp", "on"],
}
EXACT = 1e-3  # collectives: the planner's bytes to 0.1%


def run_case(name: str, argv: list[str], timeout_s: float) -> dict:
    cli = os.path.join(os.path.dirname(sys.executable), "elastic-gpt")
    load0, t0 = load_average(), time.perf_counter()
    done = subprocess.run([cli, "dry-run", *argv, "--json"], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"case": name, "argv": argv, "wall_s": wall, "exit": done.returncode,
                "error": (done.stderr.strip().splitlines() or ["(no output)"])[-1]}
    got = json.loads(done.stdout)
    ranks = []
    for r in got["ranks"]:
        counted = [c for c in r["collectives"] if c["planner_bytes"] is not None]
        off = [f"{c['dim']} {c['kind']}" for c in counted
               if abs(c["dry_run_bytes"] - c["planner_bytes"]) > EXACT * max(c["planner_bytes"], 1)]
        ranks.append({"rank": r["rank"], "coordinate": r["coordinate"], "seconds": r["seconds"],
                      "dry_run_gib": r["total_gib"]["dry_run"],
                      "planner_gib": r["total_gib"]["planner"],
                      "planner_over_dry_run": r["planner_over_dry_run"], "within": r["within"],
                      "fits": r["fits"], "collectives_counted": len(counted),
                      "collectives_off": off, "memory_gib": r["memory_gib"]})
    return {"case": name, "argv": argv, "wall_s": wall, "exit": 0, "load_before": load0,
            "load_after": load_average(), "layout": got["layout"],
            "micro_batch": got["micro_batch"], "ranks": ranks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per case")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    results = []
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"bench_dry_run.py: --cases {name} is not one of {', '.join(CASES)}")
        r = run_case(name, CASES[name], args.timeout_s)
        results.append(r)
        if r["exit"]:
            print(f"{name}: exit {r['exit']} after {r['wall_s']:.0f} s: {r['error']}", flush=True)
            continue
        m = r["layout"]
        print(f"{name}: pp{m['pp']} x dp_replicate{m['dp_replicate']} x dp_shard{m['dp_shard']} "
              f"x tp{m['tp']} (stages/rank {m['stages_per_rank']}), micro-batch "
              f"{r['micro_batch']}: {r['wall_s']:.0f} s wall, load {r['load_before']:.1f} -> "
              f"{r['load_after']:.1f}", flush=True)
        for k in r["ranks"]:
            where = " ".join(f"{d}{v}" for d, v in k["coordinate"].items())
            print(f"  rank {k['rank']:>5} ({where}): dry run {k['dry_run_gib']:6.2f} GiB, planner "
                  f"{k['planner_gib']:6.2f} GiB, planner/dry {k['planner_over_dry_run']:+.1%}"
                  f"{'' if k['within'] else ' OUTSIDE 10%'}; collectives "
                  + ("all the planner's bytes" if not k["collectives_off"]
                     else f"off: {', '.join(k['collectives_off'])}")
                  + f" ({k['collectives_counted']} kinds)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

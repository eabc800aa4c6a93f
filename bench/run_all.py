"""`make bench`: every benchmark that fits this machine, one table, bench/results.json.

    .venv/bin/python bench/run_all.py [--quick] [--skip-data] [--skip-recovery] [--skip-ray]

Each part runs in its own process (a clean torch/Ray/process-group state each), one after the
other on the same cores, so the ratios inside a part are measured side by side:

  overhead (in-process)  Trainer.train_step (FSDP2 W=1, real data stream) vs a plain PyTorch loop,
                         alternating in one process; CPU time and wall time per step
  scaling (in-process)   the Trainer at W=2 vs W=1 in plain processes over gloo, and two plain
                         loops vs one (the ceiling of 2 workers on this machine)
  overhead + scaling     elastic-gpt through Ray Train: W=1 vs the plain loop, W=2 vs W=1 (wall)
  checkpoint stall       async vs sync save blocking time, tokens/s dip while a save is in flight
  checkpoint streams     write throughput per rank to a loopback S3 server, 1 stream vs 8
  MFU                    model FLOP/s vs the measured fp32 matmul peak of the same cores
  data, recovery         bench/bench_data.py and bench/bench_recovery.py, when present

Other load skews wall-clock figures: the load average before and after each part is recorded next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The goals the table marks each figure against (docs/performance.md, "Current figures").
TARGETS = {"overhead": ">= 0.95", "scaling": ">= 1.6", "blocked_fraction": "<= 0.10"}


def run_part(name: str, argv: list[str], out_json: str, timeout: float,
             json_flag: str = "--json") -> dict:
    load0, t0 = os.getloadavg()[0], time.time()
    print(f"==> {name}: {' '.join(argv)}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")])}
    env.setdefault("RAY_TMPDIR", "/tmp/ray_bench")
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    # A session of its own: on timeout the whole group goes (a part's local Ray cluster too).
    proc = subprocess.Popen([sys.executable, *argv, json_flag, out_json], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        ok = proc.returncode == 0 and os.path.exists(out_json)
        tail = out[-1500:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        ok, tail = False, f"timed out after {timeout:.0f} s"
    res = {}
    if ok:
        with open(out_json) as f:
            res = json.load(f)
    else:
        print(f"    {name} FAILED:\n{tail}", flush=True)
    res["_meta"] = {"ok": ok, "seconds": round(time.time() - t0, 1), "load_before": load0,
                    "load_after": os.getloadavg()[0]}
    print(f"    {name}: {res['_meta']}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--skip-ray", action="store_true", help="skip the Ray Train runs")
    ap.add_argument("--skip-data", action="store_true", help="skip bench/bench_data.py")
    ap.add_argument("--skip-recovery", action="store_true", help="skip bench/bench_recovery.py")
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"))
    ap.add_argument("--table-only", action="store_true", help="print the table of --out again")
    args = ap.parse_args()
    if args.table_only:
        with open(args.out) as f:
            print_table(json.load(f))
        return
    work = tempfile.mkdtemp(prefix="elastic_gpt_bench_")
    q = args.quick
    results: dict = {"machine": {"cpus": os.cpu_count(), "started": time.strftime("%F %T")}}

    results["overhead_inprocess"] = run_part(
        "overhead (in-process, interleaved)",
        ["bench/bench_trainer.py", "--part", "interleaved", "--rounds", "2" if q else "4",
         "--workdir", work], f"{work}/inproc.json", 900)
    results["scaling_inprocess"] = run_part(
        "scaling (in-process, no Ray)",
        ["bench/bench_trainer.py", "--part", "scaling", "--repeats", "1" if q else "2",
         "--steps", "8", "--workdir", work], f"{work}/scaling.json", 900)
    if not args.skip_ray:
        results["ray"] = run_part(
            "overhead + scaling (Ray Train)",
            ["bench/bench_trainer.py", "--part", "ray", "--repeats", "1" if q else "2",
             "--steps", "8" if q else "10", "--workdir", work], f"{work}/ray.json", 900)
    results["checkpoint"] = run_part(
        "checkpoint stall", ["bench/bench_checkpoint.py", "--steps", "9" if q else "15",
                             "--every", "3", "--workdir", work], f"{work}/ckpt.json", 600)
    results["checkpoint_streams"] = run_part(
        "checkpoint streams", ["bench/bench_checkpoint_streams.py", "--streams", "1,8",
                               "--rounds", "2" if q else "3"], f"{work}/streams.json", 600)
    # The data and recovery benches, each with its own JSON flag. Recovery runs 3 trials of node
    # loss + node add for elastic-gpt and 1 for Ray Train's defaults (each of its events waits
    # out a ~60 s placement timeout) and skips the 2 x 200 s goodput runs, to keep `make bench`
    # under 15 minutes; run `bench/bench_recovery.py` alone for 5 trials each and the goodput.
    for name, argv, flag, skip in (
            ("data", ["bench/bench_data.py"], "--json", args.skip_data),
            ("recovery", ["bench/bench_recovery.py", "--trials", "1" if q else "3",
                          "--baseline-trials", "1", "--goodput-s", "0"], "--out",
             args.skip_recovery)):
        if not skip and os.path.exists(os.path.join(ROOT, argv[0])):
            results[name] = run_part(name, argv, f"{work}/{name}.json", 600, json_flag=flag)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)
    print(f"\nwrote {args.out}")


def _finished(results: dict, part: str) -> dict | None:
    """A part's figures if it ran to the end, else None (its table rows are left out)."""
    res = results.get(part, {})
    return res if res.get("_meta", {}).get("ok") else None


def print_table(r: dict) -> None:
    rows = []
    ip = _finished(r, "overhead_inprocess")
    if ip:
        rows += [
            ("trainer overhead, CPU time (in-process)", ip["overhead_ratio_cpu"],
             TARGETS["overhead"],
             f"plain {ip['plain_cpu_s']:.2f} s vs trainer {ip['trainer_cpu_s']:.2f} s CPU/step"),
            ("trainer overhead, wall (in-process)", ip["overhead_ratio_wall"], TARGETS["overhead"],
             f"plain {ip['plain_wall_s']:.2f} s vs trainer {ip['trainer_wall_s']:.2f} s/step"),
            ("MFU plain loop (CPU time, 1 thread)", ip["mfu_plain_cpu"], "",
             f"peak {ip['peak_1thread_cpu_time_flops'] / 1e9:.0f} GFLOP/s per CPU-second"),
            ("MFU elastic-gpt W=1 (CPU time)", ip["mfu_trainer_cpu"], "", ""),
        ]
    sc = _finished(r, "scaling_inprocess")
    if sc:
        rows += [
            ("scaling 2x1 vs 1x1 workers, wall (no Ray)", sc["scaling_ratio"], TARGETS["scaling"],
             f"{sc['w2_tokens_per_s']:.0f} vs {sc['w1_tokens_per_s']:.0f} tok/s; CPU/step per "
             f"worker {sc['w2_cpu_s']:.2f} s vs {sc['w1_cpu_s']:.2f} s"),
            ("  machine ceiling: 2 plain loops vs 1", sc["ceiling_ratio"], "",
             f"{sc['plain2_step_s']:.2f} s vs {sc['plain1_step_s']:.2f} s per step"),
        ]
    ray = _finished(r, "ray")
    if ray:
        rows += [
            ("trainer overhead via Ray, wall", ray["overhead_ratio"], TARGETS["overhead"],
             f"{ray['w1_tokens_per_s']:.0f} vs plain {ray['plain_tokens_per_s']:.0f} tok/s"),
            ("scaling 2x1 vs 1x1 workers, wall", ray["scaling_ratio"], TARGETS["scaling"],
             f"{ray['w2_tokens_per_s']:.0f} vs {ray['w1_tokens_per_s']:.0f} tok/s"),
            ("MFU W=1 via Ray (wall)", ray["mfu_w1"], "",
             f"peak {ray['peak_1thread_flops'] / 1e9:.0f} GFLOP/s (1 thread, wall)"),
            ("MFU W=2 via Ray (wall)", ray["mfu_w2"], "",
             f"peak {ray['peak_2thread_flops'] / 1e9:.0f} GFLOP/s (2 threads, wall)"),
        ]
    ck = _finished(r, "checkpoint")
    if ck:
        rows += [
            ("checkpoint blocked, async / sync", ck["blocked_fraction"],
             TARGETS["blocked_fraction"],
             f"{ck['async_blocked_s'] * 1e3:.0f} ms vs {ck['sync_save_s'] * 1e3:.0f} ms "
             f"({ck['sync']['state_bytes'] / 1e6:.0f} MB)"),
            ("checkpoint blocked, async / sync (CPU time)", ck.get("blocked_fraction_cpu"), "",
             f"training thread CPU: {ck['async']['blocked_cpu_median_s'] * 1e3:.0f} ms vs "
             f"{ck['sync']['blocked_cpu_median_s'] * 1e3:.0f} ms" if "blocked_cpu_median_s"
             in ck["async"] else ""),
            ("tokens/s dip while a save is in flight", ck["dip"], "",
             f"{ck['async']['n_overlapped']} overlapped steps"),
        ]
    cs = _finished(r, "checkpoint_streams")
    if cs:
        one, eight = cs["streams"]["1"], cs["streams"]["8"]
        rows.append(("checkpoint write per rank, 8 streams / 1", eight["vs_first"], "",
                     f"{eight['mb_per_s_per_rank_median']:.0f} vs "
                     f"{one['mb_per_s_per_rank_median']:.0f} MB/s to loopback S3; server "
                     f"CPU/wall {one['server_cpu_per_wall_median']:.2f}"))
    data = _finished(r, "data")
    if data:
        for k, v in data.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                rows.append((f"data: {k}", v, "", ""))
    rec = _finished(r, "recovery")
    if rec:
        for system, res in rec.items():
            if system.startswith("_"):
                continue
            for key, label in (("recovery_s", "node lost -> training again, s"),
                               ("scale_up_s", "node added -> training at W+1, s"),
                               ("lost_steps", "steps re-done after a loss")):
                st = res[key]
                rows.append((f"{system}: {label}", st["median"], "",
                             f"median of {st['n']}, max {st['max']}"))
            if "goodput" in res:
                rows.append((f"{system}: goodput, a node lost per 60 s", res["goodput"]["goodput"],
                             "", f"{res['goodput']['wall_s']} s run"))
    width = max([44, *(len(row[0]) for row in rows)])
    print(f"\n{'figure':{width}s} {'value':>8s} {'target':>8s}  detail")
    for name, value, target, detail in rows:
        v = "n/a" if value is None else f"{value:8.3f}"
        print(f"{name:{width}s} {v:>8s} {target:>8s}  {detail}")
    for k in ("overhead_inprocess", "scaling_inprocess", "ray", "checkpoint", "checkpoint_streams",
              "data", "recovery"):
        if k in r:
            m = r[k]["_meta"]
            print(f"  [{k}: {'ok' if m['ok'] else 'FAILED'}, {m['seconds']} s, load average "
                  f"{m['load_before']:.1f} -> {m['load_after']:.1f} on {r['machine']['cpus']} cores]")


if __name__ == "__main__":
    main()

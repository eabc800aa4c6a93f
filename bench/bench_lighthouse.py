"""The replica groups' Lighthouse (elastic/lighthouse.py) against torchft's own, side by side.

    .venv/bin/python bench/bench_lighthouse.py [--rounds 3] [--steps 300] [--groups 2]

Each round runs the same job twice, once per Lighthouse, in turn (this machine's speed drifts
over minutes): `--groups` one-process replica groups (a real torchft Manager each, gloo) step a
quorum, an all-reduce of a small tensor and a commit vote `--steps` times. Printed per
Lighthouse: the median quorum call and step attempt of the first group, and then what a lost
group costs: one group SIGKILLed, the time until the others commit a step without it (torchft's:
the heartbeat timeout; ours: a refused probe).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from elastic_gpt.testing.torchft_member import read_steps, start_member  # noqa: E402

HEARTBEAT_S = 1.5


def torchft_lighthouse():
    from torchft.coordination import LighthouseServer
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=int(2000 * HEARTBEAT_S),
                              quorum_tick_ms=10, heartbeat_timeout_ms=int(1000 * HEARTBEAT_S))
    return server, server.address(), server.shutdown


def our_lighthouse():
    from elastic_gpt.elastic.lighthouse import LighthouseServer
    server = LighthouseServer(min_replicas=1, join_timeout_ms=int(2000 * HEARTBEAT_S),
                              quorum_tick_ms=10, heartbeat_timeout_ms=int(1000 * HEARTBEAT_S))
    return server, server.address(), server.shutdown


def run(make, steps: int, groups: int, folder: str) -> dict:
    """Steady quorum and step times of group "a", then the cost of a lost group."""
    _, address, stop = make()
    out = os.path.join(folder, f"{make.__name__}-{time.time()}.jsonl")
    names = [chr(ord("a") + i) for i in range(groups)]
    members = {n: start_member(address, n, out, heartbeat_timeout_s=HEARTBEAT_S) for n in names}
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            together = [r for r in read_steps(out) if r["name"] == "a" and r["committed"]
                        and r["participants"] == groups]
            if len(together) >= steps:
                break
            time.sleep(0.1)
        steady, after = together[-steps:], []
        os.kill(members[names[-1]].pid, signal.SIGKILL)
        killed = time.time()
        while time.time() < deadline:
            after = [r for r in read_steps(out) if r["name"] == "a" and r["committed"]
                     and r["t"] > killed and r["participants"] == groups - 1]
            if after:
                break
            time.sleep(0.01)
    finally:
        for p in members.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
        stop()
    steps_s = [b["t"] - a["t"] for a, b in zip(steady, steady[1:])]
    return {"quorum_ms": 1000 * statistics.median(r["quorum_s"] for r in steady),
            "step_ms": 1000 * statistics.median(steps_s),
            "lost_group_s": after[0]["t"] - killed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--groups", type=int, default=2)
    args = p.parse_args()
    results: dict[str, list[dict]] = {"torchft": [], "elastic-gpt": []}
    with tempfile.TemporaryDirectory(prefix="bench-lighthouse-") as folder:
        for i in range(args.rounds):
            for name, make in (("torchft", torchft_lighthouse), ("elastic-gpt", our_lighthouse)):
                r = run(make, args.steps, args.groups, folder)
                results[name].append(r)
                print(f"round {i + 1} {name:12s} quorum {r['quorum_ms']:.2f} ms, step "
                      f"{r['step_ms']:.2f} ms (with a 20 ms sleep), a group SIGKILLed: the "
                      f"others without it after {r['lost_group_s']:.3f} s", flush=True)
    print(f"\n{args.groups} one-process groups, heartbeat timeout {HEARTBEAT_S} s, medians over "
          f"{args.rounds} round(s):")
    print("| Lighthouse | quorum call (ms) | step attempt (ms) | a group SIGKILLed -> others on (s) |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        print(f"| {name} | {statistics.median(r['quorum_ms'] for r in rs):.2f} | "
              f"{statistics.median(r['step_ms'] for r in rs):.2f} | "
              f"{statistics.median(r['lost_group_s'] for r in rs):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A replica group's quorum when another group hangs (parallel/replicate.py): two groups of two
ranks, real torchft Managers, the real Lighthouse, no Ray.

A rank stopped between two steps never asks for the next quorum. Its group's rank 0 waits for it
inside the quorum call, and its Manager (in that rank 0) keeps heartbeating, so the Lighthouse
keeps the other group waiting for it too: both calls time out at the same moment. The hung group
must fail (its own ranks do not all answer) and the healthy one must go on alone, not fail with it.
"""

from __future__ import annotations

import os
import signal

from elastic_gpt.elastic.lighthouse import LighthouseServer
from elastic_gpt.testing.ports import free_port
from elastic_gpt.testing.replica_group_rank import start_rank
from elastic_gpt.testing.torchft_member import read_steps, wait_for_steps

TIMEOUT_S = 2.0  # the hang timeout: the Manager's timeout, a group's collectives; quorum twice it
HEARTBEAT_S = 1.0
STOP_AFTER = 5
STEPS = 300


def test_a_rank_hung_between_steps_fails_its_group_and_not_the_other(tmp_path):
    departures = []
    server = LighthouseServer(min_replicas=1, join_timeout_ms=int(2000 * HEARTBEAT_S),
                              quorum_tick_ms=10, heartbeat_timeout_ms=int(1000 * HEARTBEAT_S),
                              on_departure=departures.append)
    out = str(tmp_path / "steps.jsonl")
    ports = [free_port(), free_port()]
    ranks = {(g, r): start_rank(server.address(), g, r, 2, ports[g], out, steps=STEPS,
                                timeout_s=TIMEOUT_S,
                                stop_after=STOP_AFTER if (g, r) == (1, 1) else None)
             for g in range(2) for r in range(2)}
    hung = ranks[(1, 1)]
    try:
        stopped = wait_for_steps(out, lambda lines: [
            r for r in lines if r.get("stopping")], "group 1 rank 1 stopping")[0]["t"]
        alone = wait_for_steps(out, lambda lines: [r for r in lines if r.get("group") == 0 and r["t"] >
                                          stopped and r.get("groups") == 1 and r["committed"]],
                      "group 0 stepping alone")[0]
        for rank in range(2):
            ranks[(0, rank)].join(timeout=60)
            assert ranks[(0, rank)].exitcode == 0, f"group 0 rank {rank} failed"
        ranks[(1, 0)].join(timeout=30)
    finally:
        os.kill(hung.pid, signal.SIGKILL)
        for process in ranks.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(timeout=10)
        server.shutdown()

    lines = read_steps(out)
    assert not [r for r in lines if r.get("group") == 0 and "error" in r], lines
    # The hung group failed, at its rank 0's barrier with the stopped rank after the quorum's
    # timeout, and left; group 0 went on alone once it had, and to the end.
    errors = [r for r in lines if (r["group"], r["rank"]) == (1, 0) and "error" in r]
    assert errors and ranks[(1, 0)].exitcode != 0, lines[-6:]
    failed = errors[0]["t"]
    assert 2 * TIMEOUT_S <= failed - stopped <= 2 * TIMEOUT_S + TIMEOUT_S + 10.0, failed - stopped
    assert alone["t"] >= failed - 0.5, (alone["t"], failed)
    finished = max(r["t"] for r in lines if r["group"] == 0)
    assert max(r["step"] for r in lines if r["group"] == 0 and r["committed"]) == STEPS - 1
    # Group 1 left the quorum once, said so on its way out; group 0 only when it finished.
    assert [(d.replica_id.split(":")[0], d.why) for d in departures
            if stopped < d.at < finished] == [("replica_group_1", "left")], departures
    print(f"\n[replica group quorum] hung rank stopped; its group failed after "
          f"{failed - stopped:.1f} s, group 0 alone after {alone['t'] - stopped:.1f} s "
          f"(hang timeout {TIMEOUT_S} s, quorum timeout {2 * TIMEOUT_S} s)")

"""The replica groups' Lighthouse on loopback (elastic/lighthouse.py, and the client of its Leave,
parallel/lighthouse_client.py): a group forgotten at once when it leaves or its process is gone,
but not when it is only stuck; a refused port told from a listening one."""

from __future__ import annotations

import os
import signal
import socket
import time

from elastic_gpt.elastic.lighthouse import (
    LighthouseServer,
    probe,
)
from elastic_gpt.parallel.lighthouse_client import LighthouseClient
from elastic_gpt.testing.torchft_member import read_steps, wait_for_steps

# ---- torchft's rules (its src/lighthouse.rs tests, case by case) -----------------------------


# ---- the server with real torchft managers -----------------------------------------------------


def test_probe_tells_a_refused_port_from_a_listening_one():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert probe(f"http://127.0.0.1:{port}") is True
    assert probe(f"http://127.0.0.1:{port}") is False


def test_leave_needs_a_lighthouse_and_says_so_without_raising():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = LighthouseClient(f"http://127.0.0.1:{port}")
    assert client.leave("replica_group_0:x", timeout_s=1.0) is False
    client.close()


def _first_alone_after(t: float, participants: int):
    def found(lines):
        return next((r for r in lines if r.get("name") == "a" and r["t"] > t and r["committed"]
                     and r["participants"] == participants), None)
    return found


def test_a_group_that_leaves_or_dies_is_dropped_at_once_and_a_stuck_one_after_its_heartbeat(
        tmp_path):
    """Four one-process groups: b leaves (and keeps heartbeating), c is SIGKILLed, d is stopped
    (SIGSTOP). Group a's quorum drops b and c at once, far inside the heartbeat timeout, and d
    only when its heartbeat times out: a stopped process still accepts the probe's connection."""
    from elastic_gpt.testing.torchft_member import start_member

    heartbeat_s = 3.0
    departures = []
    server = LighthouseServer(min_replicas=1, join_timeout_ms=int(2000 * heartbeat_s),
                              quorum_tick_ms=10, heartbeat_timeout_ms=int(1000 * heartbeat_s),
                              on_departure=departures.append)
    out, leave_now = str(tmp_path / "steps.jsonl"), str(tmp_path / "b-leaves")
    members = {name: start_member(server.address(), name, out, heartbeat_timeout_s=heartbeat_s,
                                  leave_when=leave_now if name == "b" else None)
               for name in "abcd"}
    try:
        wait_for_steps(out, lambda lines: len([r for r in lines if r.get("name") == "a"
                                      and r["participants"] == 4]) >= 5, "all four together")
        open(leave_now, "w").close()
        wait_for_steps(out, lambda lines: any(r.get("left") for r in lines), "b leaving")
        left = next(r["t"] for r in read_steps(out) if r.get("left"))
        after_leave = wait_for_steps(out, _first_alone_after(left, 3), "a without b")
        a_steps = [r for r in read_steps(out) if r.get("name") == "a" and r["t"] < left]
        wait_for_steps(out, lambda lines: [r for r in lines if r.get("name") == "a" and r["t"] >
                                  after_leave["t"] + 1.0], "a stepping on without b")

        os.kill(members["c"].pid, signal.SIGKILL)
        killed = time.time()
        after_kill = wait_for_steps(out, _first_alone_after(killed, 2), "a without c")

        os.kill(members["d"].pid, signal.SIGSTOP)
        stopped = time.time()
        after_stop = wait_for_steps(out, _first_alone_after(stopped, 1), "a without d",
                           timeout_s=6 * heartbeat_s)
        departed = list(departures)  # before the clean-up below kills the rest
    finally:
        for process in members.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join(timeout=10)
        server.shutdown()

    assert a_steps[-1]["participants"] == 4, a_steps[-3:]
    # b's heartbeats after its Leave do not bring it back: a went on with 3 for a second.
    lines = read_steps(out)
    assert all(r["participants"] == 3 for r in lines if r.get("name") == "a" and
               after_leave["t"] <= r["t"] < killed and r["committed"])
    why = {d.replica_id.split(":")[0]: d.why for d in departed}
    assert why == {"b": "left", "c": "probe refused", "d": "heartbeat timeout"}, departed
    # a, waiting for the killed c, waited a probe or two at the Lighthouse, not a heartbeat
    waited = {d.replica_id.split(":")[0]: d.waited_s for d in departed}
    assert waited["c"] is not None and waited["c"] < heartbeat_s / 3, departed
    # Dropped at once: far inside the heartbeat timeout (a step here is a few milliseconds).
    assert after_leave["t"] - left < heartbeat_s / 3, after_leave["t"] - left
    assert after_kill["t"] - killed < heartbeat_s / 3, after_kill["t"] - killed
    # The stopped process is dropped by its heartbeat alone, not sooner.
    assert heartbeat_s - 0.5 <= after_stop["t"] - stopped <= 2 * heartbeat_s, \
        after_stop["t"] - stopped
    print(f"\n[lighthouse] dropped after: leave {after_leave['t'] - left:.3f} s, SIGKILL "
          f"{after_kill['t'] - killed:.3f} s, SIGSTOP {after_stop['t'] - stopped:.2f} s "
          f"(heartbeat timeout {heartbeat_s} s)")

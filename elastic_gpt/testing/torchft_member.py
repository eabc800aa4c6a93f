"""A replica group of one process for Lighthouse tests and benchmarks: a real torchft `Manager`
(its Rust `ManagerServer`, gloo) that steps a quorum, an all-reduce and a commit vote in a loop and
reports each step attempt. No model, no Ray: what is under test is the quorum service.

`start_member(lighthouse, name, out)` starts one; each step attempt is a line of JSON appended to
`out` (`t`, `step`, `participants`, `committed`, `quorum_s`). `leave_when=PATH`: after the first
step committed once that file exists, the member says `Leave` and then idles with its manager
(and its heartbeats) still running.
"""

from __future__ import annotations

import json
import os
import time

from elastic_gpt.testing import preloaded


def start_member(lighthouse: str, name: str, out: str, *, steps: int = 10_000,
                 leave_when: str | None = None, heartbeat_timeout_s: float = 5.0):
    """A started process (`preloaded.py`; its pid is the one to kill or stop)."""
    return preloaded.start(_member_main, lighthouse, name, out, steps, leave_when,
                           heartbeat_timeout_s)


def read_steps(out: str) -> list[dict]:
    """Every line the members wrote to `out` so far."""
    if not os.path.exists(out):
        return []
    with open(out) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for_steps(out: str, found, what: str, timeout_s: float = 60.0):
    """What `found(lines)` returns once it is truthy, reading `out` as it grows; TimeoutError
    naming `what` and the last lines if it never is."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        hit = found(read_steps(out))
        if hit:
            return hit
        time.sleep(0.02)
    raise TimeoutError(f"never saw {what}: {read_steps(out)[-6:]}")


def _member_main(lighthouse: str, name: str, out: str, steps: int, leave_when: str | None,
                 timeout_s: float) -> None:
    from datetime import timedelta

    import torch
    import torchft
    from torch.distributed import TCPStore

    from elastic_gpt.parallel.lighthouse_client import LighthouseClient

    state = torch.zeros(4)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # A collective with a stopped peer gives up after the heartbeat timeout, as a quorum
    # without it forms then; the quorum call itself may wait longer (a joiner being healed).
    timeout = timedelta(seconds=timeout_s)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda s: state.copy_(s["state"]), state_dict=lambda: {"state": state},
        replica_id=name, rank=0, world_size=1, lighthouse_addr=lighthouse, timeout=timeout,
        quorum_timeout=10 * timeout, init_sync=False, store_addr="127.0.0.1", store_port=store.port)
    client = LighthouseClient(lighthouse)
    with open(out, "a", buffering=1) as f:
        while manager.current_step() < steps:
            t0 = time.perf_counter()
            manager.start_quorum()
            quorum_s = time.perf_counter() - t0
            grad = torch.ones(4)
            manager.allreduce(grad).wait()
            committed = manager.should_commit()
            if committed:
                state.add_(grad)
            f.write(json.dumps({"t": time.time(), "name": name, "step": manager.current_step(),
                                "participants": manager.num_participants(),
                                "committed": committed, "quorum_s": quorum_s}) + "\n")
            if leave_when is not None and committed and os.path.exists(leave_when):
                replica_id = manager._store.get(torchft.manager.REPLICA_ID_KEY).decode()
                client.leave(replica_id)
                f.write(json.dumps({"t": time.time(), "name": name, "left": True}) + "\n")
                while True:  # gone from the quorum, still heartbeating
                    time.sleep(1)
            time.sleep(0.02)
    manager.shutdown(wait=False)

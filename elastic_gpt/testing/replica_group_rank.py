"""One rank of a replica group for tests without Ray: `parallel.replicate.ReplicaGroup` (a real
torchft `Manager`, gloo) over a tiny linear model, stepping the Trainer's sequence of calls (the
quorum, the group's own gradient all-reduce, the cross-group one, the stats, the commit vote).

`start_rank(lighthouse, group, rank, size, port, out)` starts one; ranks of one group share `port`
(their process group's store, which the Manager uses too). Each step attempt is a line of JSON
appended to `out` (`t`, `group`, `rank`, `step`, `groups`, `committed`); a rank that fails writes
`error` with the exception's type and message, says `Leave` (as the Trainer's exit does) and
exits.
`stop_after=N`: once it has committed N steps with both groups, the rank writes `stopping` and
stops itself (SIGSTOP) between two steps: after its last collective of one, before its next quorum.
"""

from __future__ import annotations

import json
import os
import signal
import time

from elastic_gpt.testing import preloaded


def start_rank(lighthouse: str, group: int, rank: int, size: int, port: int, out: str, *,
               steps: int, timeout_s: float, stop_after: int | None = None):
    """A started process (`preloaded.py`; its pid is the one to kill or stop)."""
    return preloaded.start(_rank_main, lighthouse, group, rank, size, port, out, steps, timeout_s,
                           stop_after)


def _rank_main(lighthouse: str, group: int, rank: int, size: int, port: int, out: str,
               steps: int, timeout_s: float, stop_after: int | None) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from elastic_gpt.parallel.replicate import ReplicaGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    member = ReplicaGroup(lighthouse=lighthouse, group=group, group_rank=rank, group_size=size,
                          groups=2, timeout_s=timeout_s)
    member.attach(model, optimizer, torch.device("cpu"))

    def write(f, **record) -> None:
        f.write(json.dumps({"t": time.time(), "group": group, "rank": rank, **record}) + "\n")

    with open(out, "a", buffering=1) as f:
        try:
            step = together = 0
            while step < steps:
                step, dp_rank, dp_degree = member.begin_step(rank, size)
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 64 + dp_rank))
                model(x).square().mean().backward()
                for p in model.parameters():  # the group's own gradient sync (FSDP's, here)
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                member.reduce_gradients()
                stats = torch.zeros(4)
                member.reduce_stats(stats)
                committed = member.should_commit(step, stats)
                if committed:
                    optimizer.step()
                optimizer.zero_grad()
                together += committed and member.live_groups == 2
                stopping = together == stop_after
                write(f, step=step, groups=member.live_groups, committed=committed,
                      stopping=stopping)
                step += committed
                if stopping:
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(0.02)  # a step's compute: groups that start apart overlap
        except Exception as e:
            write(f, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            member.shutdown()  # says Leave first

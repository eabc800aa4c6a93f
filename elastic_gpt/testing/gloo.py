"""Real gloo process groups on loopback for tests and benchmarks, without Ray.

`run_gloo(fn, world, *args)` starts `world` processes (`preloaded.py`: forked from a server that
has imported torch and the trainer's modules), joins them into one gloo group,
runs `fn(rank, world, *args)` in each and returns what each rank returned; a rank that raises
(or dies) makes it raise. `gloo_group()` makes this process a group of one for a with-block.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from elastic_gpt.testing import preloaded
from elastic_gpt.testing.ports import free_port


def run_gloo(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` ranks of one gloo group; their return values,
    by rank. fn and its arguments must pickle (a module-level function of an importable module),
    and so must what it returns (tensors included: it travels through torch.save)."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo-") as out:
        # start_processes joins every rank, and if one fails it stops the others and raises.
        preloaded.context()  # the fork server start_processes forks from, with its preload
        mp.start_processes(_rank_main,
                           args=(fn, world, free_port(), out, args, preloaded.caller()),
                           nprocs=world, start_method="forkserver")
        return [torch.load(os.path.join(out, f"{rank}.pt"), weights_only=False)
                for rank in range(world)]


def _rank_main(rank: int, fn: Callable[..., Any], world: int, port: int, out: str,
               args: tuple, caller: tuple) -> None:
    preloaded.adopt(caller)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = fn(rank, world, *args)
        try:  # no rank tears the group down while a peer is still in a collective on it
            dist.barrier()
        except RuntimeError:  # a peer failed: its error is the one start_processes reports
            pass
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    # The result is on disk: leave without the interpreter's teardown. C++ objects that outlive
    # destroy_process_group (the device mesh's sub-groups, a compiled graph's) are freed at exit in
    # no set order, and a background thread freed while still joinable aborts the process
    # (SIGABRT, "terminate called without an active exception") after the work has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def gloo_group() -> Iterator[None]:
    """This process as rank 0 of a gloo group of one (what a single-GPU run has, with nccl), for
    the with-block. A default group that already exists is used as it is and left up."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

"""Real gloo process groups on loopback for tests and benchmarks, without Ray.

`run_gloo(fn, world, *args)` starts `world` processes (forked from a server that has imported
torch and the trainer's modules, and nothing else), joins them into one gloo group,
runs `fn(rank, world, *args)` in each and returns what each rank returned; a rank that raises
(or dies) makes it raise. `gloo_group()` makes this process a group of one for a with-block.
Nothing here uses the Trainer or the model: it only names their modules, to import them ahead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from elastic_gpt.testing.ports import free_port

# Imported once, by the fork server, before it forks any rank: each rank then starts in a fraction
# of a second instead of importing torch and the trainer anew, which on a small CI machine is most
# of a short multi-process test. (A module that fails to import here is imported by the rank.)
PRELOADED = ("numpy", "torch", "torch.distributed", "torch.distributed.fsdp",
             "torch.distributed.tensor", "torch.distributed.pipelining",
             "torch.distributed.checkpoint", "elastic_gpt.config", "elastic_gpt.model.gpt",
             "elastic_gpt.train.trainer")


def run_gloo(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` ranks of one gloo group; their return values,
    by rank. fn and its arguments must pickle (a module-level function of an importable module),
    and so must what it returns (tensors included: it travels through torch.save)."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo-") as out:
        # A fork server, not a fork of this process: a forked child would inherit this process's
        # torch threads and locks; the server is a fresh process that has only imported modules.
        # It was started with the environment of its first use, so each rank is handed this
        # process's environment as it is now. start_processes joins every rank, and if one fails
        # it stops the others and raises.
        mp.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
        mp.start_processes(_rank_main, args=(fn, world, free_port(), out, args, dict(os.environ)),
                           nprocs=world, start_method="forkserver")
        return [torch.load(os.path.join(out, f"{rank}.pt"), weights_only=False)
                for rank in range(world)]


def _rank_main(rank: int, fn: Callable[..., Any], world: int, port: int, out: str,
               args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
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

"""Processes for tests and benchmarks that start without importing torch anew: each is forked from
one multiprocessing fork server per test process, which has imported torch and the trainer's
modules and nothing else. A spawned process imports them itself, which on a small CI machine is
most of a short multi-process test.

`start(target, *args)` starts one (its pid is the one to kill or stop); `context()` is the
multiprocessing context, for `torch.multiprocessing.start_processes`, with `caller()` handed to
the child and `adopt(...)` called first there: the server keeps the environment, working
directory and import path of its first use, so a child takes the caller's as they are now.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

# Imported once, by the fork server, before it forks anything. (A module that fails to import
# there is imported by the child that needs it.)
PRELOADED = ("numpy", "torch", "torch.distributed", "torch.distributed.fsdp",
             "torch.distributed.tensor", "torch.distributed.pipelining",
             "torch.distributed.checkpoint", "elastic_gpt.config", "elastic_gpt.model.gpt",
             "elastic_gpt.train.trainer")


def context():
    """The fork-server context. A fork server, not a fork of the caller: a forked child would
    inherit the caller's torch threads and locks; the server is a fresh process that has only
    imported modules."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def start(target: Callable[..., Any], *args: Any, daemon: bool = True):
    """`target(*args)` in a started process, as if started from here. target and args must
    pickle (a module-level function of an importable module)."""
    process = context().Process(target=_run, args=(caller(), target, args), daemon=daemon)
    process.start()
    return process


def caller() -> tuple[dict[str, str], str, list[str]]:
    """This process's environment, working directory and import path."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def adopt(state: tuple[dict[str, str], str, list[str]]) -> None:
    """In the child: the caller's environment, working directory and import path."""
    environment, cwd, path = state
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    sys.path[:] = path


def _run(state: tuple[dict[str, str], str, list[str]], target: Callable[..., Any],
         args: tuple) -> Any:
    adopt(state)
    return target(*args)

"""Unit tests start nothing and wait for nothing: no process, no socket, no process group, no
sleep, and each test's own work (its call, fixtures apart) within UNIT_TEST_BUDGET_S. That is what
keeps `make test-fast` fast; a test that needs more belongs in tests/integration (processes,
process groups, loopback servers, command-line subprocesses) or tests/system (Ray). This file
fails a unit test that crosses the line, naming what it started, so the split cannot drift.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import socket
import subprocess
import threading
import time

import pytest

# Imported before any test is guarded: a first `import mlflow` runs `uname` (its telemetry schema
# reads platform.platform(), which Python answers from a subprocess once per process).
import mlflow  # noqa: F401,E402  isort: skip

UNIT_TEST_BUDGET_S = 8.0
"""A unit test's call on 2 idle cores stays well under this; one over it fails."""

GIT_COMMIT_ENV = "ELASTIC_GPT_GIT_COMMIT"  # tracking/runs.git_commit reads it before asking git
MOVE_IT = "a unit test starts nothing; move it to tests/integration (or tests/system for Ray)"


class StartedSomething(RuntimeError):
    pass


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise StartedSomething(f"{what}: {MOVE_IT}")
    return refuse


def _guards(record_sleep) -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for everything a unit test must not do."""
    real_sleep = time.sleep

    def sleep(seconds):
        if seconds and seconds > 0 and threading.current_thread() is threading.main_thread():
            record_sleep(seconds)
        return real_sleep(seconds)

    guards = [(subprocess.Popen, "__init__", _refuse("started a subprocess")),
              (multiprocessing.process.BaseProcess, "start", _refuse("started a process")),
              (socket.socket, "connect", _refuse("opened a socket connection")),
              (socket.socket, "connect_ex", _refuse("opened a socket connection")),
              (socket.socket, "bind", _refuse("bound a socket")),
              (time, "sleep", sleep)]
    try:
        import torch.distributed as dist
        guards.append((dist, "init_process_group", _refuse("made a process group")))
    except ImportError:
        pass
    return guards


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    t0 = time.perf_counter()
    with _guarded(item, "call"):
        result = yield
    took = time.perf_counter() - t0
    if took > UNIT_TEST_BUDGET_S:
        pytest.fail(f"{item.nodeid} took {took:.1f} s, over the unit budget of "
                    f"{UNIT_TEST_BUDGET_S:.0f} s: make it faster or move it to tests/integration",
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _guarded(item, "teardown"):
        return (yield)


@contextlib.contextmanager
def _guarded(item, phase: str):
    slept: list[float] = []
    saved = []
    for owner, name, replacement in _guards(slept.append):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)
    # The code's commit, which a run records, is given: asking git would start a process.
    commit = os.environ.get(GIT_COMMIT_ENV)
    os.environ[GIT_COMMIT_ENV] = commit or "unit-tests"
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
        if commit is None:
            os.environ.pop(GIT_COMMIT_ENV, None)
    if slept:
        pytest.fail(f"{item.nodeid} slept {sum(slept):.2f} s in its {phase}: a unit test waits "
                    "for nothing; move it to tests/integration", pytrace=False)

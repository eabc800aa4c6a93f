"""Processes started from the fork server (testing/preloaded.py) run as if started by the caller
as it is at the start, not as it was when the server started: its environment (tests set
variables the code reads), working directory and import path; and with the server's modules
already imported."""

from __future__ import annotations

import os
import sys

from elastic_gpt.testing.gloo import run_gloo

VARIABLE = "ELASTIC_GPT_PRELOADED_TEST"


def _seen(rank: int, world: int) -> tuple:
    # The trainer is imported by the server only: neither a rank's start nor this module imports
    # it, so a spawned rank would not have it.
    return (os.environ.get(VARIABLE), os.getcwd(), sys.path[0],
            "elastic_gpt.train.trainer" in sys.modules)


def test_a_rank_takes_the_callers_environment_directory_and_path_as_they_are_now(
        tmp_path, monkeypatch):
    run_gloo(_seen, 1)  # the server is up, started with the state before the changes below
    monkeypatch.setenv(VARIABLE, "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    seen = run_gloo(_seen, 2)
    assert seen == [("set after the server started", str(tmp_path), str(tmp_path / "code"),
                     True)] * 2
    monkeypatch.delenv(VARIABLE)
    assert run_gloo(_seen, 1)[0][0] is None

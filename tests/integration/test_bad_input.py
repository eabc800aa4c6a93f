"""Bad input that only a server or a mount shows (C6 clear errors): the cases of
tests/bad_input_cases.py that reach the loopback S3 server, a read-only mount or a closed port,
each one line and exit 2 with nothing changed."""

from __future__ import annotations

import pytest

from tests.bad_input_cases import (
    CASES,
    NEEDS_SERVER,
    assert_one_line_exit_2_and_nothing_changed,
    make_world,
)

WITH_SERVERS = [c for c in CASES if c.needs in NEEDS_SERVER]


@pytest.fixture(scope="module")
def world(tmp_path_factory, stdlib_dataset):
    yield from make_world(str(tmp_path_factory.mktemp("world")), stdlib_dataset, servers=True)


@pytest.mark.parametrize("case", WITH_SERVERS, ids=[c.id for c in WITH_SERVERS])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, world, monkeypatch, capsys):
    assert_one_line_exit_2_and_nothing_changed(case, world, monkeypatch, capsys)

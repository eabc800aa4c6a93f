"""Bad input that fails in this process, before any server, mount or cluster is reached (C6 clear
errors): every case of tests/bad_input_cases.py that needs nothing more, the table's coverage of
every subcommand, and its copy in docs/operations.md."""

from __future__ import annotations

import pytest

from tests.bad_input_cases import (
    CASES,
    DOCS,
    TABLE_END,
    TABLE_START,
    Case,
    assert_one_line_exit_2_and_nothing_changed,
    make_world,
    render_table,
    run_case,
    train,
)

IN_PROCESS = [c for c in CASES if not c.needs]


@pytest.fixture(scope="module")
def world(tmp_path_factory, stdlib_dataset):
    yield from make_world(str(tmp_path_factory.mktemp("world")), stdlib_dataset, servers=False)


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.id for c in IN_PROCESS])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, world, monkeypatch, capsys):
    assert_one_line_exit_2_and_nothing_changed(case, world, monkeypatch, capsys)


def test_replica_groups_without_torchft_is_one_line(world, monkeypatch, capsys):
    """The ft extra missing: `import torchft` fails (a None entry in sys.modules is how the
    import system says a module is absent), and train says what to install, before Ray starts."""
    import sys

    from elastic_gpt.parallel.replicate import FT_MISSING

    monkeypatch.setitem(sys.modules, "torchft", None)
    case = Case("replica-groups-without-torchft", train("elastic.replica_groups=2",
                                                        "scaling.max_workers=2"),
                FT_MISSING, "replica groups without torchft")
    before, runs_before = world.digest(), world.runs()
    code, output = run_case(case, world, monkeypatch, capsys)
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, output
    assert lines[0] == f"elastic-gpt train: error: {FT_MISSING}", output
    assert world.runs() == runs_before and world.digest() == before


def test_there_are_at_least_fifty_cases_over_every_subcommand():
    from elastic_gpt.cli import build_parser
    assert len(CASES) >= 50
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    assert {c.command for c in CASES} == subcommands
    assert len({c.id for c in CASES}) == len(CASES)


def test_the_failure_table_in_the_docs_is_this_table():
    with open(DOCS) as f:
        text = f.read()
    assert TABLE_START in text and TABLE_END in text, f"{DOCS} lacks the generated table"
    current = text[text.index(TABLE_START):text.index(TABLE_END) + len(TABLE_END)]
    assert current == render_table(), ("docs/operations.md's failure table is stale: run "
                                      ".venv/bin/python -m tests.bad_input_cases --write-docs")

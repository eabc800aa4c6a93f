"""The `elastic-gpt` command as a user runs it: --help everywhere, and bad input (C6 clear errors)
gives one readable line, exit code 2, and leaves committed checkpoints untouched."""

from __future__ import annotations

import os

import pytest

from elastic_gpt.cli import main


@pytest.mark.parametrize("command", ["prepare-data", "train", "generate", "export-hf", "plan"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "usage: elastic-gpt" in capsys.readouterr().out


def assert_one_error_line(code: int, capsys, message: str) -> None:
    """Exit 2 and one `elastic-gpt train: error:` line on stderr that names the problem (C6 clear
    errors)."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-gpt train: error: "), err
    assert message in lines[0]


@pytest.mark.parametrize("args,message", [
    (["train.lrr=1"], "unknown config key 'train.lrr'"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"],
     "is not a multiple of train.micro_batch_size=4"),
    (["data.path=/nonexistent/dataset"], "/nonexistent/dataset"),
])
def test_bad_train_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    code = main(["train", "--config", "jobs/configs/mini.yaml", f"checkpoint.path={tmp_path}/c",
                 f"tracking.uri=sqlite:///{tmp_path}/m.db", *args])
    assert_one_error_line(code, capsys, message)


@pytest.mark.parametrize("args,message", [
    # The tiny preset has 2 heads: 4 tensor-parallel ranks cannot each take whole heads.
    (["parallel.tp=4", "scaling.min_workers=4", "scaling.max_workers=4"],
     "parallel.tp=4 does not divide model.n_head=2 (each tensor-parallel rank needs whole "
     "attention heads); use parallel.tp in {1, 2} or a model.n_head that tp divides"),
    (["parallel.tp=2", "scaling.min_workers=3", "scaling.max_workers=4"],
     "must be multiples of parallel.tp=2"),
])
def test_a_layout_the_model_cannot_take_is_one_line_and_exit_2(args, message, stdlib_dataset,
                                                              tmp_path, capsys):
    code = main(["train", "--config", "jobs/configs/mini.yaml", "model.preset=tiny",
                 f"data.path={stdlib_dataset}", f"checkpoint.path={tmp_path}/c",
                 f"tracking.uri=sqlite:///{tmp_path}/m.db", *args])
    assert_one_error_line(code, capsys, message)
    assert not os.path.exists(tmp_path / "c")


def test_generate_and_export_name_a_missing_checkpoint(tmp_path, capsys):
    for args in (["generate", "--prompt", "x"], ["export-hf", "--out", str(tmp_path / "hf")]):
        assert main([*args, "--checkpoint", str(tmp_path / "nothing-here")]) == 2
        assert "no committed checkpoint under" in capsys.readouterr().err

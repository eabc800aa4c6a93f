"""The `elastic-gpt` command as a user runs it: --help everywhere, and bad input (C6 clear errors)
gives one readable line, exit code 2, and leaves committed checkpoints untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from elastic_gpt.checkpoint.sharded import save_sharded
from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname
from elastic_gpt.cli import main
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT

CLI = [sys.executable, "-m", "elastic_gpt.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("command", ["prepare-data", "train", "generate", "export-hf", "plan"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "usage: elastic-gpt" in capsys.readouterr().out


def tree_digest(root: str) -> str:
    """Every folder (an empty one left behind counts) and every file's path and bytes."""
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        h.update(dirpath.encode())
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            h.update(path.encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def other_shape_checkpoint(tmp_path_factory, stdlib_dataset):
    """A committed checkpoint of a 3-layer model, as if from an earlier run with another shape."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    store = CheckpointStore(root)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=64, seq_len=64, vocab_size=320)
    store.prepare_step_dir(5)
    save_sharded(store.url(step_dirname(5)), GPT(cfg), None)
    store.commit(5, {"step": 5, "samples_seen": 5 * 12, "model_shape": cfg.shape(),
                     "global_batch_size": 12})
    return root


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


def test_checkpoint_of_another_shape_is_refused_and_left_alone(  # a real process: exit code 2
other_shape_checkpoint,
                                                               stdlib_dataset, tmp_path):
    before = tree_digest(other_shape_checkpoint)
    out = cli("train", "--config", "jobs/configs/mini.yaml", "model.preset=tiny",
              f"data.path={stdlib_dataset}", f"checkpoint.path={other_shape_checkpoint}",
              f"tracking.uri=sqlite:///{tmp_path}/m.db", "train.global_batch_size=12",
              "train.micro_batch_size=2")
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "another model shape" in line and "n_layer: checkpoint 3 vs config 2" in line
    assert tree_digest(other_shape_checkpoint) == before


def test_generate_and_export_name_a_missing_checkpoint(tmp_path, capsys):
    for args in (["generate", "--prompt", "x"], ["export-hf", "--out", str(tmp_path / "hf")]):
        assert main([*args, "--checkpoint", str(tmp_path / "nothing-here")]) == 2
        assert "no committed checkpoint under" in capsys.readouterr().err

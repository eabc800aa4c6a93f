"""The `elastic-gpt` command in its own process (`python -m elastic_gpt.cli`): a checkpoint of
another model shape is refused in one line, exit 2, and left untouched (C6 clear errors)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_gpt.checkpoint.sharded import save_sharded
from elastic_gpt.checkpoint.store import CheckpointStore, step_dirname
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT
from tests.file_trees import tree_digest

CLI = [sys.executable, "-m", "elastic_gpt.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)




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



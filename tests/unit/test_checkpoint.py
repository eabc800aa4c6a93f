"""Checkpoint commit protocol (C4 atomic commit) with real DCP files on disk, in one process: torn
steps are invisible or skipped, retention keeps the newest, leftovers are cleaned, loading refuses
code in metadata; async_save=auto is asynchronous on CUDA only."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from elastic_gpt.checkpoint.sharded import (
    load_model_weights,
    save_sharded,
)
from elastic_gpt.checkpoint.store import COMMIT_MARKER, CheckpointStore, step_dirname
from elastic_gpt.model.gpt import GPT
from tests.tiny_models import CFG, models


def save_step(store: CheckpointStore, step: int, model: torch.nn.Module) -> str:
    store.prepare_step_dir(step)
    url = store.url(step_dirname(step))
    save_sharded(url, model, None)
    store.commit(step, {"step": step, "samples_seen": step, "model_shape": CFG.shape()})
    return url


def test_newest_committed_step_loads_back_exactly(tmp_path):
    store = CheckpointStore(str(tmp_path))
    a, b = models(2)
    save_step(store, 10, a)
    save_step(store, 20, b)
    latest = store.latest()
    assert latest.step == 20 and latest.state["step"] == 20
    fresh = GPT(CFG)
    load_model_weights(latest.url, fresh)
    for (n, p), (_, q) in zip(fresh.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_uncommitted_step_is_invisible(tmp_path):
    store = CheckpointStore(str(tmp_path))
    a, b = models(2)
    save_step(store, 10, a)
    save_step(store, 20, b)
    os.remove(tmp_path / step_dirname(20) / COMMIT_MARKER)  # the marker never got written
    assert store.latest().step == 10


def test_truncated_shard_of_a_committed_step_is_skipped_with_a_warning(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    a, b = models(2)
    save_step(store, 10, a)
    save_step(store, 20, b)
    shard = next(p for p in (tmp_path / step_dirname(20)).iterdir() if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    latest = store.latest()
    assert latest.step == 10
    assert "torn write" in caplog.text and step_dirname(20) in caplog.text


def test_retention_keeps_the_newest_and_cleans_leftovers(tmp_path):
    store = CheckpointStore(str(tmp_path))
    m = models(1)[0]
    for step in (10, 20, 30, 40):
        save_step(store, step, m)
    os.makedirs(tmp_path / step_dirname(25))  # leftover of a crashed save, older than newest
    os.makedirs(tmp_path / step_dirname(50))  # could be an in-flight async save: keep
    assert store.retain(keep=2) == [10, 20, 25]
    assert sorted(store.step_dirs()) == [30, 40, 50]
    assert store.retain(keep=0) == [30]  # keep=0 still never deletes the newest committed one
    assert store.latest().step == 40
    assert store.remove_uncommitted() == [50]  # at a restart nothing is in flight


def test_metadata_that_would_run_code_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path))
    url = save_step(store, 10, models(1)[0])

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(tmp_path / step_dirname(10) / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(Exception, match="tampered|refus"):
        load_model_weights(url, GPT(CFG))
    assert not (tmp_path / "pwned").exists()


def test_run_info_round_trips_atomically(tmp_path):
    store = CheckpointStore(str(tmp_path / "new-root"))
    assert store.read_run_info() is None
    store.write_run_info({"mlflow_run_id": "abc"})
    assert store.read_run_info() == {"mlflow_run_id": "abc"}
    assert not [p for p in os.listdir(tmp_path / "new-root") if ".tmp-" in p]


# ---- the clock cadence, on every rank ------------------------------------------------------------


# ---- several write streams per rank, to S3, loaded at another world size --------------------------


# ---- async_save: auto ------------------------------------------------------------------------------


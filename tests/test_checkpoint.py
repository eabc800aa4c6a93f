"""Checkpoint commit protocol (C4 atomic commit) with real DCP files on disk: torn steps are
invisible or skipped, retention keeps the newest, leftovers are cleaned, loading refuses code in
metadata; both checkpointers save on the same cadence and commit the same way."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from elastic_gpt.checkpoint.checkpointer import AsyncCheckpointer, make_checkpointer
from elastic_gpt.checkpoint.sharded import load_model_weights, save_sharded
from elastic_gpt.checkpoint.store import COMMIT_MARKER, CheckpointStore, step_dirname
from elastic_gpt.config import CheckpointSection
from elastic_gpt.model.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=32)


def save_step(store: CheckpointStore, step: int, model: torch.nn.Module) -> str:
    store.prepare_step_dir(step)
    url = store.url(step_dirname(step))
    save_sharded(url, model, None)
    store.commit(step, {"step": step, "samples_seen": step, "model_shape": CFG.shape()})
    return url


def models(n: int) -> list[GPT]:
    out = []
    for i in range(n):
        m = GPT(CFG)
        m.init_weights(seed=i)
        out.append(m)
    return out


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


@pytest.fixture
def one_rank_group():
    """A process group of this process alone: the checkpointers' collectives need one."""
    from elastic_gpt.testing.gloo import gloo_group
    with gloo_group():
        yield


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpointer_saves_on_its_cadence_and_when_forced(tmp_path, async_save, one_rank_group):
    store = CheckpointStore(str(tmp_path))
    model = models(1)[0]
    state, flushes, blocked = {}, [], []
    ckpt = make_checkpointer(
        CheckpointSection(path=str(tmp_path), every_steps=3, keep=10, async_save=async_save),
        store, rank=0, model=model, optimizer=None, trainer_state=lambda: state,
        before_save=lambda: flushes.append(state["step"]), on_blocked=blocked.append)
    assert isinstance(ckpt, AsyncCheckpointer) == async_save
    saved = []
    for step in range(1, 8):
        state["step"] = step
        ckpt.poll()
        if ckpt.save(step, force=step == 7):  # 7: the last step
            saved.append(step)
    ckpt.finish()
    assert saved == flushes == [3, 6, 7] and len(blocked) == 3
    assert sorted(store.step_dirs()) == saved
    for step in saved:  # committed, with the trainer state as it was when the save was taken
        assert store.verify(step) is None and store.read_state(step) == {"step": step}
    fresh = GPT(CFG)
    load_model_weights(store.latest().url, fresh)
    for (n, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n

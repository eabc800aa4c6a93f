"""The checkpointers under a process group: both save on the same cadence and commit the same
way, only the group that saves writes, a rollback's discard waits out the save in flight, the
clock cadence (every_minutes) is rank 0's on every rank, and shards written by several streams
per rank to the loopback S3 server load back bit for bit at another world size."""

from __future__ import annotations

import pytest
import torch

from elastic_gpt.checkpoint.checkpointer import (
    AsyncCheckpointer,
    SyncCheckpointer,
    make_checkpointer,
    resolve_async_save,
)
from elastic_gpt.checkpoint.sharded import (
    load_model_weights,
    load_sharded,
    save_sharded,
    training_state_dict,
)
from elastic_gpt.checkpoint.store import CheckpointStore
from elastic_gpt.config import CheckpointSection
from elastic_gpt.model.config import GPTConfig
from elastic_gpt.model.gpt import GPT
from elastic_gpt.testing.gloo import run_gloo
from tests.tiny_models import CFG, models


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
        if ckpt.save(step, last_step=step == 7):
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


def test_discard_after_waits_out_the_save_in_flight_then_deletes_it(tmp_path, one_rank_group):
    """A rollback abandons every step after its target: a save of one of them still in flight
    lands first (its commit is a second away here), then it is deleted with the others."""
    import time

    store = CheckpointStore(str(tmp_path))
    ckpt = make_checkpointer(
        CheckpointSection(path=str(tmp_path), every_steps=1, keep=10, async_save=True), store,
        rank=0, model=models(1)[0], optimizer=None, trainer_state=lambda: {},
        extra_files=lambda step_url: time.sleep(1.0))  # before the commit, in the background
    for step in (1, 2, 3):
        assert ckpt.save(step)
    assert ckpt.in_flight  # step 3's write
    assert ckpt.discard_after(1) == [2, 3]
    assert not ckpt.in_flight and sorted(store.step_dirs()) == [1]
    ckpt.finish()
    assert store.latest().step == 1


def test_who_saves_and_what_a_start_removes(tmp_path, one_rank_group):
    """A group that does not save this step (another replica group leads it, or suspect steps
    are re-run) writes nothing, not even a last step. At the start, an uncommitted step folder is
    a leftover only where this group writes alone: with other writers it may be a save in
    flight."""
    store = CheckpointStore(str(tmp_path))
    args = dict(rank=0, model=models(1)[0], optimizer=None, trainer_state=lambda: {})
    section = CheckpointSection(path=str(tmp_path), every_steps=1, keep=10, async_save=False)
    idle = make_checkpointer(section, store, may_save=lambda: False, **args)
    assert not idle.save(4, last_step=True) and store.step_dirs() == {}
    store.prepare_step_dir(5)
    (tmp_path / "step_00000005" / "part.distcp").write_bytes(b"torn")
    make_checkpointer(section, store, writes_alone=False, **args).start()
    assert sorted(store.step_dirs()) == [5]
    make_checkpointer(section, store, writes_alone=True, **args).start()
    assert store.step_dirs() == {}


# ---- the clock cadence, on every rank ------------------------------------------------------------

def _clock_cadence_rank(rank: int, world: int, root: str) -> dict:
    """Ten steps, each 1 minute long by rank 0's clock and 7 by rank 1's: rank 0's decides. Two
    runs: the clock alone (every 2.5 minutes, synchronous saves), and both cadences (every 4
    steps or 2.5 minutes, asynchronous saves)."""
    torch.manual_seed(0)  # the same weights on every rank: the model is replicated here
    model, saved = models(1)[0], {}
    for run, (every_steps, async_save) in {"clock": (0, False), "both": (4, True)}.items():
        now, state = [0.0], {}
        store = CheckpointStore(f"{root}/{run}")
        ckpt = make_checkpointer(
            CheckpointSection(every_steps=every_steps, every_minutes=2.5, keep=10,
                              async_save=async_save), store, rank=rank, model=model,
            optimizer=None, trainer_state=lambda state=state: state, clock=lambda now=now: now[0])
        saved[run] = []
        for step in range(1, 11):
            now[0] += 60.0 if rank == 0 else 420.0
            state["step"] = step
            ckpt.poll()
            if ckpt.save(step, last_step=step == 10):
                saved[run].append(step)
        ckpt.finish()
    return saved


def test_every_minutes_saves_at_rank_0s_step_on_every_rank(tmp_path):
    saved = run_gloo(_clock_cadence_rank, 2, str(tmp_path))
    # The clock alone: 3 minutes since the start at step 3, then again 3 later. With both
    # cadences the step cadence saves at 4 and 8, and each of those saves restarts the clock.
    expected = {"clock": [3, 6, 9, 10], "both": [3, 4, 7, 8, 10]}
    assert saved == [expected, expected]  # rank 1's own clock would have saved at every step
    for run, steps in expected.items():
        store = CheckpointStore(str(tmp_path / run))
        assert sorted(store.step_dirs()) == steps
        assert all(store.verify(step) is None for step in steps)
        assert store.read_state(7 if run == "both" else 6)["step"] == (7 if run == "both" else 6)


# ---- several write streams per rank, to S3, loaded at another world size --------------------------

def _toy_fsdp(world: int):
    """A tiny GPT under FSDP2 over `world` ranks of the default group, after one AdamW step."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_gpt.model.gpt import token_losses
    from elastic_gpt.parallel.fsdp import init_sharded_weights, parallelize
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64))
    parallelize(model, init_device_mesh("cpu", (world,)), compute_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_sharded_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    token_losses(model(x[:, :16]), x[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _full(model, opt) -> dict:
    """Every tensor of the training state, whole (gathered from the shards)."""
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                out[f"{prefix}{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    walk(training_state_dict(model, opt), "")
    return out


def _save_with_streams_rank(rank: int, world: int, url: str, storage_options: dict) -> dict:
    model, opt = _toy_fsdp(world)
    save_sharded(url, model, opt, storage_options=storage_options, streams=3)
    return _full(model, opt)


def test_shards_written_by_several_streams_load_back_bit_for_bit_at_another_world_size(s3):  # noqa: F811
    from elastic_gpt.testing.gloo import gloo_group
    url = "s3://corpus/streams/step_00000001"
    saved = run_gloo(_save_with_streams_rank, 2, url, s3.storage_options())[0]
    files = [f for f in s3.filesystem().ls(url, detail=False) if f.endswith(".distcp")]
    assert len(files) == 2 * 3  # each rank wrote its shards as 3 files, one per stream
    with gloo_group():  # W=1: every tensor is read back from the 2 ranks' 6 files
        model, opt = _toy_fsdp(1)
        load_sharded(url, model, opt, storage_options=s3.storage_options())
        loaded = _full(model, opt)
    assert loaded.keys() == saved.keys() and any(".exp_avg_sq" in k for k in saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


# ---- async_save: auto ------------------------------------------------------------------------------

def test_async_save_auto_is_asynchronous_on_cuda_and_synchronous_on_the_cpu(tmp_path,
                                                                           one_rank_group):
    assert resolve_async_save("auto", "cuda") and not resolve_async_save("auto", "cpu")
    assert resolve_async_save(True, "cpu") and not resolve_async_save(False, "cuda")
    kinds = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        model = GPT(CFG).to(device)
        kinds[device] = make_checkpointer(
            CheckpointSection(), CheckpointStore(str(tmp_path / device)), rank=0, model=model,
            optimizer=None, trainer_state=dict)
    assert type(kinds["cpu"]) is SyncCheckpointer  # the CPU tests' behaviour, unchanged
    if "cuda" in kinds:
        assert type(kinds["cuda"]) is AsyncCheckpointer

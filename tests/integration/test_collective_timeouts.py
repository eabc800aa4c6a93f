"""Two collective timeouts on real gloo process groups: a peer late by more than the steady bound is
waited for while an attempt starts, and is a failure within that bound once it steps."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from elastic_gpt.testing.gloo import run_gloo

STARTUP_S, STEADY_S, LATE_S = 60.0, 2.0, 5.0


def _late_peer(rank: int, world: int) -> dict:
    from elastic_gpt.train.collective_timeouts import CollectiveTimeouts

    timeouts = CollectiveTimeouts(STARTUP_S, STEADY_S)
    timeouts.current = None  # the group was made with torch's default: set the start-up bound
    timeouts.before_save()
    out = {}
    x = torch.ones(1)
    if rank == 1:
        time.sleep(LATE_S)  # a slow start: the first compile, a checkpoint read
    t = time.monotonic()
    dist.all_reduce(x)
    out["startup_wait_s"] = time.monotonic() - t
    timeouts.step_done()
    if rank == 1:
        time.sleep(LATE_S)  # now a hang: the steady bound fails the waiting rank
    t = time.monotonic()
    try:
        dist.all_reduce(x)
        out["steady"] = "completed"
    except RuntimeError as e:
        out["steady"] = type(e).__name__
    out["steady_wait_s"] = time.monotonic() - t
    return out


def test_a_late_peer_is_waited_for_at_start_and_a_failure_when_steady():
    rank0, _ = run_gloo(_late_peer, 2)
    print(f"\n[timeouts] start-up wait {rank0['startup_wait_s']:.1f} s (bound {STARTUP_S:g}), "
          f"steady wait {rank0['steady_wait_s']:.1f} s (bound {STEADY_S:g}): {rank0['steady']}")
    assert rank0["startup_wait_s"] > LATE_S - 1.0  # waited the late peer out
    assert rank0["steady"] != "completed"
    assert STEADY_S - 0.5 < rank0["steady_wait_s"] < LATE_S - 0.5


def test_the_first_checkpoint_is_under_the_start_up_bound_then_steps_are_not():
    """What the process groups themselves have after each event, the default group and another
    one (as a device mesh makes) alike."""
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.torch_internals import collective_timeouts
    from elastic_gpt.train.collective_timeouts import CollectiveTimeouts

    seen = []
    with gloo_group():
        dist.new_group([0])
        timeouts = CollectiveTimeouts(STARTUP_S, STEADY_S)
        for event in (timeouts.step_done,
                      timeouts.before_save, lambda: timeouts.after_save(False),  # not due yet
                      timeouts.before_save, lambda: timeouts.after_save(True),  # the first one
                      timeouts.before_save, lambda: timeouts.after_save(True)):
            event()
            seen.append(collective_timeouts())
    assert seen == [{STEADY_S}, {STARTUP_S}, {STEADY_S}, {STARTUP_S}, {STEADY_S}, {STEADY_S},
                    {STEADY_S}]


def test_the_trainer_ends_its_start_up_at_its_first_step(stdlib_dataset, tmp_path):
    from elastic_gpt.config import load_config
    from elastic_gpt.testing.gloo import gloo_group
    from elastic_gpt.train.trainer import Trainer

    cfg = load_config("jobs/configs/mini.yaml", [
        f"data.path={stdlib_dataset}", f"checkpoint.path={tmp_path}/ckpt", "eval.samples=0",
        "model.n_layer=1", "train.max_steps=2", "checkpoint.every_steps=1",
        "train.global_batch_size=4", "train.micro_batch_size=2", "elastic.hang_timeout_s=42",
        "elastic.init_timeout_s=900"])
    with gloo_group():
        trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None)
        assert trainer.timeouts.current == 900
        trainer.train()
    assert trainer.timeouts.current == 42 and trainer.timeouts.saved

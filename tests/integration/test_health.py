"""Training health (elastic_gpt/health/) in real training on gloo ranks: loss spikes and
non-finite losses rolled back, attributed by re-running, and the blamed data skipped, with real
faults: a dataset whose samples at known steps are garbage (data), one exponent bit of one
rank's parameters or gradients flipped, a device that computes a wrong known answer (hardware,
testing/hardware_faults.py); HSDP's replicas and the replica groups' copies compared (real
torchft Managers and Lighthouse)."""

from __future__ import annotations

import json
import math
import os

import pytest

from elastic_gpt.health.spikes import SpikeDetector

G = 8
SEED = 1234
WINDOW = 16384  # data.shuffle_window's default
CHECKPOINT_EVERY = 10
BAD_STEPS = range(40, 42)  # steps done before the two garbage batches: logged as steps 41 and 42
STEPS = 56
# The test job's loss still falls fast for its first ~30 steps; a shorter window than the
# default's 100 follows it (the default job's whole curve is checked for false flags below).
ARGS = ["model.preset=tiny", f"data.seed={SEED}", f"train.global_batch_size={G}",
        "train.micro_batch_size=4", f"train.max_steps={STEPS}", "train.warmup_steps=5",
        "train.lr=3e-3", "train.dtype=float32", f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        "checkpoint.keep=3", "tracking.enabled=false", "eval.samples=0", "train.log_every=100",
        "data.prefetch_steps=2", "health.spike_steps=2", "health.spike_window=20",
        "health.spike_min_history=10"]


# ---- the detector and the skips, alone ---------------------------------------------------------


# ---- real faults in real training ----------------------------------------------------------------

def _train(rank: int, world: int, overrides: list[str], rank_nodes: list[str] | None = None,
           faults=None) -> dict:
    from elastic_gpt.config import load_config
    from elastic_gpt.health.faults import NoFaults
    from elastic_gpt.testing.step_recorder import StepRecorder
    from elastic_gpt.train.trainer import Trainer

    recorder = StepRecorder()
    trainer = Trainer(load_config("jobs/configs/mini.yaml", overrides), rank=rank,
                      world_size=world, mlflow_run_id=None, metrics=recorder,
                      rank_nodes=rank_nodes, faults=(faults or NoFaults()).for_rank(rank))
    trainer.train()
    return {"seen": recorder.seen, "events": trainer.ledger.events,
            "summary": trainer.ledger.summary(), "skips": trainer.health.skips.to_list(),
            "worst_ratio": trainer.health.stragglers.worst_ratio}


@pytest.fixture(scope="module")
def garbage_data(stdlib_dataset, tmp_path_factory):
    """The test dataset with the samples of BAD_STEPS replaced by random tokens."""
    from elastic_gpt.testing.faults import corrupt_steps

    out = str(tmp_path_factory.mktemp("garbage") / "data")
    positions = corrupt_steps(stdlib_dataset, out, BAD_STEPS, G, SEED, WINDOW)
    return out, positions


def test_a_spike_from_bad_data_is_rolled_back_reproduced_and_skipped(garbage_data, tmp_path):
    from elastic_gpt.testing.gloo import run_gloo

    data, bad = garbage_data
    ckpt = str(tmp_path / "run")
    got = run_gloo(_train, 1, [*ARGS, f"data.path={data}", f"checkpoint.path={ckpt}"])[0]
    kinds = [e["kind"] for e in got["events"]]
    assert kinds == ["loss spike", "rollback", "data skipped", "rollback"], got["events"]
    spike, rollback, skipped, _ = got["events"]
    # Flagged at the two garbage batches' steps, rolled back to the checkpoint before the update
    # the first flagged loss was computed after (skip_steps_before: its batch is suspect too).
    assert (spike["first_step"], spike["step"]) == (BAD_STEPS.start + 1, BAD_STEPS.stop)
    back_to = BAD_STEPS.start - CHECKPOINT_EVERY
    assert rollback["resumed_from_step"] == back_to
    # The re-run reproduced it (same losses), so the data was blamed: every garbage sample is
    # in the skipped range, which is in the run record a restart reads.
    assert "then" in skipped["detail"]
    lo, hi = skipped["sample_positions"]
    assert lo <= min(bad) and max(bad) < hi
    with open(os.path.join(ckpt, "run.json")) as f:
        assert json.load(f)["data_skips"] == got["skips"] == [
            {"from_step": skipped["from_step"], "steps": skipped["skipped_steps"]}]
    assert (skipped["from_step"], skipped["skipped_steps"]) == (BAD_STEPS.start - 1, 3)
    assert got["summary"]["lost_steps"] == 2 * (BAD_STEPS.stop - back_to)

    # The run's trajectory is a run that never saw the garbage: one that starts with the skips
    # in its record trains the same losses on the same samples, bit for bit (C2 with the skips,
    # C3), and flags nothing.
    ref_root = tmp_path / "reference"
    ref_root.mkdir()
    (ref_root / "run.json").write_text(json.dumps({"data_skips": got["skips"]}))
    ref = run_gloo(_train, 1, [*ARGS, f"data.path={data}", f"checkpoint.path={ref_root}"])[0]
    assert ref["events"] == []
    assert got["seen"] == ref["seen"]
    assert sorted(got["seen"]) == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def clean_two_ranks(stdlib_dataset, tmp_path_factory) -> dict:
    """Two ranks (FSDP) trained with no fault: the trajectory a hardware fault's re-run must
    rejoin."""
    from elastic_gpt.testing.gloo import run_gloo

    ref = run_gloo(_train, 2, [*ARGS, f"data.path={stdlib_dataset}", "scaling.min_workers=1",
                               f"checkpoint.path={tmp_path_factory.mktemp('clean') / 'run'}"])
    assert ref[0]["events"] == []
    return ref[0]


# Rank 1's shard after the update of step 40, a checkpoint step: the checkpoint of step 40 holds
# the corrupt value, and the rollback must reach past it. Or a gradient rank 1 computes in step
# 41, before the reduce-scatter (a faulty backward): the reduce-scatter lands the corrupted
# element in rank 0's shard (the flat input's first element is rank 0's), so the weights'
# checksums alone would not name rank 1; its gradients' do. The gradient is non-finite: the step
# is skipped, and the non-finite step is the spike (train.nan_patience 0).
FAULTS = {"weights": (dict(rank=1, step=40), 41),
          "gradient": (dict(rank=1, step=41, in_gradient=True), 41)}


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_a_flipped_bit_is_a_hardware_fault_on_its_rank_and_nothing_is_skipped(
        where, stdlib_dataset, clean_two_ranks, tmp_path):
    from elastic_gpt.testing.gloo import run_gloo
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults

    flip, first = FAULTS[where]
    got = run_gloo(_train, 2, [*ARGS, f"data.path={stdlib_dataset}", "scaling.min_workers=1",
                               f"checkpoint.path={tmp_path / 'run'}"], None,
                   HardwareFaults(FlippedBit(**flip)))
    events = got[0]["events"]
    assert [e["kind"] for e in events] == ["loss spike", "rollback", "hardware fault"], events
    fault = events[2]
    assert fault["ranks"] == [1] and fault["skipped_steps"] == 0, fault
    assert events[0]["first_step"] == first
    # Back past the update before the first flagged loss (that of step 40, a checkpoint step).
    assert events[1]["resumed_from_step"] == 40 - CHECKPOINT_EVERY
    assert got[0]["skips"] == [] and not os.path.exists(tmp_path / "run" / "run.json")
    # The re-run is the trajectory: the same as a run in which no bit flipped.
    assert got[0]["seen"] == clean_two_ranks["seen"]


def _train_until_restart(rank: int, world: int, overrides: list[str], faults) -> dict:
    """`_train` on ranks of two nodes, to the end or to a planned restart (its reason)."""
    from elastic_gpt.config import load_config
    from elastic_gpt.errors import ElasticRestart
    from elastic_gpt.testing.step_recorder import StepRecorder
    from elastic_gpt.train.trainer import Trainer

    trainer = Trainer(load_config("jobs/configs/mini.yaml", overrides), rank=rank,
                      world_size=world, mlflow_run_id=None, metrics=StepRecorder(),
                      rank_nodes=["node-a", "node-b"][:world], faults=faults.for_rank(rank))
    try:
        trainer.train()
        restart = None
    except ElasticRestart as e:
        restart = {"reason": e.reason, "step": e.step}
    return {"events": trainer.ledger.events, "restart": restart,
            "skips": trainer.health.skips.to_list()}


@pytest.mark.parametrize("found_by", ["probe", "spike", "replicas"])
def test_a_device_that_computes_wrong_is_found_by_its_known_answer_and_left_out(
        found_by, stdlib_dataset, tmp_path):
    """Rank 1's device computes wrong from step 40 on (a persistent fault): its probe's known
    answer changes. Found by the periodic probe (every 10 steps), or, with no periodic probe, by
    the probe a reproduced spike asks for before it blames the data (the fault flips the same bit
    of rank 1's weights at every pass over step 40, so the re-run reproduces the spike, as bad
    data would), or by the probe HSDP's two replicas ask for when they disagree with no
    majority (before, they rolled back to the same fault for ever). Each way: rank 1 named, its
    node drained, the group back at the step-30 checkpoint (the last one from before the fault,
    the later ones deleted) and restarting without it; nothing skipped."""
    from elastic_gpt.checkpoint.store import CheckpointStore
    from elastic_gpt.testing.gloo import run_gloo
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults, WrongProbeAnswers

    faults = [WrongProbeAnswers(rank=1, from_step=40)]
    # FSDP over the two ranks (no replicas to compare), or HSDP's two replicas, which the
    # fault makes disagree with no majority.
    extra = {"probe": ["health.straggler_every_steps=10", "parallel.hsdp=off"],
             "spike": ["health.straggler_every_steps=1000", "parallel.hsdp=off"],
             "replicas": ["health.straggler_every_steps=1000", "parallel.hsdp=on"]}[found_by]
    if found_by != "probe":
        faults.append(FlippedBit(rank=1, step=40, every_pass=True))
    root = tmp_path / "run"
    got = run_gloo(_train_until_restart, 2, [*ARGS, f"data.path={stdlib_dataset}",
                                             "scaling.min_workers=1", f"checkpoint.path={root}",
                                             *extra], HardwareFaults(*faults))[0]
    kinds = [e["kind"] for e in got["events"]]
    expected = {"probe": ["hardware fault", "rollback"],
                "spike": ["loss spike", "rollback", "hardware fault", "rollback"],
                "replicas": ["silent data corruption", "hardware fault", "rollback"]}[found_by]
    assert kinds == expected, got["events"]
    fault = next(e for e in got["events"] if e["kind"] == "hardware fault")
    assert fault["ranks"] == [1] and fault["nodes"] == ["node-b"], fault
    assert fault["action"] == "node drained" and "known answer" in fault["detail"]
    assert got["restart"]["reason"].startswith("preemption: rank(s) [1] compute wrong")
    assert got["restart"]["step"] == 30 == got["events"][-1]["resumed_from_step"]
    assert CheckpointStore(str(root)).latest().step == 30
    assert got["skips"] == [] and not os.path.exists(root / "run.json")


def test_the_skip_budget_stops_a_run_that_keeps_diverging(garbage_data, tmp_path):
    from elastic_gpt.testing.gloo import run_gloo

    data, _ = garbage_data
    with pytest.raises(Exception, match="health.max_skipped_steps=1"):
        run_gloo(_train, 1, [*ARGS, f"data.path={data}", f"checkpoint.path={tmp_path}",
                             "health.max_skipped_steps=1", f"train.max_steps={BAD_STEPS.stop}"])


def test_the_default_job_trains_without_a_false_flag(stdlib_dataset, tmp_path):
    """The default job (jobs/configs/mini.yaml: its model, batch, schedule, two workers and the
    default health settings) on the test corpus: no loss is flagged, not even one alone, no rank
    is a straggler at any of the 14 shares of the ranks' compute (a window of 20 steps from the
    4th step on), and the goodput ledger counts next to no time as slow."""
    from elastic_gpt.testing.gloo import run_gloo

    steps = 160
    got = run_gloo(_train, 2, [f"data.path={stdlib_dataset}", f"train.max_steps={steps}",
                               "tracking.enabled=false", "eval.samples=0", "train.log_every=100",
                               f"checkpoint.path={tmp_path}/ckpt",
                               f"run.storage_path={tmp_path}/runs", "run.name=default"])
    assert got[0]["events"] == [] and got[1]["events"] == []
    # Every rank's figure at every share is published (rank 0's file in the run's log folder),
    # and the worst ratio the watch saw is the one those figures give.
    with open(tmp_path / "runs" / "default" / "logs" / "probes.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["event"] == "start" and lines[0]["world_size"] == 2
    probes = [line for line in lines if "probe_s" in line]
    assert [p["step"] for p in probes] == list(range(10, steps + 1, 10))
    assert all(len(p["probe_s"]) == 2 and min(p["probe_s"]) > 0 for p in probes)
    # The first share with a full window of 20 steps (the attempt's first steps are not judged).
    shares = [p for p in probes if "compute_s" in p]
    assert [p["step"] for p in shares] == list(range(30, steps + 1, 10))
    assert all(min(p["compute_s"]) > 0 for p in shares)
    worst = max(max(p["compute_s"]) / min(p["compute_s"]) for p in shares)
    assert worst == pytest.approx(got[0]["worst_ratio"], rel=1e-3)
    summary = got[0]["summary"]
    print(f"[health] default job, {steps} steps at W=2: the slowest rank's compute reached "
          f"{worst:.2f}x the median at worst (a straggler is 1.5x over a window of 20 steps); "
          f"the ledger counted {summary['slow_s']:.2f} s slow of {summary['productive_s']:.1f} s "
          "productive")
    assert summary["slow_s"] <= 0.1 * summary["productive_s"], summary
    got = got[0]
    losses = [got["seen"][k][0] for k in sorted(got["seen"])]
    d = SpikeDetector(window=100, deviations=6, min_rise=0.05, steps=1, min_history=20)
    closest = 0.0
    for k, loss in enumerate(losses, 1):
        median, threshold = d.threshold()
        if math.isfinite(threshold):
            closest = max(closest, (loss - median) / (threshold - median))
        assert d.observe(k, loss) is None, (k, loss, median, threshold)
    print(f"[health] default job, {steps} steps: the highest loss reached {closest:.2f} of the "
          "way from the running median to the threshold")


@pytest.mark.parametrize("nodes", [["a", "b", "c"], ["a", "b"]], ids=["majority", "two"])
def test_a_bit_flipped_in_one_replica_is_caught_before_it_is_used(stdlib_dataset, tmp_path,
                                                                  nodes):
    """HSDP over 3 (or 2) nodes holds every shard on each: one low mantissa bit of one replica's
    parameters flipped between two steps (no spike follows) is found by the replicas' checksums
    before the next forward. With a majority the replica is overwritten from it; with two, the
    run rolls back to its newest checkpoint. Either way every loss equals an uncorrupted run's,
    bit for bit (health/silent_corruption.py)."""
    from elastic_gpt.testing.gloo import run_gloo
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults

    # After the update of step 20, a checkpoint step: that checkpoint may hold the corrupt value.
    world, flip_at = len(nodes), 20
    args = [*ARGS, f"data.path={stdlib_dataset}", "scaling.min_workers=1", "parallel.hsdp=on",
            "train.max_steps=40", "health.straggler_action=off", "train.micro_batch_size=2",
            "train.global_batch_size=12"]
    got = run_gloo(_train, world, [*args, f"checkpoint.path={tmp_path / 'run'}"], nodes,
                   HardwareFaults(FlippedBit(rank=world - 1, step=flip_at, bit=3)))
    events = got[0]["events"]
    found = [e for e in events if e["kind"] == "silent data corruption"]
    assert len(found) == 1 and found[0]["step"] == flip_at, events
    if world == 3:
        assert found[0]["ranks"] == [2] and found[0]["nodes"] == ["c"]
        assert found[0]["action"] == "healed from the majority"
        assert [e["kind"] for e in events] == ["silent data corruption"]
        # Healed in memory, and the checkpoint written after the corruption deleted.
        from elastic_gpt.checkpoint.store import CheckpointStore
        assert sorted(CheckpointStore(str(tmp_path / "run")).step_dirs()) == [10, 30, 40]
    else:
        # Back to before the last check the replicas passed: past the step-20 checkpoint.
        assert found[0]["action"] == "rollback"
        rollback = next(e for e in events if e["kind"] == "rollback")
        assert rollback["resumed_from_step"] == flip_at - CHECKPOINT_EVERY
    ref = run_gloo(_train, world, [*args, f"checkpoint.path={tmp_path / 'reference'}"], nodes)
    assert ref[0]["events"] == []
    assert got[0]["seen"] == ref[0]["seen"]


# ---- the replica groups' copies compared (health/silent_corruption.GroupCopiesCheck) ----------

def _group_main(group: int, groups: int, lighthouse: str, overrides: list[str],
                faults, port: int, out: str) -> None:
    """One replica group of one rank: the real Trainer with a real torchft Manager, its process
    group made as a launcher makes it (the store at MASTER_ADDR:MASTER_PORT, which the Manager
    uses too). Saves what it logged, and its error if the copies differ with no majority."""
    import torch
    import torch.distributed as dist

    from elastic_gpt.config import load_config
    from elastic_gpt.health.faults import NoFaults
    from elastic_gpt.health.silent_corruption import GroupCopiesDiffer
    from elastic_gpt.parallel.replicate import ReplicaGroup
    from elastic_gpt.testing.step_recorder import StepRecorder
    from elastic_gpt.train.fault_tolerance import ReplicaGroupPath
    from elastic_gpt.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    recorder = StepRecorder()
    member = ReplicaGroup(lighthouse=lighthouse, group=group, group_rank=0, group_size=1,
                          groups=groups, timeout_s=20.0)
    trainer = Trainer(load_config("jobs/configs/mini.yaml", overrides), rank=0, world_size=1,
                      mlflow_run_id=None, metrics=recorder, fault_tolerance=ReplicaGroupPath(member),
                      faults=(faults or NoFaults()).for_rank(0))
    try:
        trainer.train()
        result = {"seen": recorder.seen, "events": trainer.ledger.events,
                  "hash": member.local_state_hash(), "skips": trainer.health.skips.to_list()}
    except GroupCopiesDiffer as e:
        result = {"error": str(e), "seen": recorder.seen}
    torch.save(result, out)
    os._exit(0)  # as testing/gloo.py: no teardown of torchft's threads after the result


def _replica_groups_run(groups: int, overrides: list[str], flipped: dict, tmp: str) -> list:
    """`groups` groups trained side by side at a real Lighthouse (every group in every quorum:
    min_replicas is all of them); what each saved, or None for a group that died."""
    import torch

    from elastic_gpt.elastic.lighthouse import LighthouseServer
    from elastic_gpt.testing import preloaded
    from elastic_gpt.testing.ports import free_port

    server = LighthouseServer(min_replicas=groups, join_timeout_ms=60_000, quorum_tick_ms=10,
                              heartbeat_timeout_ms=10_000)
    outs = [os.path.join(tmp, f"group{g}.pt") for g in range(groups)]
    processes = []
    try:
        for g in range(groups):
            processes.append(preloaded.start(
                _group_main, g, groups, server.address(),
                [*overrides, f"elastic.replica_groups={groups}"], flipped.get(g), free_port(),
                outs[g], daemon=False))
        for p in processes:
            p.join(timeout=300)
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
        server.shutdown()
    return [torch.load(o, weights_only=False) if os.path.exists(o) else None for o in outs]


def _flipped(step: int):
    """A low mantissa bit of a one-rank group's copy, flipped by the update of `step`."""
    from elastic_gpt.testing.hardware_faults import FlippedBit, HardwareFaults
    return HardwareFaults(FlippedBit(rank=0, step=step, bit=3))


def test_a_bit_flipped_in_one_replica_groups_copy_is_healed_from_the_majority(
        stdlib_dataset, tmp_path):
    """Three replica groups (one rank each, a real torchft Manager and Lighthouse): one low
    mantissa bit of group 2's copy flipped by the update of step 20, a checkpoint step. The
    copies' checksums, carried in step 21's stats, differ: no group commits it, group 2 is healed
    from a live peer at the next quorum, and the run goes on; every group's every loss equals an
    uncorrupted run's, bit for bit, and the copies end equal. With two groups there is no
    majority: the checkpoint written after the flip is deleted and both groups fail, to restart
    from the one before."""
    from elastic_gpt.checkpoint.store import CheckpointStore

    flip_at, steps = 20, 40
    args = [*ARGS, f"data.path={stdlib_dataset}", "train.micro_batch_size=2",
            f"train.max_steps={steps}", "health.straggler_action=off"]
    got = _replica_groups_run(3, [*args, f"checkpoint.path={tmp_path / 'run'}"],
                              {2: _flipped(flip_at)}, str(tmp_path))
    ref = _replica_groups_run(3, [*args, f"checkpoint.path={tmp_path / 'reference'}"], {},
                              str(tmp_path))
    assert all(g is not None and "error" not in g for g in got + ref), got + ref
    leader = got[0]["events"]
    found = [e for e in leader if e["kind"] == "silent data corruption"]
    assert len(found) == 1 and found[0]["step"] == flip_at and found[0]["groups"] == [2], leader
    for g in range(3):
        assert got[g]["seen"] == ref[0]["seen"], g  # every committed step, bit for bit
    assert got[0]["hash"] == got[1]["hash"] == got[2]["hash"] == ref[0]["hash"]

    two = _replica_groups_run(2, [*args, f"checkpoint.path={tmp_path / 'two'}"],
                              {1: _flipped(flip_at)}, str(tmp_path))
    assert all(g is not None and "with no majority" in g.get("error", "") for g in two), two
    assert max(two[0]["seen"]) == flip_at  # step 21 was applied nowhere
    assert sorted(CheckpointStore(str(tmp_path / "two")).step_dirs()) == [10]


def test_replica_groups_roll_a_data_spike_back_together_and_skip_it_alike(garbage_data, tmp_path):
    """Two replica groups (one rank each, a real torchft Manager and Lighthouse) on the garbage
    data: they sum the loss and hold the same detector state, so both flag the spike at the same
    step, roll back to the same checkpoint, re-run, blame the data and skip the same batches; the
    quorum stays whole (no group is healed back to the abandoned trajectory). Every group's every
    committed loss equals a two-group run that started with the skips in its record, bit for bit,
    and the copies end equal."""
    data, bad = garbage_data
    args = [*ARGS, f"data.path={data}", "health.straggler_action=off"]
    got = _replica_groups_run(2, [*args, f"checkpoint.path={tmp_path / 'run'}"], {},
                              str(tmp_path))
    assert all(g is not None and "error" not in g for g in got), got
    for g in got:
        kinds = [e["kind"] for e in g["events"]]
        assert kinds == ["loss spike", "rollback", "data skipped", "rollback"], g["events"]
        spike, rollback, skipped, again = g["events"]
        assert (spike["first_step"], spike["step"]) == (BAD_STEPS.start + 1, BAD_STEPS.stop)
        assert rollback["resumed_from_step"] == again["resumed_from_step"] == \
            BAD_STEPS.start - CHECKPOINT_EVERY
        assert (skipped["from_step"], skipped["skipped_steps"]) == (BAD_STEPS.start - 1, 3)
        lo, hi = skipped["sample_positions"]
        assert lo <= min(bad) and max(bad) < hi
        print(f"group {got.index(g)}: spike at step {spike['step']}, rolled back to "
              f"{rollback['resumed_from_step']}, re-run and skipped; the second rollback "
              f"{again['at'] - spike['at']:.2f} s after the detection, "
              f"{rollback['lost_steps'] + again['lost_steps']} steps re-done")
    assert got[0]["skips"] == got[1]["skips"] and len(got[0]["skips"]) == 1
    with open(tmp_path / "run" / "run.json") as f:
        assert json.load(f)["data_skips"] == got[0]["skips"]

    ref_root = tmp_path / "reference"
    ref_root.mkdir()
    (ref_root / "run.json").write_text(json.dumps({"data_skips": got[0]["skips"]}))
    ref = _replica_groups_run(2, [*args, f"checkpoint.path={ref_root}"], {}, str(tmp_path))
    assert all(r is not None and r["events"] == [] for r in ref), ref
    for g in range(2):
        assert got[g]["seen"] == ref[0]["seen"], g
    assert sorted(got[0]["seen"]) == list(range(1, STEPS + 1))
    assert got[0]["hash"] == got[1]["hash"] == ref[0]["hash"]



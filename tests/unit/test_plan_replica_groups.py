"""The planner's replica-group model (`elastic.replica_groups: N`) against the restart path: its
formulas, the layouts it weighs, and the config it writes (pure Python)."""

from __future__ import annotations

import math

import pytest
import yaml

from elastic_gpt.cli import main
from elastic_gpt.config import load_config
from elastic_gpt.cost_model.mesh import make_mesh
from elastic_gpt.cost_model.network import Network, ring_bytes
from elastic_gpt.cost_model.shape import model_shape
from elastic_gpt.cost_model.step_time import step_time
from elastic_gpt.data.order import BatchSplit
from elastic_gpt.model.config import preset_config
from elastic_gpt.planner.cli import run_from_args
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.reliability import goodput
from elastic_gpt.planner.replica_group_model import (
    COLLECTIVE_TIMEOUT_S,
    cross_group_allreduce,
    replica_goodput,
    replica_groups_problem,
)
from elastic_gpt.planner.report import format_report, plan_summary, training_config
from elastic_gpt.planner.training_plan import plan_training
from tests.planner_helpers import cli, load_config_from

A100_175B = dict(model="gpt3-175b", gpu="A100-80GB", tokens=300e9)


# ----------------------------------------------------------------------------- replica groups

# 64 nodes of 8 H100s whose spot nodes are reclaimed every 12 hours: the restart path stops all 512
# GPUs for every loss, replica groups only the lost group.
# The uncalibrated step model (one efficiency, a fixed latency per collective): these tests are
# about what replica groups cost and save, with step times whose formulas they can restate.
SPOT_512 = dict(model="gpt3-1.3b", gpu="H100", n_gpus=512, global_batch_size=1024, tokens=26e9,
                spot_node_mtbf_h=12.0, efficiency=0.6)
FIXED_NET = Network(8, 370, 320, nccl_latency=False)


def test_replica_goodput_is_the_hand_computed_formula():
    """tau = 100 s, delta = 10 s, M = 1000 s; each loss stalls 5 s and the lost group of 4 is
    away 50 s at 3/4 speed (12.5 s of work); the fallback (R = 60 s, half a cycle 55 s) every
    1e5 s: 100/110 * (1 - 17.5/1000 - 115/1e5)."""
    got = replica_goodput(100.0, 10.0, 1000.0, stall_s=5.0, absent_s=50.0, n_groups=4,
                          fallback_mtbf_s=1e5, fallback_recovery_s=60.0)
    assert got == pytest.approx(100 / 110 * (1 - 17.5 / 1000 - 115 / 1e5))
    assert got == pytest.approx(0.892136, abs=1e-6)
    # a measured degraded speed replaces (N - m) / N; m groups lost at once leave (N - m) / N
    assert replica_goodput(100.0, 10.0, 1000.0, stall_s=5.0, absent_s=50.0, n_groups=4,
                           degraded_speed=0.5) == pytest.approx(100 / 110 * (1 - 30 / 1000))
    assert replica_goodput(100.0, 10.0, 1000.0, stall_s=5.0, absent_s=50.0, n_groups=4,
                           groups_lost=2) == pytest.approx(100 / 110 * (1 - 30 / 1000))
    with pytest.raises(ValueError, match="some group has to survive"):
        replica_goodput(100.0, 10.0, 1000.0, stall_s=5.0, absent_s=50.0, n_groups=2,
                        groups_lost=2)


def test_replica_goodput_grows_with_the_groups_for_a_fixed_absent_time():
    """A lost group of N is 1/N of the throughput: more groups lose less while one is away, and
    the limit is the stall alone."""
    kw = dict(stall_s=5.0, absent_s=300.0, fallback_mtbf_s=1e6, fallback_recovery_s=100.0)
    values = [replica_goodput(600.0, 5.0, 3600.0, n_groups=n, **kw) for n in (2, 4, 8, 16, 64)]
    assert values == sorted(values) and len(set(values)) == len(values)
    no_absence = replica_goodput(600.0, 5.0, 3600.0, n_groups=2, degraded_speed=1.0, **kw)
    assert values[-1] < no_absence and no_absence - values[-1] < 300 / 64 / 3600
    # and it beats the restart path whenever a restart costs more than the stall + absence / N
    assert values[0] > goodput(600.0, 5.0, 300.0, 3600.0)


def test_cross_group_allreduce_is_a_ring_over_the_groups_sharing_the_nics():
    """Each GPU all-reduces its reduce-scattered fp32 shard (4 P / dp_shard bytes) over the N
    groups, 2 (N-1)/N of it; the node's 8 rings share its NICs; one ring latency per FSDP
    unit."""
    shape = model_shape(preset_config("gpt2-124m"))
    net, group = Network(8, 370, 320), make_mesh(8, 1, False, 8)
    sent, seconds = cross_group_allreduce(shape, net, group, 4, 1, 32)
    per_gpu = 2 * 3 / 4 * 4 * shape.params / 8
    assert sent == pytest.approx(per_gpu)
    L = shape.cfg.n_layer
    # one group per node: a ring over 4 nodes, NCCL's latency for it per FSDP unit
    assert seconds == pytest.approx(8 * per_gpu / 320e9
                                    + (L + 1) * net.ring_latency_s(4, 1, all_reduce=True))
    twice, twice_s = cross_group_allreduce(shape, net, group, 4, 2, 32)  # per micro-batch sync
    assert twice == pytest.approx(2 * sent) and twice_s == pytest.approx(2 * seconds)
    assert cross_group_allreduce(shape, net, group, 1, 1, 8) == (0.0, 0.0)


def test_the_plans_replica_figures_are_its_formulas():
    """The layout a plan weighs, term by term: heal = the GPU's 12 B/param shard through the
    node's NICs; stall = the larger of the heartbeat and the collective timeout (a lost node goes
    silent, and the survivors' collective with it gives up after that) + the step in flight + heal;
    away = restart + the group's checkpoint read; the checkpoint is written by one group's nodes;
    the goodput is replica_goodput's."""
    plan = plan_training(PlanInputs(**SPOT_512))
    rg = plan.fault_tolerance.best
    lay, shape, c = rg.layout, plan.shape, rg.layout.candidate
    assert lay.memory.total <= plan.usable_bytes and lay.mesh.world == lay.group_gpus
    assert lay.n_groups * lay.group_gpus == 512 and lay.groups_lost == 1
    assert lay.mesh == make_mesh(lay.group_gpus, c.tp, c.hsdp, 8)
    assert c.micro_batches_per_rank == BatchSplit(1024, c.micro_batch).slots(512 // c.tp)
    assert lay.heal_bytes == pytest.approx(12 * shape.local_params(c.tp) / lay.mesh.dp_shard)
    assert lay.heal_s == pytest.approx(8 * lay.heal_bytes / 320e9 + 20e-6)
    group_nodes = lay.group_gpus // 8
    assert lay.ckpt_write_s == pytest.approx(12 * shape.params / (group_nodes * 2e9))
    assert lay.ckpt_read_s == pytest.approx(lay.ckpt_write_s)
    assert rg.stall_s == pytest.approx(max(2.0, COLLECTIVE_TIMEOUT_S) + lay.step_s + lay.heal_s)
    assert rg.absent_s == pytest.approx(90.0 + lay.ckpt_read_s)
    assert rg.mtbf_s == pytest.approx(12 * 3600 / 64) and rg.fallback_mtbf_s == 12 * 3600
    assert rg.every_steps == round(math.sqrt(2 * lay.ckpt_write_s * 12 * 3600) / lay.step_s)
    assert rg.goodput == pytest.approx(replica_goodput(
        rg.interval_s, lay.ckpt_write_s, rg.mtbf_s, stall_s=rg.stall_s, absent_s=rg.absent_s,
        n_groups=lay.n_groups, degraded_speed=lay.degraded_speed,
        fallback_mtbf_s=rg.fallback_mtbf_s, fallback_recovery_s=rg.absent_s))
    # steady state: the group's own step (same settings, its own mesh) + the cross-group
    # all-reduce, counted whole: replica groups are slower per step than the restart path here
    k = c.micro_batches_per_rank
    in_group = step_time(shape, plan.gpu, FIXED_NET, lay.group_gpus, c.micro_batch,
                         k, activation_checkpointing=c.activation_checkpointing,
                         grad_sync=c.grad_sync, reshard_after_forward=c.reshard_after_forward,
                         tp=c.tp, hsdp=lay.mesh.hsdp, efficiency=0.6)
    assert lay.in_group_step_s == pytest.approx(in_group.step_s)
    assert lay.step_s == pytest.approx(lay.in_group_step_s + lay.allreduce_s)
    assert lay.allreduce_s > 0 and lay.step_s > plan.step_s
    assert lay.allreduce_bytes == pytest.approx(
        _syncs(c) * 2 * ring_bytes(4 * shape.local_params(c.tp) / lay.mesh.dp_shard,
                                   lay.n_groups))
    # while a group is away the survivors take its micro-batches (C1 fixed global batch: the
    # slowest rank's ceil)
    k_away = BatchSplit(1024, c.micro_batch).slots((lay.n_groups - 1) * lay.mesh.dp)
    assert k_away > k and lay.degraded_step_s > lay.step_s
    away = step_time(shape, plan.gpu, FIXED_NET, lay.group_gpus, c.micro_batch,
                     k_away, activation_checkpointing=c.activation_checkpointing,
                     grad_sync=c.grad_sync, reshard_after_forward=c.reshard_after_forward,
                     tp=c.tp, hsdp=lay.mesh.hsdp, efficiency=0.6)
    _, away_allreduce_s = cross_group_allreduce(shape, FIXED_NET, lay.mesh,
                                                lay.n_groups - 1, _syncs(c, k_away), 512)
    assert lay.degraded_step_s == pytest.approx(away.step_s + away_allreduce_s)
    assert lay.degraded_speed == pytest.approx(lay.step_s / lay.degraded_step_s)


def _syncs(c, micro_batches=None) -> int:
    """Gradient syncs per step of candidate c (at its own micro-batch count by default)."""
    k = c.micro_batches_per_rank if micro_batches is None else micro_batches
    return k if c.grad_sync == "microbatch" else 1


def test_frequent_spot_losses_choose_replica_groups_and_write_a_config_the_launcher_takes(
        tmp_path, capsys):
    plan = plan_training(PlanInputs(**SPOT_512))
    ft = plan.fault_tolerance
    assert ft.market == "spot" and ft.use_replica_groups and plan.chosen_replica_groups is ft.best
    assert ft.replica_effective(ft.best) > ft.restart_effective
    assert ft.best.goodput > ft.restart.goodput
    # every N weighed is listed best first, and the best is written
    effective = [ft.replica_effective(r) for r in ft.replica]
    assert effective == sorted(effective, reverse=True) and len(ft.replica) > 2
    written = training_config(plan)
    n = written["elastic"]["replica_groups"]
    assert n == ft.best.layout.n_groups >= 2
    workers, tp = written["scaling"]["max_workers"], written.get("parallel", {}).get("tp", 1)
    assert workers % n == 0 and (workers // n) % tp == 0  # the launcher's rule
    assert written["elastic"]["replica_heartbeat_timeout_s"] == 2.0
    assert written["checkpoint"]["every_steps"] == 0  # the fallback's interval, in minutes
    assert written["checkpoint"]["every_minutes"] == pytest.approx(ft.best.interval_s / 60,
                                                                   rel=1e-2)
    assert ft.best.interval_s != pytest.approx(plan.spot.interval_s, rel=0.1)
    # the group's own settings are written (they fit a group), and groups are a fixed size
    group = ft.best.layout.candidate
    assert written["train"]["micro_batch_size"] == group.micro_batch
    assert written["train"]["activation_checkpointing"] == group.activation_checkpointing
    assert written["train"]["grad_sync"] == group.grad_sync
    assert written["scaling"]["min_workers"] == written["scaling"]["max_workers"] == 512
    cfg = load_config_from(written, tmp_path)
    assert cfg.elastic.replica_groups == n
    from elastic_gpt.elastic.replica_group_driver import group_size
    assert group_size(cfg) == 512 // n
    summary = plan_summary(plan)
    assert summary["replica_groups"] == n
    spot = summary["fault_tolerance"]["spot"]
    assert spot["mode"] == "replica_groups"
    assert spot["replica_groups"]["goodput"] == ft.best.goodput
    assert spot["restart"]["goodput"] == plan.spot.goodput
    report = format_report(plan)
    assert f"written config (spot): replica groups (N={n})" in report
    assert "restart path" in report and f"replica N={n}" in report
    # on-demand nodes (6000 h) rarely fail: the same run on-demand keeps the restart path
    on_demand = plan_training(PlanInputs(**SPOT_512, market="on-demand"))
    assert on_demand.chosen_replica_groups is None
    assert training_config(on_demand)["elastic"] == {"replica_groups": "off",
                                                     "node_mtbf_h": 6000.0}
    assert "written config (on-demand): restart path" in format_report(on_demand)
    assert plan_summary(on_demand)["fault_tolerance"]["on-demand"]["mode"] == "restart"


def test_a_model_that_needs_the_whole_cluster_is_not_offered_replica_groups():
    """GPT-3 175B on 64 A100-80GBs fits only with tensor parallelism over all 64: half of them
    cannot hold 16 B x 175B / 32 of state, so N would be 1, however often nodes fail."""
    plan = plan_training(PlanInputs(**A100_175B, n_gpus=64, node_mtbf_h=8.0,
                                    market="on-demand"))
    ft = plan.fault_tolerance
    assert ft.best is None and not ft.use_replica_groups and plan.chosen_replica_groups is None
    assert any("no group smaller than the whole cluster fits" in n for n in ft.not_offered)
    assert training_config(plan)["elastic"]["replica_groups"] == "off"
    assert "not offered: N=2, 4, 8, 16, 32, 64 do not fit" in format_report(plan)
    # one node: a node failure takes every group, whatever the memory
    one = plan_training(PlanInputs(model="gpt2-124m", gpu="H100", n_gpus=8))
    assert one.fault_tolerance.best is None
    assert one.fault_tolerance.not_offered == ["replica groups on one node: a node failure takes every group"]


def test_a_long_heartbeat_timeout_makes_the_restart_path_win():
    """Every lost group stalls the survivors one heartbeat timeout (when it is longer than the
    collective timeout): an hour of it costs more than a restart. The restart path here finds
    its failures in 30 s (crashes Ray reports, no hung rank): at the hang timeout's 600 s a
    loss every 11 minutes leaves it no goodput either, and the plan is refused."""
    quick = plan_training(PlanInputs(**SPOT_512, detect_s=30.0))
    slow = plan_training(PlanInputs(**SPOT_512, detect_s=30.0, replica_heartbeat_timeout_s=3600.0))
    assert quick.chosen_replica_groups is not None and slow.chosen_replica_groups is None
    assert slow.fault_tolerance.best.goodput < quick.fault_tolerance.best.goodput
    assert slow.fault_tolerance.best.stall_s - quick.fault_tolerance.best.stall_s == \
        pytest.approx(3600.0 - max(2.0, COLLECTIVE_TIMEOUT_S), rel=1e-3)
    assert slow.spot.goodput == quick.spot.goodput  # the restart path does not have one
    assert training_config(slow)["elastic"]["replica_groups"] == "off"
    # an hour's stall per loss, with a loss every 11 minutes, leaves no goodput: still reported
    assert slow.fault_tolerance.best.goodput == 0.0
    assert "written config (spot): restart path" in format_report(slow)


def test_groups_smaller_than_a_node_are_all_lost_with_it():
    """Sub-node groups: a node failure takes every group on the node (gpus_per_node / g)."""
    plan = plan_training(PlanInputs(model="gpt2-124m", gpu="H100", n_gpus=16,
                                    replica_groups=8))
    lay = plan.fault_tolerance.best.layout
    assert lay.group_gpus == 2 and lay.groups_lost == 4
    # 4 of 8 groups away: the survivors do twice the micro-batches, about half the throughput
    # (a little more: the 4 survivors share one node, so their all-reduce stays on NVLink)
    assert lay.degraded_speed == pytest.approx(0.5, abs=0.03)
    # the node's 4 restarted groups all read the checkpoint through it; one group writes it
    assert lay.ckpt_read_s == pytest.approx(4 * lay.ckpt_write_s)
    assert plan.chosen_replica_groups.layout is lay  # forced: written whatever the comparison says
    assert "a group is whole nodes" in replica_groups_problem.__doc__
    assert replica_groups_problem(4, 48, 1, 8) is not None  # 12-GPU groups straddle nodes
    assert "straddle" in replica_groups_problem(4, 48, 1, 8)
    assert replica_groups_problem(6, 48, 1, 8) is None
    assert "multiple of tp=4" in replica_groups_problem(8, 16, 4, 8)
    assert "one node" in replica_groups_problem(2, 8, 1, 8)


def test_forced_replica_groups_are_written_and_bad_ones_refused(tmp_path, capsys):
    """--replica-groups N writes N even where the restart path would win (the report still
    compares); an N that cannot split the GPUs, or whose groups do not fit, is one line."""
    out = tmp_path / "rg.yaml"
    assert run_from_args(cli("--model", "gpt3-1.3b", "--gpus", "64", "--replica-groups", "4",
                             "--replica-heartbeat-timeout-s", "5", "--write-config",
                             str(out))) == 0
    report = capsys.readouterr().out
    assert "written config (spot): replica groups (N=4, as --replica-groups asks)" in report
    written = yaml.safe_load(out.read_text())
    assert written["elastic"] == {"replica_groups": 4, "replica_heartbeat_timeout_s": 5.0}
    assert load_config(str(out), ["data.path=/tmp/any-dataset"]).elastic.replica_groups == 4
    plan = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=64,
                                    replica_groups="off"))
    assert plan.fault_tolerance.best is None and plan.chosen_replica_groups is None
    for argv, message in [
        (("--gpus", "64", "--model", "gpt3-1.3b", "--replica-groups", "3"),
         "--replica-groups=3 must divide --gpus=64"),
        (("--gpus", "64", "--model", "gpt3-175b", "--gpu", "A100-80GB", "--replica-groups", "2"),
         "--replica-groups=2: groups of 32 GPUs need 90.3 GiB per GPU even at micro-batch 1"),
    ]:
        assert main(["plan", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    # values the trainer's config would refuse never reach the plan: argparse says which flag
    for argv, message in [
        (("--replica-groups", "1"), "argument --replica-groups: '1' is not auto, off or a group"),
        (("--replica-heartbeat-timeout-s", "0.05"), "'0.05' is not a number of seconds >= 0.1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["plan", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_groups_of_whole_pipelines_are_planned_and_written(tmp_path):
    """Replica groups may hold pipelines (the trainer runs them: test_replica_groups_pipeline.py):
    each group's mesh is searched with pipeline stages, its cross-group all-reduce and heal are a
    pipeline rank's part of the model (the largest rank's), and the written config carries both
    and loads."""
    from elastic_gpt.cost_model.pipeline import rank_shapes
    from elastic_gpt.elastic.replica_group_driver import group_size

    plan = plan_training(PlanInputs(model="gpt3-1.3b", gpu="H100", n_gpus=16, tokens=26e9,
                                    replica_groups=2, pp=2, spot_node_mtbf_h=12.0))
    lay = plan.fault_tolerance.best.layout
    mesh, c = lay.mesh, lay.candidate
    assert mesh.pp == 2 and lay.group_gpus == 8 and mesh.world == 8
    assert (c.grad_sync, c.reshard_policy) == ("step", "never")  # the schedules' (KEPT_GATHERED)
    held = max(s.params for s in rank_shapes(plan.shape, 2, mesh.stages_per_rank).values())
    assert lay.allreduce_bytes == pytest.approx(2 * ring_bytes(4 * held / mesh.dp_shard, 2))
    assert lay.heal_bytes == pytest.approx(12 * held / mesh.dp_shard)
    written = training_config(plan)
    assert written["parallel"]["pp"] == 2 and written["elastic"]["replica_groups"] == 2
    cfg = load_config_from(written, tmp_path)
    assert group_size(cfg) == 8

"""`elastic-gpt plan` from the command line: the report, the written config the trainer loads,
forced --tp / --hsdp, and bad input as one line with exit code 2 (pure Python)."""

from __future__ import annotations

import pytest
import yaml

from elastic_gpt.cli import main
from elastic_gpt.config import load_config
from elastic_gpt.planner.cli import inputs_from_args, run_from_args
from elastic_gpt.planner.inputs import PlanInputs
from elastic_gpt.planner.report import plan_summary, training_config
from elastic_gpt.planner.training_plan import plan_training, trainer_parallel_keys
from tests.planner_helpers import cli

# ----------------------------------------------------------------------------- CLI


def test_unknown_gpu_is_one_clear_line_and_exit_2(capsys):
    with pytest.raises(ValueError, match="unknown GPU 'B300'; known GPUs: A100-40GB"):
        plan_training(PlanInputs(gpu="B300"))
    assert main(["plan", "--gpu", "B300"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "H100" in err and err.startswith("elastic-gpt plan: error:")


def test_model_that_cannot_fit_says_what_would(capsys):
    assert main(["plan", "--model", "gpt3-13b", "--gpu", "A10G", "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "does not fit on 8 x A10G" in err and "at least" in err and "x A100-40GB" in err
    # the suggestion is right: that many GPUs (and a batch to feed them) does fit
    n = int(err.split("at least ")[1].split(" x")[0])
    plan = plan_training(PlanInputs(model="gpt3-13b", gpu="A10G", n_gpus=n,
                                    global_batch_size=4 * n))
    # (12 would fit at tp=4, but its 3 FSDP shards cannot split c_attn's 5,120 columns)
    assert plan.chosen.activation_checkpointing and 5120 % plan.chosen.mesh.dp_shard == 0
    with pytest.raises(ValueError, match="does not fit"):
        plan_training(PlanInputs(model="gpt3-13b", gpu="A10G", n_gpus=n - 1,
                                 global_batch_size=4 * n))


def test_report_and_written_config_load_in_the_trainer(tmp_path, capsys):
    out = tmp_path / "planned.yaml"
    rc = run_from_args(cli("--model", "gpt2-124m", "--gpu", "L4", "--gpus", "16",
                           "--tokens", "2.5B", "--write-config", str(out)))
    report = capsys.readouterr().out
    assert rc == 0
    for heading in ("memory per GPU", "communication per GPU", "MFU", "goodput", "spot"):
        assert heading in report
    written = yaml.safe_load(out.read_text())
    allowed = {"model": {"preset", "n_layer", "n_head", "n_embd", "seq_len"},
               "train": {"global_batch_size", "micro_batch_size", "max_steps", "lr",
                         "warmup_steps", "activation_checkpointing", "grad_sync",
                         "reshard_after_forward", "dtype"},
               "scaling": {"min_workers", "max_workers", "use_gpu"},
               "checkpoint": {"every_steps", "every_minutes"},
               "elastic": {"replica_groups", "replica_heartbeat_timeout_s", "node_mtbf_h"}}
    if trainer_parallel_keys():
        allowed["parallel"] = trainer_parallel_keys() & {"tp", "hsdp"}
    assert set(written) == set(allowed)
    for section, keys in written.items():
        assert set(keys) <= allowed[section], section
    assert written["model"]["preset"] == "gpt2-124m" and written["scaling"]["max_workers"] == 16
    cfg = load_config(str(out), ["data.path=/tmp/any-dataset"])  # the trainer's own validation
    assert cfg.train.micro_batch_size == written["train"]["micro_batch_size"]
    # The planned checkpoint interval (of the fault-tolerance mode written, for the default
    # spot market) as minutes of wall time, the step cadence off.
    plan = plan_training(inputs_from_args(cli("--model", "gpt2-124m", "--gpu", "L4", "--gpus",
                                              "16", "--tokens", "2.5B")))
    interval_s = (plan.chosen_replica_groups or plan.spot).interval_s
    assert cfg.checkpoint.every_steps == 0
    assert cfg.checkpoint.every_minutes == pytest.approx(interval_s / 60, rel=1e-2)
    assert cfg.elastic.replica_groups == written["elastic"]["replica_groups"]
    # The grow rule's prior is the node MTBF of the market planned for (spot by default).
    assert cfg.elastic.node_mtbf_h == PlanInputs.spot_node_mtbf_h == written["elastic"]["node_mtbf_h"]
    assert "fault tolerance: the restart path or replica groups" in report


def test_custom_shape_is_written_as_fields(tmp_path, capsys):
    out = tmp_path / "custom.yaml"
    rc = run_from_args(cli("--n-layer", "8", "--n-head", "8", "--n-embd", "512", "--seq-len",
                           "512", "--gpus", "2", "--gpu", "L4", "--write-config", str(out),
                           "--json"))
    assert rc == 0
    model = yaml.safe_load(out.read_text())["model"]
    assert model == {"n_layer": 8, "n_head": 8, "n_embd": 512, "seq_len": 512}
    assert '"micro_batch_size"' in capsys.readouterr().out


# ----------------------------------------------------------------------------- --tp / --hsdp


def test_forced_tp_and_hsdp_are_planned_and_written(tmp_path, capsys):
    out = tmp_path / "tp.yaml"
    rc = run_from_args(cli("--model", "gpt3-13b", "--gpus", "64", "--tp", "2", "--hsdp", "on",
                           "--pp", "1", "--write-config", str(out)))
    assert rc == 0
    report = capsys.readouterr().out
    assert "layout    tp=2 x dp=32 (HSDP: FSDP over 4 in each node x 8 replicas" in report
    assert "layouts weighed" not in report  # one mesh: nothing else was weighed
    plan = plan_training(inputs_from_args(cli("--model", "gpt3-13b", "--gpus", "64", "--tp",
                                              "2", "--hsdp", "on", "--pp", "1")))
    assert plan.chosen.tp == 2 and plan.chosen.hsdp and len(plan.layouts) == 1
    assert plan.min_workers % 8 == 0  # HSDP shrinks in whole nodes (one replica each)
    summary = plan_summary(plan)
    assert (summary["tp"], summary["hsdp"], summary["dp_shard"], summary["dp_replicate"]) == \
        (2, True, 4, 8)
    written = yaml.safe_load(out.read_text())
    keys = trainer_parallel_keys()
    if {"tp", "hsdp"} <= keys:  # the trainer's config has the section: it runs the plan
        assert written["parallel"] == {"tp": 2, "hsdp": "on"}
        cfg = load_config(str(out), ["data.path=/tmp/any-dataset"])
        assert cfg.parallel.tp == 2 and cfg.parallel.hsdp == "on"
    else:
        assert "parallel" not in written
        assert any("has no parallel." in n for n in plan.notes)
    off = plan_training(PlanInputs(model="gpt3-13b", n_gpus=64, tp=1, hsdp="off"))
    assert off.chosen.tp == 1 and not off.chosen.hsdp
    assert training_config(off).get("parallel", {}).get("hsdp", "off") == "off"


@pytest.mark.parametrize("argv, message", [
    (("--model", "gpt2-124m", "--tp", "8"), "--tp=8 does not divide model.n_head=12"),
    (("--model", "gpt3-1.3b", "--tp", "8", "--gpus-per-node", "4", "--gpus", "8"),
     "GPUs per node [4] are not all multiples of --tp=8"),
    (("--model", "gpt3-1.3b", "--tp", "3"), "--tp=3 must be one of 1, 2, 4, 8"),
    (("--model", "gpt3-1.3b", "--tp", "4", "--gpus", "2"), "--tp=4 is more than the 2 GPUs"),
    (("--model", "gpt3-1.3b", "--hsdp", "on", "--gpus", "12"), "--hsdp on replicates whole"),
    (("--model", "gpt3-13b", "--gpu", "L4", "--gpus", "8", "--hsdp", "on"), "does not fit on 8 x L4"),
])
def test_bad_tp_or_hsdp_is_one_clear_line_and_exit_2(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert err.startswith("elastic-gpt plan: error: "), err


def test_a_market_whose_goodput_is_zero_is_named_not_priced(capsys):
    """16384 H100s with a 5-hour spot node MTBF fail every 9 s, before a restart is done: the
    spot cost says the run never ends (not an astronomic figure), the JSON has no cost for it,
    and planning for that market is one line and exit 2."""
    import json

    argv = ("--model", "gpt3-175b", "--gpu", "H100", "--gpus", "16384", "--tokens", "300e9",
            "--spot-node-mtbf-hours", "5")
    assert run_from_args(cli(*argv, "--market", "on-demand")) == 0
    report = capsys.readouterr().out
    spot = next(line for line in report.splitlines() if line.startswith("  spot      $2.50:"))
    assert "never ends: the cluster fails every" in spot and "goodput 0" in spot, spot
    assert "$2,4" not in spot and "days" not in spot
    assert run_from_args(cli(*argv, "--market", "on-demand", "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["cost_spot_usd"] is None and summary["cost_on_demand_usd"] > 0
    assert main(["plan", *argv, "--market", "spot"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "on spot capacity this run never ends" in err[0], err


@pytest.mark.parametrize("forced, named, fix", [
    (("--micro-batch-size", "64"), "at --micro-batch-size 64 does", ("--micro-batch-size",)),
    (("--micro-batch-size", "16", "--activation-checkpointing", "off"),
     "at --micro-batch-size 16 with --activation-checkpointing off does",
     ("--micro-batch-size", "--activation-checkpointing")),
])
def test_a_forced_micro_batch_that_does_not_fit_is_named_with_one_that_does(forced, named, fix,
                                                                            capsys):
    """The model fits these 8 GPUs; the forced setting does not. The line names the setting, not
    the model's floor (micro-batch 1 with checkpointing, which fits), and offers what fits."""
    base = ("--model", "gpt3-13b", "--gpu", "A100-80GB", "--gpus", "8", "--tp", "1", "--pp", "1")
    assert main(["plan", *base, *forced]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("elastic-gpt plan: error: "), err
    assert named in err and "at least" not in err and "even at micro-batch 1" not in err, err
    offered = err.split("; use ")[1].split(" or ")
    assert [o.split()[0] for o in offered] == list(fix), offered
    for option in offered:  # each one offered fits, the other forced settings kept
        words = option.split()
        changed = dict(zip(words[::2], words[1::2]))
        argv = dict(zip(forced[::2], forced[1::2])) | changed
        assert main(["plan", *base, *(x for kv in argv.items() for x in kv)]) == 0, argv
        capsys.readouterr()

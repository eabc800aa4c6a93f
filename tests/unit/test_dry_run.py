"""`elastic-gpt dry-run`'s choice of what to run, without running it: the config it simulates is
the layout the planner is compared on."""

from __future__ import annotations

import argparse

from elastic_gpt.dry_run.cli import _config_of, _inputs_and_config, add_cli_arguments
from elastic_gpt.planner.training_plan import plan_training


def test_a_plan_that_would_write_replica_groups_is_run_in_its_chosen_layout():
    """Llama 3 405B on 512 H100s at tp=8 x pp=8: `plan` writes two replica groups (each group's
    micro-batch 1 and 1F1B); the dry run runs and compares the layout the plan chose for the
    whole world (interleaved, 8 stages per rank, micro-batch 2)."""
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    argv = ["--model", "llama3-405b", "--gpu", "H100-80GB", "--gpus", "512", "--tp", "8",
            "--pp", "8"]
    written = plan_training(_inputs_and_config(parser.parse_args(argv))[0])  # as plan --dry-run
    cfg = _config_of(written)
    mesh = written.chosen.mesh
    assert written.chosen_replica_groups is not None and cfg.elastic.replica_groups == "off"
    assert (cfg.train.micro_batch_size, cfg.parallel.pp_stages_per_rank, cfg.parallel.pp,
            cfg.parallel.tp) == (written.chosen.micro_batch, mesh.stages_per_rank, mesh.pp, mesh.tp)
    assert mesh.stages_per_rank > 1 and cfg.parallel.pp_schedule != "1f1b"

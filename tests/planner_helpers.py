"""What the planner's test modules share: parsed `plan` arguments, a written config read back
through the trainer's own loader, the memory settings a run resolves for a plan, and a relative
tolerance; `tune` run as a user runs it."""

from __future__ import annotations

import argparse

import yaml

from elastic_gpt.cli import build_parser, main
from elastic_gpt.config import load_config
from elastic_gpt.cost_model.memory_settings import resolve_memory_settings
from elastic_gpt.planner.cli import add_cli_arguments


def within(value: float, expected: float, rel: float = 0.10) -> bool:
    return abs(value - expected) <= rel * abs(expected)


def cli(*argv: str) -> argparse.Namespace:
    """`elastic-gpt plan`'s arguments, parsed as the command parses them."""
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return parser.parse_args(list(argv))


def load_config_from(written: dict, tmp_path):
    """A config the planner wrote, through the trainer's own loader and validation."""
    out = tmp_path / "written.yaml"
    out.write_text(yaml.safe_dump(written))
    return load_config(str(out), ["data.path=/tmp/any-dataset"])


def as_planned(plan, **forced):
    """What a run resolves given the plan's GPUs, nodes, tp, micro-batch and checkpointing."""
    c, gpu = plan.chosen, plan.gpu
    n, per = plan.n_gpus, gpu.gpus_per_node
    args = dict(world_size=n, tp=c.tp, workers_per_node=[per] * (n // per) if n > per else [n],
                micro_batch=c.micro_batch, micro_batches_per_rank=c.micro_batches_per_rank,
                activation_checkpointing=c.activation_checkpointing, dtype="bfloat16",
                device_bytes=gpu.memory_bytes, gpu=gpu, pp=c.mesh.pp,
                stages_per_rank=c.mesh.stages_per_rank)
    return resolve_memory_settings(plan.shape, **{**args, **forced})


def planned_settings(c) -> tuple:
    """A planned layout's (hsdp, grad_sync, reshard_after_forward)."""
    return c.hsdp, c.grad_sync, c.reshard_after_forward


def overrides(tmp_path, data: str, *extra: str) -> list[str]:
    """`tune`'s config overrides for the tiny model on `data`, 2 workers, paths under tmp_path."""
    return [f"data.path={data}", "model.preset=tiny", "train.global_batch_size=8",
            "scaling.min_workers=2", "scaling.max_workers=2",
            f"run.storage_path={tmp_path}/ray", f"checkpoint.path={tmp_path}/ckpt", *extra]


def tune(tmp_path, data: str, *flags: str, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    """Through the CLI's error boundary, as a user runs it: (exit code, the parsed arguments)."""
    argv = ["tune", "--config", "jobs/configs/mini.yaml", *overrides(tmp_path, data, *extra),
            *flags]
    return main(argv), build_parser().parse_args(argv)

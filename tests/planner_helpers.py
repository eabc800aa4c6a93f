"""What the planner's test modules share: parsed `plan` arguments, a written config read back
through the trainer's own loader, and a relative tolerance."""

from __future__ import annotations

import argparse

import yaml

from elastic_gpt.config import load_config
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

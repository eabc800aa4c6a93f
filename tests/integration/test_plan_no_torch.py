"""`elastic-gpt plan` and the cost model import no torch (its import alone takes seconds): the
model's shape and arithmetic are model/config.py's, and `tune`'s torch-using modules are
imported only when `tune` runs. Each check is a fresh interpreter, so nothing imported by
another test counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = ["elastic_gpt.planner.cli", "elastic_gpt.planner.tune", "elastic_gpt.cost_model.pipeline",
              "elastic_gpt.cost_model.memory_settings", "elastic_gpt.model.config",
              "elastic_gpt.hardware", "elastic_gpt.planner.inputs"]


def _imports_torch(code: str) -> bool:
    check = f"import sys\n{code}\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_planner_and_the_cost_model_import_no_torch(module):
    assert not _imports_torch(f"import {module}"), f"{module} imports torch"


def test_a_plan_runs_without_torch():
    """The whole command, flags parsed and a plan reported, through the `elastic-gpt` entry
    point's parser."""
    code = ("import contextlib, io\nfrom elastic_gpt.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['plan', '--model', 'gpt2-124m', '--gpus', '8']) == 0")
    assert not _imports_torch(code)


def test_the_check_sees_torch_when_it_is_imported():
    assert _imports_torch("import elastic_gpt.model.gpt")

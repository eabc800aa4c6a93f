"""The Trainer stands apart from Ray: importing it (and the driver's model-shape check) in a fresh
interpreter loads no Ray module, so it runs under any torch process group and the driver's
preflight stays cheap. Ray enters only through elastic_gpt/elastic (worker.py on a worker)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["elastic_gpt.train.trainer", "elastic_gpt.train.model_config"])
def test_importing_the_trainer_loads_no_ray(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

"""The watcher and membership modules import no Ray at import time (a fresh interpreter), so the
watcher starts fast on every node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_watcher_and_the_membership_modules_import_no_ray():
    """The spot watcher starts on every node and the membership thread runs in every worker:
    importing them (and the door itself) must stay cheap."""
    code = ("import sys; import elastic_gpt.elastic.ray_internals, elastic_gpt.elastic.membership,"
            " elastic_gpt.elastic.preemption; print(sorted(m for m in sys.modules"
            " if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout

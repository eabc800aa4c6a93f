"""validation/ is not installed with the package (it is not shipped): its tests import it from
the repository root."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)

"""A digest of a folder tree, for tests that must leave files exactly as they were."""

from __future__ import annotations

import hashlib
import os


def tree_digest(root: str) -> str:
    """Every folder (an empty one left behind counts) and every file's path and bytes."""
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        h.update(dirpath.encode())
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            h.update(path.encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()

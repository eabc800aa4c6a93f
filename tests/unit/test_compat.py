"""What users already have keeps working across upgrades: a dataset written by an older main
(tests/fixtures/main-v0, see its README) reads with today's code (tests/integration/test_compat.py
resumes its checkpoint)."""

from __future__ import annotations

import os
import shutil

import pytest

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "main-v0")


@pytest.fixture
def old_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run


def test_old_dataset_manifest_reads(old_run):
    from elastic_gpt.data.manifest import load_manifest

    manifest = load_manifest(str(old_run / "dataset"))
    assert manifest.num_samples == 1039 and manifest.seq_len == 32

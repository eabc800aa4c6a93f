"""What users already have keeps working across upgrades: a dataset, a config and a checkpoint
written by an older main (tests/fixtures/main-v0, see its README) load with today's code, and the
resumed run logs the same data fingerprints as the old uninterrupted run did and its losses
(C3 bit-identical resume; to the bit on the machine that recorded them: within float32 rounding on
another CPU, whose matmul kernels differ)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from elastic_gpt.tracking import metric_names as mn

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "main-v0")

_RESUME = r"""
import json, os, sys
import torch.distributed as dist
from elastic_gpt.config import load_config, resolve_paths
from elastic_gpt.tracking import metric_names as mn
from elastic_gpt.train.trainer import NullMetricSink, Trainer

os.chdir(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = resolve_paths(load_config("config.yaml"))
logged = {}
class Recorder(NullMetricSink):
    def log(self, m, s):
        logged[str(s)] = [m[mn.TRAIN_LOSS], m[mn.DATA_FINGERPRINT]]
trainer = Trainer(cfg, rank=0, world_size=1, mlflow_run_id=None, metrics=Recorder())
summary = trainer.train()
json.dump({"logged": logged, "step": summary["step"]}, open("resumed.json", "w"))
dist.destroy_process_group()
"""


@pytest.fixture
def old_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run


def test_old_config_dataset_and_checkpoint_resume_bit_identically(old_run):
    from elastic_gpt.testing.ports import free_port

    subprocess.run([sys.executable, "-c", _RESUME, str(old_run), str(free_port())], check=True,
                   timeout=300)
    resumed = json.loads((old_run / "resumed.json").read_text())
    expected = json.loads((old_run / "expected.json").read_text())
    assert resumed["step"] == 4
    # The checkpoint is step_00000002 (after 2 steps): the 3rd and 4th steps are trained again
    # by the new code, which logs them as steps 3 and 4. The old main numbered metrics from 0,
    # so expected.json has them as "2" and "3".
    assert sorted(resumed["logged"]) == ["3", "4"]
    for step, (loss, fingerprint) in resumed["logged"].items():
        old = str(int(step) - mn.OLD_STEP_OFFSET)
        # The fixture's losses were recorded on another machine: CPU matmul kernels differ by
        # instruction set in the last bits (float32 rounding), not in the samples trained.
        assert loss == pytest.approx(expected["loss"][old], rel=1e-6), f"step {step}"
        assert fingerprint == expected["data_fingerprint"][old], f"step {step}"



"""bench/gpu.sh's scripts on the CPU with CUDA hidden: the MFU benchmark and the Trainer check run
every code path of theirs, so a GPU minute is never spent on a Python error."""

from __future__ import annotations

import math
import os

import pytest


def test_the_gpu_benchmark_runs_on_the_cpu_with_cuda_hidden(tmp_path):
    """bench/gpu.sh's measurement script, every code path of it (bf16 and float8, the host-read
    window, the GEMM ceiling, the planner's memory): a GPU minute never goes to a Python error."""
    import json
    import subprocess
    import sys

    out, calibration = tmp_path / "gpu.json", tmp_path / "calibration.json"
    subprocess.run([sys.executable, "bench/gpu_mfu.py", "--cpu-dry-run", "--models", "tiny",
                    "--float8-models", "tiny", "--steps", "1", "--warmup", "1", "--no-compile",
                    "--json", str(out), "--gpu", "H100", "--calibration", str(calibration)],
                   check=True, timeout=300, capture_output=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": "0"})
    got = json.loads(out.read_text())
    # The runs as the planner's measured calibration, in the format it reads: CPU figures on the
    # H100 row, which it refuses to fit (far slower than any H100), in one line.
    from elastic_gpt.hardware import GPUS
    from elastic_gpt.planner.calibration_file import CalibrationFileError, load_calibration

    doc = json.loads(calibration.read_text())
    assert doc["gpu"] == "H100" and [r["dtype"] for r in doc["runs"]] == ["bfloat16", "float8"]
    assert [r["tokens_per_s_per_gpu"] for r in doc["runs"]] == [
        r["host_sync_tokens_per_s"] for r in got["results"]]
    with pytest.raises(CalibrationFileError, match="its runs ran slower than the kernel model"):
        load_calibration(str(calibration), dict(GPUS))
    assert [r["float8"] for r in got["results"]] == [False, True]
    assert got["gemm_ceiling_tflops"] > 0 and got["environment"]["device"] == "cpu"
    for r in got["results"]:
        assert r["tokens_per_s"] > 0 and r["host_sync_tokens_per_s"] > 0
        assert r["predicted_mem_gb"] > 0 and math.isfinite(r["last_loss"])
    # One bf16 step profiled into its parts; every part of a GPT step is there.
    profile = got["results"][0]["profile"]
    assert {"gemm", "attention", "loss", "optimizer", "fsdp_copies_and_collectives"} <= set(
        k for k, v in profile["seconds"].items() if v > 0), profile
    assert sum(profile["share"].values()) == pytest.approx(1.0)
    assert 0 < profile["busy_s"] <= profile["wall_s"] * 1.05
    # The tensor-parallel path on a one-rank mesh gives the plain model's losses and norms.
    smoke = got["tp_compile_smoke"]
    assert smoke["equal"] and len(smoke["tp"]["losses"]) == 3, smoke


def test_the_gpu_trainer_check_runs_on_the_cpu_with_cuda_hidden(tmp_path):
    """bench/gpu.sh's Trainer check (learns, saves asynchronously, resumes), on the CPU: the
    same assertions the GPU run makes."""
    import json
    import subprocess
    import sys

    out = tmp_path / "trainer.json"
    subprocess.run([sys.executable, "bench/gpu_trainer_check.py", "--cpu-dry-run", "--steps",
                    "6", "--json", str(out)], check=True, timeout=300, capture_output=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": "0"})
    got = json.loads(out.read_text())
    assert got["resumed_at"] == 3 and got["committed"] == 6
    assert got["loss_late"] < got["loss_early"]

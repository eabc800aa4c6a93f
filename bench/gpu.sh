#!/usr/bin/env bash
# MFU and tokens/s on one NVIDIA GPU (H100/H200 class) for gpt2-124m, gpt2-350m and gpt3-1.3b:
# bf16, FSDP2 on a world-size-1 NCCL group, SDPA flash attention, fused AdamW, torch.compile per
# block (reset between models), with and without the trainer's per-step host read, against the
# datasheet peak and the measured bf16 GEMM ceiling, peak memory beside the planner's; 1.3b also
# in float8; one step of each model profiled into GEMM, attention, loss, optimizer and FSDP's
# copies; the tensor-parallel path compiled on a one-rank mesh against the plain model. First the
# real Trainer at W=1 over NCCL: 30 steps, an async save, a resume. Under
# 9 minutes on one H200 (most of it is compilation). Figures go to $OUT (or bench/) as
# gpu_trainer_check.json and gpu_results.json, with the environment they were measured in, and
# the runs as the planner's measured calibration of this GPU, calibration.json
# (`elastic-gpt plan --gpu <its row> --calibration calibration.json`, docs/planner.md).
#
#   bash bench/gpu.sh [extra args for bench/gpu_mfu.py, e.g. --models gpt2-124m --steps 10]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=${OUT:-bench}
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# The same path on the CPU first, with CUDA hidden (seconds): a Python error must cost no GPU
# minute, and must stop the check here.
CUDA_VISIBLE_DEVICES="" "$PY" -m pytest -q -x tests/unit/test_gpu_path.py tests/integration/test_gpu_path.py \
    -p no:cacheprovider 2>&1 | tail -3
CUDA_VISIBLE_DEVICES="" "$PY" bench/gpu_mfu.py --cpu-dry-run --models tiny --float8-models tiny \
    --steps 1 --warmup 1 --no-compile --json "$DEST/gpu_dry_run.json" --gpu H100 \
    --calibration "$DEST/calibration_dry_run.json" > /dev/null
CUDA_VISIBLE_DEVICES="" "$PY" bench/gpu_trainer_check.py --cpu-dry-run --steps 6 \
    --json "$DEST/gpu_trainer_dry_run.json" > /dev/null
# The real Trainer on the GPU over NCCL: it learns, saves asynchronously, resumes (a minute).
timeout 120 "$PY" bench/gpu_trainer_check.py --json "$DEST/gpu_trainer_check.json"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
timeout 390 "$PY" bench/gpu_mfu.py --json "$DEST/gpu_results.json" \
    --calibration "$DEST/calibration.json" "$@"

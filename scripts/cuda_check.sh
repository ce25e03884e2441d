#!/usr/bin/env bash
# On a Hopper GPU machine: the CUDA backend's tests (GPU and CPU), JIT costs and a timing against
# cuBLAS on the DeepSeek-V3 dense shapes. Logs and JSON go to $OUT (default
# /tmp/fp8gemm-cuda-check); a short table is printed last.
#   bash scripts/cuda_check.sh [dsv3|quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8gemm-cuda-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FP8GEMM_CACHE_DIR=${FP8GEMM_CACHE_DIR:-/tmp/fp8gemm-cache}
SHAPES=${1:-dsv3}

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"

echo "== tests"
timeout -s KILL 300 python3 -m pytest -q -rs tests/test_cuda_gpu.py tests/test_cuda_compile.py \
    tests/test_jit.py 2>&1 | tee "$OUT/pytest.log" | tail -n 8

echo "== JIT costs"
timeout -s KILL 120 python3 scripts/cuda_jit_timing.py 2>&1 | tee "$OUT/jit_timing.log"

echo "== benchmark"
timeout -s KILL 300 python3 scripts/cuda_bench.py --shapes "$SHAPES" --out "$OUT/cuda_bench.json" \
    2>&1 | tee "$OUT/bench.log" | tail -n 23

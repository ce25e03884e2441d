#!/usr/bin/env bash
# On the GPU machine: run the Triton backend's GPU tests, then time it against its peers with
# fp8gemm.bench (configs printed as they are chosen). Logs and the JSON result go under $OUT.
#   scripts/triton_check.sh [bench suite, default all] [extra fp8gemm.bench args]
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/triton_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} FP8GEMM_CACHE_DIR=${FP8GEMM_CACHE_DIR:-/tmp/fp8gemm_cache}
SUITE=${1:-all}
shift || true

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
status=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    # PYTEST_K: an optional pytest -k expression selecting a subset of the GPU tests
    python -m pytest tests/test_triton_gpu.py -q -x -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
    status=$?
fi
FP8GEMM_PRINT_CONFIGS=1 python -m fp8gemm.bench --suite "$SUITE" \
    --impl fp8gemm-triton,cublas-block,cublas-rowwise-grouped,torch-bf16 \
    --json "$OUT/triton_bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
bench=$?
[ $status -ne 0 ] && echo "GPU TESTS FAILED (see $OUT/gpu_tests.log)"
exit $(( status || bench ))

#!/usr/bin/env bash
# Hardware counters of one call per shape and impl (fp8gemm.bench's implementations) of a dense
# GEMM, a backward one (OP=wgrad, OP=dgrad) or a grouped one (OP=contiguous, offsets, masked;
# shapes GxMxNxK, M rows per group, the bench's layouts; sGxMxNxK: the G groups' G * M rows in the
# moe-skewed suite's skewed sizes), with Nsight Compute. Clocks are left alone
# (--clock-control none): the kernels run at the clocks the benchmark sees. Needs a machine whose
# runtime lets ncu read the counters.
#
#   OUT=/tmp/ncu SHAPES="4096x4096x7168 4096x7168x2048" IMPLS="fp8gemm-cuda cublas-tensor" \
#       bash scripts/ncu_dense.sh
#   OP=wgrad SHAPES=2112x7168x4096 IMPLS="fp8gemm-cuda deepgemm cublas-block" \
#       bash scripts/ncu_dense.sh
#   OP=offsets SHAPES=8x4096x7168x2048 IMPLS=fp8gemm-cuda bash scripts/ncu_dense.sh
#   OP=contiguous SHAPES=s16x2048x4096x7168 SOURCE=1 \
#       IMPLS="fp8gemm-cuda:block_m=128+block_n=160 deepgemm" bash scripts/ncu_dense.sh
#
# `fp8gemm-cuda:VARIANT` profiles a config of the CUDA family that takes the problem, VARIANT in
# scripts/cuda_tiles.py's syntax (`base` or FIELD=VALUE changes joined by '+'), run through the
# family's `run`. SOURCE=1 also writes each kernel's per-instruction counters and stall samples
# (`--page source --print-source sass`, CSV) to $OUT/ncu_<tag>_sass.csv.
#
# (deepgemm needs DeepGEMM's checkout on PYTHONPATH: DEEPGEMM_DIR, default .peers/deepgemm.)
#
# Per shape and impl: one warm-up call, then the profiled one (the kernels inside an NVTX
# range); the sections' text goes to $OUT/ncu_<op>_<shape>_<impl>.txt, a few headline metrics to
# stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/ncu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FP8GEMM_CACHE_DIR="${FP8GEMM_CACHE_DIR:-/tmp/fp8gemm-cache}"
DEEPGEMM_DIR="${DEEPGEMM_DIR:-$PWD/.peers/deepgemm}"
if [[ -d "$DEEPGEMM_DIR/deep_gemm" ]]; then
    export PYTHONPATH="$PYTHONPATH:$DEEPGEMM_DIR" DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/dg-cache}"
fi
OP="${OP:-dense}"
SHAPES="${SHAPES:-4096x4096x7168}"
IMPLS="${IMPLS:-fp8gemm-cuda cublas-tensor}"
METRICS="sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum,\
sm__inst_executed_pipe_tensor_op_gmma.sum,\
lts__t_bytes.sum.per_second,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,\
smsp__issue_active.avg.pct_of_peak_sustained_elapsed,\
smsp__inst_executed.sum,sm__warps_active.avg.per_cycle_active"
for shape in $SHAPES; do
    for impl in $IMPLS; do
        tag="$(echo "${OP}_${shape}_${impl}" | tr -c 'A-Za-z0-9._\n-' '_')"
        timeout 240 ncu --clock-control none --nvtx --nvtx-include "profiled/" --launch-count 4 \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
            --section SourceCounters --print-details all --metrics "$METRICS" \
            python3 scripts/ncu_call.py "$shape" "$impl" "$OP" >"$OUT/ncu_$tag.txt" 2>&1
        rc=$?
        if [[ "${SOURCE:-0}" == "1" ]]; then
            timeout 240 ncu --clock-control none --nvtx --nvtx-include "profiled/" --launch-count 4 \
                --section SourceCounters --section WarpStateStats --page source --csv \
                --print-source sass python3 scripts/ncu_call.py "$shape" "$impl" "$OP" \
                >"$OUT/ncu_${tag}_sass.csv" 2>&1
        fi
        echo "== $tag (rc $rc)"
        pattern="^  [a-zA-Z_]+ \(|Duration|SM Frequency|gmma|lts__t_bytes|hit_rate|dram__bytes"
        pattern+="|issue_active|inst_executed|Compute \(SM\) Throughput|Memory Throughput"
        pattern+="|Warp Cycles Per Issued|Stall|stall"
        grep -E "$pattern" \
            "$OUT/ncu_$tag.txt" | head -40
    done
done

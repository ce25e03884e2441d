#!/usr/bin/env bash
# One run on the GPU machine: the GPU tests, then the benchmark, then a short summary.
#
#   FP8GEMM_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh
#
# Writes into $OUT (default /tmp/gpu_check_out): gpu_tests.log, bench.log, bench.json (the
# result-file form of fp8gemm/bench/report.py), bench.md, bench.png. Each suite runs in its own
# process under its own time limit, so a kernel fault or a hang in one loses only that suite;
# results are saved after every measurement.
#
# Environment (all optional):
#   SUITES="deepseek-dense deepseek-grouped irregular"   suites to run (space or comma separated)
#   IMPLS=fp8gemm-triton,cublas-block,...                 implementations (default: the bench's)
#   QUICK=1            30 timed runs instead of 100 and fewer irregular shapes
#   SKIP_TESTS=1       no pytest;  SKIP_BENCH=1: no benchmark
#   QUANT=1            also the quantisers against a bf16 copy (scripts/quant_bandwidth.py, e4m3
#                      and e5m2) -> quant.log, quant.json (at most 120 s)
#   COPY=1             also a copy of each decode GEMM's bytes against the bench's memory floor
#                      (scripts/copy_floor.py) -> copy.log, copy.json (at most 60 s)
#   PROBE=1            also the mainloop probes (scripts/wgmma_probe.py: tensor cores against
#                      the promotion, no loads) -> probe.log, probe.json (at most 90 s);
#                      PROBE_ONLY="NAME,NAME": those probes alone
#   TILES="ARGS; ARGS" also scripts/cuda_tiles.py once per ';'-separated argument list (configs
#                      of a family timed against its choice and peers in one run), each at most
#                      TILES_TIMEOUT=150 s -> tiles.log, tiles-1.json, tiles-2.json, ...
#   TIMELINE="ARGS; ARGS"  also scripts/timeline_1d2d.py once per ';'-separated argument list
#                      (SHAPE OP [VARIANT]: a traced 1D2D build, or VARIANT `deepgemm` DeepGEMM's
#                      kernel traced alike; the cycles with no wgmma in flight
#                      by cause), each at most 120 s -> timeline.log, timeline-1.json (stamps), ...
#   DG_CORE=1          also DeepGEMM's own tests/test_core.py (DEEPGEMM_DIR) against the drop-in
#                      fp8gemm.compat.deep_gemm installed as `deep_gemm` -> dg_core.log (240 s)
#   TEST_PATHS=tests/  what pytest collects (e.g. "tests/test_triton_gpu.py")
#   TEST_PART=1|2      half of the GPU suite, for calls of at most 600 s: 1 is PART1_TESTS (the
#                      CUDA GEMM kernels: dense, small-M, grouped, 1D1D, k-grouped; about 240
#                      tests), 2 every other file (the quantisers, Triton, ops, nn, autograd,
#                      compile: about 210). On an H100 the whole suite no longer fits 370 s.
#   TEST_ARGS="..."    extra pytest arguments, shell-quoted (e.g. "-x" or '-k "combine or e5m2"')
#   TEST_TIMEOUT=450   seconds for the tests (the whole GPU suite no longer fits: 434 s ran 307 of
#                      its ~400 tests; run it as TEST_PART=1 and 2, the bench in either call)
#   TIME_BUDGET=570    seconds for the whole script; the suites share what the tests leave
#   FP8GEMM_COMMIT     recorded in the results (else git rev-parse, where .git exists). Through the
#                      device tool, write the hash in literally: the copy's .git there can be stale.
#   DEEPGEMM_DIR       DeepGEMM's checkout (default .peers/deepgemm): on PYTHONPATH when present, so
#                      the bench times the `deepgemm` peer (an ignored folder: carry it).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEEPGEMM_DIR="${DEEPGEMM_DIR:-$PWD/.peers/deepgemm}"
if [[ -d "$DEEPGEMM_DIR/deep_gemm" ]]; then
    export PYTHONPATH="$PYTHONPATH:$DEEPGEMM_DIR" DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/dg-cache}"
fi
export FP8GEMM_CACHE_DIR="${FP8GEMM_CACHE_DIR:-/tmp/fp8gemm-cache}"
if [[ -z "${FP8GEMM_COMMIT:-}" ]]; then
    FP8GEMM_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
fi
export FP8GEMM_COMMIT
SUITES="${SUITES:-deepseek-dense deepseek-grouped irregular}"
SUITES="${SUITES//,/ }"
TIME_BUDGET="${TIME_BUDGET:-570}"
TEST_TIMEOUT="${TEST_TIMEOUT:-450}"
START=$SECONDS
WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"

echo "== gpu_check: commit $FP8GEMM_COMMIT, out $OUT, budget ${TIME_BUDGET}s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,memory.used \
    --format=csv,noheader 2>&1 | head -4
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability())' 2>&1

PART1_TESTS="tests/test_cuda_gpu.py tests/test_cuda_small_m.py tests/test_cuda_grouped_gpu.py"
PART1_TESTS+=" tests/test_cuda_1d1d.py tests/test_k_grouped.py tests/test_cuda_pdl_gpu.py"
PART1_TESTS+=" tests/test_cuda_tiles.py"
case "${TEST_PART:-}" in
    1) TEST_PATHS="$PART1_TESTS" ;;
    2) TEST_PATHS="tests/"
       for f in $PART1_TESTS; do TEST_ARGS="${TEST_ARGS:-} --ignore=$f"; done ;;
    "") ;;
    *) echo "TEST_PART must be 1 or 2, got $TEST_PART" >&2; exit 2 ;;
esac

tests_summary="skipped (SKIP_TESTS=1)"
if [[ "${SKIP_TESTS:-0}" != "1" ]]; then
    echo "== pytest -m gpu (limit ${TEST_TIMEOUT}s) -> $OUT/gpu_tests.log"
    eval "extra=(${TEST_ARGS:-})"  # (quoted words stay one argument: -k "a or b")
    # NOTE: -v names each test before it runs, so a test that hangs (a kernel that never ends
    # holds every later test too) is the last line before the interrupt; -rfEs lists failures,
    # errors and skips after the run.
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=15 "$TEST_TIMEOUT" \
        python3 -m pytest -m gpu -v --tb=short -rfEs -p no:cacheprovider ${TEST_PATHS:-tests/} \
        "${extra[@]}" >"$OUT/gpu_tests.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/gpu_tests.log"
    last="$(grep -E '( in [0-9.]+s|no tests ran)' "$OUT/gpu_tests.log" | tail -n 1 \
        | sed -E 's/^=+ *//; s/ *=+$//')"
    case $rc in
        0) tests_summary="ok: $last" ;;
        5) tests_summary="no gpu tests collected" ;;
        124|130)
            # (an interrupted run has pytest's '!!! KeyboardInterrupt !!!' banner; without it the
            # run had ended, and only the process's exit outlasted the limit)
            if [[ -n "$last" ]] && ! grep -qE '^!+ KeyboardInterrupt !+$' "$OUT/gpu_tests.log"; then
                if [[ "$last" =~ (failed|error) ]]; then
                    tests_summary="FAILED (the run complete, its exit stopped at the limit): $last"
                else
                    tests_summary="ok, the run complete, its exit stopped at the ${TEST_TIMEOUT}s limit: $last"
                fi
            else
                started="$(grep -oE '^tests/[^ ]+::[^ ]+' "$OUT/gpu_tests.log" | tail -n 1)"
                tests_summary="TIMED OUT after ${TEST_TIMEOUT}s (last started: $started): $last"
            fi ;;
        *) tests_summary="FAILED (rc $rc): $last" ;;
    esac
fi

bench_summary="skipped (SKIP_BENCH=1)"
if [[ "${SKIP_BENCH:-0}" != "1" ]]; then
    args=()
    [[ "${QUICK:-0}" == "1" ]] && args+=(--quick)
    [[ -n "${IMPLS:-}" ]] && args+=(--impl "$IMPLS")
    read -r -a suites <<<"$SUITES"
    jsons=() notes=() failed=()
    : >"$OUT/bench.log"
    for i in "${!suites[@]}"; do
        s="${suites[$i]}"
        left=$(( TIME_BUDGET - (SECONDS - START) - 20 ))
        share=$(( left / (${#suites[@]} - i) ))
        if (( share < 30 )); then
            echo "== $s: not run, only ${left}s of the budget left" | tee -a "$OUT/bench.log"
            failed+=("$s (no time left)")
            continue
        fi
        echo "== bench --suite $s (limit ${share}s)" | tee -a "$OUT/bench.log"
        t0=$SECONDS
        timeout --signal=INT --kill-after=15 "$share" \
            python3 -m fp8gemm.bench --suite "$s" "${args[@]}" --json "$WORK/$s.json" \
            --notes "$WORK/$s.notes" >"$WORK/$s.log" 2>&1
        rc=$?
        cat "$WORK/$s.log" >>"$OUT/bench.log"
        echo "   $s: rc $rc, $(grep -c '^  [a-z-]*/.* us  eager' "$WORK/$s.log") measurements, $(( SECONDS - t0 ))s"
        (( rc != 0 )) && tail -n 4 "$WORK/$s.log"
        [[ -s "$WORK/$s.json" ]] && jsons+=("$WORK/$s.json")
        [[ -s "$WORK/$s.notes" ]] && notes+=(--notes "$WORK/$s.notes")
        if (( rc != 0 )); then
            failed+=("$s (rc $rc$( ((rc == 124 || rc == 130)) && echo ', timed out: partial'))")
            echo "partial or failed: $s (rc $rc)" >>"$WORK/failures.notes"
        fi
    done
    [[ -s "$WORK/failures.notes" ]] && notes+=(--notes "$WORK/failures.notes")
    if (( ${#jsons[@]} )); then
        python3 -m fp8gemm.bench --from-json "${jsons[@]}" "${notes[@]}" --json "$OUT/bench.json" \
            --markdown "$OUT/bench.md" --plot "$OUT/bench.png" >>"$OUT/bench.log" 2>&1 \
            || echo "merging the results failed: see bench.log"
    fi
    bench_summary="${#jsons[@]} of ${#suites[@]} suites with results"
    (( ${#failed[@]} )) && bench_summary+="; problems: ${failed[*]}"
fi

copy_summary="skipped (COPY=0)"
if [[ "${COPY:-0}" == "1" ]]; then
    echo "== copies of the decode GEMMs' bytes -> $OUT/copy.log"
    timeout --signal=INT --kill-after=10 60 python3 scripts/copy_floor.py \
        --json "$OUT/copy.json" >"$OUT/copy.log" 2>&1
    rc=$?
    cat "$OUT/copy.log"
    copy_summary="rc $rc, $(grep -c 'the floor' "$OUT/copy.log") shapes"
fi

quant_summary="skipped (QUANT=0)"
if [[ "${QUANT:-0}" == "1" ]]; then
    echo "== quantisers against a copy -> $OUT/quant.log"
    timeout --signal=INT --kill-after=10 120 python3 scripts/quant_bandwidth.py --fmt e4m3,e5m2 \
        --json "$OUT/quant.json" >"$OUT/quant.log" 2>&1
    rc=$?
    tail -n 30 "$OUT/quant.log"
    quant_summary="rc $rc, $(grep -c ' of copy' "$OUT/quant.log") measurements"
fi

probe_summary="skipped (PROBE=0)"
if [[ "${PROBE:-0}" == "1" ]]; then
    echo "== mainloop probes -> $OUT/probe.log"
    only=()
    [[ -n "${PROBE_ONLY:-}" ]] && only=(--only "$PROBE_ONLY")
    timeout --signal=INT --kill-after=10 90 \
        python3 scripts/wgmma_probe.py --json "$OUT/probe.json" "${only[@]}" \
        >"$OUT/probe.log" 2>&1
    rc=$?
    cat "$OUT/probe.log"
    probe_summary="rc $rc, $(grep -c 'cycles/k-block' "$OUT/probe.log") probes"
fi

# run_lists NAME SCRIPT SECONDS LISTS [OPTION]: SCRIPT once per ';'-separated argument list of
# LISTS, each at most SECONDS, into $OUT/NAME.log (OPTION: also OPTION $OUT/NAME-<i>.json, the
# script's file output); sets lists_summary.
run_lists() {
    local name=$1 script=$2 seconds=$3 lists=$4 out_opt=${5:-} i rc done_runs=0 runs targs extra
    IFS=';' read -r -a runs <<<"$lists"
    : >"$OUT/$name.log"
    for i in "${!runs[@]}"; do
        eval "targs=(${runs[$i]})"  # (quoted words stay one argument)
        (( ${#targs[@]} )) || continue
        extra=()
        [[ -n "$out_opt" ]] && extra=("$out_opt" "$OUT/$name-$(( i + 1 )).json")
        echo "== $script ${runs[$i]} -> $OUT/$name.log" | tee -a "$OUT/$name.log"
        timeout --signal=INT --kill-after=10 "$seconds" python3 "scripts/$script" "${targs[@]}" \
            "${extra[@]}" >>"$OUT/$name.log" 2>&1
        rc=$?
        echo "   rc $rc" | tee -a "$OUT/$name.log"
        (( rc == 0 )) && done_runs=$(( done_runs + 1 ))
    done
    lists_summary="$done_runs of ${#runs[@]} runs completed"
}

tiles_summary="skipped (TILES empty)"
if [[ -n "${TILES:-}" ]]; then
    run_lists tiles cuda_tiles.py "${TILES_TIMEOUT:-150}" "$TILES" --json
    grep -E '^ +[0-9sx]+ |geometric|WRONG|refused' "$OUT/tiles.log" | cut -c1-160 | head -n 60
    tiles_summary=$lists_summary
fi

timeline_summary="skipped (TIMELINE empty)"
if [[ -n "${TIMELINE:-}" ]]; then
    run_lists timeline timeline_1d2d.py 120 "$TIMELINE" --dump
    grep -vE '^(==|   rc)' "$OUT/timeline.log" | cut -c1-200 | head -n 80
    timeline_summary=$lists_summary
fi

dg_summary="skipped (DG_CORE=0)"
if [[ "${DG_CORE:-0}" == "1" ]]; then
    echo "== DeepGEMM's test_core.py against the drop-in -> $OUT/dg_core.log"
    timeout --signal=INT --kill-after=10 240 python3 -c '
import runpy, sys
import fp8gemm.compat.deep_gemm as d
d.install()
runpy.run_path(sys.argv[1], run_name="__main__")' "$DEEPGEMM_DIR/tests/test_core.py" \
        >"$OUT/dg_core.log" 2>&1
    rc=$?
    tail -n 20 "$OUT/dg_core.log"
    dg_summary="rc $rc ($( ((rc == 0)) && echo 'every assert passed' || echo 'see dg_core.log'))"
fi

echo
echo "== skipped implementations and peer notes (bench.md has all)"
if [[ -s "$OUT/bench.md" ]]; then
    awk '/^#### Notes/{on=1; next} /^###/{on=0} on && NF' "$OUT/bench.md" | cut -c1-220 | head -n 20
fi
echo
echo "== summary (device µs, × baseline peer of the same run)"
if [[ -s "$OUT/bench.json" ]]; then
    python3 - "$OUT/bench.json" <<'PY'
import sys
from fp8gemm.bench.report import load_json, summary_markdown
print(summary_markdown(load_json(sys.argv[1])))
PY
fi
echo "tests: $tests_summary"
echo "bench: $bench_summary"
echo "quant: $quant_summary"
echo "copy: $copy_summary"
echo "probes: $probe_summary"
echo "tiles: $tiles_summary"
echo "timeline: $timeline_summary"
echo "deepgemm test_core on the drop-in: $dg_summary"
echo "files: $(cd "$OUT" && ls | tr '\n' ' ')  ($(( SECONDS - START ))s)"
rm -rf "$WORK"

#!/usr/bin/env python3
"""Time the CUDA backend's dense kernel against cuBLAS on the DeepSeek-V3 shapes (H100/H200).

Device time: CUDA events around one call, L2 flushed (256 MB memset) before each run, median of
--reps runs. Eager time: 50 back-to-back calls, no flush, wall time / 50 (what an eager caller
sees); host time: the Python time of those calls before the final synchronise. Peers, measured in
the same run: `torch._scaled_mm` block-wise (1x128 x 128x128, cuBLAS) when this torch has it and
its result checks out, and per-tensor (the no-scaling ceiling).

    python scripts/cuda_bench.py --out results.json [--shapes dsv3|quick] [--reps 30]

Writes the DESIGN.md section 6 JSON form and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_cuda_gpu import (DSV3_SHAPES, calc_diff, dense_problem, make_operands,  # noqa: E402
                           reference, run_cuda)

from fp8gemm.backends import cuda as cuda_backend  # noqa: E402

_FLUSH = None


def flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    _FLUSH.zero_()


def device_times_us(fns: dict, reps: int, warmup_ms: float = 30.0) -> dict:
    """Median device time of each fn, cold L2, measured round-robin (one run of each per round)
    so that clock changes over the measurement (H200 boost vs power) hit every fn alike."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    # Warm up the clocks on the work itself, not on idle.
    for fn in fns.values():
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < warmup_ms / max(len(fns), 1):
            fn()
        torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            flush_l2()
            # NOTE: the flush keeps the GPU busy while the host records the start event and
            # launches fn, so host launch cost stays out of the measured interval.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def device_time_us(fn, reps: int) -> float:
    return device_times_us({"fn": fn}, reps, warmup_ms=5.0)["fn"]


def eager_us(fn, calls: int = 50) -> tuple[float, float]:
    """(wall us per call including the device, host us per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / calls * 1e6, (t1 - t0) / calls * 1e6


def cublas_blockwise(a, sa, b, sb):
    """cuBLAS block-wise (1x128 A, 128x128 B): `torch.nn.functional.scaled_mm` where it exists,
    else `torch._scaled_mm`. cuBLAS reads sa [M, kb] with strides (1, M) and B's scales as those
    of B^T [K, N]: [kb, nb] with strides (1, kb), kb padded to a multiple of 4 (zeros) where
    torch asks for it. Returns (fn, how)."""
    import torch.nn.functional as F

    nb, kb = sb.shape
    sa_arg = sa.t().contiguous().t() if kb > 1 else sa.contiguous()
    kb4 = (kb + 3) // 4 * 4
    padded = torch.zeros(nb, kb4, device=sb.device, dtype=torch.float32)
    padded[:, :kb] = sb
    layouts = {"plain": sb.contiguous().t(), "padded-view": padded.t()[:kb], "padded": padded.t()}
    errors = []
    for name, sb_arg in layouts.items():
        for api in ("F.scaled_mm", "torch._scaled_mm"):
            if api == "F.scaled_mm" and hasattr(F, "scaled_mm"):
                st = F.ScalingType

                def fn(sb_arg=sb_arg):
                    return F.scaled_mm(a, b.t(), sa_arg, st.BlockWise1x128, sb_arg,
                                       st.BlockWise128x128, output_dtype=torch.bfloat16)
            elif api == "torch._scaled_mm":
                def fn(sb_arg=sb_arg):
                    return torch._scaled_mm(a, b.t(), scale_a=sa_arg, scale_b=sb_arg,
                                            out_dtype=torch.bfloat16)
            else:
                continue
            try:
                fn()
                return fn, f"{api}, B scales {name}"
            except Exception as e:  # noqa: BLE001 - try the next calling convention
                errors.append(f"{api}/{name}: {str(e).splitlines()[0][:120]}")
    raise RuntimeError("; ".join(errors))


def cublas_tensorwise(a, b):
    one = torch.ones((), device=a.device, dtype=torch.float32)

    def fn():
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return fn


def meta() -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            return ""

    import triton

    clocks = run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm", "--format=csv,noheader"])
    return {"gpu": torch.cuda.get_device_name(), "clocks": clocks, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "commit": run(["git", "rev-parse", "--short", "HEAD"]) or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cuda_bench.json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default="dsv3", choices=("dsv3", "quick"))
    args = ap.parse_args()
    shapes = DSV3_SHAPES if args.shapes == "dsv3" else DSV3_SHAPES[::6]
    dev = torch.device("cuda")
    from fp8gemm.backends.cuda import sm90_fp8_gemm

    rows, table = [], []
    for m, n, k in shapes:
        a, sa, b, sb = make_operands(m, n, k, dev)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        t0 = time.perf_counter()
        run_cuda(a, sa, b, sb, out)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        ref = reference(a, sa, b, sb)
        diff = calc_diff(out, ref)
        flops, nbytes = 2.0 * m * n * k, m * k + n * k + m * n * 2
        problem_cfg = str(sm90_fp8_gemm._plans[(m, n, k, 0)].cfg)

        problem = dense_problem(m, n, k)

        def ours():  # the backend entry the ops layer calls, with its problem prebuilt
            cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, None, problem)

        impls = {"fp8gemm-cuda": (ours, diff)}
        try:
            blk, how = cublas_blockwise(a, sa, b, sb)
            d_blk = calc_diff(blk(), ref)
            if m == shapes[0][0] and (n, k) == shapes[0][1:]:
                print(f"cublas-block via {how}")
            impls["cublas-block"] = (blk, d_blk)
        except Exception as e:  # torch without block-wise scaled_mm
            print(f"cublas-block unavailable for {m}x{n}x{k}: {type(e).__name__}: {e}"[:300])
        impls["cublas-tensor"] = (cublas_tensorwise(a, b), float("nan"))

        res = {}
        dev_us = device_times_us({name: fn for name, (fn, _) in impls.items()}, args.reps)
        for name, (fn, d) in impls.items():
            us = dev_us[name]
            eager, host = eager_us(fn)
            res[name] = (us, eager, host)
            rows.append({"suite": "dsv3-dense", "op": "fp8_gemm_nt",
                         "shape": {"m": m, "n": n, "k": k, "groups": 1}, "impl": name, "us": us,
                         "eager_us": eager, "host_us": host, "tflops": flops / us / 1e6,
                         "gbs": nbytes / us / 1e3, "diff": None if math.isnan(d) else d,
                         **({"config": problem_cfg, "first_call_s": first_call_s}
                            if name == "fp8gemm-cuda" else {})})
        ours_us = res["fp8gemm-cuda"][0]
        blk_us = res.get("cublas-block", (float("nan"),))[0]
        table.append((m, n, k, ours_us, blk_us, res["cublas-tensor"][0], blk_us / ours_us,
                      flops / ours_us / 1e6, res["fp8gemm-cuda"][2], res["fp8gemm-cuda"][1],
                      diff, impls.get("cublas-block", (None, float("nan")))[1], problem_cfg))
        del a, b, out, ref
        torch.cuda.empty_cache()

    Path(args.out).write_text(json.dumps({"meta": meta(), "rows": rows}, indent=1))
    print(f"\n{'M':>5} {'N':>6} {'K':>6} {'ours us':>8} {'cuBLAS blk':>10} {'cuBLAS tns':>10} "
          f"{'x blk':>6} {'TFLOPS':>7} {'host us':>7} {'eager us':>8} {'diff':>8} {'blkdiff':>8}  config")
    for r in table:
        print(f"{r[0]:>5} {r[1]:>6} {r[2]:>6} {r[3]:8.1f} {r[4]:10.1f} {r[5]:10.1f} {r[6]:6.2f} "
              f"{r[7]:7.0f} {r[8]:7.1f} {r[9]:8.1f} {r[10]:8.1e} {r[11]:8.1e}  {r[12]}")
    ratios = [r[6] for r in table if not math.isnan(r[6])]
    big = [r[6] for r in table if r[0] >= 4096 and not math.isnan(r[6])]
    if ratios:
        gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
        print(f"geomean x cuBLAS block: all {gm(ratios):.3f}" + (f", M=4096 {gm(big):.3f}" if big else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

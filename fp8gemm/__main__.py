"""`python -m fp8gemm`: the main job.

On a machine without a Hopper GPU: quantise random data at a DeepSeek-V3 shape, run every backend
that can run here (the reference, and Triton through its CPU interpreter) and print how close each
is to bf16 and float64 results. On a Hopper GPU: the same check, then a short benchmark.
`python -m fp8gemm --check` reports the environment, with what to do about each problem.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _has_hopper() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def demo(m: int, n: int, k: int) -> int:
    import torch

    import fp8gemm
    from fp8gemm.backends import NAMES, get_backend, load_error
    from fp8gemm.backends.reference import dequantize

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    a, sa = fp8gemm.quantize_per_token(x)
    b, sb = fp8gemm.quantize_per_block(w)
    problem_ref = (dequantize(a, sa, fp8gemm.Recipe.GROUP, torch.float64)
                   @ dequantize(b, sb, fp8gemm.Recipe.BLOCK, torch.float64).T)
    bf16_ref = (x @ w.T).double()
    print(f"fp8gemm {fp8gemm.__version__} on {device}: y = x @ w.T with x [{m}, {k}] quantised "
          f"per 1x128 token group and w [{n}, {k}] per 128x128 block (e4m3)")
    print(f"{'backend':<10} {'status':<8} {'ms':>9}  {'diff vs float64 (dequantised)':>30}  "
          f"{'diff vs bf16 x @ w.T':>20}")
    failed = 0
    for name in NAMES:
        mod = get_backend(name)
        if mod is None:
            print(f"{name:<10} {'skipped':<8} {'':>9}  not importable: {load_error(name)}")
            continue
        if not mod.is_available(device):
            print(f"{name:<10} {'skipped':<8} {'':>9}  not available on {device}")
            continue
        try:
            y = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend=name)  # compile / warm up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend=name)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
        except ValueError as e:  # the backend does not take this problem here
            print(f"{name:<10} {'skipped':<8} {'':>9}  {e}")
            continue
        d64, dbf = fp8gemm.calc_diff(y, problem_ref), fp8gemm.calc_diff(y, bf16_ref)
        ok = d64 < 1e-5 and not bool(torch.isnan(y).any())
        failed += not ok
        print(f"{name:<10} {'ok' if ok else 'WRONG':<8} {ms:>9.2f}  {d64:>30.2e}  {dbf:>20.2e}")
    print("(diff = 1 - 2*sum(xy)/sum(x^2+y^2); below 1e-5 against float64 is correct; the bf16 "
          "column is the quantisation error itself)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="report the environment and exit")
    p.add_argument("--shape", default=None, help="M,N,K of the demo (default: 64,2112,7168 on a "
                   "GPU, 64,512,7168 on a CPU so Triton's interpreter stays quick)")
    p.add_argument("--no-bench", action="store_true", help="on a GPU, skip the short benchmark")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        # NOTE: without a GPU, Triton kernels run in its interpreter; it must be chosen before
        # triton is first imported. The same for --check, so that both report one environment.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.check:
        from .check import report

        return report()
    shape = args.shape or ("64,2112,7168" if torch.cuda.is_available() else "64,512,7168")
    try:
        m, n, k = (int(v) for v in shape.split(","))
    except ValueError:
        p.error(f"--shape must be M,N,K, got {shape!r}")
    rc = demo(m, n, k)
    if _has_hopper() and not args.no_bench:
        from .bench.__main__ import main as bench_main

        print("\nShort benchmark (python -m fp8gemm.bench --help for more):", flush=True)
        rc |= bench_main(["--suite", "deepseek-dense", "--quick"]) or 0
    elif not torch.cuda.is_available():
        print("\nNo CUDA GPU here, so no benchmark: it needs a Hopper GPU (H100/H200/H800). "
              "python -m fp8gemm --check reports the environment.")
    return rc


if __name__ == "__main__":
    sys.exit(main())

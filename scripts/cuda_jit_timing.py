#!/usr/bin/env python3
"""JIT costs on the GPU machine: cold compile per kernel (empty cache), cached load in a fresh
process, and host time of a warm eager call at small M.

    FP8GEMM_CACHE_DIR=/tmp/x python scripts/cuda_jit_timing.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHILD = r"""
import time, sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
from test_cuda_gpu import make_operands, run_cuda
a, sa, b, sb = make_operands({m}, {n}, {k}, torch.device("cuda"))
out = torch.empty(({m}, {n}), dtype=torch.bfloat16, device="cuda")
t0 = time.perf_counter(); run_cuda(a, sa, b, sb, out); torch.cuda.synchronize()
first = time.perf_counter() - t0
for _ in range(20): run_cuda(a, sa, b, sb, out)
torch.cuda.synchronize()
def host_us(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    hs = []
    for _ in range(n):
        t = time.perf_counter(); fn(); hs.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(hs) * 1e6
from fp8gemm.backends.cuda import sm90_fp8_gemm as g
from test_cuda_gpu import dense_problem
import statistics
problem = dense_problem({m}, {n}, {k})
plan = g._plans[({m}, {n}, {k}, 0)]
pack = next(iter(plan.packs.values()))
stream = torch._C._cuda_getCurrentRawStream(0)
t_helper = host_us(lambda: run_cuda(a, sa, b, sb, out))
t_backend = host_us(lambda: g.fp8_gemm_nt(a, sa, b, sb, out, problem))
t_launch = host_us(lambda: plan.kernel.launch(plan.launch, stream, pack))
t_empty = host_us(lambda: None)
one = torch.ones((), device="cuda")
t_cublas = host_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
t_ops = float("nan")
try:
    import fp8gemm
    t_ops = host_us(lambda: fp8gemm.fp8_gemm_nt((a, sa), (b, sb), out, backend="cuda"))
except Exception as e:
    print("ops layer:", type(e).__name__, e)
print(f"RESULT first_call_s={{first:.4f}} compile_s={{plan.kernel.compile_seconds:.3f}} "
      f"load_ms={{plan.kernel.load_seconds * 1e3:.2f}} host_us: test_helper={{t_helper:.2f}} "
      f"backend={{t_backend:.2f}} launch_only={{t_launch:.2f}} "
      f"empty_lambda={{t_empty:.2f}} ops_layer={{t_ops:.2f}} "
      f"torch_scaled_mm={{t_cublas:.2f}}")
"""


def child(m, n, k, cache_dir):
    env = dict(os.environ, FP8GEMM_CACHE_DIR=cache_dir)
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), m=m, n=n, k=k)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        return f"FAILED: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    return line[0]


def main():
    with tempfile.TemporaryDirectory() as cache:
        for m, n, k in [(64, 2112, 7168), (4096, 7168, 2048)]:
            print(f"{m}x{n}x{k} cold  : {child(m, n, k, cache)}", flush=True)
            print(f"{m}x{n}x{k} cached: {child(m, n, k, cache)}", flush=True)


if __name__ == "__main__":
    main()

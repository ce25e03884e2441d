"""Compile the Triton GEMM, quantisation and MoE combine kernels for sm_90a on a machine without a GPU and report
registers, spills and shared memory per config (Triton ships ptxas). Catches compile errors and
register spills before any GPU time is spent.

    python scripts/triton_compile_check.py [--configs dense|all] [--ptx DIR]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fp8gemm.backends.triton import fp8_gemm, moe, quant  # noqa: E402
from fp8gemm.problem import GemmKind, GemmProblem, Recipe  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_KINDS = {0: GemmKind.DENSE, 1: GemmKind.CONTIGUOUS, 2: GemmKind.OFFSETS, 3: GemmKind.MASKED,
          4: GemmKind.CONTIGUOUS}
_RECIPES = {0: Recipe.TENSOR, 1: Recipe.ROW, 2: Recipe.GROUP, 3: Recipe.BLOCK}
_DTYPES = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2, "bf16": torch.bfloat16,
           "fp32": torch.float32}


def resources(kernel) -> str:
    """REG / STACK / SHARED / spills of the cubin, read with the cuobjdump Triton ships."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([str(_BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=False).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    return (f"regs={m.group(1)} stack={m.group(2)} smem={kernel.metadata.shared}" if m else res[-300:])


def compile_gemm(kind=0, ra=2, rb=3, has_c=False, split=1, tma=True, bm=128, bn=128, warps=8,
                 stages=4, fp8="fp8e4nv", out="bf16", flatten=False):
    """The persistent kernel of one config (kind 4: the contiguous further-groups launch), as
    its family launches it, through fp8_gemm.compile_config."""
    problem = GemmProblem(_KINDS[kind], 4096, 4096, 7168, 1 if kind == 0 else 16, _DTYPES[fp8],
                          _DTYPES[fp8], _RECIPES[ra], _RECIPES[rb], _DTYPES[out], has_c)
    cfg = fp8_gemm.PersistentConfig(bm, bn, 8, split, stages, warps, tma, 132, flatten)
    t = time.time()
    k = fp8_gemm.compile_config(cfg, problem, TARGET, further=kind == 4)
    return k, time.time() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="dense")
    p.add_argument("--ptx", type=Path, help="write each config's PTX into this directory")
    args = p.parse_args()
    cases = [dict(), dict(flatten=True), dict(flatten=True, bm=64, bn=256, warps=8),
             dict(bm=64, bn=128, warps=4, stages=6), dict(bm=64, bn=64, warps=4, stages=6),
             dict(split=4, bm=64, warps=4, stages=6), dict(ra=1, rb=1), dict(tma=False)]
    if args.configs == "all":
        cases += [dict(kind=1), dict(kind=2), dict(kind=3, bm=64, warps=4), dict(kind=4),
                  dict(has_c=True), dict(fp8="fp8e5", out="fp32"),
                  dict(bm=128, bn=256, warps=8, stages=3), dict(bm=64, bn=256, warps=8, stages=4),
                  dict(ra=0, rb=0), dict(ra=2, rb=2)]
    for i, case in enumerate(cases):
        try:
            k, dt = compile_gemm(**case)
        except Exception as e:  # noqa: BLE001
            print(f"{case}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        print(f"{case}: {resources(k)} ({dt:.1f}s)", flush=True)
        if args.ptx:
            args.ptx.mkdir(parents=True, exist_ok=True)
            (args.ptx / f"gemm_{i}.ptx").write_text(k.asm["ptx"])
    for name, k in quant.compile_kernels(TARGET) + moe.compile_kernels(TARGET):
        print(f"{name}: {resources(k)}")


if __name__ == "__main__":
    main()

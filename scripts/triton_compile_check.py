"""Compile the Triton GEMM and quantisation kernels for sm_90 on a machine without a GPU and report
registers, spills and shared memory per config (Triton ships ptxas). Catches compile errors and
register spills before any GPU time is spent.

    python scripts/triton_compile_check.py [--configs dense|all] [--sass]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp8gemm.backends.triton import fp8_gemm, quant  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resources(kernel) -> str:
    """REG / STACK / SHARED / spills of the cubin, read with the cuobjdump Triton ships."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([str(_BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=False).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    return (f"regs={m.group(1)} stack={m.group(2)} smem={kernel.metadata.shared}" if m else res[-300:])


def gemm_signature(fp8="fp8e4nv", out="bf16", tma=True, bm=128, bn=128, bk=128):
    fn = fp8_gemm._fp8_gemm_nt_kernel
    sig = {}
    for name in fn.arg_names:
        sig[name] = "i32"
    sig.update(a_ptr=f"*{fp8}", b_ptr=f"*{fp8}", out_ptr=f"*{out}", c_ptr="*fp32", ws_ptr="*fp32",
               sa_ptr="*fp32", sb_ptr="*fp32", idx_ptr="*i32")
    if tma:
        sig["a_desc"] = f"tensordesc<{fp8}[{bm}, {bk}]>"
        sig["b_desc"] = f"tensordesc<{fp8}[{bn}, {bk}]>"
    else:
        sig["a_desc"] = sig["b_desc"] = "constexpr"
    return sig


def compile_gemm(kind=0, ra=2, rb=3, has_c=False, split=1, tma=True, bm=128, bn=128, bk=128,
                 warps=8, stages=4, fp8="fp8e4nv", out="bf16", flatten=False):
    fn = fp8_gemm._fp8_gemm_nt_kernel
    sig = gemm_signature(fp8, out, tma, bm, bn, bk)
    consts = dict(KIND=kind, A_RECIPE=ra, B_RECIPE=rb, HAS_C=has_c, SPLIT_K=split, USE_TMA=tma,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=132, G_POW2=16,
                  FLATTEN=flatten)
    if not tma:
        consts.update(a_desc=None, b_desc=None)
    for k in consts:
        sig[k] = "constexpr"
    src = ASTSource(fn, sig, consts)
    t = time.time()
    k = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    return k, time.time() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="dense")
    p.add_argument("--sass", action="store_true")
    args = p.parse_args()
    cases = [dict(), dict(flatten=True), dict(flatten=True, bm=64, bn=256, warps=8), dict(bm=64, bn=128, warps=4, stages=6), dict(bm=64, bn=64, warps=4, stages=6),
             dict(split=4, bm=64, warps=4, stages=6), dict(ra=1, rb=1), dict(tma=False)]
    if args.configs == "all":
        cases += [dict(kind=1), dict(kind=2), dict(kind=3, bm=64, warps=4), dict(has_c=True),
                  dict(fp8="fp8e5", out="fp32"), dict(bm=128, bn=256, warps=8, stages=3),
                  dict(bm=64, bn=256, warps=8, stages=4), dict(ra=0, rb=0), dict(ra=2, rb=2)]
    for case in cases:
        try:
            k, dt = compile_gemm(**case)
        except Exception as e:  # noqa: BLE001
            print(f"{case}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        print(f"{case}: {resources(k)} ({dt:.1f}s)", flush=True)
        if args.sass and case == {}:
            Path("/tmp/triton_gemm.ptx").write_text(k.asm["ptx"])
    # quant kernels
    for fn, sig, consts in [
        (quant._quant_rows_kernel,
         dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
         dict(SILU_MUL=True, FMT_MAX=448.0, POW2=False, SOFT_ROUND=False, MANT_BITS=3, MIN_EXP=-6,
              BLOCK_M=32, GROUP_K=128)),
        (quant._quant_block_kernel,
         dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
         dict(FMT_MAX=448.0, POW2=True, SOFT_ROUND=False, MANT_BITS=3, MIN_EXP=-6, BLOCK=128)),
    ]:
        full = {n: "i32" for n in fn.arg_names}
        full.update(sig)
        for kk in consts:
            full[kk] = "constexpr"
        k = triton.compile(ASTSource(fn, full, consts), target=TARGET, options=dict(num_warps=4))
        print(f"{fn.__name__}: {resources(k)}")


if __name__ == "__main__":
    main()

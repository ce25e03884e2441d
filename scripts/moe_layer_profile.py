#!/usr/bin/env python3
"""Where an eager Fp8MoE layer spends its time, on a Hopper GPU: the moe-layer suite's prefill
(one rank's 32 DeepSeek-V3 experts, contiguous layout) and the bf16 layer it is measured against.

    python scripts/moe_layer_profile.py [--tokens 4096] [--calls 5] [--top 16]

For each layer: the wall time of a synchronised call, the device time of its kernels (from the
profiler: the part of the wall time the GPU is busy; the rest is the GPU waiting for the host,
as after the dispatch's synchronisation), the kernels by device time, and the host time of each
step of the fp8 layer called on its own (back-to-back calls, no synchronisation).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fp8gemm  # noqa: E402
from fp8gemm.bench.impls import _bf16_moe, make_data  # noqa: E402
from fp8gemm.bench.suites import MOE_LAYER, Case  # noqa: E402
from fp8gemm.bench.timing import eager_time_us  # noqa: E402


def kernel_table(fn, calls: int):
    """(device µs per call, [(µs per call, launches per call, kernel name)] by time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.self_device_time_total / calls, e.count / calls, e.key)
            for e in prof.key_averages()
            if e.device_type is not None and "cuda" in str(e.device_type).lower()
            and e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[0])
    return sum(r[0] for r in rows), rows


def wall_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def steps_of(md):
    """The fp8 layer's steps, each callable alone on buffers one pass made."""
    mod, g = md.module, md.module.num_experts
    w13, s13, w2, s2 = mod._fp8_weights()
    a, sa = fp8gemm.quantize_per_token(md.x)
    lay = fp8gemm.moe_dispatch_contiguous(a, md.topk_ids, g)
    sa_rows = fp8gemm.get_col_major_tma_aligned_tensor(sa.index_select(0, lay.token_of_row))
    mid = fp8gemm.m_grouped_fp8_gemm_nt_contiguous((lay.x, sa_rows), (w13, s13), None,
                                                  lay.m_indices)
    a2, sa2 = fp8gemm.silu_mul_quantize_per_token(mid)
    y = fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a2, sa2), (w2, s2), None, lay.m_indices)
    return {
        "quantize_per_token (T rows)": lambda: fp8gemm.quantize_per_token(md.x),
        "dispatch (synchronises)": lambda: fp8gemm.moe_dispatch_contiguous(a, md.topk_ids, g),
        "scales laid out": lambda: fp8gemm.get_col_major_tma_aligned_tensor(
            sa.index_select(0, lay.token_of_row)),
        "grouped GEMM w13": lambda: fp8gemm.m_grouped_fp8_gemm_nt_contiguous(
            (lay.x, sa_rows), (w13, s13), None, lay.m_indices),
        "silu_mul_quantize_per_token": lambda: fp8gemm.silu_mul_quantize_per_token(mid),
        "grouped GEMM w2": lambda: fp8gemm.m_grouped_fp8_gemm_nt_contiguous(
            (a2, sa2), (w2, s2), None, lay.m_indices),
        "combine": lambda: fp8gemm.moe_combine_contiguous(y, lay, md.topk_weights),
        "whole layer": lambda: mod(md.x, md.topk_ids, md.topk_weights, layout="contiguous"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=5, help="profiled calls per layer")
    ap.add_argument("--top", type=int, default=16, help="kernels listed per layer")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_layer_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    s = MOE_LAYER
    md = make_data(Case("moe-layer", "moe_layer", args.tokens, s.hidden, s.width,
                        s.local_experts), dev).moe
    bf16, _ = _bf16_moe(md, static=False)
    layers = {"fp8gemm Fp8MoE": lambda: md.module(md.x, md.topk_ids, md.topk_weights,
                                                  layout="contiguous"),
              "bf16 (torch._grouped_mm)": bf16}
    with torch.no_grad():
        for name, fn in layers.items():
            for _ in range(3):
                fn()
            wall = wall_us(fn, 10)
            busy, rows = kernel_table(fn, args.calls)
            print(f"== {name}, {args.tokens} tokens: {wall:.1f} us a synchronised call, kernels "
                  f"{busy:.1f} us ({100 * busy / wall:.0f} % busy)")
            for us, n, key in rows[:args.top]:
                print(f"   {us:8.1f} us  x{n:<4.0f} {key[:100]}")
        print("== host time per call, each step of the fp8 layer alone")
        for name, fn in steps_of(md).items():
            e = eager_time_us(fn, dev, calls=30)
            print(f"   {name:>30}: host {e.host_us:7.1f} us  wall {e.wall_us:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

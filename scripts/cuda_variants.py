#!/usr/bin/env python3
"""Time config variants of the dense sm90 kernel on chosen shapes (tuning aid, H100/H200).

    python scripts/cuda_variants.py [--reps 20]

For each shape: the heuristic's config, then variants (no multicast, multicast on the other
operand, other BLOCK_N, band sizes), device time with a cold L2. Also prints how many 2-CTA
clusters of the kernel can be resident at once (cuOccupancyMaxActiveClusters).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from cuda_bench import device_time_us  # noqa: E402
from test_cuda_gpu import calc_diff, dense_problem, make_operands, reference  # noqa: E402

from fp8gemm.backends.cuda import sm90_fp8_gemm as g  # noqa: E402
from fp8gemm.problem import ceil_div  # noqa: E402


def max_active_clusters(plan) -> int:
    from cuda.bindings import driver as cu

    cfg = plan.cfg
    err, func = cu.cuKernelGetFunction(plan.kernel._kernel)
    lc = cu.CUlaunchConfig()
    lc.gridDimX, lc.gridDimY, lc.gridDimZ = cfg.grid, 1, 1
    lc.blockDimX, lc.blockDimY, lc.blockDimZ = cfg.num_threads, 1, 1
    lc.sharedMemBytes = cfg.smem
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cfg.num_multicast, 1, 1
    lc.attrs = [attr]
    lc.numAttrs = 1
    err2, n = cu.cuOccupancyMaxActiveClusters(func, lc)
    return int(n) if err2 == cu.CUresult.CUDA_SUCCESS else -int(err2)


def variants(m, n, k, base):
    out = [("heuristic", base)]
    nb_m, nb_n = ceil_div(m, base.block_m), ceil_div(n, base.block_n)
    out.append(("no-mcast", dataclasses.replace(base, num_multicast=1, grid=min(132, nb_m * nb_n))))
    if base.num_multicast == 2 and not base.multicast_on_a and nb_n % 2 == 0:
        out.append(("mcast-A", dataclasses.replace(base, multicast_on_a=True)))
    for band in (4, 8, 32):
        out.append((f"band{band}", dataclasses.replace(base, band_size=band)))
    for bn in (128, 144):
        if bn != base.block_n:
            st = g._stages(base.block_m, bn, k, 232448)
            tiles = ceil_div(m, base.block_m) * ceil_div(n, bn)
            mc = base.num_multicast if (ceil_div(m, base.block_m) % 2 == 0) else 1
            cfg = dataclasses.replace(base, block_n=bn, num_stages=st, num_multicast=mc,
                                      multicast_on_a=False, grid=min(132, tiles) // mc * mc,
                                      smem=g.smem_bytes(base.block_m, bn, st, k))
            out.append((f"BN{bn}", cfg))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="4096x7168x16384,4096x4096x7168,4096x7168x2048,4096x2112x7168")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for spec in args.shapes.split(","):
        m, n, k = map(int, spec.split("x"))
        a, sa, b, sb = make_operands(m, n, k, dev)
        ref = reference(a, sa, b, sb)
        problem = dense_problem(m, n, k)

        base = g.select_config(problem, g.DeviceFacts.of(dev))
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        for name, cfg in variants(m, n, k, base):
            try:
                plan = g._Plan(problem, 0, cfg)
                key = (0,)
                sa_k = g._kernel_a_scales(sa, m)
                pack = plan.params(a, sa_k, b, sb, out, key)

                def fn():
                    plan.kernel.launch(plan.launch, torch._C._cuda_getCurrentRawStream(0), pack)

                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                diff = calc_diff(out, ref)
                us = device_time_us(fn, args.reps)
                clusters = max_active_clusters(plan)
                print(f"{m}x{n}x{k} {name:10s} {us:8.1f} us {2 * m * n * k / us / 1e6:6.0f} TFLOPS "
                      f"diff={diff:.1e} clusters={clusters} {cfg}", flush=True)
            except Exception as e:
                print(f"{m}x{n}x{k} {name:10s} FAILED {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()

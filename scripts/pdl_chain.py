#!/usr/bin/env python3
"""Decode chains with and without programmatic dependent launch (FP8GEMM_PDL), on a Hopper GPU.

    python scripts/pdl_chain.py [--links 16] [--rounds 3] [--json out.json]

A chain is what a decode step runs per linear layer: the CUDA per-token quantiser on the layer's
bf16 input, then the GEMM with that layer's own fp8 weight (every link has its own B, so none
stays in L2), captured in one CUDA graph. `gemm` chains are GEMMs alone, back to back, each
with its own A and B; `quant+masked` chains the quantiser and a masked grouped GEMM (decode
MoE). Each chain's graph replay is timed as the benchmark times a call (fp8gemm.bench.timing:
median of 30 runs, L2 flushed, launch hidden behind a sleep), in two child processes, FP8GEMM_PDL=1
and =0, taking turns `--rounds` times; printed per link, with the ratio off / on. FP8GEMM_PDL
is read when a kernel's launch configuration is built, hence a process per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 7168, 2048), (64, 2112, 7168), (64, 7168, 2048), (128, 4096, 7168),
          (128, 7168, 2048)]
# masked: (experts, Mmax rows, N, K), every expert with Mmax / 2 rows (the CUDA quantiser takes
# G * Mmax * K <= 2^20 elements)
MASKED = [(4, 32, 4096, 7168), (8, 64, 7168, 2048)]
REPLAY_HOST_US = 50.0  # host time of a graph replay, for the sleep that hides it


def time_graph(fn, links: int, timer) -> float:
    """µs per link of fn's work captured in a CUDA graph: the benchmark's device time of the
    graph's replay (fp8gemm.bench.timing: L2 flushed, launch hidden behind a sleep, median)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(timer.time_us(graph.replay, host_us=REPLAY_HOST_US)) / links


def child(links: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import fp8gemm
    from fp8gemm.bench.timing import DeviceTimer

    dev = torch.device("cuda")
    timer = DeviceTimer(dev)
    out = {}
    for m, n, k in SHAPES:
        bs = [fp8gemm.quantize_per_block(torch.randn(n, k, device=dev, dtype=torch.bfloat16))
              for _ in range(links)]
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(links)]
        qs = [fp8gemm.quantize_per_token(x) for x in xs]
        chains = {
            "quant+gemm": lambda: [fp8gemm.fp8_gemm_nt(fp8gemm.quantize_per_token(x), b,
                                                       backend="cuda") for x, b in zip(xs, bs)],
            "gemm": lambda: [fp8gemm.fp8_gemm_nt(q, b, backend="cuda") for q, b in zip(qs, bs)],
        }
        for name, fn in chains.items():
            out[f"{name} {m}x{n}x{k}"] = time_graph(fn, links, timer)
    for g, mmax, n, k in MASKED:
        bs = [fp8gemm.quantize_per_block(torch.randn(g, n, k, device=dev, dtype=torch.bfloat16))
              for _ in range(links)]
        xs = [torch.randn(g, mmax, k, device=dev, dtype=torch.bfloat16) for _ in range(links)]
        masked_m = torch.full((g,), mmax // 2, device=dev, dtype=torch.int32)
        outs = [torch.empty(g, mmax, n, device=dev, dtype=torch.bfloat16) for _ in range(links)]

        def masked_chain():
            for x, b, o in zip(xs, bs, outs):
                fp8gemm.m_grouped_fp8_gemm_nt_masked(fp8gemm.quantize_per_token(x), b, o, masked_m,
                                                     expected_m=mmax // 2, backend="cuda")
        out[f"quant+masked {g}x{mmax}x{n}x{k}"] = time_graph(masked_chain, links, timer)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--links", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.links)))
        return
    runs = {"1": [], "0": []}
    for _ in range(args.rounds):
        for mode in ("1", "0"):
            env = dict(os.environ, FP8GEMM_PDL=mode)
            res = subprocess.run([sys.executable, __file__, "--child", "--links", str(args.links)],
                                 env=env, capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    rows = []
    print(f"{'chain':36s} {'PDL on us/link':>15s} {'off':>8s} {'off/on':>7s}")
    for key in runs["1"][0]:
        on = statistics.median(r[key] for r in runs["1"])
        off = statistics.median(r[key] for r in runs["0"])
        rows.append({"chain": key, "pdl_us": on, "no_pdl_us": off})
        print(f"{key:36s} {on:15.2f} {off:8.2f} {off / on:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": runs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Decode chains with and without programmatic dependent launch (FP8GEMM_PDL), on a Hopper GPU.

    python scripts/pdl_chain.py [--links 16] [--rounds 3] [--json out.json] [--headers NAME=DIR]

A chain is what a decode step runs per linear layer: the CUDA per-token quantiser on the layer's
bf16 input, then the GEMM with that layer's own fp8 weight (every link has its own B, so none
stays in L2), captured in one CUDA graph. `gemm` chains are GEMMs alone, back to back, each
with its own A and B; `quant+masked` chains the quantiser and a masked grouped GEMM (decode
MoE). Each chain's graph replay is timed as the benchmark times a call (fp8gemm.bench.timing:
median of 30 runs, L2 flushed, launch hidden behind a sleep), in two child processes, FP8GEMM_PDL=1
and =0, taking turns `--rounds` times; printed per link, with the ratio off / on. FP8GEMM_PDL
is read when a kernel's launch configuration is built, hence a process per mode.
--headers NAME=DIR (as scripts/cuda_tiles.py takes it) also times the chains with the GEMM
kernels built from DIR's headers (the quantiser stays this tree's), on and off, in the same
rounds: a kernel change judged where PDL overlaps it. DIR's kernels need the dependency wait.
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


def child(links: int, include: str) -> dict:
    """The chains' µs per link, with the GEMM kernels built from `include` when given."""
    sys.path.insert(0, str(ROOT))
    if include:
        import cuda_tiles  # (beside this script)

        with cuda_tiles.kernel_headers(Path(include), {}):
            return chains(links)
    return chains(links)


def chains(links: int) -> dict:
    import torch

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
    ap.add_argument("--headers", default="",
                    help="NAME=DIR,...: also the chains with GEMM kernels from DIR's headers")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--include", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.links, args.include)))
        return
    # (column, FP8GEMM_PDL, include folder: "" for this tree's headers)
    modes = [("on", "1", ""), ("off", "0", "")]
    if args.headers:
        import cuda_tiles  # (beside this script)

        for name, inc in cuda_tiles.parse_headers(args.headers).items():
            modes += [(f"on@{name}", "1", str(inc)), (f"off@{name}", "0", str(inc))]
    runs: dict[str, list] = {col: [] for col, _, _ in modes}
    for _ in range(args.rounds):
        for col, pdl, inc in modes:
            env = dict(os.environ, FP8GEMM_PDL=pdl)
            res = subprocess.run([sys.executable, __file__, "--child", "--links", str(args.links),
                                  "--include", inc], env=env, capture_output=True, text=True,
                                 check=True)
            runs[col].append(json.loads(res.stdout.strip().splitlines()[-1]))
    rows = []
    print(f"{'chain (us/link)':36s}" + "".join(f" {col:>10s}" for col in runs) + "  off/on")
    for key in runs["on"][0]:
        med = {col: statistics.median(r[key] for r in rs) for col, rs in runs.items()}
        rows.append({"chain": key, **{f"{col}_us": v for col, v in med.items()}})
        print(f"{key:36s}" + "".join(f" {v:10.2f}" for v in med.values())
              + f"  {med['off'] / med['on']:6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": runs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

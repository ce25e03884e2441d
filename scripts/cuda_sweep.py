#!/usr/bin/env python3
"""Sweep tile configs of the dense sm90 kernel on the DeepSeek-V3 shapes (heuristic calibration).

For each shape, the heuristic's choice and the next cheapest candidates of its cost model, plus
BLOCK_N 64/128, all without multicast, then the best with multicast. Device time, cold L2.

    python scripts/cuda_sweep.py --out sweep.json [--reps 10] [--top 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "scripts"):
    sys.path.insert(0, str(p))

from cuda_bench import device_time_us  # noqa: E402
from test_cuda_gpu import DSV3_SHAPES, calc_diff, dense_problem, make_operands, reference  # noqa: E402

from fp8gemm.backends.cuda import sm90_fp8_gemm as g  # noqa: E402
from fp8gemm.problem import ceil_div  # noqa: E402


def make_cfg(m, n, k, bm, bn, facts, multicast=1, on_a=True):
    st = g._stages(bm, bn, k, facts.smem_per_block)
    tiles = ceil_div(m, bm) * ceil_div(n, bn)
    grid = min(facts.num_sms, tiles)
    grid -= grid % multicast
    return g.Sm90GemmConfig(bm, bn, st, multicast, on_a, g.BAND_SIZE, grid,
                            g.smem_bytes(bm, bn, st, k), bm // 64 * 128 + 128)


def time_cfg(problem, cfg, a, sa, b, sb, out, ref, reps):
    plan = g._Plan(problem, 0, cfg)
    pack = plan.params(a, g._kernel_a_scales(sa, problem.m), b, sb, out, (0,))

    def fn():
        plan.kernel.launch(plan.launch, torch._C._cuda_getCurrentRawStream(0), pack)

    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    return device_time_us(fn, reps), calc_diff(out, ref)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--shapes", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    facts = g.DeviceFacts.of(dev)
    shapes = DSV3_SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = []
    for m, n, k in shapes:
        a, sa, b, sb = make_operands(m, n, k, dev)
        ref = reference(a, sa, b, sb)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        problem = dense_problem(m, n, k)
        chosen = g.select_config(problem, facts)
        cands = sorted(g.candidate_configs(m, n, k, facts), key=g._rank)[:args.top]
        tiles = {(c.block_m, c.block_n) for c in cands} | {(chosen.block_m, 64), (chosen.block_m, 128)}
        results = []
        for bm, bn in sorted(tiles):
            cfg = make_cfg(m, n, k, bm, bn, facts)
            try:
                us, diff = time_cfg(problem, cfg, a, sa, b, sb, out, ref, args.reps)
            except Exception as e:  # noqa: BLE001
                print(f"{m}x{n}x{k} {bm}x{bn} FAILED {e}", flush=True)
                continue
            results.append((us, bm, bn, 1, diff))
        results.sort()
        best_us, bm, bn = results[0][:3]
        for on_a in (True, False):
            nb = ceil_div(n, bn) if on_a else ceil_div(m, bm)
            if nb % 2 == 0 and ceil_div(m, bm) * ceil_div(n, bn) >= facts.num_sms:
                cfg = make_cfg(m, n, k, bm, bn, facts, 2, on_a)
                us, diff = time_cfg(problem, cfg, a, sa, b, sb, out, ref, args.reps)
                results.append((us, bm, bn, "A" if on_a else "B", diff))
        results.sort()
        line = " ".join(f"{bm}x{bn}{'' if mc == 1 else '+mc' + mc}:{us:.1f}" for us, bm, bn, mc, _ in results)
        print(f"{m}x{n}x{k} chosen {chosen.block_m}x{chosen.block_n}{'' if chosen.num_multicast == 1 else '+mc'} | {line}", flush=True)
        rows.append({"m": m, "n": n, "k": k, "chosen": [chosen.block_m, chosen.block_n, chosen.num_multicast],
                     "results": [{"us": us, "bm": bm, "bn": bn, "mc": mc, "diff": d} for us, bm, bn, mc, d in results]})
        del a, b, out, ref
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A/B timing of sm90 kernel variants against cuBLAS block-wise, all in one round-robin (H100/H200).

    python scripts/cuda_ab.py [--shapes 4096x4096x7168,...] [--variants base,y0.5,y1] [--reps 30]
    python scripts/cuda_ab.py --once ...     # each variant launched once (for ncu), no timing
    python scripts/cuda_ab.py --method bench # every run after a flush and a sleep, as the bench

Timing methods (both cold L2, variants interleaved run by run so drift hits all alike):
  steady  back-to-back runs after a warm-up: the chip hot and at its power limit
  bench   DESIGN.md section 6 per run (256 MB memset, then a sleep kernel, then the call): each run
          starts from a near-idle chip, as in the bench CLI. The two can rank tiles differently
          (a 128x128 tile that wins steady lost 8 % under bench at 4096x4096x7168).

A variant is the heuristic's config with changes, named by '+'-joined parts:
  base      the heuristic's config as it is
  mcA, mcB  2-CTA multicast of A / B (when the block counts allow), mc0 = none
  bmM, bnN  BLOCK_M = M, BLOCK_N = N (stages, smem, threads, two accumulators recomputed)
  acc2, acc1  two wgmma accumulators in flight / one (after bm/bn)
  @NAME     built from the headers of --alt NAME=DIR (a copy of include/ with a kernel change)
e.g. "bm256+mcB", "base@old". Prints µs, TFLOPS and the speed-up over cuBLAS block-wise of the
same round;
--json writes every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from cuda_bench import device_times_us  # noqa: E402
from fp8gemm.bench.timing import DeviceTimer  # noqa: E402
from test_cuda_gpu import calc_diff, dense_problem  # noqa: E402

from fp8gemm.backends.cuda import sm90_fp8_gemm as g  # noqa: E402
from fp8gemm.bench.impls import cublas_block_probe, make_data, make_impl, reference_output  # noqa: E402
from fp8gemm.bench.suites import Case  # noqa: E402
from fp8gemm.problem import ceil_div  # noqa: E402

M4096 = "4096x2112x7168,4096x24576x1536,4096x32768x512,4096x7168x16384,4096x4096x7168,4096x7168x2048"


def variant(m: int, n: int, k: int, base: g.Sm90GemmConfig, spec: str, num_sms: int):
    cfg = base
    for part in spec.split("+"):
        if part == "base":
            continue
        if part.startswith(("bn", "bm")):
            bm, bn = (int(part[2:]), cfg.block_n) if part[1] == "m" else (cfg.block_m, int(part[2:]))
            st = g._stages(bm, bn, k, 232448)
            cfg = dataclasses.replace(cfg, block_m=bm, block_n=bn, num_stages=st,
                                      smem=g.smem_bytes(bm, bn, st, k),
                                      num_threads=g.num_threads(bm),
                                      two_accum=g.use_two_accum(bm, bn, k))
        elif part in ("acc1", "acc2"):
            cfg = dataclasses.replace(cfg, two_accum=part == "acc2")
        elif part in ("mcA", "mcB", "mc0"):
            mc = 1 if part == "mc0" else 2
            cfg = dataclasses.replace(cfg, num_multicast=mc, multicast_on_a=part == "mcA")
        else:
            raise ValueError(f"unknown variant part {part!r}")
    if cfg.two_accum and not (cfg.block_m == 128 and cfg.block_n <= 128):
        return None
    nb_m, nb_n = ceil_div(m, cfg.block_m), ceil_div(n, cfg.block_n)
    if cfg.num_multicast == 2 and (nb_n if cfg.multicast_on_a else nb_m) % 2:
        return None  # multicast impossible for this shape
    grid = min(num_sms, nb_m * nb_n)
    return dataclasses.replace(cfg, grid=max(grid - grid % cfg.num_multicast, cfg.num_multicast))


def bench_method_times_us(fns: dict, reps: int) -> dict:
    """Median device time of each fn under the bench CLI's per-run method, run by run in turn."""
    timer = DeviceTimer(torch.device("cuda"))
    sleep = timer.sleep_cycles(30.0)
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        events = []
        for name, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            timer.flush_buf.zero_()
            torch.cuda._sleep(sleep)
            s.record()
            fn()
            e.record()
            events.append((name, s, e))
        torch.cuda.synchronize()
        for name, s, e in events:
            times[name].append(s.elapsed_time(e) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=M4096)
    ap.add_argument("--variants", default="base,bm128,bm256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--method", choices=("steady", "bench"), default="steady")
    ap.add_argument("--json", default="")
    ap.add_argument("--alt", action="append", default=[],
                    help="NAME=DIR: variants ending in @NAME compile from DIR's headers")
    args = ap.parse_args()
    dev = torch.device("cuda")
    facts = g.DeviceFacts.of(dev)
    stream = torch.cuda.current_stream().cuda_stream
    # The calling convention of cuBLAS block-wise the bench uses (the first one right at its probe
    # shapes): another one may pick a slower cuBLAS kernel.
    block_way, _ = cublas_block_probe(dev)
    alts = dict(a.split("=", 1) for a in args.alt)
    rows = []
    for spec in args.shapes.split(","):
        m, n, k = map(int, spec.split("x"))
        data = make_data(Case("ab", "dense", m, n, k), dev)
        a, sa, b, sb = data.a, data.sa, data.b, data.sb
        ref = reference_output(data)
        problem = dense_problem(m, n, k)
        base = g.select_config(problem, facts)
        sa_k = g._kernel_a_scales(sa, m)
        fns, cfgs = {}, {}
        for vname in args.variants.split(","):
            spec_part, _, alt = vname.partition("@")
            cfg = variant(m, n, k, base, spec_part, facts.num_sms)
            if cfg is None or (cfg, alt) in cfgs.values():
                continue
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
            include_dir = g.INCLUDE_DIR
            if alt:
                g.INCLUDE_DIR = Path(alts[alt]).resolve()
            try:
                plan = g._Plan(problem, 0, cfg)
            finally:
                g.INCLUDE_DIR = include_dir
            pack = plan.params(a, sa_k, b, sb, out, (0,))

            def fn(plan=plan, pack=pack):
                plan.kernel.launch(plan.launch, stream, pack)

            fn()
            torch.cuda.synchronize()
            diff = calc_diff(out, ref)
            if not diff < 1e-5:
                print(f"{spec} {vname}: WRONG diff={diff:.2e} {cfg}", flush=True)
                continue
            fns[vname], cfgs[vname] = fn, (cfg, alt)
        if args.once:
            continue
        fns["cublas-block"] = make_impl("cublas-block", data, block_way).fn
        times = (bench_method_times_us(fns, args.reps) if args.method == "bench"
                 else device_times_us(fns, args.reps))
        for name, us in times.items():
            x = times["cublas-block"] / us
            print(f"{spec:>18} {name:>14} {us:8.1f} us {2 * m * n * k / us / 1e6:6.0f} TFLOPS "
                  f"{x:5.2f}x  {cfgs.get(name, ('',))[0]}", flush=True)
            rows.append({"shape": spec, "variant": name, "us": us, "x_cublas_block": x,
                         "config": str(cfgs.get(name, ("",))[0])})
        del a, b, ref, data
        torch.cuda.empty_cache()
    if rows:
        print("geomean x cuBLAS block over the shapes each variant ran:")
        for name in dict.fromkeys(r["variant"] for r in rows):
            xs = [r["x_cublas_block"] for r in rows if r["variant"] == name]
            print(f"  {name:>14} {math.exp(sum(map(math.log, xs)) / len(xs)):.3f} ({len(xs)})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

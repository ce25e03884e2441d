"""Time the Triton backend against cuBLAS on the DeepSeek-V3 shapes (DESIGN.md section 6).

Device time: L2 flushed (256 MB memset) before every run, the GPU kept busy (torch.cuda._sleep)
while the host enqueues, CUDA events, median of --reps. Eager time: 50 back-to-back calls.
Peers in the same run: cuBLAS block-wise / per-tensor (torch._scaled_mm), row-wise grouped
(torch._scaled_grouped_mm), bf16 bmm; copy bandwidth for the quantisation kernels.

    python scripts/triton_bench.py [--suite dense,grouped,masked,quant,sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fp8gemm.backends.triton as tb  # noqa: E402
from fp8gemm.backends.triton import config as tcfg  # noqa: E402
from fp8gemm.backends.triton import quant as tquant  # noqa: E402
from fp8gemm.backends.triton.fp8_gemm import launch_gemm  # noqa: E402
from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div  # noqa: E402
from fp8gemm.quant import calc_diff  # noqa: E402

E4M3 = torch.float8_e4m3fn
DEV = torch.device("cuda")
DENSE = [(m, n, k) for m in (64, 128, 4096)
         for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
                      (7168, 2048))]
CONTIG = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]
MASKED = [(1, 1024, 4096, 7168), (1, 1024, 7168, 2048), (2, 512, 4096, 7168), (2, 512, 7168, 2048),
          (4, 256, 4096, 7168), (4, 256, 7168, 2048)]

_flush = None


def device_us(fn, reps: int) -> float:
    """Median device time (us) of fn with a cold L2 and the host kept out of the measurement."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _flush.zero_()
        torch.cuda._sleep(300_000)  # ~150 us of GPU work: the launch below is enqueued meanwhile
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def eager_us(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def rand_fp8(shape):
    return (torch.randn(shape, device=DEV) * 16).clamp(-400, 400).to(E4M3)


def col_major(s):
    return s.t().contiguous().t()


ROWS: list[dict] = []


def record(suite, op, m, n, k, groups, impl, us, eager, flops, nbytes, diff=None):
    ROWS.append(dict(suite=suite, op=op, shape=dict(m=m, n=n, k=k, groups=groups), impl=impl,
                     us=round(us, 2), eager_us=round(eager, 2) if eager is not None else None,
                     tflops=round(flops / us / 1e6, 1), gbs=round(nbytes / us / 1e3, 1),
                     diff=diff))


# ---------------------------------------------------------------------------------------------
# dense


def dense_operands(m, n, k):
    a, b = rand_fp8((m, k)), rand_fp8((n, k))
    sa = col_major(torch.rand(m, ceil_div(k, 128), device=DEV) + 0.5)
    sb = torch.rand(ceil_div(n, 128), ceil_div(k, 128), device=DEV) + 0.5
    return a, sa, b, sb


def triton_dense_fn(a, sa, b, sb, out, cfg=None):
    m, k = a.shape
    n = b.shape[0]
    prob = GemmProblem(GemmKind.DENSE, m, n, k, 1, E4M3, E4M3, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16)
    if cfg is None:
        return prob, (lambda: tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob))
    return prob, (lambda: launch_gemm(prob, cfg, a, sa, b, sb, out, None, None))


def suite_dense(reps, table):
    one = torch.ones((), device=DEV)
    for m, n, k in DENSE:
        a, sa, b, sb = dense_operands(m, n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        prob, fn = triton_dense_fn(a, sa, b, sb, out)
        flops, nbytes = 2 * m * n * k, m * k + n * k + 2 * m * n
        t = device_us(fn, reps)
        cfg = tb.get_config(prob, DEV)
        ref = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
        diff = calc_diff(out, ref)
        record("deepseek-dense", "fp8_gemm_nt", m, n, k, 1, "fp8gemm-triton", t, eager_us(fn),
               flops, nbytes, diff)
        tbl = device_us(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(),
                                                 out_dtype=torch.bfloat16), reps)
        record("deepseek-dense", "fp8_gemm_nt", m, n, k, 1, "cublas-block", tbl, None, flops, nbytes)
        tt = device_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                out_dtype=torch.bfloat16), reps)
        record("deepseek-dense", "fp8_gemm_nt", m, n, k, 1, "cublas-tensor", tt, None, flops, nbytes)
        floor = nbytes / 4.25e6 + 4.0
        table.append((f"dense {m}x{n}x{k}", t, tbl, tt, floor, diff, str(cfg)))
        print(f"dense {m}x{n}x{k}: triton {t:.1f} us, cublas-block {tbl:.1f}, tensor {tt:.1f}, "
              f"floor {floor:.1f}, diff {diff:.2e}, {cfg}", flush=True)


def sweep_configs(m, n, k, facts):
    """The configs the sweep times for one dense shape (the heuristic's first)."""
    prob = GemmProblem(GemmKind.DENSE, m, n, k, 1, E4M3, E4M3, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16)
    base = tcfg.choose_config(prob, facts)
    cands = [base]
    kb = ceil_div(k, 128)
    sms = facts.num_sms
    if m <= 128:
        tiles = ((64, 128, 4, 5), (64, 64, 4, 6), (64, 256, 8, 4), (128, 128, 8, 4))
        splits = (1, 2, 3, 4, 6, 8)
    else:
        tiles = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 5), (64, 256, 8, 3),
                 (64, 256, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4))
        splits = (1,)
    for bm, bn, warps, stages in tiles:
        for split in splits:
            if split > 1 and ceil_div(kb, ceil_div(kb, split)) != split:
                continue
            tiles_n = ceil_div(m, bm) * ceil_div(n, bn) * split
            per_sm = 2 if (warps == 4 and m > 128) else 1
            for flatten in (False, True):
                cands.append(tcfg.GemmConfig(bm, bn, 128, 8, split, stages, warps, True,
                                             min(tiles_n, per_sm * sms), flatten))
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return prob, out


def _precompile_worker(jobs):
    for m, n, k, cfg in jobs:
        try:
            a, sa, b, sb = dense_operands(m, n, k)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
            _, fn = triton_dense_fn(a, sa, b, sb, out, cfg)
            fn()
        except Exception as e:  # noqa: BLE001  (a config that does not compile: reported when timed)
            print(f"  precompile {m}x{n}x{k} {cfg}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()


def suite_sweep(reps, budget_s, ms, workers):
    """Time a grid of configs per dense shape (tiles, split-K, flattened pipeline): data for the
    heuristic, printed. Kernels are first compiled by `workers` processes in parallel."""
    facts = tcfg.device_facts(DEV)
    shapes = [s for s in DENSE if s[0] in ms]
    plans = [(s, *sweep_configs(*s, facts)) for s in shapes]
    jobs = [(m, n, k, c) for (m, n, k), _, cs in plans for c in cs]
    t0 = time.time()
    if workers > 1:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with ctx.Pool(workers) as pool:
            pool.map(_precompile_worker, [jobs[i::workers] for i in range(workers)])
        print(f"sweep: compiled {len(jobs)} jobs in {time.time() - t0:.0f} s", flush=True)
    for (m, n, k), _prob, cands in plans:
        if time.time() - t0 > budget_s:
            print("sweep: time budget spent", flush=True)
            break
        a, sa, b, sb = dense_operands(m, n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        res = []
        for cfg in cands:
            _, fn = triton_dense_fn(a, sa, b, sb, out, cfg)
            try:
                t = device_us(fn, max(10, reps // 2))
            except Exception as e:  # noqa: BLE001  (a config that does not compile)
                print(f"  {cfg}: {type(e).__name__}", flush=True)
                continue
            res.append((t, cfg))
        base_t = next((t for t, c in res if c == cands[0]), float("nan"))
        res.sort(key=lambda r: r[0])
        print(f"sweep {m}x{n}x{k}: heuristic {base_t:.1f} us [{cands[0]}]", flush=True)
        for t, cfg in res[:5]:
            print(f"    {t:7.1f} us  {cfg}", flush=True)


# ---------------------------------------------------------------------------------------------
# grouped


def suite_contiguous(reps, table):
    for groups, m_per, n, k in CONTIG:
        m = groups * m_per
        a, sa, _, _ = dense_operands(m, n, k)
        b = rand_fp8((groups, n, k))
        sb = torch.rand(groups, ceil_div(n, 128), ceil_div(k, 128), device=DEV) + 0.5
        idx = torch.arange(groups, dtype=torch.int32, device=DEV).repeat_interleave(m_per)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        prob = GemmProblem(GemmKind.CONTIGUOUS, m, n, k, groups, E4M3, E4M3, Recipe.GROUP,
                           Recipe.BLOCK, torch.bfloat16)
        fn = lambda: tb.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, idx, prob)  # noqa: E731
        flops, nbytes = 2 * m * n * k, m * k + groups * n * k + 2 * m * n
        t = device_us(fn, reps)
        cfg = tb.get_config(prob, DEV)
        record("deepseek-grouped", "m_grouped_contiguous", m_per, n, k, groups, "fp8gemm-triton",
               t, eager_us(fn), flops, nbytes)
        sa_row = torch.rand(m, device=DEV) + 0.5
        sb_row = torch.rand(groups, n, device=DEV) + 0.5
        offs = (torch.arange(1, groups + 1, device=DEV, dtype=torch.int32) * m_per)
        bt = b.transpose(1, 2)
        try:
            peer = lambda: torch._scaled_grouped_mm(a, bt, sa_row, sb_row, offs=offs,  # noqa: E731
                                                    out_dtype=torch.bfloat16)
            tp = device_us(peer, reps)
        except Exception as e:  # noqa: BLE001
            print(f"  _scaled_grouped_mm failed: {e}", flush=True)
            tp = float("nan")
        record("deepseek-grouped", "m_grouped_contiguous", m_per, n, k, groups,
               "cublas-rowwise-grouped", tp, None, flops, nbytes)
        table.append((f"contig {groups}x{m_per} {n}x{k}", t, tp, None, None, None, str(cfg)))
        print(f"contig {groups}x{m_per} {n}x{k}: triton {t:.1f} us, rowwise grouped {tp:.1f}, {cfg}",
              flush=True)


def suite_masked(reps, table):
    for groups, mmax, n, k in MASKED:
        a = rand_fp8((groups, mmax, k))
        sa = torch.rand(groups, mmax, ceil_div(k, 128), device=DEV) + 0.5
        b = rand_fp8((groups, n, k))
        sb = torch.rand(groups, ceil_div(n, 128), ceil_div(k, 128), device=DEV) + 0.5
        masked_m = torch.full((groups,), mmax, dtype=torch.int32, device=DEV)
        out = torch.empty(groups, mmax, n, dtype=torch.bfloat16, device=DEV)
        prob = GemmProblem(GemmKind.MASKED, mmax, n, k, groups, E4M3, E4M3, Recipe.GROUP,
                           Recipe.BLOCK, torch.bfloat16, expected_m=mmax)
        fn = lambda: tb.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, prob)  # noqa: E731
        flops, nbytes = 2 * groups * mmax * n * k, groups * (mmax * k + n * k + 2 * mmax * n)
        t = device_us(fn, reps)
        cfg = tb.get_config(prob, DEV)
        record("deepseek-grouped", "m_grouped_masked", mmax, n, k, groups, "fp8gemm-triton", t,
               eager_us(fn), flops, nbytes)
        ab = torch.randn(groups, mmax, k, device=DEV, dtype=torch.bfloat16)
        bb = torch.randn(groups, n, k, device=DEV, dtype=torch.bfloat16)
        tp = device_us(lambda: torch.bmm(ab, bb.transpose(1, 2)), reps)
        record("deepseek-grouped", "m_grouped_masked", mmax, n, k, groups, "torch-bf16", tp, None,
               flops, 2 * nbytes)
        table.append((f"masked {groups}x{mmax} {n}x{k}", t, tp, None, None, None, str(cfg)))
        print(f"masked {groups}x{mmax} {n}x{k}: triton {t:.1f} us, bf16 bmm {tp:.1f}, {cfg}",
              flush=True)


# ---------------------------------------------------------------------------------------------
# quantisation


def suite_quant(reps, table):
    m, k = 4096, 7168
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    x2 = torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy_bytes = 2 * x.numel() * 2
    tc = device_us(lambda: dst.copy_(x), reps)
    copy_gbs = copy_bytes / tc / 1e3
    cases = [("quantize_per_token", lambda: tquant.quantize_per_token(x), 3 * m * k + 4 * m * k // 128),
             ("quantize_per_block", lambda: tquant.quantize_per_block(x), 3 * m * k),
             ("silu_mul_quantize_per_token", lambda: tquant.silu_mul_quantize_per_token(x2),
              4 * m * k + m * k + 4 * m * k // 128)]
    for name, fn, nbytes in cases:
        t = device_us(fn, reps)
        gbs = nbytes / t / 1e3
        record("quant", name, m, 0, k, 1, "fp8gemm-triton", t, eager_us(fn), 0, nbytes)
        table.append((f"{name} [{m},{k}]", t, tc * nbytes / copy_bytes, None, None, None,
                      f"{gbs:.0f} GB/s = {gbs / copy_gbs * 100:.0f}% of copy {copy_gbs:.0f} GB/s"))
        print(f"{name}: {t:.1f} us, {gbs:.0f} GB/s, copy {copy_gbs:.0f} GB/s", flush=True)


# ---------------------------------------------------------------------------------------------


def meta():
    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                                  check=False).stdout.strip()
        except Exception:  # noqa: BLE001
            return ""
    import triton

    return dict(gpu=torch.cuda.get_device_name(),
                clocks=sh(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem",
                           "--format=csv,noheader"]),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                commit=sh(["git", "rev-parse", "--short", "HEAD"]),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="dense,grouped,masked,quant")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--sweep-budget", type=float, default=120.0)
    p.add_argument("--sweep-m", default="64,128,4096")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "triton_bench.json"))
    args = p.parse_args()
    suites = args.suite.split(",")
    table: list[tuple] = []
    print(json.dumps(meta()), flush=True)
    if "dense" in suites:
        suite_dense(args.reps, table)
    if "grouped" in suites:
        suite_contiguous(args.reps, table)
    if "masked" in suites:
        suite_masked(args.reps, table)
    if "quant" in suites:
        suite_quant(args.reps, table)
    if "sweep" in suites:
        suite_sweep(args.reps, args.sweep_budget, [int(v) for v in args.sweep_m.split(",")],
                    args.workers)
    Path(args.json).write_text(json.dumps(dict(meta=meta(), rows=ROWS), indent=1))

    print("\n| case | triton us | peer us | x peer | x per-tensor | floor us | diff |")
    print("|---|---|---|---|---|---|---|")
    groups: dict[str, list[float]] = {}
    for name, t, peer, tensor, floor, diff, _cfg in table:
        ratio = peer / t if peer and not math.isnan(peer) else float("nan")
        groups.setdefault(name.split()[0], []).append(ratio)
        tr = f"{tensor / t:.2f}" if tensor else ""
        fl = f"{floor:.1f}" if floor else ""
        df = f"{diff:.1e}" if diff is not None else ""
        print(f"| {name} | {t:.1f} | {peer:.1f} | {ratio:.2f} | {tr} | {fl} | {df} |")
    for g, rs in groups.items():
        rs = [r for r in rs if not math.isnan(r) and r > 0]
        if rs and g != "quantize_per_token" and not g.startswith("quant") and not g.startswith("silu"):
            print(f"geomean x peer, {g}: {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} over {len(rs)}")
    if "dense" in suites:
        small = [r for (n, *_), r in zip(table, groups.get("dense", [])) if int(n.split()[1].split("x")[0]) <= 128]
        if small:
            print(f"geomean x cublas-block, dense M<=128: {math.exp(sum(map(math.log, small)) / len(small)):.3f}")


if __name__ == "__main__":
    main()

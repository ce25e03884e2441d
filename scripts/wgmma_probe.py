#!/usr/bin/env python3
"""What one SM's tensor cores and FP32 pipes do together in the GEMM mainloop, on a Hopper GPU.

    python scripts/wgmma_probe.py [--iters 4096] [--json out.json] [--only NAME,...]
    python scripts/wgmma_probe.py --compile-only     # no GPU: registers, spills, C75xx

The GEMM kernels' k-block is four wgmma.m64nNk32 per math warpgroup, a wait, and a promotion on
the FP32 pipes (1D2D: an FFMA per accumulator element; 1D1D: an FMUL and an FFMA). Timed on the
H200, taking the promotion out of a kernel saved its whole issue time, with one accumulator and
with two (docs/cuda.md, "The 1D1D kernels"): it did not overlap the wgmma. These probes
(scripts/wgmma_probe.cuh) run that k-block on one CTA per SM with no loads, so that what is left
is the tensor cores and the promotion: one to four warpgroups, dependent or independent chains,
promotion or none (the 1D1D products formed after the wait or under the k-block's own
wgmma), free-running (from the same clock or staggered), meeting before every
k-block or taking turns on the tensor cores, and FFMA streams in a warpgroup of their own beside
the wgmma of another. Printed per probe: clock cycles per k-block (median of the CTAs' clock64
spans), the tensor cores' share of them (warpgroups x 64 x N x 128 FMA at 4096 FP8 FMA a cycle
per SM, over the measured cycles), and FFMA per cycle per SM of the FFMA warpgroups, if any.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8gemm import jit  # noqa: E402

INCLUDE_DIRS = (str(ROOT / "fp8gemm" / "backends" / "cuda" / "include"), str(ROOT / "scripts"))
FMA_PER_CYCLE = 4096  # dense FP8 wgmma per SM (4 tensor cores x 1024)
MAX_WGS = 4


@dataclass(frozen=True)
class Probe:
    name: str
    n: int
    mma_wgs: int = 2
    ffma_wgs: int = 0
    promote: int = 0
    chains: int = 1
    pipelined: bool = False
    lockstep: bool = False
    stagger: int = 0
    turns: bool = False

    @property
    def threads(self) -> int:
        return (self.mma_wgs + self.ffma_wgs) * 128

    def smem(self) -> int:
        # ProbeLayout::kBytes
        return (1024 + self.mma_wgs * 64 * 128 + self.n * 128
                + 4 * (4 * 64 * self.mma_wgs + 4 * self.n) + 16)

    def name_expr(self) -> str:
        b = {True: "true", False: "false"}
        return (f"&probe::wgmma_probe<{self.n}, {self.mma_wgs}, {self.ffma_wgs}, {self.promote}, "
                f"{self.chains}, {b[self.pipelined]}, {b[self.lockstep]}, {self.stagger}, "
                f"{b[self.turns]}>")


PROBES = [
    # the tensor cores alone: one warpgroup's dependent chain, two chains, two warpgroups
    Probe("1wg n128", 128, mma_wgs=1),
    Probe("1wg n128 2 chains", 128, mma_wgs=1, chains=2),
    Probe("1wg n256", 256, mma_wgs=1),
    Probe("2wg n128", 128),
    Probe("2wg n160", 160),
    Probe("2wg n128 2 chains", 128, chains=2),
    # the promotion after the wait (the kernels' one-accumulator loop)
    Probe("1wg n128 promote1", 128, mma_wgs=1, promote=1),
    Probe("1wg n128 promote2", 128, mma_wgs=1, promote=2),
    Probe("2wg n128 promote1", 128, promote=1),
    Probe("2wg n128 promote2", 128, promote=2),
    Probe("2wg n160 promote1", 160, promote=1),
    Probe("2wg n160 promote2", 160, promote=2),
    Probe("2wg n128 promote2 lockstep", 128, promote=2, lockstep=True),
    Probe("2wg n160 promote1 lockstep", 160, promote=1, lockstep=True),
    Probe("2wg n128 promote2 stagger 256", 128, promote=2, stagger=256),
    Probe("2wg n160 promote1 stagger 320", 160, promote=1, stagger=320),
    # the promotion under the next k-block's wgmma (two accumulators), and with two chains
    Probe("2wg n128 promote2 pipelined", 128, promote=2, pipelined=True),
    Probe("2wg n128 promote1 pipelined", 128, promote=1, pipelined=True),
    Probe("2wg n128 promote2 2 chains", 128, promote=2, chains=2),
    # a third math warpgroup: two keep the tensor cores busy while one promotes?
    Probe("3wg n128", 128, mma_wgs=3),
    Probe("3wg n128 promote1", 128, mma_wgs=3, promote=1),
    Probe("3wg n128 promote2", 128, mma_wgs=3, promote=2),
    # the 1D1D kernel's three-warpgroup tiles (BLOCK_M = 192) fit 112 columns, against two
    # warpgroups at the same width; four (one 256-row wave: 120 registers a math thread beside a
    # producer) would fit about 80
    Probe("2wg n112 promote2", 112, promote=2),
    Probe("3wg n112 promote2", 112, mma_wgs=3, promote=2),
    Probe("3wg n96 promote2", 96, mma_wgs=3, promote=2),
    Probe("4wg n64 promote2", 64, mma_wgs=4, promote=2),
    Probe("4wg n80 promote2", 80, mma_wgs=4, promote=2),
    # the 1D1D products formed under the k-block's own wgmma, only the FFMAs after the wait
    # (the 1D1D kernel's SASS at 128x128 has them so already; at 128x160 and 192x112 ptxas sinks
    # them below the wait, short of registers)
    Probe("2wg n128 premul", 128, promote=3),
    Probe("2wg n160 premul", 160, promote=3),
    Probe("3wg n112 premul", 112, mma_wgs=3, promote=3),
    Probe("3wg n96 premul", 96, mma_wgs=3, promote=3),
    # FFMA streams of another warpgroup beside the wgmma: do the FP32 pipes slow the tensor cores?
    Probe("1wg n128 + ffma wg", 128, mma_wgs=1, ffma_wgs=1),
    Probe("1wg n128 2 chains + ffma wg", 128, mma_wgs=1, ffma_wgs=1, chains=2),
    Probe("2wg n128 + ffma wg", 128, ffma_wgs=1),
    Probe("1wg n256 + ffma wg", 256, mma_wgs=1, ffma_wgs=1),
    # turns (last: a barrier protocol of their own): one warpgroup's wgmma at a time, the other
    # promoting meanwhile (do its two chains keep the tensor cores as busy as two warpgroups'?)
    Probe("2wg n128 turns", 128, turns=True),
    Probe("2wg n128 turns 2 chains", 128, chains=2, turns=True),
    Probe("2wg n128 promote2 turns", 128, promote=2, turns=True),
    Probe("2wg n128 promote2 turns 2 chains", 128, promote=2, chains=2, turns=True),
    Probe("2wg n160 promote1 turns 2 chains", 160, promote=1, chains=2, turns=True),
]


def compile_all(probes: list[Probe]) -> int:
    """Compile every probe (no GPU): registers, spills and serialised-wgmma warnings."""
    bad = 0
    for p in probes:
        _, compiled, _, _ = jit.compile_cached('#include "wgmma_probe.cuh"\n', p.name_expr(),
                                               INCLUDE_DIRS)
        log = compiled.log
        regs = re.findall(r"Used (\d+) registers", log)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        warn = sorted(set(re.findall(r"C75\d\d", log)))
        bad += bool((spills and max(spills)) or warn)
        print(f"{p.name:34s} regs {','.join(regs) or '?':>4s}  "
              f"spills {max(spills) if spills else '?'}  {' '.join(warn)}")
    return 1 if bad else 0


def summarise(p: Probe, spans: list, iters: int, us: float) -> dict:
    """A probe's result row from its kernel's spans ([CTA][warpgroup] = [clock cycles, iterations]:
    the math warpgroups first, then the FFMA ones) and the launch's µs."""
    mma_cycles = [cta[w][0] for cta in spans for w in range(p.mma_wgs)]
    cycles = statistics.median(mma_cycles)
    ideal = p.mma_wgs * 64 * p.n * 128 / FMA_PER_CYCLE
    row = {**asdict(p), "iters": iters, "us": round(us, 1),
           "cycles_per_kblock": round(cycles / iters, 1), "ideal_cycles": ideal,
           "tensor_share": round(ideal * iters / cycles, 3),
           "clock_ghz": round(cycles / us / 1e3, 3)}
    if p.ffma_wgs:
        # 2 x R FFMA per thread an iteration (R = N / chains / 2), 128 threads a warpgroup
        rates = [cta[w][1] * (p.n // p.chains) * 128 / cta[w][0]
                 for cta in spans for w in range(p.mma_wgs, p.mma_wgs + p.ffma_wgs)]
        row["ffma_per_cycle"] = round(statistics.median(rates) * p.ffma_wgs, 1)
    return row


def run(probes: list[Probe], iters: int) -> list[dict]:
    import torch

    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for p in probes:
        kernel = jit.build('#include "wgmma_probe.cuh"\n', p.name_expr(), INCLUDE_DIRS)
        sink = torch.empty(num_sms * p.threads, device=dev, dtype=torch.float32)
        spans = torch.zeros(num_sms * MAX_WGS * 2, device=dev, dtype=torch.int64)
        # NOTE: shared memory past half the SM's keeps one CTA per SM.
        cfg = jit.LaunchConfig((num_sms, 1, 1), (p.threads, 1, 1), max(p.smem(), 120 * 1024))
        kernel.set_max_dynamic_smem(cfg.smem, dev.index or 0)
        pack = jit.ParamPack([ctypes.c_uint32(iters), ctypes.c_void_p(sink.data_ptr()),
                              ctypes.c_void_p(spans.data_ptr())])
        stream = torch.cuda.current_stream().cuda_stream
        for _ in range(2):  # the first launch warms the clocks
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernel.launch(cfg, stream, pack)
            end.record()
            torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3
        row = summarise(p, spans.view(num_sms, MAX_WGS, 2).tolist(), iters, us)
        rows.append(row)
        print(f"{p.name:34s} {row['cycles_per_kblock']:8.1f} cycles/k-block  tensor "
              f"{row['tensor_share']:6.1%}"
              + (f"  ffma/cycle {row['ffma_per_cycle']:6.1f}" if p.ffma_wgs else "")
              + f"  ({row['clock_ghz']} GHz)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4096,
                    help="k-blocks per math warpgroup (a multiple of 8)")
    ap.add_argument("--only", default="", help="comma-separated probe names")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.iters % 8:
        ap.error("--iters must be a multiple of 8")
    probes = PROBES
    if args.only:
        names = set(args.only.split(","))
        probes = [p for p in PROBES if p.name in names]
    if args.compile_only:
        return compile_all(probes)
    rows = run(probes, args.iters)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

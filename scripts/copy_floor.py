#!/usr/bin/env python3
"""Time a device-to-device copy of each decode GEMM's bytes, against the bench's memory floor
(Hopper GPU).

    python scripts/copy_floor.py                         # deepseek-dense's M <= 128 shapes
    python scripts/copy_floor.py --shapes 64x2112x7168,1x7168x16384 --json copy.json

The bench's floor of a GEMM (fp8gemm.bench.suites: `Case.floor_us`) is its fewest bytes at
FLOOR_BYTES_PER_US (the copy bandwidth of 2 GB) plus FLOOR_FIXED_US (an almost empty kernel).
A copy of half those bytes moves the same bytes through DRAM (each read and written once), so
its time is what the floor would be if a small transfer ran at a small copy's rate: the floor
any kernel that streams those bytes can reach. Printed first: an almost empty kernel (a
one-element add), the floor's fixed part measured again; then per shape the floor, the copy
(`dst.copy_(src)`, uint8), the copy over the floor, and the effective bandwidth past
FLOOR_FIXED_US; timed as the benchmark times (fp8gemm.bench.timing: cold L2, launch cost hidden,
the calls taking turns run by run, median).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8gemm.bench.suites import FLOOR_FIXED_US, Case, suite_cases  # noqa: E402
from fp8gemm.bench.timing import (DeviceTimer, MIN_BUSY_US, MIN_DEVICE_RUNS,  # noqa: E402
                                  eager_time_us, geomean, median)


def default_shapes() -> list[tuple[int, int, int]]:
    """The deepseek-dense suite's M <= 128 shapes."""
    return [(c.m, c.n, c.k) for c in suite_cases("deepseek-dense") if c.m <= 128]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="comma-separated MxNxK (default: deepseek-dense "
                                                 "M <= 128)")
    ap.add_argument("--runs", type=int, default=MIN_DEVICE_RUNS)
    ap.add_argument("--json", default="", help="write every row here")
    args = ap.parse_args(argv)
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else default_shapes())
    if not torch.cuda.is_available():
        print("copy_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    timer = DeviceTimer(dev)

    def time_us(fn) -> float:
        """The median device time of `fn`, timed as the benchmark times a call."""
        host = eager_time_us(fn, dev).host_us
        return median(timer.time_interleaved_us([(fn, host, MIN_BUSY_US)], args.runs)[0])

    tiny = torch.zeros(1, device=dev)
    empty_us = time_us(lambda: tiny.add_(1))
    print(f"an almost empty kernel: {empty_us:.1f} us (the floor's fixed part: "
          f"{FLOOR_FIXED_US:g} us)", flush=True)
    rows, ratios = [], []
    for m, n, k in shapes:
        case = Case("copy-floor", "dense", m, n, k)
        half = case.min_bytes // 2
        src = torch.randint(0, 255, (half,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        us = time_us(lambda: dst.copy_(src))
        floor = case.floor_us
        tbs = case.min_bytes / max(us - FLOOR_FIXED_US, 1e-3) / 1e6
        ratios.append(us / floor)
        print(f"{m:>5}x{n}x{k:<6} {case.min_bytes / 1e6:8.1f} MB  floor {floor:7.1f} us  copy "
              f"{us:7.1f} us  {us / floor:5.2f}x the floor  {tbs:5.2f} TB/s past "
              f"{FLOOR_FIXED_US:g} us", flush=True)
        rows.append({"shape": [m, n, k], "bytes": case.min_bytes, "floor_us": round(floor, 3),
                     "copy_us": round(us, 3), "copy_over_floor": round(us / floor, 4)})
        del src, dst
    print(f"geometric mean of copy / floor: {geomean(ratios):.3f} ({len(ratios)} shapes)")
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "empty_kernel_us": round(empty_us, 3)}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Host time of a warm eager dense call: fp8gemm against torch._scaled_mm, on a CUDA GPU.

    python scripts/host_cost.py [--rounds 7] [--json PATH]

Host time per call: one loop of --calls warm calls, timed on the host while a sleep kernel keeps
the GPU busy for longer than the loop takes, so the launch queue never fills and no call waits
for the device. Every (shape, call) gets one loop per round, the rounds going over all of them
in turn, and the median over the rounds is reported (with min and max): the host's own noise
comes in bursts that can cover one shape's whole measurement, and rounds spread it over all the
calls alike. Device time, for scale: cold L2, as the benchmark measures it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import fp8gemm
from fp8gemm.bench.timing import DeviceTimer, median

SHAPES = [(1, 2112, 7168), (37, 2112, 7168), (64, 2112, 7168), (128, 2112, 7168),
          (1, 7168, 2048), (64, 7168, 2048), (1, 200, 320)]
PEER = "torch._scaled_mm per-tensor"
# An upper bound on one call's host time, to size the sleep kernel that covers a loop.
MAX_HOST_US_PER_CALL = 500.0


def loop_host_us(fn, calls: int, timer: DeviceTimer) -> float:
    """Host microseconds per call over one loop of `calls` calls, the GPU kept busy."""
    torch.cuda._sleep(int(calls * MAX_HOST_US_PER_CALL * timer.cycles_per_us))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def calls_for(m: int, n: int, k: int, dev: torch.device) -> dict:
    """The calls timed at one shape, by name."""
    x, w = torch.randn(m, k, device=dev), torch.randn(n, k, device=dev)
    a, sa = fp8gemm.quantize_per_token(x)
    b, sb = fp8gemm.quantize_per_block(w)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    gemm = functools.partial(fp8gemm.fp8_gemm_nt, (a, sa), (b, sb))
    at, st = fp8gemm.quantize_per_tensor(x)
    bt, sbt = fp8gemm.quantize_per_tensor(w)
    # NOTE: cuBLAS needs M a multiple of 16 here: pad A's rows with zeros.
    mp = (m + 15) // 16 * 16
    at = torch.nn.functional.pad(at.view(torch.uint8), (0, 0, 0, mp - m)).view(at.dtype)
    return {
        "fp8gemm cuda, out given": functools.partial(gemm, out, backend="cuda"),
        "fp8gemm cuda, out allocated": functools.partial(gemm, backend="cuda"),
        "fp8gemm cuda, row-major sa": functools.partial(
            fp8gemm.fp8_gemm_nt, (a, sa.contiguous()), (b, sb), out, backend="cuda"),
        "fp8gemm triton, out given": functools.partial(gemm, out, backend="triton"),
        PEER: functools.partial(torch._scaled_mm, at, bt.t(), st.reshape(()), sbt.reshape(()),
                                out_dtype=torch.bfloat16),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="calls per loop")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    timer = DeviceTimer(dev)
    todo = {}  # (m, n, k, name) -> fn, for the calls that ran once
    for m, n, k in SHAPES:
        for name, fn in calls_for(m, n, k, dev).items():
            try:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            except (RuntimeError, ValueError) as e:
                print(f"{m:>5}x{n}x{k:<6} {name:<30} failed: {str(e).splitlines()[0][:100]}")
                continue
            todo[(m, n, k, name)] = fn
    host = {key: [] for key in todo}
    for _ in range(args.rounds):
        for key, fn in todo.items():
            host[key].append(loop_host_us(fn, args.calls, timer))
    rows = []
    for (m, n, k, name), fn in todo.items():
        hs = host[(m, n, k, name)]
        h = statistics.median(hs)
        d = median(timer.time_us(fn, h))
        peer = host.get((m, n, k, PEER))
        ratio = h / statistics.median(peer) if peer else None
        rows.append(dict(m=m, n=n, k=k, impl=name, host_us=round(h, 2), host_us_min=round(min(hs), 2),
                         host_us_max=round(max(hs), 2), device_us=round(d, 2),
                         host_x_peer=None if ratio is None else round(ratio, 3)))
        print(f"{m:>5}x{n}x{k:<6} {name:<30} host {h:7.2f} us (min {min(hs):.2f}, max "
              f"{max(hs):.2f})  device {d:7.2f} us"
              + ("" if ratio is None else f"  host {ratio:.2f}x {PEER}"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rounds": args.rounds, "calls": args.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

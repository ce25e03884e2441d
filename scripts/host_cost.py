"""Host cost of a warm eager call, and device time at small M, on a Hopper GPU.

    python3 scripts/host_cost.py [--json PATH]

Host time: the median of seven loops of 200 calls, the GPU kept busy with a sleep kernel while
each loop enqueues, so a loop's wall time is the host's alone (the launch queue never fills).
Device time: cold L2, as the bench.
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


def host_us(fn, calls: int = 200, loops: int = 7) -> float:
    """Median over `loops` loops of `calls` calls, us per call; before each loop a sleep kernel
    keeps the GPU busy for longer than the loop takes, so the launch queue never fills.
    NOTE: one loop alone moved by up to 40 % between shapes that run the same Python (7.5 vs
    11.1 us in the 2026-11-30 run); the median of seven moves by a few percent."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per_loop = []
    for _ in range(loops):
        torch.cuda._sleep(100_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_loop.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(per_loop)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=0,
                   help="then time 'op cuda, out given' again: this many rounds over the shapes")
    args = p.parse_args()
    dev = torch.device("cuda")
    timer = DeviceTimer(dev)
    rows = []
    warm_calls = {}  # (m, n, k) -> the "op cuda, out given" call, for --rounds
    for m, n, k in [(1, 2112, 7168), (37, 2112, 7168), (64, 2112, 7168), (128, 2112, 7168),
                    (1, 7168, 2048), (64, 7168, 2048), (1, 200, 320)]:
        x = torch.randn(m, k, device=dev)
        w = torch.randn(n, k, device=dev)
        a, sa = fp8gemm.quantize_per_token(x)
        b, sb = fp8gemm.quantize_per_block(w)
        sa_rm = sa.contiguous()  # row-major: the backend converts it per call
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        gemm = functools.partial(fp8gemm.fp8_gemm_nt, (a, sa), (b, sb))
        # NOTE: partials, not lambdas over the loop's variables: --rounds calls them after the loop.
        for name, fn in [
            ("op cuda, out given", functools.partial(gemm, out, backend="cuda")),
            ("op cuda, out allocated", functools.partial(gemm, backend="cuda")),
            ("op cuda, row-major sa", functools.partial(
                fp8gemm.fp8_gemm_nt, (a, sa_rm), (b, sb), out, backend="cuda")),
            ("op triton, out given", functools.partial(gemm, out, backend="triton")),
            ("torch._scaled_mm per-tensor", None),
        ]:
            if fn is None:
                at, st = fp8gemm.quantize_per_tensor(x)
                bt, sbt = fp8gemm.quantize_per_tensor(w)
                mp = (m + 15) // 16 * 16
                at = torch.nn.functional.pad(at.view(torch.uint8), (0, 0, 0, mp - m)).view(at.dtype)
                fn = lambda: torch._scaled_mm(at, bt.t(), st.reshape(()), sbt.reshape(()),  # noqa: E731
                                              out_dtype=torch.bfloat16)
            try:
                h = host_us(fn)
                d = median(timer.time_us(fn, h, 30))
            except (RuntimeError, ValueError) as e:
                print(f"{m:>5}x{n}x{k:<6} {name:<28} failed: {str(e).splitlines()[0][:100]}")
                continue
            rows.append(dict(m=m, n=n, k=k, impl=name, host_us=round(h, 2), device_us=round(d, 2)))
            if name == "op cuda, out given":
                warm_calls[(m, n, k)] = fn
            print(f"{m:>5}x{n}x{k:<6} {name:<28} host {h:7.2f} us   device {d:7.2f} us", flush=True)
    # NOTE: the host's own noise comes in bursts that can cover one shape's whole measurement
    # (10.7 vs 7.0 us for the same Python in one run); rounds over all shapes spread it.
    per_shape = {key: [] for key in warm_calls}
    for _ in range(args.rounds):
        for key, fn in warm_calls.items():
            per_shape[key].append(host_us(fn))
    for (m, n, k), hs in per_shape.items():
        if not hs:
            continue
        h = statistics.median(hs)
        rows.append(dict(m=m, n=n, k=k, impl=f"op cuda, out given, {len(hs)} rounds",
                         host_us=round(h, 2), host_us_min=round(min(hs), 2),
                         host_us_max=round(max(hs), 2)))
        print(f"{m:>5}x{n}x{k:<6} op cuda, out given: median of {len(hs)} rounds {h:6.2f} us "
              f"(min {min(hs):.2f}, max {max(hs):.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Which kernels each implementation launches for a bench case, with the launch shape the
profiler records: grid, block, registers a thread, shared memory. cuBLAS's kernel names carry
its tile, stage count and cluster shape (nvjet_sm90_..._128x128_128x6_1x2_...: 128x128 tiles,
k-block 128, 6 stages, 1x2 CTAs a cluster), so this is how to read what a peer runs.

    python scripts/kernel_names.py wgrad:2112x7168x4096 dense:256x2112x7168 [--impls a,b]

Cases are OP:MxNxK[xG] in the bench's naming (fp8gemm.bench.suites.Case). One warm call each
under torch.profiler; needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8gemm.bench.impls import Skip, make_data, make_impl  # noqa: E402
from fp8gemm.bench.suites import Case  # noqa: E402


def kernels(fn) -> list[dict]:
    """The kernel events of one call of `fn` (torch.profiler's trace)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return [e for e in events if e.get("cat") == "kernel"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", help="OP:MxNxK[xG], e.g. wgrad:2112x7168x4096")
    p.add_argument("--impls", default="fp8gemm-cuda,cublas-block,cublas-tensor,deepgemm")
    args = p.parse_args()
    dev = torch.device("cuda")
    for spec in args.cases:
        op, _, shape = spec.partition(":")
        m, n, k, *g = (int(v) for v in shape.split("x"))
        data = make_data(Case("kernels", op, m, n, k, groups=g[0] if g else 1), dev, seed=1)
        print(f"== {spec}")
        for name in args.impls.split(","):
            try:
                impl = make_impl(name, data)
            except Skip as e:
                print(f"  {name}: skipped ({e})")
                continue
            for e in kernels(impl.fn):
                a = e.get("args", {})
                print(f"  {name:14s} {e['dur']:8.1f} us grid={a.get('grid')} "
                      f"block={a.get('block')} regs={a.get('registers per thread')} "
                      f"smem={a.get('shared memory')} {e['name'][:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

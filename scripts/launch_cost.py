"""Host cost of the pieces of a warm CUDA-backend launch, on a Hopper GPU.

    python3 scripts/launch_cost.py [--json PATH] [--shape 64x2112x7168]

Each line: host_cost.host_us (median of 7 loops of 200 calls, us per call, the GPU kept busy so
only the host's time is in the loop). The variants isolate what a warm `fp8_gemm_nt` spends: the
ops layer, `Kernel.launch`, the bare ctypes call of cuLaunchKernelEx with the library's CUkernel
or with the context's CUfunction, the older cuLaunchKernel, a trivial driver call (the ctypes and
driver-entry floor), and torch's own launch of a tiny kernel for reference.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

import fp8gemm
from fp8gemm.backends.cuda import sm90_fp8_gemm as sm90
from fp8gemm.jit import driver

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import host_us  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--shape", default="64x2112x7168")
    args = p.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    dev = torch.device("cuda", torch.cuda.current_device())
    from cuda.bindings import driver as cu

    a, sa = fp8gemm.quantize_per_token(torch.randn(m, k, device=dev))
    b, sb = fp8gemm.quantize_per_block(torch.randn(n, k, device=dev))
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    fp8gemm.fp8_gemm_nt((a, sa), (b, sb), out, backend="cuda")
    torch.cuda.synchronize()
    plan = next(p for key, p in sm90._plans.items() if key[:3] == (m, n, k))
    pack = next(iter(plan.packs.values()))
    kernel, launch = plan.kernel, plan.launch
    lib = driver.lib()
    libcuda = ctypes.CDLL("libcuda.so.1")
    func = driver.check(cu.cuKernelGetFunction(kernel._kernel), "cuKernelGetFunction")
    fhandle = int(func)
    legacy = libcuda.cuLaunchKernel
    legacy.restype = ctypes.c_int
    legacy.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    version = ctypes.c_int()
    get_version = libcuda.cuDriverGetVersion
    get_version.restype = ctypes.c_int
    get_version.argtypes = [ctypes.c_void_p]
    version_addr = ctypes.addressof(version)
    side = torch.cuda.Stream(dev)
    rows = []

    def row(name, fn):
        us = host_us(fn)
        rows.append({"variant": name, "host_us": round(us, 2)})
        print(f"{name:<44} {us:7.2f} us", flush=True)

    def launch_rows(stream_name: str, raw: int) -> None:
        cfg_addr = launch.for_stream(raw)[1]
        g, bl = launch.grid, launch.block
        print(f"-- {stream_name} (raw {raw:#x}), {m}x{n}x{k}, {plan.cfg}")
        row(f"{stream_name}: op fp8_gemm_nt, out given",
            lambda: fp8gemm.fp8_gemm_nt((a, sa), (b, sb), out, backend="cuda"))
        row(f"{stream_name}: Kernel.launch", lambda: kernel.launch(launch, raw, pack))
        row(f"{stream_name}: ctypes cuLaunchKernelEx, CUkernel",
            lambda: lib.cuLaunchKernelEx(cfg_addr, kernel.handle, pack.address, None))
        row(f"{stream_name}: ctypes cuLaunchKernelEx, CUfunction",
            lambda: lib.cuLaunchKernelEx(cfg_addr, fhandle, pack.address, None))
        if launch.cluster == (1, 1, 1):
            row(f"{stream_name}: ctypes cuLaunchKernel, CUfunction",
                lambda: legacy(fhandle, g[0], g[1], g[2], bl[0], bl[1], bl[2], launch.smem,
                               raw or None, pack.address, None))

    launch_rows("default stream", torch._C._cuda_getCurrentRawStream(dev.index))
    with torch.cuda.stream(side):
        launch_rows("side stream", torch._C._cuda_getCurrentRawStream(dev.index))
    row("ctypes cuDriverGetVersion (floor)", lambda: get_version(version_addr))
    row("torch._C._cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(dev.index))
    small = torch.empty(16, device=dev)
    row("torch: small.zero_() (one launch)", lambda: small.zero_())
    row("torch.cuda._sleep(1) (one launch)", lambda: torch.cuda._sleep(1))
    torch.cuda.synchronize()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "shape": [m, n, k], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

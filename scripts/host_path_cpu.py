"""Host (Python) cost of a warm `fp8_gemm_nt` call on the CUDA backend, measured without a GPU.

    python scripts/host_path_cpu.py [--calls 20000] [--repeats 5] [--m 64 --n 2112 --k 7168]

Runs the real Python of ops/gemm.py, backends/cuda and jit/runtime.py on CPU tensors, with only
what needs a GPU stood in for:
- the ops fast path is switched on for CPU tensors (as tests/test_fast_path.py does), the CUDA
  backend reports itself available and "auto" picks it;
- the driver: `cuda.bindings.driver` (kernel load, smem attribute) by a fake module, and the two
  hot-path libcuda symbols (`cuLaunchKernelEx`, `cuTensorMapEncodeTiled`) by no-op C functions
  compiled with gcc, so the ctypes call costs what it costs for real minus the driver's own work
  (pure-Python stand-ins when there is no gcc: then the launch line is not comparable);
- `torch._C._cuda_getCurrentRawStream` returns 0 (torch's default stream: the common case, which
  also asks for the current device) and `torch._C._cuda_getDevice` the tensors' device.

Each line times `repeats` x `calls` warm calls (time.perf_counter) in chunks of 1000: the best
chunk (for comparing changes on a noisy machine) and the median, in us/call.
The launch stub counts its calls: every timed call must launch exactly once. On the H200 host a
warm call costs about 1.8 x (op - stub driver call) here plus cuLaunchKernelEx there (5-6 us,
docs/cuda.md): that host runs this Python ~1.8x slower.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

# NOTE: run from a checkout (python scripts/host_path_cpu.py) without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_STUB_C = r"""
int launches = 0;
int cuLaunchKernelEx(void *config, void *kernel, void **params, void **extra) {
    launches++;
    return 0;
}
int cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *addr, void *dims,
                           void *strides, void *box, void *elem_strides, int interleave,
                           int swizzle, int l2, int oob) {
    return 0;
}
"""


class _StubLib:
    """What fp8gemm.jit.driver.lib() returns, with the libcuda symbols replaced by no-ops."""

    def __init__(self, tmp: Path) -> None:
        src, so = tmp / "stub.c", tmp / "libstub.so"
        src.write_text(_STUB_C)
        try:
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                           capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            self.native = False
            self._count = [0]

            def launch(*args):
                self._count[0] += 1
                return 0

            self.cuLaunchKernelEx = launch
            self.cuTensorMapEncodeTiled = lambda *args: 0
            return
        self.native = True
        from fp8gemm.jit import driver

        lib = ctypes.CDLL(str(so))
        driver.bind_hot_path(self, lib)
        self._launches = ctypes.c_int.in_dll(lib, "launches")

    def launches(self) -> int:
        return self._launches.value if self.native else self._count[0]


def _fake_cuda_driver_module() -> types.ModuleType:
    """Enough of `cuda.bindings.driver` for Kernel.__init__ and set_max_dynamic_smem."""
    cu = types.ModuleType("cuda.bindings.driver")
    cu.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    cu.CUfunction_attribute = types.SimpleNamespace(
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8)
    cu.CUdevice = lambda index: index
    cu.cuInit = lambda flags: (0,)
    cu.cuLibraryLoadData = lambda *args: (0, "library")
    cu.cuLibraryGetKernel = lambda library, name: (0, 0x1234)
    cu.cuKernelSetAttribute = lambda *args: (0,)
    return cu


def install_stubs(tmp: Path) -> _StubLib:
    import fp8gemm.backends.cuda as cuda_backend
    from fp8gemm import jit
    from fp8gemm.backends.cuda import sm90_fp8_gemm as g
    from fp8gemm.jit import driver
    from fp8gemm.ops import gemm

    # The fast path and backend choice as on a GPU.
    gemm._values_unchecked = lambda t: True
    cuda_backend.is_available = lambda device: True
    real_select = gemm.select_backend
    gemm.select_backend = lambda problem, device, requested="auto": real_select(
        problem, device, "cuda" if requested == "auto" else requested)

    # The driver.
    cu = _fake_cuda_driver_module()
    try:
        from cuda import bindings
    except ImportError:
        bindings = types.ModuleType("cuda.bindings")
        sys.modules.setdefault("cuda", types.ModuleType("cuda")).bindings = bindings
        sys.modules["cuda.bindings"] = bindings
    bindings.driver = cu
    sys.modules["cuda.bindings.driver"] = cu
    lib = _StubLib(tmp)
    driver.lib = lambda: lib
    g.DeviceFacts.of = staticmethod(lambda device: g.DeviceFacts(132, 232448, 60 * 2 ** 20))
    g.build_kernel = lambda n, k, cfg: jit.Kernel(
        "stub", jit.CompiledCubin(b"", f"stub_{n}_{k}", "", 0.0), None)

    # The stream queries, as C callables like the real ones (a Python stand-in would cost a
    # frame each): the default stream of the tensors' device (index None: CPU tensors), which is
    # the current device.
    torch._C._cuda_getCurrentRawStream = {None: 0}.get
    torch._C._cuda_getDevice = itertools.repeat(None).__next__
    return lib


def time_us(fn, calls: int, repeats: int, chunk: int = 1000) -> tuple[float, float]:
    """(best, median) us/call over chunks of `chunk` calls: the best chunk is the one that
    least else ran during (a shared or virtual machine), the median what a loop sees."""
    for _ in range(200):
        fn()
    chunks = []
    for _ in range(repeats * max(calls // chunk, 1)):
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        chunks.append(time.perf_counter() - t0)
    chunks.sort()
    return chunks[0] * 1e6 / chunk, chunks[len(chunks) // 2] * 1e6 / chunk


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--m", type=int, default=64)
    p.add_argument("--n", type=int, default=2112)
    p.add_argument("--k", type=int, default=7168)
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="fp8gemm-host-") as tmp:
        lib = install_stubs(Path(tmp))
        import fp8gemm
        import fp8gemm.backends.cuda as cuda_backend
        from fp8gemm.backends.cuda import sm90_fp8_gemm as g
        from fp8gemm.problem import GemmKind, GemmProblem, Recipe

        m, n, k = args.m, args.n, args.k
        a, sa = fp8gemm.quantize_per_token(torch.randn(m, k))
        b, sb = fp8gemm.quantize_per_block(torch.randn(n, k))
        out = torch.empty(m, n, dtype=torch.bfloat16)
        problem = GemmProblem(GemmKind.DENSE, m, n, k, 1, a.dtype, b.dtype, Recipe.GROUP,
                              Recipe.BLOCK, torch.bfloat16)
        gemm_nt = fp8gemm.fp8_gemm_nt
        gemm_nt((a, sa), (b, sb), out, backend="cuda")
        plan = g._plans[(m, n, k, a.device.index)]
        pack = next(iter(plan.packs.values()))
        kernel, launch = plan.kernel, plan.launch
        driver_fn = lib.cuLaunchKernelEx

        cases = [
            ("op cuda, out given", lambda: gemm_nt((a, sa), (b, sb), out, backend="cuda")),
            ("op auto, out given", lambda: gemm_nt((a, sa), (b, sb), out)),
            ("op cuda, out=None (CPU alloc)", lambda: gemm_nt((a, sa), (b, sb), backend="cuda")),
            ("backend entry", lambda: cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, None, problem)),
            ("Kernel.launch", lambda: kernel.launch(launch, 0, pack)),
            ("stub driver call alone", lambda: driver_fn(0, 0, 0, None)),
        ]
        print(f"M={m} N={n} K={k}, {args.calls} calls x {args.repeats} in chunks of 1000; "
              f"{'native' if lib.native else 'Python'} driver stubs; us/call: best chunk, median")
        for name, fn in cases:
            before = lib.launches()
            best, med = time_us(fn, args.calls, args.repeats)
            launched = lib.launches() - before
            expected = 200 + max(args.calls // 1000, 1) * 1000 * args.repeats
            assert launched == expected, f"{name}: {launched} launches for {expected} calls"
            print(f"  {name:<32} {best:6.2f} {med:6.2f}")


if __name__ == "__main__":
    main()

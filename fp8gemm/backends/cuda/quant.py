"""Per-token FP8 quantisation (1x128 groups along K, and SiLU*mul fused with it) as a CUDA kernel
of the JIT: include/fp8gemm/quant_rows.cuh. Launched like the GEMMs (a prebuilt argument pack
through cuLaunchKernelEx), so a call costs a few microseconds of host time where a Triton launch
costs tens.

`quantize_rows` returns what fp8gemm.quant's torch code does (its specification); `refusal`
says why an input is not taken (the caller then runs the Triton kernel): the kernel reads
16-byte vectors, so it needs K (and the SiLU split) % 8 == 0, row strides % 8 == 0 and 16-byte
aligned bases, and its 32-bit work index needs M * ceil(K/128) < 2^31.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from ... import jit
from ..._settings import settings
from ...layout import empty_token_scales
from ...problem import SCALE_BLOCK, ceil_div
from .launch import launch

__all__ = ["quantize_rows", "refusal", "kernel_source", "compile_kernel", "VARIANTS"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
THREADS = 256
# groups per thread, all loaded before any is reduced: 2 keep 32 bytes in flight per thread
ITEMS = 2
_IN_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAX_GRID_Y = 65535
# (input dtype, fmt, SiLU*mul, pow2, rows first = column-major scales): every instance the public
# quantisers can ask for
VARIANTS = [(dt, fmt, silu, pow2, rows_first) for dt in _IN_KIND for fmt in _FP8
            for silu in (False, True) for pow2 in (False, True) for rows_first in (True, False)]


def kernel_source(dtype: torch.dtype, fmt: str, silu: bool, pow2: bool,
                  rows_first: bool) -> tuple[str, str]:
    """(source, name expression) of one kernel instance (rows_first: the work order for
    column-major scales)."""
    b = lambda v: "true" if v else "false"  # noqa: E731
    name = (f"&fp8gemm::quant_rows_kernel<{_IN_KIND[dtype]}, {b(fmt == 'e5m2')}, {b(silu)}, "
            f"{b(pow2)}, {b(rows_first)}, {THREADS}, {ITEMS}>")
    return "#include <fp8gemm/quant_rows.cuh>\n", name


def compile_kernel(dtype: torch.dtype, fmt: str, silu: bool, pow2: bool, rows_first: bool,
                   compiler: str | None = None):
    """Compile without loading (no GPU needed): (key, CompiledCubin, path, was_cached)."""
    return jit.compile_cached(*kernel_source(dtype, fmt, silu, pow2, rows_first),
                              (str(INCLUDE_DIR),), compiler=compiler)


def refusal(x: torch.Tensor, k: int, silu: bool) -> str | None:
    """Why the kernel does not take x [..., M, K_in] (K the quantised width), or None."""
    if x.dtype not in _IN_KIND:
        return f"reads bf16, fp16 or fp32, got {x.dtype}"
    if x.dim() < 2 or x.stride(-1) != 1:
        return "needs a unit column stride"
    if k % 8 or x.data_ptr() % 16:
        return "needs K % 8 == 0 and a 16-byte aligned base"
    rows = x.reshape(-1, *x.shape[-2:]) if x.dim() > 3 else x
    if any(st % 8 for st in rows.stride()[:-1]):
        return "needs row and batch strides % 8 == 0 (16-byte vectors)"
    if x.shape[-2] * ceil_div(k, SCALE_BLOCK) >= 2 ** 31:
        return "needs M * ceil(K/128) < 2^31"
    return None


_kernels: dict[tuple, jit.Kernel] = {}
_configs: dict[tuple[int, int], jit.LaunchConfig] = {}
_local = threading.local()


def _kernel(key: tuple) -> jit.Kernel:
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = jit.build(*kernel_source(*key), (str(INCLUDE_DIR),))
    return kernel


def _args() -> tuple[list, jit.ParamPack]:
    """This thread's argument values and their pack, rewritten for every launch.
    NOTE: the driver copies kernel arguments when the launch is issued (and a captured launch
    into its graph node), so the values may change once launch() returns; per thread, because
    ctypes drops the GIL inside the launch call."""
    entry = getattr(_local, "args", None)
    if entry is None:
        values = [ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0),
                  ctypes.c_uint32(0), ctypes.c_uint32(0), ctypes.c_uint32(0),
                  ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0),
                  ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0),
                  ctypes.c_uint64(0)]
        entry = _local.args = (values, jit.ParamPack(values))
    return entry


def quantize_rows(x: torch.Tensor, fmt: str, pow2: bool, col_major: bool, silu: bool,
                  masked_m: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., M, K] (or [..., M, 2I] with silu) on a CUDA GPU, `refusal` None ->
    (q [..., M, K] fp8 row-major, s [..., M, ceil(K/128)] float32: column-major with M padded to
    16 bytes when col_major, else row-major). masked_m: int32 [G] for x [G, M, K_in] (checked by
    the caller): rows at or past masked_m[g] are neither read nor written but for their scales
    (an all-zero group's)."""
    lead, m = tuple(x.shape[:-2]), x.shape[-2]
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    kb = ceil_div(k, SCALE_BLOCK)
    q = torch.empty((*lead, m, k), dtype=_FP8[fmt], device=x.device)
    s = empty_token_scales(lead, m, kb, col_major, x.device)
    if q.numel() == 0:
        return q, s
    if x.dim() == 2:  # (no views: this runs on every activation)
        batch, x_row, x_batch, s_batch = 1, x.stride(0), 0, 0
    else:
        x3 = x.reshape(-1, m, x.shape[-1])  # (a copy where the leading dims do not merge)
        batch, x_row, x_batch = x3.shape[0], x3.stride(1), x3.stride(0)
        s_batch = s.stride(-3)  # (empty_token_scales: every leading dim merges)
    s_row, s_group = s.stride(-2), s.stride(-1)
    kernel = _kernel((x.dtype, fmt, silu, pow2, col_major))
    per_cta = THREADS // 16 * ITEMS
    grid_x = ceil_div(m * kb, per_cta)
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    values, pack = _args()
    x_ptr = (x if x.dim() == 2 else x3).data_ptr()
    for lo in range(0, batch, _MAX_GRID_Y):
        n = min(batch - lo, _MAX_GRID_Y)
        config = _configs.get((grid_x, n))
        if config is None:
            config = _configs[(grid_x, n)] = jit.LaunchConfig((grid_x, n, 1), (THREADS, 1, 1), 0,
                                                              pdl=settings.pdl)
        for v, val in zip(values, (
                x_ptr + lo * x_batch * x.element_size(), q.data_ptr() + lo * m * k,
                s.data_ptr() + lo * s_batch * 4, m, k, k if silu else 0, x_row, x_batch, m * k,
                s_row, s_group, s_batch, 0 if masked_m is None else masked_m.data_ptr() + lo * 4)):
            v.value = val
        launch(kernel, config, device_index, pack)
    return q, s

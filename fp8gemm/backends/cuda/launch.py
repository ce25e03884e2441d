"""Host pieces every sm90 family shares: tensor layouts TMA can address, and the launch on the
current torch stream."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from ... import jit
from ..._settings import settings
from ...layout import TMA_ALIGN_BYTES, get_col_major_tma_aligned_tensor

__all__ = ["row_stride", "tma_aligned", "kernel_a_scales", "launch", "cached_plan",
           "split_workspace"]

P = TypeVar("P")
# Plans a family keeps (each holds a loaded kernel and its argument packs); a full cache starts
# over rather than tracking use.
PLAN_CAPACITY = 4096

# Raw stream handles that are not real streams: NULL (legacy default), CU_STREAM_LEGACY,
# CU_STREAM_PER_THREAD (cuda.h).
_SPECIAL_STREAMS = (0, 1, 2)


def row_stride(t: torch.Tensor) -> int:
    """Row stride (elements) of a contiguous 2-D tensor for its tensor map.
    NOTE: torch calls a tensor with one row contiguous whatever its row stride (a [1, K] view of
    a wider buffer, an expanded row: stride 0); TMA reads one row then, so the packed stride is
    used and the descriptor is the same for every such view."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy when its base address is not 16-byte aligned (a contiguous view
    at an odd storage offset): TMA cannot address it, and `supports` sees only the problem, not
    the pointers, so the backend copies (slow but correct, never an error)."""
    return t if t.data_ptr() % TMA_ALIGN_BYTES == 0 else t.clone(memory_format=torch.contiguous_format)


def kernel_a_scales(sa: torch.Tensor) -> torch.Tensor:
    """A scales [..., M, kb] in the kernels' layout (column-major, columns padded to 16 bytes:
    `layout.get_col_major_tma_aligned_tensor`) at a 16-byte aligned base: sa itself when it
    already is (what quantize_per_token emits), else a converted copy."""
    sa = get_col_major_tma_aligned_tensor(sa)
    if sa.data_ptr() % TMA_ALIGN_BYTES:
        sa = get_col_major_tma_aligned_tensor(sa.contiguous())
    return sa


def launch(kernel: jit.Kernel, config: jit.LaunchConfig, device_index: int,
           pack: jit.ParamPack) -> None:
    """Launch on the current torch stream of the tensors' device."""
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    # NOTE: a CUkernel launched on a special stream (torch's default stream is NULL) runs in the
    # thread's *current* context (cuda.h, cuLaunchKernelEx), not the one of the tensors' device:
    # make that device current when it is not (tensors on cuda:1, current device cuda:0).
    if stream in _SPECIAL_STREAMS and torch._C._cuda_getDevice() != device_index:
        with torch.cuda.device(device_index):
            kernel.launch(config, stream, pack)
    else:
        kernel.launch(config, stream, pack)


# Split-K workspaces, per (device, raw stream): (float32 parts, int32 counters). The counters start
# at zero and every launch leaves them zero, so one pair serves every launch on its stream (a
# stream's launches run in order; a dependent launch touches them only after its grid-dependency
# wait, once the kernel before has finished).
_split_buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(device_index: int, floats: int,
                    flags: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parts, flags) for a launch on the current stream of device `device_index`: at least
    `floats` float32 parts and `flags` int32 counters, the counters zero.
    NOTE: under CUDA-graph capture nothing runs, so a cached pair's zeros could not be vouched
    for in the graph's replays, and graphs captured on one stream may replay on several: a
    capture takes a new pair from the graph's pool, its zero fill recorded before the kernel."""
    device = torch.device("cuda", device_index)
    if torch.cuda.is_current_stream_capturing():
        return (torch.empty(floats, dtype=torch.float32, device=device),
                torch.zeros(flags, dtype=torch.int32, device=device))
    key = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    bufs = _split_buffers.get(key)
    if bufs is None or bufs[0].numel() < floats or bufs[1].numel() < flags:
        if len(_split_buffers) >= 64:
            _split_buffers.clear()  # (stream-ordered frees: launches queued on them finish first)
        old = (0, 0) if bufs is None else (bufs[0].numel(), bufs[1].numel())
        bufs = _split_buffers[key] = (
            torch.empty(max(floats, old[0]), dtype=torch.float32, device=device),
            torch.zeros(max(flags, old[1]), dtype=torch.int32, device=device))
    return bufs


def cached_plan(plans: dict, key: tuple, build: Callable[[], P], family: str, problem,
                cfg) -> P:
    """plans[key], built by `build()` on first use; a new plan's family and config are printed
    under FP8GEMM_PRINT_CONFIGS (what is printed is what runs)."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= PLAN_CAPACITY:
            plans.clear()
        plan = plans[key] = build()
        if settings.print_configs:
            print(f"[fp8gemm] cuda: {problem} -> {family} {cfg}", flush=True)
    return plan

"""CUDA backend: run-time compiled sm_90a kernels (see fp8gemm/backends/__init__.py for the contract).

Part 1 covers the dense GEMM with A in 1x128 groups and B in 128x128 blocks (e4m3, bf16 out);
`supports` turns everything else away with a reason, so the dispatcher falls back visibly.
"""

from __future__ import annotations

import functools

import torch

from ...problem import GemmProblem
from . import sm90_fp8_gemm

__all__ = ["NAME", "is_available", "supports", "fp8_gemm_nt", "fp8_gemm_nt_launcher"]

NAME = "cuda"


@functools.lru_cache(maxsize=None)
def _toolchain_ok() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    from ...jit import CompilerUnavailable, get_compiler

    try:
        get_compiler()
    except (CompilerUnavailable, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    # NOTE: the kernels use sm_90a-only instructions (wgmma, setmaxnreg): exactly 9.0, not later.
    return torch.cuda.get_device_capability(index) == (9, 0)


def is_available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _is_sm90(index) and _toolchain_ok()


def supports(problem: GemmProblem) -> str | None:
    return sm90_fp8_gemm.supports(problem)


def fp8_gemm_nt(a, sa, b, sb, out, c, problem: GemmProblem) -> None:
    if c is not None:
        raise ValueError("the CUDA backend has no C input yet (supports() refuses has_c)")
    sm90_fp8_gemm.fp8_gemm_nt(a, sa, b, sb, out, problem)


def fp8_gemm_nt_launcher(problem: GemmProblem, sa, sb):
    """Optional part of the contract, used by the ops layer's per-metadata fast path: a callable
    (a, sa, b, sb, out, c) that runs `problem` for later calls whose tensors have the metadata of
    this call's (a, b, out contiguous; scales as sa and sb, unreshaped; one device), skipping this
    module's checks and the plan lookups; or None."""
    return sm90_fp8_gemm.launcher(problem, sa, sb)

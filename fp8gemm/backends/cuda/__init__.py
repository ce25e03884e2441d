"""CUDA backend: run-time compiled sm_90a kernels (see fp8gemm/backends/__init__.py for the contract).

A table of kernel families (fp8gemm/backends/family.py), in order of preference; `supports` is
the first that takes a problem, and the op functions run the first family that supports it and
does not decline it on the tensors' device (its model leaves it to a later family), with its
heuristic's config. Everything the families refuse goes to another backend, visibly
(FP8GEMM_PRINT_CONFIGS).
"""

from __future__ import annotations

import functools

import torch

from ...problem import GemmProblem
from ..family import DeviceFacts, KernelFamily, choose_family
from . import sm90_fp8_gemm_1d1d, sm90_fp8_gemm_1d2d, sm90_fp8_gemm_small_m

__all__ = ["NAME", "FAMILIES", "TRIAL_FAMILIES", "is_available", "supports", "family_for",
           "fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked", "k_grouped_fp8_gemm_nt_contiguous",
           "fp8_gemm_nt_launcher", "m_grouped_fp8_gemm_nt_launcher"]

NAME = "cuda"
# NOTE: the small-M and split-K families each support a subset of what the family after them
# does and decline what their models give to it, so `supports` answers as if they were not there.
FAMILIES = (sm90_fp8_gemm_small_m.SMALL_M, sm90_fp8_gemm_1d2d.SPLIT_K, sm90_fp8_gemm_1d2d.DENSE,
            sm90_fp8_gemm_small_m.MASKED_SMALL_M, sm90_fp8_gemm_1d2d.GROUPED,
            sm90_fp8_gemm_1d1d.DENSE, sm90_fp8_gemm_1d1d.K_GROUPED)
# Families built and compile-checked that the table does not offer yet: the H200 has not run
# their GPU tests. Tests, `run` with a forced config and scripts/cuda_tiles.py reach them by
# name; each moves into FAMILIES (before the family it declines to) once its tests pass there.
TRIAL_FAMILIES = ()


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


@functools.lru_cache(maxsize=4096)
def _choice(problem: GemmProblem):
    return choose_family(FAMILIES, problem)


def supports(problem: GemmProblem) -> str | None:
    return _choice(problem)[1]


@functools.lru_cache(maxsize=4096)
def _family(problem: GemmProblem, facts: DeviceFacts | None) -> KernelFamily:
    reasons = []
    for fam in FAMILIES:
        why = fam.supports(problem)
        if why is None and type(fam).declines is not KernelFamily.declines:
            if facts is None:
                facts = DeviceFacts.of(torch.device("cuda"))
            why = fam.declines(problem, facts)
        if why is None:
            return fam
        reasons.append(f"{fam.name}: {why}")
    raise ValueError(f"the CUDA backend cannot run {problem}: {'; '.join(reasons)}")


def family_for(problem: GemmProblem, facts: DeviceFacts | None = None) -> KernelFamily:
    """The family that runs `problem` (supports() has accepted it) on a device with `facts`
    (default: the current CUDA device's, read only where a family's choice depends on them)."""
    return _family(problem, facts)


def _run(problem: GemmProblem, a, sa, b, sb, out, c, index) -> None:
    fam = _family(problem, DeviceFacts.of(a.device))
    fam.run(fam.config_for(problem, a.device), problem, a, sa, b, sb, out, c, index)


def fp8_gemm_nt(a, sa, b, sb, out, c, problem: GemmProblem) -> None:
    _run(problem, a, sa, b, sb, out, c, None)


def m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, m_indices, problem: GemmProblem) -> None:
    _run(problem, a, sa, b, sb, out, None, m_indices)


def m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, offsets, problem: GemmProblem) -> None:
    _run(problem, a, sa, b, sb, out, None, offsets)


def m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, problem: GemmProblem) -> None:
    _run(problem, a, sa, b, sb, out, None, masked_m)


def k_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, c, ks, problem: GemmProblem) -> None:
    _run(problem, a, sa, b, sb, out, c, ks)


def fp8_gemm_nt_launcher(problem: GemmProblem, sa, sb):
    """Optional part of the contract, used by the ops layer's per-metadata fast path: a callable
    (a, sa, b, sb, out, c) that runs `problem` for later calls whose tensors have the metadata of
    this call's (a, b, out contiguous; scales as sa and sb, unreshaped; one device), skipping this
    module's checks and the plan lookups; or None."""
    fam = _family(problem, DeviceFacts.of(sa.device))
    if fam is sm90_fp8_gemm_small_m.SMALL_M:
        def slow(a, sa_, b, sb_, out, c):
            fp8_gemm_nt(a, sa_, b, sb_, out, c, problem)
        return sm90_fp8_gemm_small_m.launcher(fam, problem, sa, sb, slow)
    if fam is sm90_fp8_gemm_1d1d.DENSE:
        return sm90_fp8_gemm_1d1d.launcher(problem, sa, sb)
    return sm90_fp8_gemm_1d2d.launcher(fam, problem, sa, sb)


def m_grouped_fp8_gemm_nt_launcher(problem: GemmProblem, sa, sb):
    """As fp8_gemm_nt_launcher, for the grouped kinds: a callable (a, sa, b, sb, out, index),
    index being the m_indices, offsets or masked_m of the call (contiguous, like a, b and out),
    or None."""
    fam = _family(problem, DeviceFacts.of(sa.device))
    if fam is sm90_fp8_gemm_small_m.MASKED_SMALL_M:
        def slow(a, sa, b, sb, out, masked_m):
            m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, problem)
        return sm90_fp8_gemm_small_m.launcher(fam, problem, sa, sb, slow)
    return sm90_fp8_gemm_1d2d.launcher(fam, problem, sa, sb)

"""Backends and how one is chosen.

A backend is a module with:

    NAME: str
    is_available(device: torch.device) -> bool
    supports(problem: GemmProblem) -> str | None        # None, or why not
    fp8_gemm_nt(a, sa, b, sb, out, c, problem) -> None
    m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, m_indices, problem) -> None
    m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, offsets, problem) -> None
    m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, problem) -> None
    k_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, c, ks, problem) -> None

A backend defines the GEMM functions of the kinds its `supports` accepts; the others may be
absent (the dispatcher never picks it for them). Optionally, for the ops layer's warm-call fast
path:

    fp8_gemm_nt_launcher(problem, sa, sb) -> run(a, sa, b, sb, out, c) or None
    m_grouped_fp8_gemm_nt_launcher(problem, sa, sb) -> run(a, sa, b, sb, out, index) or None

a callable that runs `problem` for later calls whose tensors have the metadata of this call's,
skipping the backend's own checks and lookups (see backends/cuda). `sa` and `sb` are the scales
as the caller passed them (the ops layer asks only when they are already in the normalised
shapes); the grouped launcher serves the three grouped kinds (problem.kind says which), `index`
being the call's m_indices, offsets or masked_m. None: the ops layer calls the GEMM function
instead. The ops layer asks once per metadata signature, and only where values go unchecked
(CUDA tensors, FP8GEMM_CHECK_VALUES off); `out` may be a fresh zero tensor of each call.

The ops layer has validated everything: a, b and out are contiguous, scales are float32 in the
normalised shapes of `Recipe` (any strides), index tensors are contiguous int32, every tensor is
on one device, and no dimension is zero. A dense `c` is None, `out` itself, or float32 [M, N]
with unit column stride and any row stride (0: one row for all, a bias). A backend writes only
`out`; rows that belong to no group
(m_indices -1, rows at or past masked_m[g]) are left untouched. K-grouped: a [M, sum K],
b [N, sum K], scales [M, S] and [N, S] (1x128 along each group's K), ks [G] (sum K > 0, a
group's K may be 0), out [G, M, N] float32 written everywhere, c None, [G, M, N] or out itself.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from .._settings import settings
from ..problem import GemmProblem

__all__ = ["NAMES", "get_backend", "select_backend", "triton_runs_on"]

NAMES = ("cuda", "triton", "reference")
_MODULES = {"cuda": ".cuda", "triton": ".triton", "reference": ".reference"}
_CONTRACT = ("NAME", "is_available", "supports")
_loaded: dict[str, ModuleType | None] = {}
_load_errors: dict[str, str] = {}
_chosen: dict[tuple, ModuleType] = {}


def get_backend(name: str) -> ModuleType | None:
    """The backend module, or None when it cannot be imported here (see `load_error`)."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    if name not in _loaded:
        try:
            mod = importlib.import_module(_MODULES[name], __name__)
            missing = [f for f in _CONTRACT if not hasattr(mod, f)]
            if missing:
                raise ImportError(f"fp8gemm.backends.{name} lacks {', '.join(missing)}")
            _loaded[name] = mod
        except ImportError as e:  # an optional dependency (triton, cuda-bindings) is missing
            _loaded[name] = None
            _load_errors[name] = f"{type(e).__name__}: {e}"
    return _loaded[name]


@functools.lru_cache(maxsize=None)
def triton_runs_on(device_index: int) -> bool:
    """Whether the Triton backend runs on CUDA device `device_index`: the quantisers and the MoE
    combine then run their Triton kernels. Looked up once per device: they ask on every call,
    and the answer cannot change within a process (Triton picks its interpreter when first
    imported)."""
    triton = get_backend("triton")
    return triton is not None and triton.is_available(torch.device("cuda", device_index))


def load_error(name: str) -> str | None:
    get_backend(name)
    return _load_errors.get(name)


def _why_not(name: str, problem: GemmProblem, device: torch.device) -> str | None:
    mod = get_backend(name)
    if mod is None:
        return f"cannot import: {_load_errors[name]}"
    if not mod.is_available(device):
        return f"not available on {device}"
    return mod.supports(problem)


def select_backend(problem: GemmProblem, device: torch.device, requested: str = "auto") -> ModuleType:
    """Pick the backend for a problem: `requested` (or FP8GEMM_BACKEND) when not "auto", else the
    first of cuda, triton (GPU only) that takes the problem, else the reference.
    An explicitly requested backend that cannot run the problem raises instead of falling back."""
    if requested == "auto":
        requested = settings.backend
        if requested != "auto" and requested not in NAMES:
            raise ValueError(f"FP8GEMM_BACKEND must be one of {('auto',) + NAMES}, "
                             f"got {requested!r}")
    elif requested not in NAMES:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {requested!r}")
    key = (problem, device, requested)
    mod = _chosen.get(key)
    if mod is not None:
        return mod
    if requested != "auto":
        why = _why_not(requested, problem, device)
        if why is not None:
            raise ValueError(f"backend={requested!r} cannot run {problem}: {why}")
        mod, reasons = get_backend(requested), []
    else:
        reasons = []
        candidates = ("cuda", "triton") if device.type == "cuda" else ()
        for name in candidates:
            why = _why_not(name, problem, device)
            if why is None:
                mod = get_backend(name)
                break
            reasons.append(f"{name}: {why}")
        else:
            mod = get_backend("reference")
        if device.type != "cuda" and settings.print_configs:
            reasons = [f"{name}: {_why_not(name, problem, device) or 'auto takes it on CUDA devices only'}"
                       for name in ("cuda", "triton")]
    _chosen[key] = mod
    if settings.print_configs:
        skipped = f" (skipped {'; '.join(reasons)})" if reasons else ""
        print(f"[fp8gemm] {problem} -> backend {mod.NAME}{skipped}", flush=True)
    return mod

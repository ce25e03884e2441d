"""Triton backend: FP8 GEMMs for every kind and recipe, on any GPU whose Triton has FP8 dots
(compute capability >= 8.9), and on the CPU under TRITON_INTERPRET=1.

Implements the backend contract of `fp8gemm.backends` (inputs validated and normalised by the ops
layer). Configs come from `config.choose_config` (pure heuristic) or, with FP8GEMM_AUTOTUNE=1,
from timing its candidates once per problem (stored in FP8GEMM_CACHE_DIR).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
import triton  # noqa: F401  (an ImportError here tells the backend registry Triton is missing)

from ..._settings import settings
from ...problem import FP8_DTYPES, OUT_DTYPES, GemmKind, GemmProblem, Recipe
from .config import (DeviceFacts, GemmConfig, candidate_configs, choose_config, device_facts,
                     load_tuned, store_tuned)
from .fp8_gemm import launch_gemm
from .quant import quantize_per_block, quantize_per_token, silu_mul_quantize_per_token

__all__ = ["NAME", "is_available", "supports", "fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous",
           "m_grouped_fp8_gemm_nt_offsets", "m_grouped_fp8_gemm_nt_masked", "get_config",
           "quantize_per_token", "quantize_per_block", "silu_mul_quantize_per_token"]

NAME = "triton"

# NOTE: offsets / masked map tiles to groups with a [G]-wide prefix sum held in registers.
MAX_GROUPS_TABLE = 1024

_A_RECIPES = (Recipe.TENSOR, Recipe.ROW, Recipe.GROUP)
_B_RECIPES = (Recipe.TENSOR, Recipe.ROW, Recipe.BLOCK, Recipe.GROUP)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_available(device: torch.device) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available() or _interpreting():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index) >= (8, 9)
    return device.type == "cpu" and _interpreting()


def supports(problem: GemmProblem) -> str | None:
    if problem.a_dtype not in FP8_DTYPES or problem.b_dtype not in FP8_DTYPES:
        return f"operands must be FP8 (e4m3/e5m2), got {problem.a_dtype} x {problem.b_dtype}"
    if problem.out_dtype not in OUT_DTYPES:
        return f"out dtype must be bf16 or fp32, got {problem.out_dtype}"
    if problem.a_recipe not in _A_RECIPES:
        return f"A recipe {problem.a_recipe.value} is not one of {[r.value for r in _A_RECIPES]}"
    if problem.b_recipe not in _B_RECIPES:
        return f"B recipe {problem.b_recipe.value} is not one of {[r.value for r in _B_RECIPES]}"
    if problem.has_c and problem.kind is not GemmKind.DENSE:
        return "c (D = C + A.B^T) is implemented for dense GEMMs only"
    if problem.kind in (GemmKind.OFFSETS, GemmKind.MASKED) and problem.groups > MAX_GROUPS_TABLE:
        return f"{problem.kind.value} GEMMs take at most {MAX_GROUPS_TABLE} groups, got {problem.groups}"
    return None


# ---------------------------------------------------------------------------------------------
# configs

_configs: dict[tuple[GemmProblem, DeviceFacts], GemmConfig] = {}
_configs_lock = threading.Lock()
# NOTE: problems are keyed by exact M, so a server with varying batch sizes meets many; the
# configs are cheap to recompute (choose_config is cached too), so the table is simply cleared.
_MAX_CONFIGS = 4096


def get_config(problem: GemmProblem, device: torch.device, tune_args: tuple | None = None) -> GemmConfig:
    """The config this backend launches `problem` with on `device` (autotuned when enabled and
    `tune_args` = (a, sa, b, sb, out, c, idx) are given; printed once with FP8GEMM_PRINT_CONFIGS).
    With autotuning on, a call that cannot tune (no tensors given, or under CUDA-graph capture)
    gets a stored config or else the heuristic's, which is not remembered, so that the next
    call with tensors, outside a capture, tunes the problem."""
    facts = device_facts(device)
    key = (problem, facts)
    cfg = _configs.get(key)
    if cfg is not None:
        return cfg
    how = "heuristic"
    cfg = choose_config(problem, facts)
    remember = True
    if settings.autotune and device.type == "cuda":
        tuned = load_tuned(problem, facts)
        if tuned is not None:
            cfg, how = tuned, "autotune cache"
        elif tune_args is None:
            remember, how = False, "heuristic, not tuned: no tensors given"
        elif torch.cuda.is_current_stream_capturing():
            remember, how = False, "heuristic, not tuned under graph capture"
        else:
            cfg, how = _autotune(problem, facts, tune_args), "autotuned"
            try:
                store_tuned(problem, facts, cfg)
            except OSError as e:  # a read-only cache directory costs a re-tune, not the call
                warnings.warn(f"fp8gemm: autotuned config not stored: {e}", stacklevel=2)
    if remember:
        with _configs_lock:
            if len(_configs) >= _MAX_CONFIGS:
                _configs.clear()
            _configs[key] = cfg
    if settings.print_configs:
        print(f"[fp8gemm] triton {problem} -> {cfg} ({how}, {facts.name}, {facts.num_sms} SMs)",
              flush=True)
    return cfg


def _autotune(problem: GemmProblem, facts: DeviceFacts, args: tuple) -> GemmConfig:
    """Time every candidate on the caller's tensors (into a scratch output, so `out` and a `c`
    that aliases it stay as they are) and return the fastest; candidates that fail to compile
    (out of shared memory or registers) are skipped."""
    from triton.testing import do_bench

    a, sa, b, sb, out, c, idx = args
    scratch = torch.empty_like(out)
    best = None
    for cfg in candidate_configs(problem, facts):
        def run(cfg=cfg):
            launch_gemm(problem, cfg, a, sa, b, sb, scratch, c, idx)
        try:
            run()
            t = do_bench(run, warmup=5, rep=25, return_mode="median")
        except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError):
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError(f"no Triton config compiles for {problem}")
    return best[1]


# ---------------------------------------------------------------------------------------------
# the backend contract


def _run(problem, a, sa, b, sb, out, c, idx) -> None:
    cfg = get_config(problem, a.device, (a, sa, b, sb, out, c, idx))
    launch_gemm(problem, cfg, a, sa, b, sb, out, c, idx)


def fp8_gemm_nt(a, sa, b, sb, out, c, problem: GemmProblem) -> None:
    """out[M, N] = (a[M, K] * sa) @ (b[N, K] * sb)^T (+ c[M, N] fp32; c may alias out)."""
    _run(problem, a, sa, b, sb, out, c, None)


def m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, m_indices, problem: GemmProblem) -> None:
    """out[m] = a[m] @ b[m_indices[m]]^T for rows with 0 <= m_indices[m] < G; other rows untouched."""
    _run(problem, a, sa, b, sb, out, None, m_indices)


def m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, offsets, problem: GemmProblem) -> None:
    """Rows offsets[g] <= m < offsets[g+1] use b[g]; rows outside every group are untouched."""
    _run(problem, a, sa, b, sb, out, None, offsets)


def m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, problem: GemmProblem) -> None:
    """out[g, m] = a[g, m] @ b[g]^T for m < min(masked_m[g], Mmax); other rows untouched."""
    _run(problem, a, sa, b, sb, out, None, masked_m)

"""Triton backend: FP8 GEMMs for every kind and recipe, on any GPU whose Triton has FP8 dots
(compute capability >= 8.9), and on the CPU under TRITON_INTERPRET=1.

Implements the backend contract of `fp8gemm.backends` (inputs validated and normalised by the ops
layer) with two kernel families, in order of preference (`FAMILIES`):

- `gluon_fp8_gemm_1d2d` (gluon_fp8_gemm.py: sm_90, A 1x128 x B 128x128, large M, where its wave model says it is faster);
- `k_grouped_fp8_gemm` (k_grouped_fp8_gemm.py): k-grouped GEMMs (the MoE weight gradient);
- `fp8_gemm_persistent` (fp8_gemm.py), the persistent Triton kernel: every other kind.

The family and its config are chosen once per (problem, device) by the pure heuristics
(`launch_config`), or with FP8GEMM_AUTOTUNE=1 the config is the fastest of the family's
candidates, timed once per problem and stored in FP8GEMM_CACHE_DIR (`tuning`). What
FP8GEMM_PRINT_CONFIGS prints is what runs.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch
import triton  # noqa: F401  (an ImportError here tells the backend registry Triton is missing)

from ..._settings import settings
from ...problem import GemmProblem
from ..family import DeviceFacts, KernelFamily, choose_family
from . import fp8_gemm, k_grouped_fp8_gemm, tuning
from .quant import quantize_per_block, quantize_per_token, silu_mul_quantize_per_token

try:
    from . import gluon_fp8_gemm
except ImportError:  # a Triton without Gluon's Hopper API: the persistent kernel runs everything
    gluon_fp8_gemm = None

__all__ = ["NAME", "FAMILIES", "is_available", "supports", "device_facts", "family_for",
           "launch_config", "fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous",
           "m_grouped_fp8_gemm_nt_offsets", "m_grouped_fp8_gemm_nt_masked",
           "k_grouped_fp8_gemm_nt_contiguous", "quantize_per_token", "quantize_per_block",
           "silu_mul_quantize_per_token"]

NAME = "triton"
FAMILIES: tuple[KernelFamily, ...] = tuple(
    mod.FAMILY for mod in (gluon_fp8_gemm, k_grouped_fp8_gemm, fp8_gemm) if mod is not None)

# Fixed small facts for the CPU interpreter (4 "SMs" keep persistent grids short).
INTERPRETER_FACTS = DeviceFacts("triton-interpreter", (9, 0), 4, 227 * 1024, interpreter=True)


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
    return choose_family(FAMILIES, problem)[1]


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts the heuristics read: the driver's for a CUDA device (with the set_num_sms cap),
    INTERPRETER_FACTS otherwise."""
    if device.type != "cuda":
        return INTERPRETER_FACTS
    return DeviceFacts.of(device)  # cached per device and SM cap


@functools.lru_cache(maxsize=4096)
def family_for(problem: GemmProblem, facts: DeviceFacts) -> KernelFamily:
    """The family that runs `problem` on a device with `facts`: the first of FAMILIES that
    supports it and whose heuristic does not leave it to the next one."""
    reasons = []
    for fam in FAMILIES:
        why = fam.supports(problem) or fam.declines(problem, facts)
        if why is None:
            return fam
        reasons.append(f"{fam.name}: {why}")
    raise ValueError(f"the Triton backend cannot run {problem}: {'; '.join(reasons)}")


_configs: dict[tuple[GemmProblem, DeviceFacts], tuple[KernelFamily, object]] = {}
_configs_lock = threading.Lock()
# NOTE: problems are keyed by exact M, so a server with varying batch sizes meets many; the
# configs are cheap to recompute (the heuristics are cached too), so the table is simply cleared.
_MAX_CONFIGS = 4096


def launch_config(problem: GemmProblem, device: torch.device,
                  tune_args: tuple | None = None) -> tuple[KernelFamily, object]:
    """(family, config) this backend runs `problem` with on `device`: the family from
    `family_for`, its config from its heuristic, or autotuned when enabled and `tune_args` =
    (a, sa, b, sb, out, c, index) are given; printed once with FP8GEMM_PRINT_CONFIGS. With
    autotuning on, a call that cannot tune (no tensors given, or under CUDA-graph capture) gets
    a stored config or else the heuristic's, which is not remembered, so that the next call
    with tensors, outside a capture, tunes the problem."""
    facts = device_facts(device)
    key = (problem, facts)
    hit = _configs.get(key)
    if hit is not None:
        return hit
    family = family_for(problem, facts)
    cfg, how = family.select_config(problem, facts), "heuristic"
    remember = True
    if settings.autotune and device.type == "cuda":
        tuned = tuning.load_tuned(family, problem, facts)
        if tuned is not None:
            cfg, how = tuned, "autotune cache"
        elif tune_args is None:
            remember, how = False, "heuristic, not tuned: no tensors given"
        elif torch.cuda.is_current_stream_capturing():
            remember, how = False, "heuristic, not tuned under graph capture"
        else:
            cfg, how = tuning.autotune(family, problem, facts, tune_args), "autotuned"
            try:
                tuning.store_tuned(family, problem, facts, cfg)
            except OSError as e:  # a read-only cache directory costs a re-tune, not the call
                warnings.warn(f"fp8gemm: autotuned config not stored: {e}", stacklevel=2)
    plan = (family, cfg)
    if remember:
        with _configs_lock:
            if len(_configs) >= _MAX_CONFIGS:
                _configs.clear()
            _configs[key] = plan
    if settings.print_configs:
        print(f"[fp8gemm] triton {problem} -> {family.name} {cfg} ({how}, {facts.name}, "
              f"{facts.num_sms} SMs)", flush=True)
    return plan


# ---------------------------------------------------------------------------------------------
# the backend contract


def _run(problem, a, sa, b, sb, out, c, idx) -> None:
    family, cfg = launch_config(problem, a.device, (a, sa, b, sb, out, c, idx))
    family.run(cfg, problem, a, sa, b, sb, out, c, idx)


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


def k_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, c, ks, problem: GemmProblem) -> None:
    """out[g] = c[g] + a[:, off_g : off_g + ks[g]] @ b[:, off_g : off_g + ks[g]]^T for every
    group in one launch, ks read on the device (c None, [G, M, N] fp32, or out itself)."""
    _run(problem, a, sa, b, sb, out, c, ks)

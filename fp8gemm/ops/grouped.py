"""MoE grouped FP8 GEMMs: many A row-sets against one B per group (expert)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from ..backends import select_backend
from ..problem import GemmKind, GemmProblem
from ._common import (check_device, check_fp8, check_index, check_values_now,
                      contiguous_operand, prepare_out, resolve_a_scale, resolve_b_scale,
                      resolve_out_dtype, run_into,
                      shape_str, split_operand)

__all__ = ["m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked", "check_contiguous", "check_offsets", "check_masked"]


def _grouped_b(b, k: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    b_t, b_s = split_operand("b", b)
    check_fp8("b", b_t, 3, "[G, N, K]")
    if k is not None and b_t.shape[2] != k:
        raise ValueError(f"b must be [G, N, K] with K = {k} as in a, got {shape_str(b_t.shape)}")
    check_device("b", b_t, device)
    return b_t, b_s


def _prepare_2d(a, b, out, out_dtype):
    """Shared checks of the contiguous and offsets layouts: A [sum M, K], B [G, N, K]."""
    a_t, a_s = split_operand("a", a)
    check_fp8("a", a_t, 2, "[sum M, K]")
    m, k = a_t.shape
    device = a_t.device
    b_t, b_s = _grouped_b(b, k, device)
    g, n = b_t.shape[0], b_t.shape[1]
    out_dtype = resolve_out_dtype(out, out_dtype)
    a_recipe, sa = resolve_a_scale("a", a_s, (), m, k, device)
    b_recipe, sb = resolve_b_scale("b", b_s, (g,), n, k, device)
    return a_t, sa, a_recipe, b_t, sb, b_recipe, (m, n, k, g), device, out_dtype


def _traced(op, a, b, out, args, out_dtype, backend) -> torch.Tensor:
    """A grouped op while torch.compile traces: its custom op (checked on the fake tensors by
    the fake implementation), written into `out` when one is given. The custom op returns
    zeros where no group writes, so rows `out` would keep are zero in the result: copied into
    `out` only where a group writes."""
    a_t, a_s = split_operand("a", a)
    b_t, b_s = split_operand("b", b)
    y = op(a_t, a_s, b_t, b_s, *args, resolve_out_dtype(out, out_dtype), backend)
    if out is None:
        return y
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    return out.copy_(torch.where(_written_rows(op, a_t, args).unsqueeze(-1), y, out))


def _written_rows(op, a_t: torch.Tensor, args) -> torch.Tensor:
    """Bool mask of the rows of out a grouped op writes (shape out.shape[:-1])."""
    if op is torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_contiguous:
        return args[0] >= 0
    if op is torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_masked:
        return torch.arange(a_t.shape[1], device=a_t.device)[None, :] < args[0][:, None]
    return torch.ones(a_t.shape[0], dtype=torch.bool, device=a_t.device)  # offsets: every row


def check_contiguous(a, b, out, m_indices, out_dtype):
    """The checks of m_grouped_fp8_gemm_nt_contiguous (values where check_values_now allows)."""
    a_t, sa, ra, b_t, sb, rb, (m, n, k, g), device, out_dtype = _prepare_2d(a, b, out, out_dtype)
    check_index("m_indices", m_indices, (m,), device)
    if m and check_values_now(m_indices):
        lo, hi = int(m_indices.min()), int(m_indices.max())
        if lo < -1 or hi >= g:
            raise ValueError(f"m_indices must lie in [-1, {g}) for G = {g} groups, "
                             f"got values in [{lo}, {hi}]")
    return a_t, sa, ra, b_t, sb, rb, (m, n, k, g), device, out_dtype


def check_offsets(a, b, out, offsets, out_dtype):
    """The checks of m_grouped_fp8_gemm_nt_offsets (values where check_values_now allows)."""
    a_t, sa, ra, b_t, sb, rb, (m, n, k, g), device, out_dtype = _prepare_2d(a, b, out, out_dtype)
    check_index("offsets", offsets, (g + 1,), device)
    if check_values_now(offsets):
        o = offsets.tolist()
        if o[0] != 0 or o[-1] != m or any(x > y for x, y in zip(o, o[1:])):
            shown = o if len(o) <= 9 else o[:4] + ["..."] + o[-4:]
            raise ValueError(f"offsets must be non-decreasing from 0 to sum M = {m}, got {shown}")
    return a_t, sa, ra, b_t, sb, rb, (m, n, k, g), device, out_dtype


def m_grouped_fp8_gemm_nt_contiguous(a, b, out: torch.Tensor | None, m_indices: torch.Tensor, *,
                                     out_dtype: torch.dtype | None = None,
                                     backend: str = "auto") -> torch.Tensor:
    """Grouped GEMM over a contiguous layout: out[i] = A[i] . B[m_indices[i]]^T.

    Args:
        a: (A, sa). A [sum M, K] fp8, K-major, rows of each group together (padded to
            `get_m_alignment_for_contiguous_layout()` for the fastest kernels). sa as for
            `fp8_gemm_nt` with M = sum M.
        b: (B, sb). B [G, N, K] fp8, K-major. sb float32 with a leading [G]: [G] per-tensor,
            [G, N] per-column, [G, ceil(N/128), ceil(K/128)] 128x128 blocks,
            [G, N, ceil(K/128)] 1x128 groups.
        out: [sum M, N] bfloat16/float32, or None to allocate zeros.
        m_indices: int32 [sum M] on a's device: the group of each row, -1 for padding rows.
            Padding rows of `out` are left untouched.
    """
    if is_compiling():
        return _traced(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_contiguous, a, b, out,
                       (m_indices,), out_dtype, backend)
    a_t, sa, ra, b_t, sb, rb, (m, n, k, g), device, out_dtype = check_contiguous(
        a, b, out, m_indices, out_dtype)
    out = prepare_out(out, (m, n), out_dtype, device, zero=True)
    if m == 0 or n == 0 or g == 0:
        return out
    if k == 0:
        return _empty_k(out, m_indices >= 0)
    problem = GemmProblem(GemmKind.CONTIGUOUS, m, n, k, g, a_t.dtype, b_t.dtype, ra, rb, out_dtype)
    impl = select_backend(problem, device, backend)
    a_t, b_t = contiguous_operand(a_t), contiguous_operand(b_t)
    return run_into(out, lambda dst: impl.m_grouped_fp8_gemm_nt_contiguous(
        a_t, sa, b_t, sb, dst, m_indices.contiguous(), problem))


def m_grouped_fp8_gemm_nt_offsets(a, b, out: torch.Tensor | None, offsets: torch.Tensor, *,
                                  out_dtype: torch.dtype | None = None,
                                  backend: str = "auto") -> torch.Tensor:
    """Grouped GEMM where group g owns rows offsets[g] .. offsets[g+1]-1 of A; no alignment needed.

    Args:
        a, b, out: as for `m_grouped_fp8_gemm_nt_contiguous`.
        offsets: int32 [G + 1] on a's device, non-decreasing, offsets[0] = 0, offsets[G] = sum M.
    """
    if is_compiling():
        return _traced(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_offsets, a, b, out, (offsets,),
                       out_dtype, backend)
    a_t, sa, ra, b_t, sb, rb, (m, n, k, g), device, out_dtype = check_offsets(
        a, b, out, offsets, out_dtype)
    out = prepare_out(out, (m, n), out_dtype, device, zero=True)
    if m == 0 or n == 0 or g == 0:
        return out
    if k == 0:
        return out.zero_()
    problem = GemmProblem(GemmKind.OFFSETS, m, n, k, g, a_t.dtype, b_t.dtype, ra, rb, out_dtype)
    impl = select_backend(problem, device, backend)
    a_t, b_t = contiguous_operand(a_t), contiguous_operand(b_t)
    return run_into(out, lambda dst: impl.m_grouped_fp8_gemm_nt_offsets(
        a_t, sa, b_t, sb, dst, offsets.contiguous(), problem))


def m_grouped_fp8_gemm_nt_masked(a, b, out: torch.Tensor | None, masked_m: torch.Tensor,
                                 expected_m: int | None = None, *,
                                 out_dtype: torch.dtype | None = None,
                                 backend: str = "auto") -> torch.Tensor:
    """Batched grouped GEMM for decode: out[g, :masked_m[g]] = A[g, :masked_m[g]] . B[g]^T.

    Args:
        a: (A, sa). A [G, Mmax, K] fp8, K-major. sa float32: [] or [1] per-tensor,
            [G, Mmax] per-row, [G, Mmax, ceil(K/128)] 1x128 groups.
        b: (B, sb) as for `m_grouped_fp8_gemm_nt_contiguous`.
        out: [G, Mmax, N] bfloat16/float32, or None to allocate zeros. Rows at or past
            masked_m[g] are left untouched.
        masked_m: int32 [G] on a's device, each in [0, Mmax]; read on the device (no sync).
        expected_m: host hint of the typical masked_m, used to pick a config (default Mmax).
    """
    if is_compiling():
        return _traced(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_masked, a, b, out,
                       (masked_m, expected_m), out_dtype, backend)
    a_t, sa, ra, b_t, sb, rb, (g, mmax, n, k), device, out_dtype, expected_m = check_masked(
        a, b, out, masked_m, expected_m, out_dtype)
    out = prepare_out(out, (g, mmax, n), out_dtype, device, zero=True)
    if g == 0 or mmax == 0 or n == 0:
        return out
    if k == 0:
        return _empty_k(out, torch.arange(mmax, device=device)[None, :] < masked_m[:, None])
    problem = GemmProblem(GemmKind.MASKED, mmax, n, k, g, a_t.dtype, b_t.dtype, ra, rb, out_dtype,
                          expected_m=min(expected_m, mmax))
    impl = select_backend(problem, device, backend)
    a_t, b_t = contiguous_operand(a_t), contiguous_operand(b_t)
    return run_into(out, lambda dst: impl.m_grouped_fp8_gemm_nt_masked(
        a_t, sa, b_t, sb, dst, masked_m.contiguous(), problem))


def check_masked(a, b, out, masked_m, expected_m, out_dtype):
    """The checks of m_grouped_fp8_gemm_nt_masked (values where check_values_now allows);
    expected_m defaults to Mmax."""
    a_t, a_s = split_operand("a", a)
    check_fp8("a", a_t, 3, "[G, Mmax, K]")
    g, mmax, k = a_t.shape
    device = a_t.device
    b_t, b_s = _grouped_b(b, k, device)
    if b_t.shape[0] != g:
        raise ValueError(f"b must be [G, N, K] with G = {g} as in a, got {shape_str(b_t.shape)}")
    n = b_t.shape[1]
    out_dtype = resolve_out_dtype(out, out_dtype)
    ra, sa = resolve_a_scale("a", a_s, (g,), mmax, k, device)
    rb, sb = resolve_b_scale("b", b_s, (g,), n, k, device)
    check_index("masked_m", masked_m, (g,), device)
    if g and check_values_now(masked_m):
        lo, hi = int(masked_m.min()), int(masked_m.max())
        if lo < 0 or hi > mmax:
            raise ValueError(f"masked_m must lie in [0, Mmax = {mmax}], got values in [{lo}, {hi}]")
    if expected_m is None:
        expected_m = mmax
    if not isinstance(expected_m, int) or isinstance(expected_m, bool):
        raise TypeError(f"expected_m must be an int, got {type(expected_m).__name__}")
    if expected_m < 0:
        raise ValueError(f"expected_m must be a non-negative int, got {expected_m!r}")
    return a_t, sa, ra, b_t, sb, rb, (g, mmax, n, k), device, out_dtype, expected_m


def _empty_k(out: torch.Tensor, rows_mask: torch.Tensor) -> torch.Tensor:
    """K = 0: the product is zero on the rows that belong to a group; others stay untouched."""
    out[rows_mask] = 0
    return out

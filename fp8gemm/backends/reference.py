"""The reference backend: PyTorch, CPU or GPU. The executable specification of every op.

D = (A * sa) @ (B * sb)^T (+ C), computed in float32 on dequantised inputs. Kernels promote
partial sums every 128 of K; in exact arithmetic that is the same function, so this is the spec.
"""

from __future__ import annotations

import torch

from ..problem import SCALE_BLOCK, GemmProblem, Recipe, ceil_div

NAME = "reference"


def is_available(device: torch.device) -> bool:
    return True


def supports(problem: GemmProblem) -> str | None:
    return None


def expand_scale(scale: torch.Tensor, recipe: Recipe, rows: int, k: int) -> torch.Tensor:
    """A normalised scale (shapes of `Recipe`, no leading group dim) as a tensor that broadcasts
    against the [rows, k] operand."""
    if recipe is Recipe.TENSOR:
        return scale.reshape(1, 1)
    if recipe is Recipe.ROW:
        return scale.reshape(rows, 1)
    if recipe is Recipe.GROUP:
        return scale.repeat_interleave(SCALE_BLOCK, dim=-1)[:, :k]
    if recipe is Recipe.BLOCK:
        blocks = scale.repeat_interleave(SCALE_BLOCK, dim=-2)
        return blocks.repeat_interleave(SCALE_BLOCK, dim=-1)[:rows, :k]
    raise ValueError(f"unknown recipe {recipe}")


def dequantize(t: torch.Tensor, scale: torch.Tensor, recipe: Recipe,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Real values of a 2-D fp8 operand: t * scale, in `dtype`."""
    rows, k = t.shape
    return t.to(dtype) * expand_scale(scale, recipe, rows, k).to(dtype)


def _matmul_into(out, a, sa, b, sb, problem, c=None):
    acc = dequantize(a, sa, problem.a_recipe) @ dequantize(b, sb, problem.b_recipe).T
    if c is not None:
        acc = acc + c
    out.copy_(acc)


def fp8_gemm_nt(a, sa, b, sb, out, c, problem: GemmProblem) -> None:
    _matmul_into(out, a, sa, b, sb, problem, c)


def _rows_of_scale(sa, recipe, rows):
    return sa if recipe is Recipe.TENSOR else sa[rows]


def _group_matmul_into(out, a, sa, b, sb, g: int, problem: GemmProblem) -> None:
    """Rows of A (with their scales) against group g's B; B's scale taken in the dense shape."""
    sbg = sb[g : g + 1] if problem.b_recipe is Recipe.TENSOR else sb[g]
    _matmul_into(out, a, sa, b[g], sbg, problem)


def m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, m_indices, problem: GemmProblem) -> None:
    for g in range(problem.groups):
        rows = (m_indices == g).nonzero().flatten()
        if rows.numel() == 0:
            continue
        tmp = out.new_empty(rows.numel(), problem.n)
        _group_matmul_into(tmp, a[rows], _rows_of_scale(sa, problem.a_recipe, rows), b, sb, g,
                           problem)
        out[rows] = tmp


def m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, offsets, problem: GemmProblem) -> None:
    bounds = offsets.tolist()
    for g in range(problem.groups):
        start, end = max(0, bounds[g]), min(problem.m, bounds[g + 1])
        if end <= start:
            continue
        rows = slice(start, end)
        _group_matmul_into(out[rows], a[rows], _rows_of_scale(sa, problem.a_recipe, rows), b, sb,
                           g, problem)


def m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, problem: GemmProblem) -> None:
    counts = masked_m.tolist()
    for g in range(problem.groups):
        m = min(max(counts[g], 0), problem.m)
        if m == 0:
            continue
        sag = sa if problem.a_recipe is Recipe.TENSOR else sa[g, :m]
        _group_matmul_into(out[g, :m], a[g, :m], sag, b, sb, g, problem)


def k_grouped_ranges(ks: list[int], sum_k: int, num_kb: int) -> list[tuple[int, int, int, int]]:
    """(first column, K, first scale column, scale columns) of each group for K sizes `ks`,
    clamped as the kernels clamp them: negative sizes count as 0, a group takes at most the
    columns (and scale columns) that remain, so no group reads outside a, b or their scales."""
    ranges, off, kb_off = [], 0, 0
    for k in ks:
        k = max(0, min(k, sum_k))
        lo, kb_lo = min(off, sum_k), min(kb_off, num_kb)
        ranges.append((lo, min(off + k, sum_k) - lo, kb_lo,
                       min(kb_off + ceil_div(k, SCALE_BLOCK), num_kb) - kb_lo))
        off, kb_off = off + k, kb_off + ceil_div(k, SCALE_BLOCK)
    return ranges


def k_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, c, ks, problem: GemmProblem) -> None:
    """out[g] = c[g] + A_g . B_g^T, A_g the ks[g] columns of a after those of the groups before
    (ks read on the host: this backend is the specification, not a graph-safe kernel)."""
    for g, (lo, k, kb_lo, kb) in enumerate(k_grouped_ranges(ks.tolist(), problem.k, sa.shape[1])):
        cols, scols = slice(lo, lo + k), slice(kb_lo, kb_lo + kb)
        acc = out.new_zeros(problem.m, problem.n)
        if k:
            # NOTE: a group's blocks start at its first column; the scale columns of a group
            # clamped short (values that do not add up) count as zero.
            sag = torch.zeros(problem.m, ceil_div(k, SCALE_BLOCK), device=sa.device)
            sbg = torch.zeros(problem.n, ceil_div(k, SCALE_BLOCK), device=sb.device)
            sag[:, :kb], sbg[:, :kb] = sa[:, scols], sb[:, scols]
            acc = (dequantize(a[:, cols], sag, Recipe.GROUP)
                   @ dequantize(b[:, cols], sbg, Recipe.GROUP).T)
        out[g].copy_(acc if c is None else acc + c[g])

"""The reference backend: PyTorch, CPU or GPU. The executable specification of every op.

D = (A * sa) @ (B * sb)^T (+ C), computed in float32 on dequantised inputs. Kernels promote
partial sums every 128 of K; in exact arithmetic that is the same function, so this is the spec.
"""

from __future__ import annotations

import torch

from ..problem import SCALE_BLOCK, GemmProblem, Recipe

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

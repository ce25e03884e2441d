"""MoE grouped FP8 GEMMs: many A row-sets against one B per group (expert)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling, is_dynamo_compiling

from .._settings import hot_env
from ..backends import select_backend
from ..problem import GemmKind, GemmProblem
from ._common import (check_device, check_fp8, check_index, check_values_now, contiguous_operand,
                      metadata_decides, metadata_guard, prepare_out, remember, resolve_a_scale,
                      resolve_b_scale, resolve_out_dtype, run_into, scale_view, shape_str,
                      split_operand)

__all__ = ["m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked", "check_contiguous", "check_offsets", "check_masked"]


# NOTE: the per-metadata fast path (_common's NOTE), as fp8_gemm_nt has it: key = the kind,
# expected_m (masked: it picks the config), A's and B's element counts and the other arguments;
# the guard covers a, sa, b, sb, the index tensor (m_indices, offsets, masked_m) and out where
# given. A hit skips validation, the backend choice and the backend's lookups; `out=None` still
# allocates zeros (rows of no group stay 0).
_plans: dict[tuple, tuple] = {}  # key -> ((guard, run, out shape, out dtype), ...)
_BACKEND_FN = {GemmKind.CONTIGUOUS: "m_grouped_fp8_gemm_nt_contiguous",
               GemmKind.OFFSETS: "m_grouped_fp8_gemm_nt_offsets",
               GemmKind.MASKED: "m_grouped_fp8_gemm_nt_masked"}


def _lookup(kind: GemmKind, expected_m, a, b, out, index, out_dtype, backend):
    """(key, tensors, plan) of a call: plan is the remembered outcome of the full path for this
    metadata signature, or None; key is None when the call cannot have one (not pairs of
    tensors, unhashable arguments: the full path raises the right error)."""
    try:
        (a_t, a_s), (b_t, b_s) = a, b
        key = (kind, expected_m, a_t.numel(), b_t.numel(), out is None, out_dtype, backend,
               hot_env())
        tensors = (a_t, a_s, b_t, b_s, index) if out is None else (a_t, a_s, b_t, b_s, index, out)
        for plan in _plans.get(key, ()):
            if plan[0](*tensors):
                return key, tensors, plan
    except (TypeError, ValueError, AttributeError):
        return None, None, None
    return key, tensors, None


def _run_plan(plan: tuple, a, b, out, index) -> torch.Tensor:
    _, run, out_shape, out_dtype = plan
    (a_t, a_s), (b_t, b_s) = a, b
    if out is None:
        out = torch.zeros(out_shape, dtype=out_dtype, device=a_t.device)
    run(a_t, a_s, b_t, b_s, out, index)
    return out


def _warm_run(impl, problem: GemmProblem, a_s, sa, b_s, sb):
    """run(a_t, a_s, b_t, b_s, out, index) for warm calls of one metadata signature: the
    backend's own launcher where it has one, else its op function with the scales viewed as the
    full path viewed them."""
    launcher = getattr(impl, "m_grouped_fp8_gemm_nt_launcher", None)
    if launcher is not None and sa is a_s and sb is b_s:
        run = launcher(problem, sa, sb)
        if run is not None:
            return run
    fn = getattr(impl, _BACKEND_FN[problem.kind])
    view_a, view_b = scale_view(a_s, sa), scale_view(b_s, sb)

    def run(a_t, a_s, b_t, b_s, out, index):
        fn(a_t, a_s if view_a is None else view_a(a_s), b_t,
           b_s if view_b is None else view_b(b_s), out, index, problem)
    return run


def _maybe_remember(key, tensors, impl, problem: GemmProblem, a, b, sa, sb, out, index) -> None:
    """Remember the outcome of a full call for warm calls of its metadata signature, when
    metadata decides everything (values unchecked) and every tensor is contiguous (a hit hands
    them to the backend as they are)."""
    a_t, b_t = a[0], b[0]
    if (key is not None and metadata_decides(a_t) and a_t.is_contiguous() and b_t.is_contiguous()
            and out.is_contiguous() and index.is_contiguous()):
        run = _warm_run(impl, problem, a[1], sa, b[1], sb)
        remember(_plans, key, (metadata_guard(tensors), run, tuple(out.shape), out.dtype))


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
    # NOTE: is_dynamo_compiling first, as in fp8_gemm_nt (other tracers meet is_compiling on the
    # full path).
    if is_dynamo_compiling():
        return _traced(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_contiguous, a, b, out,
                       (m_indices,), out_dtype, backend)
    key, tensors, plan = _lookup(GemmKind.CONTIGUOUS, None, a, b, out, m_indices, out_dtype,
                                 backend)
    if plan is not None:
        return _run_plan(plan, a, b, out, m_indices)
    return _contiguous_full(a, b, out, m_indices, out_dtype, backend, key, tensors)


def _contiguous_full(a, b, out, m_indices, out_dtype, backend, key, tensors) -> torch.Tensor:
    """m_grouped_fp8_gemm_nt_contiguous's full path: validation, backend choice, and (when key
    is not None) the plan that warm calls with the metadata of `tensors` reuse.
    NOTE: a function of its own, as fp8_gemm_nt's: the lambda below makes its variables cells,
    which a frame creates on entry, and the fast path should not pay for them."""
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
    _maybe_remember(key, tensors, impl, problem, a, b, sa, sb, out, m_indices)
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
    if is_dynamo_compiling():
        return _traced(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_offsets, a, b, out, (offsets,),
                       out_dtype, backend)
    key, tensors, plan = _lookup(GemmKind.OFFSETS, None, a, b, out, offsets, out_dtype, backend)
    if plan is not None:
        return _run_plan(plan, a, b, out, offsets)
    return _offsets_full(a, b, out, offsets, out_dtype, backend, key, tensors)


def _offsets_full(a, b, out, offsets, out_dtype, backend, key, tensors) -> torch.Tensor:
    """m_grouped_fp8_gemm_nt_offsets's full path (see _contiguous_full)."""
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
    _maybe_remember(key, tensors, impl, problem, a, b, sa, sb, out, offsets)
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
    if is_dynamo_compiling():
        return _traced(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_masked, a, b, out,
                       (masked_m, expected_m), out_dtype, backend)
    # NOTE: only an exact int (or None) in the key: 2.0 and True hash as 2 and 1 do, and the
    # full path refuses them.
    if expected_m is None or expected_m.__class__ is int:
        key, tensors, plan = _lookup(GemmKind.MASKED, expected_m, a, b, out, masked_m, out_dtype,
                                     backend)
        if plan is not None:
            return _run_plan(plan, a, b, out, masked_m)
    else:
        key = tensors = None
    return _masked_full(a, b, out, masked_m, expected_m, out_dtype, backend, key, tensors)


def _masked_full(a, b, out, masked_m, expected_m, out_dtype, backend, key,
                 tensors) -> torch.Tensor:
    """m_grouped_fp8_gemm_nt_masked's full path (see _contiguous_full)."""
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
    _maybe_remember(key, tensors, impl, problem, a, b, sa, sb, out, masked_m)
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

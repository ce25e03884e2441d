"""Dense FP8 GEMM: D = A . B^T (+ C)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling, is_dynamo_compiling

from .._settings import hot_env
from ..backends import select_backend
from ..problem import GemmKind, GemmProblem
from ._common import (check_device, check_fp8, contiguous_operand, metadata_decides,
                      metadata_guard, prepare_out, remember, resolve_a_scale, resolve_b_scale,
                      resolve_out_dtype, run_into, scale_view, shape_str, split_operand)

__all__ = ["fp8_gemm_nt", "check_dense"]

# NOTE: the per-metadata fast path (_common's NOTE): key = A's and B's element counts and the
# other arguments; the guard covers a, sa, b, sb and out and c where given.
_plans: dict[tuple, tuple] = {}  # key -> ((guard, run, out shape, out dtype), ...)


def _warm_run(impl, problem: GemmProblem, a_s, sa, b_s, sb):
    """run(a_t, a_s, b_t, b_s, out, c) for warm calls of one metadata signature: the backend's
    own launcher where it has one (it skips the backend's checks and lookups), else its
    fp8_gemm_nt with the scales viewed as the full path viewed them."""
    launcher = getattr(impl, "fp8_gemm_nt_launcher", None)
    if launcher is not None and sa is a_s and sb is b_s:
        run = launcher(problem, sa, sb)
        if run is not None:
            return run
    view_a, view_b = scale_view(a_s, sa), scale_view(b_s, sb)

    def run(a_t, a_s, b_t, b_s, out, c):
        impl.fp8_gemm_nt(a_t, a_s if view_a is None else view_a(a_s), b_t,
                         b_s if view_b is None else view_b(b_s), out, c, problem)
    return run


def fp8_gemm_nt(a, b, out: torch.Tensor | None = None, *, c: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """D = (A * sa) @ (B * sb)^T (+ C), accumulated in float32.

    Args:
        a: (A, sa). A [M, K] float8_e4m3fn or float8_e5m2, K-major (any strides are accepted;
            non-contiguous A is copied). sa float32: [] or [1] per-tensor, [M] or [M, 1] per-row,
            [M, ceil(K/128)] per 1x128 group (fastest in column-major, M padded to 4, as
            `quantize_per_token` returns it).
        b: (B, sb). B [N, K] fp8, K-major. sb float32: [] or [1] per-tensor, [N] or [N, 1]
            per-column, [ceil(N/128), ceil(K/128)] per 128x128 block, [N, ceil(K/128)] per 1x128
            group.
        out: optional [M, N] bfloat16 or float32 tensor to write into.
        c: optional float32 [M, N] added to the product (may be `out` itself).
        out_dtype: dtype of an allocated output (default bfloat16); must match `out` if given.
        backend: "auto", "cuda", "triton" or "reference" (FP8GEMM_BACKEND overrides "auto").

    Returns:
        out, [M, N].
    """
    # NOTE: plans are remembered only for calls whose values go unchecked (metadata_decides),
    # and a plan's guard matches only tensors on the device its call ran on, under the same raw
    # FP8GEMM_CHECK_VALUES (in the key): a hit needs no check of its own.
    # NOTE: is_dynamo_compiling costs ~0.1 us (is_compiling ~0.3 us, it asks TorchScript too);
    # other tracers (non-strict export) miss the plans (fake tensors fail their guards) and meet
    # is_compiling on the full path.
    if is_dynamo_compiling():
        return _fp8_gemm_nt_traced(a, b, out, c, out_dtype, backend)
    key = tensors = plan = None
    try:
        (a_t, a_s), (b_t, b_s) = a, b
        key = (a_t.numel(), b_t.numel(), out is None, None if c is None else c is out, out_dtype,
               backend, hot_env())
        tensors = (a_t, a_s, b_t, b_s) if out is None else (a_t, a_s, b_t, b_s, out)
        if c is not None and c is not out:
            tensors += (c,)
        for candidate in _plans.get(key, ()):
            if candidate[0](*tensors):
                plan = candidate
                break
    except (TypeError, ValueError, AttributeError):
        key = None  # not pairs of tensors: the full path raises the right error
    if plan is not None:
        _, run, out_shape, dtype = plan
        if out is None:
            out = torch.empty(out_shape, dtype=dtype, device=a_t.device)
        run(a_t, a_s, b_t, b_s, out, c)
        return out
    return _fp8_gemm_nt_full(a, b, out, c, out_dtype, backend, key, tensors)


def _fp8_gemm_nt_traced(a, b, out, c, out_dtype, backend) -> torch.Tensor:
    """fp8_gemm_nt while torch.compile traces: the custom op (checked on the fake tensors by
    its fake implementation), written into `out` when one is given."""
    a_t, a_s = split_operand("a", a)
    b_t, b_s = split_operand("b", b)
    y = torch.ops.fp8gemm.fp8_gemm_nt(a_t, a_s, b_t, b_s, c, resolve_out_dtype(out, out_dtype),
                                      backend)
    if out is None:
        return y
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    return out.copy_(y)


def check_dense(a, b, out, c, out_dtype):
    """The checks of fp8_gemm_nt (metadata; scale values where check_values_now allows) ->
    (a_t, sa, a_recipe, b_t, sb, b_recipe, (m, n, k), out_dtype)."""
    a_t, a_s = split_operand("a", a)
    b_t, b_s = split_operand("b", b)
    check_fp8("a", a_t, 2, "[M, K]")
    check_fp8("b", b_t, 2, "[N, K]")
    (m, k), (n, kb_) = a_t.shape, b_t.shape
    if kb_ != k:
        raise ValueError(f"b must be [N, K] with K = {k} as in a, got {shape_str(b_t.shape)}")
    device = a_t.device
    check_device("b", b_t, device)
    out_dtype = resolve_out_dtype(out, out_dtype)
    a_recipe, sa = resolve_a_scale("a", a_s, (), m, k, device)
    b_recipe, sb = resolve_b_scale("b", b_s, (), n, k, device)
    if c is not None:
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float32:
            raise TypeError(f"c must be a torch.float32 tensor, got "
                            f"{getattr(c, 'dtype', type(c).__name__)}")
        if tuple(c.shape) != (m, n):
            raise ValueError(f"c must have shape [{m}, {n}], got {shape_str(c.shape)}")
        check_device("c", c, device)
    return a_t, sa, a_recipe, b_t, sb, b_recipe, (m, n, k), out_dtype


def _c_as_given(c: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the backends take `c` as it is: `out` itself, or unit column stride with any row
    stride (0 for a bias broadcast over the rows: no [M, N] copy of it is made)."""
    return c is out or c.stride(1) == 1


def _fp8_gemm_nt_full(a, b, out, c, out_dtype, backend, key, tensors) -> torch.Tensor:
    """fp8_gemm_nt's full path: validation, backend choice, and (when key is not None) the plan
    that warm calls with the metadata of `tensors` reuse.
    NOTE: a function of its own: the lambda below makes its variables cells, which a frame
    creates on entry, and the fast path above should not pay for them."""
    if is_compiling():
        return _fp8_gemm_nt_traced(a, b, out, c, out_dtype, backend)
    a_t, sa, a_recipe, b_t, sb, b_recipe, (m, n, k), out_dtype = check_dense(a, b, out, c,
                                                                              out_dtype)
    a_s, b_s = a[1], b[1]
    device = a_t.device
    out = prepare_out(out, (m, n), out_dtype, device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(c) if c is not None else out.zero_()

    problem = GemmProblem(GemmKind.DENSE, m, n, k, 1, a_t.dtype, b_t.dtype, a_recipe, b_recipe,
                          out_dtype, has_c=c is not None)
    impl = select_backend(problem, device, backend)
    if (key is not None and metadata_decides(a_t) and a_t.is_contiguous() and b_t.is_contiguous()
            and out.is_contiguous() and (c is None or _c_as_given(c, out))):
        remember(_plans, key, (metadata_guard(tensors), _warm_run(impl, problem, a_s, sa, b_s, sb),
                               (m, n), out_dtype))
    a_t, b_t = contiguous_operand(a_t), contiguous_operand(b_t)
    if c is not None and not _c_as_given(c, out):
        c = c.contiguous()
    return run_into(out, lambda dst: impl.fp8_gemm_nt(a_t, sa, b_t, sb, dst,
                                                      dst if c is out else c, problem))

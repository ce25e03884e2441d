"""One test per validation rule: bad input raises TypeError/ValueError whose message names the
argument (and, where it matters, what was given and what is needed). 'meta' tensors stand in for
a second device."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import fp8gemm
from fp8gemm._settings import settings
from fp8gemm.ops import _common
from helpers import make_a, make_b

M, N, K, G = 8, 64, 256, 2  # ceil(K/128) = 2, ceil(N/128) = 1
A = make_a(M, K, "1x128")
B = make_b(N, K, "128x128")
BG = make_b(N, K, "128x128", groups=G)
AM = make_a(M, K, "1x128", lead=G)
IDX = torch.tensor([0, 0, 0, -1, 1, 1, -1, -1], dtype=torch.int32)
OFFS = torch.tensor([0, 3, M], dtype=torch.int32)
MASKED = torch.tensor([3, M], dtype=torch.int32)
META = torch.device("meta")
F32, BF16 = torch.float32, torch.bfloat16


def dense(a=A, b=B, out=None, **kw):
    return fp8gemm.fp8_gemm_nt(a, b, out, backend=kw.pop("backend", "reference"), **kw)


def contiguous(a=A, b=BG, out=None, m_indices=IDX, **kw):
    return fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, out, m_indices,
                                                    backend=kw.pop("backend", "reference"), **kw)


def offsets(a=A, b=BG, out=None, offs=OFFS, **kw):
    return fp8gemm.m_grouped_fp8_gemm_nt_offsets(a, b, out, offs, backend="reference", **kw)


def masked(a=AM, b=BG, out=None, masked_m=MASKED, expected_m=4, **kw):
    return fp8gemm.m_grouped_fp8_gemm_nt_masked(a, b, out, masked_m, expected_m,
                                                backend="reference", **kw)


def with_scale(op, s):
    return (op[0], s)


def nan_at(s, idx=0):
    s = s.clone()
    s.view(-1)[idx] = float("nan")
    return s


def meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device=META)


CASES = [
    # -- dtype -----------------------------------------------------------------------------
    ("a-dtype", lambda: dense(a=(A[0].to(BF16), A[1])), TypeError, r"^a must be float8"),
    ("b-dtype", lambda: dense(b=(B[0].float(), B[1])), TypeError, r"^b must be float8"),
    ("a-scale-dtype", lambda: dense(a=(A[0], A[1].double())), TypeError,
     r"^a scales must be torch.float32, got torch.float64"),
    ("b-scale-dtype", lambda: dense(b=(B[0], B[1].half())), TypeError,
     r"^b scales must be torch.float32"),
    ("m_indices-dtype", lambda: contiguous(m_indices=IDX.long()), TypeError,
     r"^m_indices must be torch.int32, got torch.int64"),
    ("m_indices-not-tensor", lambda: contiguous(m_indices=IDX.tolist()), TypeError,
     r"^m_indices must be a torch.int32 tensor"),
    ("offsets-dtype", lambda: offsets(offs=OFFS.long()), TypeError, r"^offsets must be"),
    ("masked_m-dtype", lambda: masked(masked_m=MASKED.long()), TypeError, r"^masked_m must be"),
    ("out-dtype", lambda: dense(out=torch.empty(M, N, dtype=torch.float16)), TypeError,
     r"^out must be torch.bfloat16 or torch.float32, got torch.float16"),
    ("out-dtype-vs-out_dtype", lambda: dense(out=torch.empty(M, N), out_dtype=BF16), TypeError,
     r"^out must have out_dtype"),
    ("out_dtype", lambda: dense(out_dtype=torch.float16), TypeError, r"^out_dtype must be"),
    ("out-not-tensor", lambda: dense(out=[[0.0]]), TypeError, r"^out must be a tensor"),
    ("c-dtype", lambda: dense(c=torch.zeros(M, N, dtype=BF16)), TypeError, r"^c must be"),
    ("a-not-pair", lambda: dense(a=A[0]), TypeError, r"^a must be a \(tensor, scale\) pair"),
    ("b-pair-of-non-tensors", lambda: dense(b=(B[0], 1.0)), TypeError,
     r"^b must be a pair of tensors"),
    # -- rank ------------------------------------------------------------------------------
    ("a-rank", lambda: dense(a=(A[0][None], A[1])), ValueError,
     r"^a must be 2-D \[M, K\], got shape \[1, 8, 256\]"),
    ("b-rank", lambda: dense(b=(B[0][0], B[1])), ValueError, r"^b must be 2-D"),
    ("grouped-b-rank", lambda: contiguous(b=B), ValueError, r"^b must be 3-D \[G, N, K\]"),
    ("masked-a-rank", lambda: masked(a=A), ValueError, r"^a must be 3-D \[G, Mmax, K\]"),
    # -- shape -----------------------------------------------------------------------------
    ("k-mismatch", lambda: dense(b=make_b(N, K + 1, "128x128")), ValueError,
     r"^b must be \[N, K\] with K = 256 as in a, got \[64, 257\]"),
    ("grouped-k-mismatch", lambda: contiguous(b=make_b(N, 128, "128x128", groups=G)),
     ValueError, r"^b must be \[G, N, K\] with K = 256"),
    ("masked-groups-mismatch", lambda: masked(b=make_b(N, K, "128x128", groups=G + 1)),
     ValueError, r"^b must be \[G, N, K\] with G = 2 as in a, got \[3, 64, 256\]"),
    ("m_indices-shape", lambda: contiguous(m_indices=IDX[:5]), ValueError,
     r"^m_indices must have shape \[8\], got \[5\]"),
    ("offsets-shape", lambda: offsets(offs=OFFS[1:]), ValueError,
     r"^offsets must have shape \[3\], got \[2\]"),
    ("masked_m-shape", lambda: masked(masked_m=MASKED[:1]), ValueError,
     r"^masked_m must have shape \[2\]"),
    ("out-shape", lambda: dense(out=torch.empty(N, M, dtype=BF16)), ValueError,
     r"^out must have shape \[8, 64\], got \[64, 8\]"),
    ("grouped-out-shape", lambda: contiguous(out=torch.empty(M + 1, N, dtype=BF16)),
     ValueError, r"^out must have shape \[8, 64\]"),
    ("masked-out-shape", lambda: masked(out=torch.empty(M, N, dtype=BF16)), ValueError,
     r"^out must have shape \[2, 8, 64\]"),
    ("c-shape", lambda: dense(c=torch.zeros(M, N + 1)), ValueError,
     r"^c must have shape \[8, 64\], got \[8, 65\]"),
    # -- scale shape matching no recipe (the message lists the accepted shapes) --------------
    ("a-scale-shape", lambda: dense(a=with_scale(A, torch.ones(M, 3))), ValueError,
     r"^a scales must be \[\] or \[1\] \(per-tensor\), \[8\] \(per-row\) or \[8, 2\] "
     r"\(1x128 groups.*got \[8, 3\]"),
    ("b-scale-shape", lambda: dense(b=with_scale(B, torch.ones(2, 2))), ValueError,
     r"^b scales must be \[\] or \[1\], \[64\] \(per-column\), \[1, 2\] \(128x128 blocks\) "
     r"or \[64, 2\] \(1x128 groups.*got \[2, 2\]"),
    ("grouped-b-scale-shape", lambda: contiguous(b=with_scale(BG, torch.ones(1, 2))), ValueError,
     r"^b scales must be \[2\] or \[\] \(per-tensor\), \[2, 64\] .*\[2, 1, 2\] .*\[2, 64, 2\]"
     r".*got \[1, 2\]"),
    ("masked-a-scale-shape", lambda: masked(a=with_scale(AM, torch.ones(M, 2))), ValueError,
     r"^a scales must be .*\[2, 8\] \(per-row\) or \[2, 8, 2\].*got \[8, 2\]"),
    ("a-scale-[1,1]-not-per-tensor", lambda: dense(a=with_scale(A, torch.ones(1, 1))),
     ValueError, r"^a scales must be"),
    # -- non-finite scales ---------------------------------------------------------------------
    ("a-scale-nan", lambda: dense(a=with_scale(A, nan_at(A[1], 5))), ValueError,
     r"^a scales must be finite"),
    ("b-scale-inf", lambda: dense(b=with_scale(B, B[1] * float("inf"))), ValueError,
     r"^b scales must be finite"),
    ("grouped-b-scale-nan", lambda: contiguous(b=with_scale(BG, nan_at(BG[1], 3))), ValueError,
     r"^b scales must be finite"),
    ("masked-a-scale-nan", lambda: masked(a=with_scale(AM, nan_at(AM[1], 7))), ValueError,
     r"^a scales must be finite"),
    # -- index values --------------------------------------------------------------------------
    ("m_indices-too-large", lambda: contiguous(m_indices=torch.where(IDX == 1, G, IDX)),
     ValueError, r"^m_indices must lie in \[-1, 2\) for G = 2 groups, got values in \[-1, 2\]"),
    ("m_indices-below-minus-1", lambda: contiguous(m_indices=torch.where(IDX == -1, -2, IDX)),
     ValueError, r"^m_indices must lie in \[-1, 2\)"),
    ("offsets-decreasing", lambda: offsets(offs=torch.tensor([0, 6, 5], dtype=torch.int32)),
     ValueError, r"^offsets must be non-decreasing"),
    ("offsets-not-ending-at-sum-m",
     lambda: offsets(offs=torch.tensor([0, 3, M - 1], dtype=torch.int32)), ValueError,
     r"^offsets must be non-decreasing from 0 to sum M = 8, got \[0, 3, 7\]"),
    ("offsets-not-starting-at-0",
     lambda: offsets(offs=torch.tensor([1, 3, M], dtype=torch.int32)), ValueError,
     r"^offsets must .* from 0"),
    ("masked_m-above-mmax", lambda: masked(masked_m=torch.tensor([3, M + 1], dtype=torch.int32)),
     ValueError, r"^masked_m must lie in \[0, Mmax = 8\], got values in \[3, 9\]"),
    ("masked_m-negative", lambda: masked(masked_m=torch.tensor([-1, 2], dtype=torch.int32)),
     ValueError, r"^masked_m must lie in \[0, Mmax = 8\]"),
    ("expected_m-negative", lambda: masked(expected_m=-1), ValueError,
     r"^expected_m must be a non-negative int, got -1"),
    ("expected_m-not-int", lambda: masked(expected_m=2.5), TypeError, r"^expected_m must be an int, got float"),
    # -- device (meta stands in for another device) -------------------------------------------
    ("b-device", lambda: dense(b=(meta(B[0]), B[1])), ValueError,
     r"^b must be on cpu like a, got meta"),
    ("a-scale-device", lambda: dense(a=(A[0], meta(A[1]))), ValueError,
     r"^a scales must be on cpu like a, got meta"),
    ("b-scale-device", lambda: dense(b=(B[0], meta(B[1]))), ValueError, r"^b scales must be on"),
    ("out-device", lambda: dense(out=meta(torch.empty(M, N, dtype=BF16))), ValueError,
     r"^out must be on cpu"),
    ("c-device", lambda: dense(c=meta(torch.empty(M, N))), ValueError, r"^c must be on cpu"),
    ("m_indices-device", lambda: contiguous(m_indices=meta(IDX)), ValueError,
     r"^m_indices must be on cpu"),
    ("offsets-device", lambda: offsets(offs=meta(OFFS)), ValueError, r"^offsets must be on cpu"),
    ("masked_m-device", lambda: masked(masked_m=meta(MASKED)), ValueError,
     r"^masked_m must be on cpu"),
    ("grouped-b-device", lambda: masked(b=(meta(BG[0]), BG[1])), ValueError,
     r"^b must be on cpu"),
    # -- backend ---------------------------------------------------------------------------------
    ("backend-name", lambda: dense(backend="cutlass"), ValueError,
     r"^backend must be one of \('auto', 'cuda', 'triton', 'reference'\), got 'cutlass'"),
    ("backend-cannot-run", lambda: dense(backend="cuda"), ValueError,
     r"^backend='cuda' cannot run dense"),
    ("grouped-backend-cannot-run", lambda: contiguous(backend="cuda"), ValueError,
     r"^backend='cuda' cannot run contiguous"),
]


@pytest.mark.parametrize("fn,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_rejects(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_valid_inputs_pass():
    """The inputs the cases above break are themselves valid (so each case tests one rule): each
    call returns a finite result of the op's shape."""
    for out, shape in ((dense(), (M, N)), (dense(c=torch.zeros(M, N)), (M, N)),
                       (contiguous(), (M, N)), (offsets(), (M, N)), (masked(), (G, M, N))):
        assert out.shape == shape and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# Quantisation, MoE helpers


QUANT = [fp8gemm.quantize_per_token, fp8gemm.quantize_per_block, fp8gemm.quantize_per_tensor,
         fp8gemm.quantize_per_channel]


@pytest.mark.parametrize("fn", QUANT, ids=lambda f: f.__name__)
def test_quantize_rejects(fn):
    x = torch.randn(8, 256)
    with pytest.raises(ValueError, match=r"^fmt must be 'e4m3' or 'e5m2', got 'e4m4'"):
        fn(x, "e4m4")
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16, got torch.int"):
        fn(torch.ones(8, 256, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^x must be"):
        fn(x.to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match=r"^x must be a tensor"):
        fn(x.tolist())
    if fn is not fp8gemm.quantize_per_tensor:
        with pytest.raises(ValueError, match=r"^x must have at least 2 dims"):
            fn(torch.randn(256))


_X = torch.randn(6, 128, dtype=BF16)
_IDS = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]], dtype=torch.int32)
_LAY_C = fp8gemm.moe_dispatch_contiguous(_X, _IDS, 3, alignment=4)
_LAY_M = fp8gemm.moe_dispatch_masked(_X, _IDS, 3)

MOE_CASES = [
    ("x-rank", lambda: fp8gemm.moe_dispatch_contiguous(_X[0], _IDS, 3), ValueError,
     r"^x must be a \[T, K\] tensor"),
    ("topk_ids-dtype", lambda: fp8gemm.moe_dispatch_masked(_X, _IDS.float(), 3), TypeError,
     r"^topk_ids must be torch.int32 or torch.int64, got torch.float32"),
    ("topk_ids-rank", lambda: fp8gemm.moe_dispatch_masked(_X, _IDS[:, 0], 3), ValueError,
     r"^topk_ids must be a \[T, topk\] tensor"),
    ("topk_ids-T", lambda: fp8gemm.moe_dispatch_contiguous(_X, _IDS[:5], 3), ValueError,
     r"^topk_ids must have T = 6 rows like x, got 5"),
    ("topk_ids-device", lambda: fp8gemm.moe_dispatch_masked(_X, meta(_IDS), 3), ValueError,
     r"^topk_ids must be on cpu like x, got meta"),
    ("num_groups", lambda: fp8gemm.moe_dispatch_contiguous(_X, _IDS, 0), ValueError,
     r"^num_groups must be a positive int, got 0"),
    ("alignment", lambda: fp8gemm.moe_dispatch_contiguous(_X, _IDS, 3, alignment=0), ValueError,
     r"^alignment must be a positive int"),
    ("max_m", lambda: fp8gemm.moe_dispatch_masked(_X, _IDS, 3, max_m=-1), ValueError,
     r"^max_m must be a non-negative int, got -1"),
    ("topk_weights-shape", lambda: fp8gemm.moe_combine_contiguous(
        torch.zeros(_LAY_C.x.shape[0], 16), _LAY_C, torch.ones(6, 3)), ValueError,
     r"^topk_weights must have shape \[6, 2\]"),
    ("combine-contiguous-y", lambda: fp8gemm.moe_combine_contiguous(
        torch.zeros(5, 16), _LAY_C, torch.ones(6, 2)), ValueError,
     r"^y must be \[R, N\] with R = 12, got \[5, 16\]"),
    ("combine-masked-y", lambda: fp8gemm.moe_combine_masked(
        torch.zeros(3, 5, 16), _LAY_M, torch.ones(6, 2)), ValueError,
     r"^y must be \[G, Mmax, N\] = \[3, 6, N\], got \[3, 5, 16\]"),
]


@pytest.mark.parametrize("fn,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in MOE_CASES])
def test_moe_rejects(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


# ---------------------------------------------------------------------------------------------
# Value checks: always on the CPU; on a GPU only with FP8GEMM_CHECK_VALUES=1


@pytest.mark.parametrize("flag", ("0", "1"))
def test_value_checks_always_on_cpu(flag, clean_env):
    clean_env.setenv("FP8GEMM_CHECK_VALUES", flag)
    assert settings.check_values is (flag == "1")  # read when asked, not at import
    assert _common.check_values_now(A[1])
    assert not _common.check_values_now(meta(A[1]))  # meta tensors hold no values
    with pytest.raises(ValueError, match=r"^a scales must be finite"):
        dense(a=with_scale(A, nan_at(A[1])))
    with pytest.raises(ValueError, match=r"^m_indices must lie"):
        contiguous(m_indices=torch.where(IDX == 1, 5, IDX))


@pytest.mark.gpu
def test_value_checks_on_gpu_follow_the_flag(clean_env, gpu_device):
    a = (A[0].to(gpu_device), nan_at(A[1]).to(gpu_device))
    b = (B[0].to(gpu_device), B[1].to(gpu_device))
    clean_env.setenv("FP8GEMM_CHECK_VALUES", "0")
    assert not _common.check_values_now(a[1])
    fp8gemm.fp8_gemm_nt(a, b, backend="reference")  # not checked: no synchronisation
    clean_env.setenv("FP8GEMM_CHECK_VALUES", "1")
    assert _common.check_values_now(a[1])
    with pytest.raises(ValueError, match=r"^a scales must be finite"):
        fp8gemm.fp8_gemm_nt(a, b, backend="reference")


# ---------------------------------------------------------------------------------------------
# A rejected call writes nothing; no assert guards user input


@pytest.mark.parametrize("bad", ("m_indices", "offsets", "masked_m", "scale"))
def test_rejected_call_leaves_out_untouched(bad):
    nan = float("nan")
    if bad == "m_indices":
        out = torch.full((M, N), nan)
        call = lambda: contiguous(out=out, m_indices=torch.where(IDX == 1, 9, IDX))  # noqa: E731
    elif bad == "offsets":
        out = torch.full((M, N), nan)
        call = lambda: offsets(out=out, offs=torch.tensor([0, 9, M], dtype=torch.int32))  # noqa
    elif bad == "masked_m":
        out = torch.full((G, M, N), nan)
        call = lambda: masked(out=out, masked_m=torch.tensor([2, 99], dtype=torch.int32))  # noqa
    else:
        out = torch.full((M, N), nan)
        call = lambda: dense(out=out, b=with_scale(B, nan_at(B[1])))  # noqa: E731
    with pytest.raises(ValueError):
        call()
    assert torch.isnan(out).all()


_CHECKED_SOURCES = ["ops", "quant.py", "layout.py", "moe.py", "backends/__init__.py",
                    "backends/reference.py", "problem.py", "_settings.py"]


def test_no_assert_statements():
    """`assert` vanishes under python -O: the validating modules must not use it."""
    root = pathlib.Path(fp8gemm.__file__).parent
    files = [p for s in _CHECKED_SOURCES
             for p in ((root / s).rglob("*.py") if (root / s).is_dir() else [root / s])]
    assert files
    found = [f"{p.relative_to(root)}:{node.lineno}" for p in files
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Assert)]
    assert not found, found


@pytest.mark.parametrize("op", (contiguous, offsets, masked), ids=lambda f: f.__name__)
def test_grouped_out_dtype(op):
    shape = (G, M, N) if op is masked else (M, N)
    with pytest.raises(TypeError, match=r"^out must be torch.bfloat16 or torch.float32, got "
                                        r"torch.float16"):
        op(out=torch.empty(shape, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"^out must have out_dtype"):
        op(out=torch.empty(shape, dtype=F32), out_dtype=BF16)
    with pytest.raises(TypeError, match=r"^out_dtype must be"):
        op(out_dtype=torch.int8)

"""The reference backend against a float64 computation on the dequantised inputs, for every op,
scale recipe, fp8 format pair and output dtype; awkward and DeepSeek-V3 shapes (N shrunk where
CPU time demands); long K; poisoned outputs; every accepted scale shape and stride."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import fp8gemm
from helpers import (E4M3, FP8_COMBOS, OUT_DTYPES, TOL, assert_close_diff, calc_diff, make_a,
                     make_b, padded_view, poisoned, rand_scales, ref_gemm, ref_grouped_rows,
                     ref_masked)

OPS = ("dense", "contiguous", "offsets", "masked")
A_RECIPES = ("tensor", "row", "1x128")  # values of fp8gemm.problem.Recipe
B_RECIPES = ("tensor", "row", "128x128", "1x128")
GROUPS = 3


# ---------------------------------------------------------------------------------------------
# Cases: inputs, the call, the float64 reference and which output rows the op must write


def contiguous_m_indices(m: int, groups: int) -> torch.Tensor:
    """A contiguous layout of m rows: each group's run followed by a run of -1 padding rows;
    some runs may be empty."""
    labels = torch.sort(torch.randint(0, 2 * groups, (m,))).values
    return torch.where(labels % 2 == 0, labels // 2, -1).to(torch.int32)


def random_offsets(m: int, groups: int) -> torch.Tensor:
    """int32 [G + 1] from 0 to m, non-decreasing; middle groups may be empty."""
    cuts = torch.sort(torch.randint(0, m + 1, (groups - 1,))).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([m])]).to(torch.int32)


def random_masked_m(mmax: int, groups: int) -> torch.Tensor:
    """int32 [G]: one full group, one empty group, the rest random in [0, Mmax]."""
    mm = torch.randint(0, mmax + 1, (groups,))
    mm[0], mm[1] = mmax, 0
    return mm.to(torch.int32)


@dataclass
class Case:
    a: tuple  # (tensor, scale)
    b: tuple
    fn: Callable  # fn(a, b, out, **kw) -> out
    ref: torch.Tensor  # float64, NaN on rows the op must not write
    written: torch.Tensor  # bool over output rows ([M] or [G, Mmax])
    out_shape: tuple

    def call(self, out, a=None, b=None, **kw):
        return self.fn(a or self.a, b or self.b, out, backend="reference", **kw)


def build_case(op: str, m: int, n: int, k: int, ra: str, rb: str, dta=E4M3, dtb=E4M3,
               groups: int = GROUPS) -> Case:
    if op == "dense":
        a, b = make_a(m, k, ra, dta), make_b(n, k, rb, dtb)
        return Case(a, b, fp8gemm.fp8_gemm_nt, ref_gemm(*a, ra, *b, rb),
                    torch.ones(m, dtype=torch.bool), (m, n))
    if op in ("contiguous", "offsets"):
        a, b = make_a(m, k, ra, dta), make_b(n, k, rb, dtb, groups=groups)
        if op == "contiguous":
            idx = contiguous_m_indices(m, groups)
            group_of_row = idx.long()

            def fn(a, b, out, **kw):
                return fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, out, idx, **kw)
        else:
            offsets = random_offsets(m, groups)
            group_of_row = torch.repeat_interleave(torch.arange(groups), offsets.diff().long())

            def fn(a, b, out, **kw):
                return fp8gemm.m_grouped_fp8_gemm_nt_offsets(a, b, out, offsets, **kw)
        return Case(a, b, fn, ref_grouped_rows(*a, ra, *b, rb, group_of_row), group_of_row >= 0,
                    (m, n))
    if op == "masked":
        a = make_a(m, k, ra, dta, lead=groups)
        b = make_b(n, k, rb, dtb, groups=groups)
        masked_m = random_masked_m(m, groups)
        written = torch.arange(m)[None, :] < masked_m[:, None].long()

        def fn(a, b, out, **kw):
            return fp8gemm.m_grouped_fp8_gemm_nt_masked(a, b, out, masked_m,
                                                        expected_m=max(1, m // 2), **kw)
        return Case(a, b, fn, ref_masked(*a, ra, *b, rb, masked_m), written, (groups, m, n))
    raise ValueError(op)


def check_case(case: Case, out_dtype: torch.dtype, what: str = "") -> torch.Tensor:
    """Run into a NaN-poisoned out: written rows match float64, the other rows stay NaN."""
    out = poisoned(case.out_shape, out_dtype)
    res = case.call(out)
    assert res is out
    assert_close_diff(out[case.written], case.ref[case.written], TOL[out_dtype], what)
    assert torch.isnan(out[~case.written]).all(), f"{what}: wrote rows outside any group"
    return out


# ---------------------------------------------------------------------------------------------
# Every op x recipe x fp8 pair x out dtype, at an awkward shape


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("dta,dtb", FP8_COMBOS, ids=["e4m3-e4m3", "e4m3-e5m2", "e5m2-e4m3",
                                                     "e5m2-e5m2"])
@pytest.mark.parametrize("rb", B_RECIPES)
@pytest.mark.parametrize("ra", A_RECIPES)
@pytest.mark.parametrize("op", OPS)
def test_recipes(op, ra, rb, dta, dtb, out_dtype):
    case = build_case(op, 37, 200, 320, ra, rb, dta, dtb)
    check_case(case, out_dtype, f"{op} A={ra} B={rb}")


# ---------------------------------------------------------------------------------------------
# Shapes: M in {0, 1, 37, 130}, N in {200, 2112}, K in {320, 7168}


_SHAPES = [(m, n, k) for m in (0, 1, 37, 130) for n, k in ((200, 320), (2112, 320), (200, 7168))]


@pytest.mark.parametrize("m,n,k", _SHAPES + [(1, 2112, 7168), (130, 2112, 7168)])
def test_shapes_dense_deepseek(m, n, k):
    """DeepSeek-V3 recipe (1x128 activations, 128x128 weights), e4m3, bf16 out; the last two
    are the real 2112x7168 projection."""
    check_case(build_case("dense", m, n, k, "1x128", "128x128"), torch.bfloat16, f"{m}x{n}x{k}")


@pytest.mark.parametrize("m,n,k", _SHAPES)
@pytest.mark.parametrize("op", ("contiguous", "offsets", "masked"))
def test_shapes_grouped_deepseek(op, m, n, k):
    check_case(build_case(op, m, n, k, "1x128", "128x128"), torch.bfloat16, f"{op} {m}x{n}x{k}")


@pytest.mark.parametrize("i,shape", list(enumerate(_SHAPES)))
@pytest.mark.parametrize("op", OPS)
def test_shapes_other_recipes(op, i, shape):
    """The shape sweep again, each shape with a different recipe / format / out dtype."""
    ra, rb = A_RECIPES[i % 3], B_RECIPES[(i + 1) % 4]
    (dta, dtb), out_dtype = FP8_COMBOS[i % 4], OUT_DTYPES[(i // 2) % 2]
    check_case(build_case(op, *shape, ra, rb, dta, dtb), out_dtype, f"{op} {shape} {ra}/{rb}")


@pytest.mark.parametrize("op", OPS)
def test_n_and_k_zero(op):
    """N = 0 gives an empty out; K = 0 gives zeros on the rows of some group, others untouched."""
    case = build_case(op, 37, 0, 320, "1x128", "128x128")
    assert case.call(None).shape == case.out_shape
    case = build_case(op, 37, 200, 0, "1x128", "128x128")
    out = poisoned(case.out_shape, torch.float32)
    case.call(out)
    assert (out[case.written] == 0).all()
    assert torch.isnan(out[~case.written]).all()


# ---------------------------------------------------------------------------------------------
# Long K: the error does not grow with K


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ("dense", "masked"))
def test_long_k(op, out_dtype):
    """The error does not grow with K: under the same K-independent tolerance at K = 16384 as at
    K = 512, and within 4x of it (bf16 output rounding dominates, and float32 blocked summation
    grows far slower than K)."""
    diffs = {}
    for k in (512, 16384):
        case = build_case(op, 64, 256, k, "1x128", "128x128", groups=2)
        out = check_case(case, out_dtype, f"K={k}")
        diffs[k] = calc_diff(out[case.written], case.ref[case.written])
    assert diffs[16384] <= 4 * diffs[512], diffs


# ---------------------------------------------------------------------------------------------
# out=None, c, determinism


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", OPS)
def test_out_none_allocates(op, out_dtype):
    """Allocated outputs have the right dtype; rows of no group are zero (not garbage)."""
    case = build_case(op, 130, 200, 320, "1x128", "128x128")
    out = case.call(None, out_dtype=out_dtype)
    assert out.dtype == out_dtype and tuple(out.shape) == case.out_shape
    assert_close_diff(out[case.written], case.ref[case.written], TOL[out_dtype], op)
    assert (out[~case.written] == 0).all()
    assert case.call(None).dtype == torch.bfloat16  # the default


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["bf16", "fp32"])
def test_dense_with_c(out_dtype):
    a, b = make_a(37, 320, "1x128"), make_b(200, 320, "128x128")
    c = torch.randn(37, 200) * 10
    out = fp8gemm.fp8_gemm_nt(a, b, poisoned((37, 200), out_dtype), c=c, backend="reference")
    assert_close_diff(out, ref_gemm(*a, "1x128", *b, "128x128", c), TOL[out_dtype], "c")


def test_dense_c_is_out():
    """D = C + A.B^T in place: c may be out itself (fp32 accumulation across calls)."""
    a, b = make_a(37, 320, "1x128"), make_b(200, 320, "128x128")
    c = torch.randn(37, 200)
    out = c.clone()
    fp8gemm.fp8_gemm_nt(a, b, out, c=out, backend="reference")
    assert_close_diff(out, ref_gemm(*a, "1x128", *b, "128x128", c), TOL[torch.float32], "c is out")
    # and on a strided out (transposed view), where the op goes through a contiguous copy
    out_t = c.T.contiguous().T
    fp8gemm.fp8_gemm_nt(a, b, out_t, c=out_t, backend="reference")
    assert torch.equal(out_t, out)


@pytest.mark.parametrize("op", OPS)
def test_deterministic(op):
    case = build_case(op, 130, 200, 320, "1x128", "128x128")
    x, y = case.call(None, out_dtype=torch.float32), case.call(None, out_dtype=torch.float32)
    assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# Every accepted scale shape and stride gives the same result


def _col_major(s):
    return fp8gemm.get_col_major_tma_aligned_tensor(s)


def _transposed_view(s):
    return s.transpose(-1, -2).contiguous().transpose(-1, -2)


def _strided_slice(s):
    big = torch.zeros(*s.shape[:-1], 2 * s.shape[-1] + 1)
    big[..., 1::2] = s
    return big[..., 1::2]


@pytest.mark.parametrize("variant", ("A [] vs [1]", "A [M] vs [M,1]", "B [] vs [1]",
                                     "B [N] vs [N,1]"))
def test_dense_scale_shapes_equivalent(variant):
    m, n, k = 37, 200, 320
    a_t, b_t = make_a(m, k, "tensor")[0], make_b(n, k, "tensor")[0]
    side, kind = variant[0], variant[2:]
    rec = "tensor" if kind == "[] vs [1]" else "row"
    base = rand_scales(() if rec == "tensor" else (m if side == "A" else n,))
    alt = base.reshape(1) if rec == "tensor" else base.reshape(-1, 1)
    other = rand_scales((m if side == "B" else n, 3))  # a 1x128 scale for the other operand
    outs = []
    for s in (base, alt):
        a, b = ((a_t, s), (b_t, other)) if side == "A" else ((a_t, other), (b_t, s))
        outs.append(fp8gemm.fp8_gemm_nt(a, b, out_dtype=torch.float32, backend="reference"))
    assert torch.equal(outs[0], outs[1])
    ra, rb = (rec, "1x128") if side == "A" else ("1x128", rec)
    assert_close_diff(outs[0], ref_gemm(*a, ra, *b, rb), TOL[torch.float32])


@pytest.mark.parametrize("layout", (_col_major, _transposed_view, _strided_slice),
                         ids=("col-major-tma", "transposed-view", "strided-slice"))
@pytest.mark.parametrize("rb", ("128x128", "1x128"))
def test_dense_scale_strides_equivalent(layout, rb):
    """Row-major scales and the same values in other layouts give identical bits; for A the
    column-major TMA-aligned layout is what quantize_per_token returns."""
    a, b = make_a(37, 320, "1x128"), make_b(200, 320, rb)
    base = fp8gemm.fp8_gemm_nt(a, b, out_dtype=torch.float32, backend="reference")
    for a2, b2 in (((a[0], layout(a[1])), b), (a, (b[0], layout(b[1])))):
        assert torch.equal(fp8gemm.fp8_gemm_nt(a2, b2, out_dtype=torch.float32,
                                               backend="reference"), base)
    assert fp8gemm.layout.is_col_major_tma_aligned(_col_major(a[1]))


def test_coinciding_readings_k_le_128():
    """With K <= 128 (and N <= 128) an [M, 1] A scale is both per-row and 1x128, and a [1, 1]
    B scale both per-tensor and one 128x128 block: the same arithmetic either way."""
    a_t, b_t = make_a(37, 100, "tensor")[0], make_b(100, 100, "tensor")[0]
    sa, sb = rand_scales((37,)), rand_scales(())
    x = fp8gemm.fp8_gemm_nt((a_t, sa), (b_t, sb), out_dtype=torch.float32, backend="reference")
    y = fp8gemm.fp8_gemm_nt((a_t, sa[:, None]), (b_t, sb.reshape(1, 1)), out_dtype=torch.float32,
                            backend="reference")
    assert torch.equal(x, y)


def test_grouped_b_scale_shapes_equivalent():
    """Grouped per-tensor B scale: [G], [G, 1], and [] / [1] broadcast to every group."""
    m, n, k = 37, 200, 320
    a = make_a(m, k, "1x128")
    b_t = make_b(n, k, "tensor", groups=GROUPS)[0]
    idx = contiguous_m_indices(m, GROUPS)
    s = rand_scales(())
    outs = [fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, (b_t, sb), None, idx,
                                                     out_dtype=torch.float32, backend="reference")
            for sb in (s.expand(GROUPS).clone(), s.expand(GROUPS, 1).clone(), s, s.reshape(1))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    # per-column [G, N] vs [G, N, 1]
    sb = rand_scales((GROUPS, n))
    x, y = (fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, (b_t, s2), None, idx,
                                                      out_dtype=torch.float32,
                                                      backend="reference")
            for s2 in (sb, sb[..., None]))
    assert torch.equal(x, y)


def test_masked_a_scale_shapes_equivalent():
    """Masked A: per-row [G, Mmax] vs [G, Mmax, 1]; 1x128 row-major vs column-major (3-D)."""
    mmax, n, k = 37, 200, 320
    b = make_b(n, k, "128x128", groups=GROUPS)
    mm = random_masked_m(mmax, GROUPS)
    a_t = make_a(mmax, k, "tensor", lead=GROUPS)[0]

    def run(sa):
        return fp8gemm.m_grouped_fp8_gemm_nt_masked((a_t, sa), b, None, mm,
                                                    out_dtype=torch.float32, backend="reference")

    s = rand_scales((GROUPS, mmax))
    assert torch.equal(run(s), run(s[..., None]))
    s = rand_scales((GROUPS, mmax, 3))
    col = _col_major(s)
    assert fp8gemm.layout.is_col_major_tma_aligned(col) and not col.is_contiguous()
    assert torch.equal(run(s), run(col))


# ---------------------------------------------------------------------------------------------
# Strided (non-contiguous) a, b and out


@pytest.mark.parametrize("op", OPS)
def test_strided_views(op):
    """Non-contiguous a, b and out (a row-padded view; a transposed out) give the same bits as
    contiguous ones, and rows of no group stay untouched in a strided out."""
    case = build_case(op, 130, 200, 320, "1x128", "128x128")
    expect = case.call(poisoned(case.out_shape, torch.float32))
    a, b = (padded_view(case.a[0]), case.a[1]), (padded_view(case.b[0]), case.b[1])
    assert not a[0].is_contiguous() and not b[0].is_contiguous()
    for out in (padded_view(poisoned(case.out_shape, torch.float32)),
                poisoned(case.out_shape[::-1], torch.float32).permute(
                    *range(len(case.out_shape) - 1, -1, -1))):
        assert not out.is_contiguous()
        res = case.call(out, a, b)
        assert res is out
        torch.testing.assert_close(out, expect, rtol=0, atol=0, equal_nan=True)
    # M-major (transposed) views of a and b
    a = (case.a[0].transpose(-1, -2).contiguous().transpose(-1, -2), case.a[1])
    b = (case.b[0].transpose(-1, -2).contiguous().transpose(-1, -2), case.b[1])
    assert not a[0].is_contiguous() and not b[0].is_contiguous()
    out = case.call(poisoned(case.out_shape, torch.float32), a, b)
    torch.testing.assert_close(out, expect, rtol=0, atol=0, equal_nan=True)

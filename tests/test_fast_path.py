"""The per-metadata fast path of fp8_gemm_nt and the grouped ops (used on CUDA, where value
checks are off).

On the CPU, values are always checked, so the fast path is off; these tests switch it on for CPU
tensors to check its logic: a warm call reuses the outcome of validation only when every piece of
metadata matches, and gives the same result as the full path.
"""

import pytest
import torch

import fp8gemm
from fp8gemm.ops import _common, gemm, grouped
from helpers import (TOL, calc_diff, col_major_tma, make_a, make_b, ref_gemm, ref_grouped_rows,
                     ref_masked)


@pytest.fixture
def fast_path(monkeypatch):
    """Fast path on for CPU tensors, a clean plan table, and a count of full-path selections."""
    monkeypatch.setattr(_common, "values_unchecked", lambda t: True)
    monkeypatch.delenv("FP8GEMM_BACKEND", raising=False)
    monkeypatch.delenv("FP8GEMM_CHECK_VALUES", raising=False)
    monkeypatch.setattr(gemm, "_plans", {})
    monkeypatch.setattr(grouped, "_plans", {})
    calls = []
    real = gemm.select_backend

    def counting(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(gemm, "select_backend", counting)
    monkeypatch.setattr(grouped, "select_backend", counting)
    return calls


def _operands(m=37, n=200, k=320):
    return make_a(m, k, "1x128"), make_b(n, k, "128x128")


def test_warm_call_skips_validation_and_matches(fast_path):
    a, b = _operands()
    ref = ref_gemm(*a, "1x128", *b, "128x128")
    out = torch.full((37, 200), float("nan"), dtype=torch.bfloat16)
    y1 = fp8gemm.fp8_gemm_nt(a, b, out)
    y2 = fp8gemm.fp8_gemm_nt(a, b, out.fill_(float("nan")))
    assert len(fast_path) == 1 and len(gemm._plans) == 1
    assert y2 is out and calc_diff(y2, ref) < TOL[torch.bfloat16]
    assert torch.equal(y1, y2)


def test_allocated_out_and_c_on_the_fast_path(fast_path):
    a, b = _operands()
    ref = ref_gemm(*a, "1x128", *b, "128x128")
    c = torch.randn(37, 200)
    for _ in range(2):
        y = fp8gemm.fp8_gemm_nt(a, b, c=c, out_dtype=torch.float32)
        assert y.shape == (37, 200) and y.dtype == torch.float32
        assert calc_diff(y, ref + c.double()) < TOL[torch.float32]
    acc = c.clone()
    for _ in range(2):  # c is out: accumulate in place, twice
        fp8gemm.fp8_gemm_nt(a, b, acc, c=acc)
    assert calc_diff(acc, 2 * ref + c.double()) < TOL[torch.float32]


def test_any_metadata_change_takes_the_full_path(fast_path):
    (a_t, sa), b = _operands()
    fp8gemm.fp8_gemm_nt((a_t, sa), b)
    fp8gemm.fp8_gemm_nt((a_t, fp8gemm.get_col_major_tma_aligned_tensor(sa)), b)  # other strides
    fp8gemm.fp8_gemm_nt((a_t, sa), b, out_dtype=torch.float32)
    fp8gemm.fp8_gemm_nt((a_t[:20], sa[:20]), b)  # another M
    assert len(fast_path) == 4


def test_environment_changes_are_seen(fast_path, monkeypatch):
    a, b = _operands()
    fp8gemm.fp8_gemm_nt(a, b)
    monkeypatch.setenv("FP8GEMM_BACKEND", "reference")
    fp8gemm.fp8_gemm_nt(a, b)
    assert len(fast_path) == 2
    monkeypatch.setenv("FP8GEMM_CHECK_VALUES", "1")
    a_t, sa = a
    bad = sa.clone()
    bad[0, 0] = float("nan")
    fp8gemm.fp8_gemm_nt((a_t, sa), b)  # warm the same signature, then a NaN scale is caught
    with pytest.raises(ValueError, match="^a scales must be finite"):
        fp8gemm.fp8_gemm_nt((a_t, bad), b)


def test_bad_input_after_warm_call_still_raises(fast_path):
    a, b = _operands()
    fp8gemm.fp8_gemm_nt(a, b)
    with pytest.raises(TypeError, match="^a must be a"):
        fp8gemm.fp8_gemm_nt(a[0], b)
    with pytest.raises(ValueError, match="^out must have shape"):
        fp8gemm.fp8_gemm_nt(a, b, torch.empty(5, 5, dtype=torch.bfloat16))


# --- grouped ops ----------------------------------------------------------------------------------
G, ROWS, N, K = 3, 40, 136, 320
# B per-tensor [] is broadcast to [G] and A per-row [M, 1] reshaped to [M]: warm calls must view
# them as the full path did.
RECIPES = [("1x128", "128x128", "1x128", "128x128"), ("row", "tensor", "row [M, 1]", "tensor []")]


def _grouped_call(kind, ra, rb):
    """(call(out=None, a=None, expected_m=None), float64 reference, rows no group writes)."""
    torch.manual_seed(0)
    b_t, sb = make_b(N, K, rb, groups=G)
    if rb == "tensor":
        sb = sb[:1].reshape(())  # one scale for every group
    b_pair, ref_sb = (b_t, sb), sb.expand(G) if sb.dim() == 0 else sb
    if kind == "masked":
        a_t, sa = make_a(ROWS, K, ra, lead=G)
        masked_m = torch.tensor([ROWS, 0, 17], dtype=torch.int32)
        ref = ref_masked(a_t, sa, ra, b_t, ref_sb, rb, masked_m)

        def call(out=None, a=None, expected_m=None):
            return fp8gemm.m_grouped_fp8_gemm_nt_masked(a or (a_t, sa), b_pair, out, masked_m,
                                                        expected_m)
        return call, ref, ref.isnan()
    a_t, sa = make_a(G * ROWS, K, ra)
    a_pair = (a_t, sa.reshape(-1, 1)) if ra == "row" else (a_t, sa)
    if kind == "contiguous":
        row_groups = torch.arange(G * ROWS, dtype=torch.int32) // ROWS
        row_groups[ROWS - 5:ROWS] = -1  # padding rows

        def call(out=None, a=None, expected_m=None):
            return fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a or a_pair, b_pair, out, row_groups)
    else:
        offsets = torch.tensor([0, ROWS, 2 * ROWS + 7, G * ROWS], dtype=torch.int32)
        row_groups = torch.bucketize(torch.arange(G * ROWS), offsets[1:], right=True).int()

        def call(out=None, a=None, expected_m=None):
            return fp8gemm.m_grouped_fp8_gemm_nt_offsets(a or a_pair, b_pair, out, offsets)
    ref = ref_grouped_rows(a_t, sa, ra, b_t, ref_sb, rb, row_groups)
    return call, ref, ref.isnan()


@pytest.mark.parametrize("recipes", RECIPES, ids=lambda r: f"{r[2]} x {r[3]}")
@pytest.mark.parametrize("kind", ["contiguous", "offsets", "masked"])
def test_grouped_warm_calls_skip_validation_and_match(fast_path, kind, recipes):
    call, ref, unwritten = _grouped_call(kind, recipes[0], recipes[1])
    first, warm = call(), call()  # out=None: the full path, then the plan
    out = torch.full(first.shape, 7.0, dtype=torch.bfloat16)
    call(out)
    again = call(out.fill_(7.0))
    assert len(fast_path) == 2 and len(grouped._plans) == 2  # out=None and out given
    assert not first[unwritten].any() and not warm[unwritten].any()  # allocated as zeros
    assert again is out and bool((out[unwritten] == 7).all())  # rows of no group untouched
    for y in (first, warm, again):
        assert calc_diff(y[~unwritten], ref[~unwritten]) < TOL[torch.bfloat16]
    assert torch.equal(first, warm) and torch.equal(first[~unwritten], again[~unwritten])


def test_grouped_metadata_changes_take_the_full_path(fast_path):
    call, _, _ = _grouped_call("masked", "1x128", "128x128")
    call()
    call(expected_m=8)  # another key: expected_m picks the config
    call(expected_m=8)
    a_t, sa = make_a(ROWS, K, "1x128", lead=G)
    call(a=(a_t, sa))  # other tensors of the same metadata: a hit
    call(a=(a_t, col_major_tma(sa)))  # other strides
    call(out=torch.empty(G, ROWS, N))  # float32 out
    assert len(fast_path) == 4 and len(grouped._plans) == 3


def test_grouped_bad_input_after_warm_call_still_raises(fast_path, monkeypatch):
    call, _, _ = _grouped_call("masked", "1x128", "128x128")
    call(expected_m=2)
    with pytest.raises(TypeError, match="^expected_m must be an int"):
        call(expected_m=2.0)
    with pytest.raises(TypeError, match="^expected_m must be an int"):
        call(expected_m=True)
    contiguous, _, _ = _grouped_call("contiguous", "1x128", "128x128")
    contiguous()
    a, b = make_a(G * ROWS, K, "1x128"), make_b(N, K, "128x128", groups=G)
    with pytest.raises(TypeError, match="^m_indices must be torch.int32"):
        fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, None,
                                                 torch.zeros(G * ROWS, dtype=torch.int64))
    # The signature is warm and values go unchecked (as on CUDA); FP8GEMM_CHECK_VALUES=1 is in
    # the key, so the full path checks them.
    monkeypatch.setenv("FP8GEMM_CHECK_VALUES", "1")
    bad = torch.full((G * ROWS,), G, dtype=torch.int32)
    with pytest.raises(ValueError, match="^m_indices must lie in"):
        fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, None, bad)


def test_grouped_ops_compile_fullgraph_with_warm_plans(fast_path):
    """While dynamo traces, the ops dispatch to their custom ops before any plan lookup (a
    lookup would break the graph)."""
    masked, _, _ = _grouped_call("masked", "1x128", "128x128")
    contiguous, _, _ = _grouped_call("contiguous", "1x128", "128x128")

    def both():
        return masked(expected_m=24), contiguous()

    eager = both(), both()  # the second from the plans
    assert len(fast_path) == 2
    torch._dynamo.reset()
    compiled = torch.compile(both, backend="eager", fullgraph=True)()
    for e, c in zip(eager[1], compiled):
        assert torch.equal(e, c)

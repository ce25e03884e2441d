"""The per-metadata fast path of fp8_gemm_nt (used on CUDA, where value checks are off).

On the CPU, values are always checked, so the fast path is off; these tests switch it on for CPU
tensors to check its logic: a warm call reuses the outcome of validation only when every piece of
metadata matches, and gives the same result as the full path.
"""

import pytest
import torch

import fp8gemm
from fp8gemm.ops import gemm
from helpers import TOL, calc_diff, make_a, make_b, ref_gemm


@pytest.fixture
def fast_path(monkeypatch):
    """Fast path on for CPU tensors, a clean plan table, and a count of full-path selections."""
    monkeypatch.setattr(gemm, "_values_unchecked", lambda t: True)
    monkeypatch.delenv("FP8GEMM_BACKEND", raising=False)
    monkeypatch.delenv("FP8GEMM_CHECK_VALUES", raising=False)
    monkeypatch.setattr(gemm, "_plans", {})
    calls = []
    real = gemm.select_backend

    def counting(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(gemm, "select_backend", counting)
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

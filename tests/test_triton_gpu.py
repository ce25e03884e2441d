"""The Triton backend on a GPU at real shapes: DeepSeek-V3 dense and MoE shapes, long K,
determinism, CUDA-graph capture, the quantisation kernels against PyTorch.

Needs a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores); skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import (BF16_DIFF, E4M3, E5M2, FP8_STEP_FRACTION, GemmKind, Recipe, a_scales,
                     b_scales, calc_diff, dequant_a, dequant_b, problem, rand_fp8,
                     ref_quant_groups)


def _gpu_ok() -> bool:
    return (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability() >= (8, 9))


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU with FP8 (sm_89+)")]

DEEPSEEK_DENSE = [(m, n, k) for m in (64, 128, 4096)
                  for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384),
                               (4096, 7168), (7168, 2048))]
GRP, BLK = Recipe.GROUP, Recipe.BLOCK


@pytest.fixture(scope="module")
def tb():
    pytest.importorskip("triton")
    import fp8gemm.backends.triton as mod

    assert mod.is_available(torch.device("cuda"))
    return mod


def _dense(m, n, k, ra=GRP, rb=BLK, da=E4M3, db=E4M3, seed=0, col_major=True):
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    a = rand_fp8((m, k), da, dev, g)
    b = rand_fp8((n, k), db, dev, g)
    sa = a_scales(ra, m, k, dev, col_major=col_major, gen=g)
    sb = b_scales(rb, n, k, dev, gen=g)
    return a, sa, b, sb


def _ref(a, sa, ra, b, sb, rb, grouped=False):
    return dequant_a(a, sa, ra) @ dequant_b(b, sb, rb, grouped).transpose(-1, -2)


def _run_dense(tb, a, sa, b, sb, ra=GRP, rb=BLK, out_dtype=torch.bfloat16, c=None):
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, ra, rb, out_dtype, has_c=c is not None)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=a.device)
    tb.fp8_gemm_nt(a, sa, b, sb, out, c, prob)
    return out


@pytest.mark.parametrize("m,n,k", DEEPSEEK_DENSE, ids=lambda v: str(v))
def test_deepseek_dense(tb, m, n, k):
    a, sa, b, sb = _dense(m, n, k, seed=m + n + k)
    out = _run_dense(tb, a, sa, b, sb)
    assert not out.isnan().any()
    assert calc_diff(out, _ref(a, sa, GRP, b, sb, BLK)) < BF16_DIFF


def _gluon_config(tb, prob):
    """The Gluon family's heuristic config for `prob` (whether or not the backend would pick
    the family)."""
    if torch.cuda.get_device_capability() != (9, 0) or tb.gluon_fp8_gemm is None:
        pytest.skip("the Gluon kernel is for sm_90")
    family = tb.gluon_fp8_gemm.FAMILY
    assert family.supports(prob) is None
    return family.select_config(prob, tb.device_facts(torch.device("cuda")))


def _run_gluon(tb, prob, cfg, a, sa, b, sb, out, idx=None):
    tb.gluon_fp8_gemm.FAMILY.run(cfg, prob, a, sa, b, sb, out, None, idx)


@pytest.mark.parametrize("m,n,k,out_dtype", [
    (4096, 4096, 7168, torch.bfloat16), (130, 576, 320, torch.bfloat16),
    (257, 2112, 7168, torch.float32), (1000, 1000, 1024, torch.bfloat16),
    (300, 256, 16384, torch.float32), (4096, 7168, 2048, torch.bfloat16),
    (129, 128, 128, torch.bfloat16)], ids=lambda v: str(v))
def test_gluon_kernel(tb, m, n, k, out_dtype):
    """The Gluon kernel (large M, A 1x128 x B 128x128 on sm_90): M and N tails, K tails (K
    blocks odd and even), long K, bf16 and fp32 out; rows of the buffer past `out` untouched."""
    a, sa, b, sb = _dense(m, n, k, seed=m * 7 + k)
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, GRP, BLK, out_dtype)
    cfg = _gluon_config(tb, prob)
    buf = torch.full((m + 64, n), float("nan"), dtype=out_dtype, device="cuda")
    out = buf[:m]
    _run_gluon(tb, prob, cfg, a, sa, b, sb, out)
    assert not out.isnan().any() and buf[m:].isnan().all()
    limit = BF16_DIFF if out_dtype is torch.bfloat16 else 1e-8
    assert calc_diff(out, _ref(a, sa, GRP, b, sb, BLK)) < limit
    again = torch.empty_like(out)
    _run_gluon(tb, prob, cfg, a, sa, b, sb, again)
    assert torch.equal(out, again)  # bit-identical on a second run


def test_gluon_unaligned_bases(tb):
    """Operands and out at base addresses TMA cannot use (views at an odd offset): the Gluon
    kernel runs on aligned copies, with the same result, and out's other elements untouched."""
    m, n, k = 256, 512, 1024
    a, sa, b, sb = _dense(m, n, k, seed=11)
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, GRP, BLK, torch.bfloat16)
    cfg = _gluon_config(tb, prob)
    a_off = torch.empty(m * k + 1, dtype=a.dtype, device="cuda")[1:].view(m, k)
    a_off.copy_(a)
    b_off = torch.empty(n * k + 3, dtype=b.dtype, device="cuda")[3:].view(n, k)
    b_off.copy_(b)
    buf = torch.full((m * n + 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[1:-1].view(m, n)
    assert a_off.data_ptr() % 16 and b_off.data_ptr() % 16 and out.data_ptr() % 16
    _run_gluon(tb, prob, cfg, a_off, sa, b_off, sb, out)
    assert buf[0].isnan() and buf[-1].isnan()
    assert calc_diff(out, _ref(a, sa, GRP, b, sb, BLK)) < BF16_DIFF
    want = torch.empty_like(out)
    _run_gluon(tb, prob, cfg, a, sa, b, sb, want)
    assert torch.equal(out, want)


@pytest.mark.parametrize("ra", [Recipe.TENSOR, Recipe.ROW, GRP], ids=lambda r: r.value)
@pytest.mark.parametrize("rb", [Recipe.TENSOR, Recipe.ROW, BLK, GRP], ids=lambda r: r.value)
@pytest.mark.parametrize("m,n,k", [(96, 4096, 7168), (1000, 1000, 1000), (1, 200, 320)],
                         ids=lambda v: str(v))
def test_recipes_and_awkward_shapes(tb, ra, rb, m, n, k):
    a, sa, b, sb = _dense(m, n, k, ra, rb, seed=5)
    out = _run_dense(tb, a, sa, b, sb, ra, rb)
    assert not out.isnan().any()
    assert calc_diff(out, _ref(a, sa, ra, b, sb, rb)) < BF16_DIFF


@pytest.mark.parametrize("da,db", [(E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)],
                         ids=["e4m3xe5m2", "e5m2xe4m3", "e5m2xe5m2"])
def test_formats(tb, da, db):
    a, sa, b, sb = _dense(256, 2112, 7168, da=da, db=db, seed=7)
    out = _run_dense(tb, a, sa, b, sb)
    assert calc_diff(out, _ref(a, sa, GRP, b, sb, BLK)) < BF16_DIFF


@pytest.mark.parametrize("m", [64, 4096])
def test_c_aliasing_out(tb, m):
    a, sa, b, sb = _dense(m, 2112, 7168, seed=9)
    c = torch.randn(m, 2112, device="cuda") * 100
    ref = _ref(a, sa, GRP, b, sb, BLK) + c.double()
    out = c.clone()
    prob = problem(GemmKind.DENSE, m, 2112, 7168, 1, a, b, GRP, BLK, torch.float32, has_c=True)
    tb.fp8_gemm_nt(a, sa, b, sb, out, out, prob)
    assert calc_diff(out, ref) < 1e-7


def test_output_past_2_31_elements(tb):
    """64-bit addressing: an output of more than 2^31 elements (4.3 GB of bf16) is written in
    full and right at its far end."""
    m, n, k = (1 << 31) // 4096 + 300, 4096, 128
    a, sa, b, sb = _dense(m, n, k, seed=41)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, GRP, BLK, torch.bfloat16)
    tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
    assert not out[-1000:].isnan().any() and not out[:1000].isnan().any()
    rows = torch.cat([torch.arange(0, 64), torch.arange(m - 600, m)]).cuda()
    ref = dequant_a(a[rows], sa[rows], GRP) @ dequant_b(b, sb, BLK, False).T
    assert calc_diff(out[rows], ref) < BF16_DIFF
    del out


def test_long_k_error_does_not_grow(tb):
    """Promotion every 128 of K: at K = 16384 the FP32-output error stays at the K = 1024 level."""
    diffs = {}
    for k in (1024, 16384):
        a, sa, b, sb = _dense(128, 512, k, seed=k)
        out = _run_dense(tb, a, sa, b, sb, out_dtype=torch.float32)
        diffs[k] = calc_diff(out, _ref(a, sa, GRP, b, sb, BLK))
    assert diffs[16384] < 1e-8 and diffs[16384] <= 4 * diffs[1024] + 1e-12, diffs


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (128, 7168, 16384), (4096, 4096, 7168)],
                         ids=lambda v: str(v))
def test_deterministic(tb, m, n, k):
    a, sa, b, sb = _dense(m, n, k, seed=3)
    first = _run_dense(tb, a, sa, b, sb)
    for _ in range(3):
        assert torch.equal(_run_dense(tb, a, sa, b, sb), first)


# ---------------------------------------------------------------------------------------------
# grouped


def _grouped_b(groups, n, k, rb=BLK, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    return rand_fp8((groups, n, k), E4M3, dev, g), b_scales(rb, n, k, dev, groups=groups, gen=g)


@pytest.mark.parametrize("groups,m_per,n,k", [(4, 8192, 4096, 7168), (8, 4096, 7168, 2048)],
                         ids=lambda v: str(v))
def test_contiguous_deepseek(tb, groups, m_per, n, k):
    m = groups * m_per
    g = torch.Generator().manual_seed(11)
    a = rand_fp8((m, k), E4M3, "cuda", g)
    sa = a_scales(GRP, m, k, "cuda", col_major=True, gen=g)
    b, sb = _grouped_b(groups, n, k, seed=12)
    idx = torch.arange(groups, dtype=torch.int32).repeat_interleave(m_per)
    idx[m_per - 128:m_per] = -1  # a padding block
    idx = idx.cuda()
    prob = problem(GemmKind.CONTIGUOUS, m, n, k, groups, a, b, GRP, BLK, torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    tb.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, idx, prob)
    assert out[idx < 0].isnan().all() and not out[idx >= 0].isnan().any()
    bd = dequant_b(b, sb, BLK, True)
    ad = dequant_a(a, sa, GRP)
    for gi in range(groups):
        rows = (idx == gi).nonzero().flatten()[:512]  # a sample of each group's rows
        assert calc_diff(out[rows], ad[rows] @ bd[gi].T) < BF16_DIFF


@pytest.mark.parametrize("gluon", [False, True], ids=["heuristic", "gluon"])
def test_contiguous_unaligned_groups(tb, gluon):
    """m_indices not aligned to the M tile (tiles holding rows of two or three groups), padding
    rows and out-of-range values (treated as padding, left untouched); the heuristic's config
    and the Gluon kernel's (then the persistent kernel's further-groups launch)."""
    groups, n, k = 3, 2112, 7168
    parts = [torch.full((s,), g, dtype=torch.int32) for g, s in ((0, 700), (-1, 5), (2, 1),
                                                                (1, 3001), (7, 3), (2, 259))]
    idx = torch.cat(parts + [torch.tensor([0, 1, 2, -9] * 16, dtype=torch.int32)])
    m = idx.numel()
    g = torch.Generator().manual_seed(17)
    a = rand_fp8((m, k), E4M3, "cuda", g)
    sa = a_scales(GRP, m, k, "cuda", col_major=True, gen=g)
    b, sb = _grouped_b(groups, n, k, seed=18)
    prob = problem(GemmKind.CONTIGUOUS, m, n, k, groups, a, b, GRP, BLK, torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    if gluon:
        _run_gluon(tb, prob, _gluon_config(tb, prob), a, sa, b, sb, out, idx.cuda())
    else:
        tb.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, idx.cuda(), prob)
    own = (idx >= 0) & (idx < groups)
    assert out[~own].isnan().all() and not out[own].isnan().any()
    bd = dequant_b(b, sb, BLK, True)
    ad = dequant_a(a, sa, GRP)
    for gi in range(groups):
        rows = (idx == gi).nonzero().flatten().cuda()
        assert calc_diff(out[rows], ad[rows] @ bd[gi].T) < BF16_DIFF


def test_offsets_unaligned(tb):
    groups, n, k = 5, 4096, 7168
    sizes = [700, 0, 1, 3001, 259]
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    m = int(offsets[-1]) + 37  # trailing rows in no group
    g = torch.Generator().manual_seed(13)
    a = rand_fp8((m, k), E4M3, "cuda", g)
    sa = a_scales(GRP, m, k, "cuda", col_major=True, gen=g)
    b, sb = _grouped_b(groups, n, k, seed=14)
    prob = problem(GemmKind.OFFSETS, m, n, k, groups, a, b, GRP, BLK, torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    tb.m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, offsets.cuda(), prob)
    assert out[int(offsets[-1]):].isnan().all()
    bd = dequant_b(b, sb, BLK, True)
    ad = dequant_a(a, sa, GRP)
    for gi in range(groups):
        lo, hi = int(offsets[gi]), int(offsets[gi + 1])
        if hi > lo:
            assert not out[lo:hi].isnan().any()
            assert calc_diff(out[lo:hi], ad[lo:hi] @ bd[gi].T) < BF16_DIFF


def _masked_setup(groups, mmax, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a = rand_fp8((groups, mmax, k), E4M3, "cuda", g)
    sa = a_scales(GRP, mmax, k, "cuda", lead=groups, gen=g)
    b, sb = _grouped_b(groups, n, k, seed=seed + 1)
    return a, sa, b, sb


@pytest.mark.parametrize("groups,mmax,n,k", [(4, 256, 4096, 7168), (2, 512, 7168, 2048)],
                         ids=lambda v: str(v))
def test_masked_deepseek(tb, groups, mmax, n, k):
    a, sa, b, sb = _masked_setup(groups, mmax, n, k, 15)
    masked_m = torch.tensor([mmax, 37, 0, 1000][:groups], dtype=torch.int32, device="cuda")
    prob = problem(GemmKind.MASKED, mmax, n, k, groups, a, b, GRP, BLK, torch.bfloat16,
                   expected_m=mmax // 2)
    out = torch.full((groups, mmax, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    tb.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, prob)
    ref = _ref(a, sa, GRP, b, sb, BLK, grouped=True)
    for gi in range(groups):
        rows = min(int(masked_m[gi]), mmax)
        assert out[gi, rows:].isnan().all()
        if rows:
            assert calc_diff(out[gi, :rows], ref[gi, :rows]) < BF16_DIFF


@pytest.mark.parametrize("groups,mmax,n,k,mm", [
    (4, 200, 576, 320, (200, 0, 130, 1000)), (3, 512, 4096, 7168, (512, 37, 300)),
    (2, 1024, 7168, 2048, (1024, 900))], ids=lambda v: str(v))
def test_gluon_masked(tb, groups, mmax, n, k, mm):
    """Masked GEMMs through the Gluon kernel (expected_m > 128): empty groups, masked_m past
    Mmax, Mmax not a multiple of the tile, partial last tiles; rows >= masked_m untouched."""
    a, sa, b, sb = _masked_setup(groups, mmax, n, k, 61)
    masked_m = torch.tensor(mm, dtype=torch.int32, device="cuda")
    prob = problem(GemmKind.MASKED, mmax, n, k, groups, a, b, GRP, BLK, torch.bfloat16,
                   expected_m=mmax)
    cfg = _gluon_config(tb, prob)
    out = torch.full((groups, mmax, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run_gluon(tb, prob, cfg, a, sa, b, sb, out, masked_m)
    ref = _ref(a, sa, GRP, b, sb, BLK, grouped=True)
    for gi in range(groups):
        rows = min(mm[gi], mmax)
        assert out[gi, rows:].isnan().all()
        if rows:
            assert calc_diff(out[gi, :rows], ref[gi, :rows]) < BF16_DIFF


def test_masked_a_scales_token_major(tb):
    """Masked A scales stored token-major ([Mmax, G, kb] in memory, viewed as [G, Mmax, kb]):
    the last m tile of group 1 runs past Mmax, where rows' scales would lie outside the tensor.
    Results stay right; that such rows are not read is checked on the CPU with guard pages
    (test_triton_interp.py::test_no_access_outside_tensors)."""
    groups, mmax, n, k = 4, 200, 4096, 7168
    a, sa, b, sb = _masked_setup(groups, mmax, n, k, 51)
    sa = sa.transpose(0, 1).contiguous().transpose(0, 1)
    masked_m = torch.tensor([200, 199, 130, 0], dtype=torch.int32, device="cuda")
    prob = problem(GemmKind.MASKED, mmax, n, k, groups, a, b, GRP, BLK, torch.bfloat16,
                   expected_m=128)
    out = torch.full((groups, mmax, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    tb.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, prob)
    torch.cuda.synchronize()
    ref = _ref(a, sa, GRP, b, sb, BLK, grouped=True)
    for gi, rows in enumerate([200, 199, 130, 0]):
        assert out[gi, rows:].isnan().all()
        if rows:
            assert calc_diff(out[gi, :rows], ref[gi, :rows]) < BF16_DIFF


# ---------------------------------------------------------------------------------------------
# CUDA graphs


def test_cuda_graph_capture(tb):
    """A split-K dense GEMM and a masked GEMM captured in one graph; replays follow new inputs
    (masked_m changed on the device) and match eager calls bit for bit."""
    a, sa, b, sb = _dense(64, 2112, 7168, seed=21)
    prob = problem(GemmKind.DENSE, 64, 2112, 7168, 1, a, b, GRP, BLK, torch.bfloat16)
    groups, mmax, n, k = 4, 256, 4096, 7168
    ma, msa, mb, msb = _masked_setup(groups, mmax, n, k, 22)
    masked_m = torch.tensor([256, 17, 0, 100], dtype=torch.int32, device="cuda")
    mprob = problem(GemmKind.MASKED, mmax, n, k, groups, ma, mb, GRP, BLK, torch.bfloat16,
                    expected_m=64)
    out = torch.empty(64, 2112, dtype=torch.bfloat16, device="cuda")
    mout = torch.zeros(groups, mmax, n, dtype=torch.bfloat16, device="cuda")
    # warm up (compile, choose configs) outside the capture
    tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
    tb.m_grouped_fp8_gemm_nt_masked(ma, msa, mb, msb, mout, masked_m, mprob)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
        tb.m_grouped_fp8_gemm_nt_masked(ma, msa, mb, msb, mout, masked_m, mprob)
    a.copy_(rand_fp8((64, 7168), E4M3, "cuda"))
    masked_m.copy_(torch.tensor([3, 256, 129, 0], dtype=torch.int32))
    mout.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _run_dense(tb, a, sa, b, sb))
    eager = torch.full_like(mout, float("nan"))
    tb.m_grouped_fp8_gemm_nt_masked(ma, msa, mb, msb, eager, masked_m, mprob)
    for gi, rows in enumerate([3, 256, 129, 0]):
        assert torch.equal(mout[gi, :rows], eager[gi, :rows])
        assert mout[gi, rows:].isnan().all()


# ---------------------------------------------------------------------------------------------
# quantisation


def _steps(q, r):
    def ordinal(t):
        bits = t.view(torch.uint8).to(torch.int32)
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits & 0x7F)
    return (ordinal(q) - ordinal(r)).abs()


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quant_kernels_match_torch(tb, fmt, pow2):
    from fp8gemm.backends.triton import quant

    m, k = 4096, 7168
    x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
    q, s = quant.quantize_per_token(x, fmt=fmt, pow2_scales=pow2)
    assert s.stride() == (1, m)
    q_ref, s_ref = ref_quant_groups(x.float().view(m, k // 128, 128), fmt, pow2)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    st = _steps(q, q_ref.view(m, k))
    assert int(st.max()) <= 1 and float((st > 0).float().mean()) <= FP8_STEP_FRACTION

    q, s = quant.quantize_per_block(x, fmt=fmt, pow2_scales=pow2)
    blocks = x.float().view(m // 128, 128, k // 128, 128).permute(0, 2, 1, 3).reshape(m // 128, k // 128, -1)
    q_ref, s_ref = ref_quant_groups(blocks, fmt, pow2)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    q_ref = q_ref.view(m // 128, k // 128, 128, 128).permute(0, 2, 1, 3).reshape(m, k)
    st = _steps(q, q_ref)
    assert int(st.max()) <= 1 and float((st > 0).float().mean()) <= FP8_STEP_FRACTION

    t, i = 1000, 2048
    xx = (torch.randn(t, 2 * i, device="cuda") * 3).to(torch.bfloat16)
    q, s = quant.silu_mul_quantize_per_token(xx, fmt=fmt, pow2_scales=pow2)
    y = torch.nn.functional.silu(xx[:, :i].float()) * xx[:, i:].float()
    q_ref, s_ref = ref_quant_groups(y.view(t, i // 128, 128), fmt, pow2)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    st = _steps(q, q_ref.view(t, i))
    assert int(st.max()) <= 1 and float((st > 0).float().mean()) <= FP8_STEP_FRACTION


def test_quantize_batch_past_grid_limit(tb):
    """[70000, 4, 256]: more matrices than a grid's z dimension takes (65535); each is quantised
    as its own 2-D call would be, the last ones included."""
    from fp8gemm.backends.triton import quant

    x = (torch.randn(70000, 4, 256, device="cuda") * 3).to(torch.bfloat16)
    q, s = quant.quantize_per_token(x)
    q2, s2 = quant.quantize_per_token(x.reshape(-1, 256), col_major_scales=False)
    assert torch.equal(q.view(torch.uint8).reshape(-1, 256), q2.view(torch.uint8))
    assert torch.equal(s.reshape(-1, 2), s2)
    qb, sbk = quant.quantize_per_block(x)
    for i in (0, 65535, 69999):
        q1, s1 = quant.quantize_per_block(x[i])
        assert torch.equal(qb[i].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(sbk[i], s1)


def test_silu_mul_masked_m_reads_only_the_tokens_rows(tb):
    """masked_m on the decode MoE's layout, compiled: the rows past masked_m[g] (NaN and inf
    here) are not read and take an all-zero group's scale; the tokens' rows have the bits of
    the unmasked call; a batch past the grid's z limit reads each expert's own count."""
    from fp8gemm.backends.triton import quant

    for g, mmax, i in ((32, 128, 2048), (66000, 2, 128)):
        x = (torch.randn(g, mmax, 2 * i, device="cuda") * 3).to(torch.bfloat16)
        mm = torch.randint(-1, mmax + 2, (g,), dtype=torch.int32, device="cuda")
        q0, s0 = quant.silu_mul_quantize_per_token(x)
        rows = mm.clamp(0, mmax)
        dead = torch.arange(mmax, device="cuda")[None, :] >= rows[:, None]
        x[dead] = float("nan")
        x[..., 1::2][dead] = float("inf")
        q, s = quant.silu_mul_quantize_per_token(x, masked_m=mm)
        zero = quant.silu_mul_quantize_per_token(torch.zeros(1, 1, 2 * i, device="cuda"))[1]
        live = ~dead
        assert torch.equal(q.view(torch.uint8)[live], q0.view(torch.uint8)[live]), (g, mmax)
        assert torch.equal(s[live], s0[live]) and bool((s[dead] == zero.flatten()[0]).all())


def test_quantized_end_to_end(tb):
    """quantize_per_token + quantize_per_block + GEMM against the bf16 product (FP8 error)."""
    from fp8gemm.backends.triton import quant

    x = torch.randn(512, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2112, 7168, device="cuda", dtype=torch.bfloat16) * 0.02
    a, sa = quant.quantize_per_token(x)
    b, sb = quant.quantize_per_block(w)
    out = _run_dense(tb, a, sa, b, sb)
    assert calc_diff(out, x.double() @ w.double().T) < 2e-3  # e4m3 quantisation of both sides


def test_autotune_stores_choice(tb, tmp_path, monkeypatch):
    """FP8GEMM_AUTOTUNE=1: candidates are timed once, the winner is used (correct results, `out`
    untouched by the timing runs when c aliases it) and stored as JSON in the cache dir."""
    import json

    from fp8gemm.backends.triton import tuning

    monkeypatch.setenv("FP8GEMM_AUTOTUNE", "1")
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_tuned", None)
    m, n, k = 96, 2048, 1024  # a problem no other test has configured
    a, sa, b, sb = _dense(m, n, k, seed=31)
    c = torch.randn(m, n, device="cuda")
    out = c.clone()
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, GRP, BLK, torch.float32, has_c=True)
    tb.fp8_gemm_nt(a, sa, b, sb, out, out, prob)
    assert calc_diff(out, _ref(a, sa, GRP, b, sb, BLK) + c.double()) < 1e-7
    stored = json.loads((tmp_path / "triton_autotune.json").read_text())
    family, cfg = tb.launch_config(prob, a.device)
    assert len(stored) == 1 and f"|{family.name}|{prob}" in next(iter(stored))
    assert tuning.config_from_json(family.Config, next(iter(stored.values()))) == cfg

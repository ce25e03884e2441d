"""torch.library custom ops (fake implementations, torch.compile) and the nn modules."""

import pytest
import torch
import torch.nn.functional as F

import fp8gemm
import fp8gemm.torch_ops  # noqa: F401
from fp8gemm.nn import Fp8Linear, Fp8MoE

# NOTE: opcheck's schema test compares fp8 tensors with allclose, which CPU torch cannot do for
# fp8; the fake-tensor test is the one that guards torch.compile.
_OPCHECK = ("test_faketensor",)


def _operands(m=37, n=200, k=320):
    x, w = torch.randn(m, k), torch.randn(n, k)
    return fp8gemm.quantize_per_token(x), fp8gemm.quantize_per_block(w)


def test_fake_impls_match_real_outputs():
    (a, sa), (b, sb) = _operands()
    torch.library.opcheck(torch.ops.fp8gemm.fp8_gemm_nt, (a, sa, b, sb, None, torch.bfloat16),
                          test_utils=_OPCHECK)
    torch.library.opcheck(torch.ops.fp8gemm.quantize_per_token, (torch.randn(37, 320),),
                          test_utils=_OPCHECK)
    torch.library.opcheck(torch.ops.fp8gemm.quantize_per_token, (torch.randn(3, 37, 320),),
                          test_utils=_OPCHECK)
    torch.library.opcheck(torch.ops.fp8gemm.silu_mul_quantize_per_token, (torch.randn(3, 7, 512),),
                          test_utils=_OPCHECK)
    torch.library.opcheck(torch.ops.fp8gemm.quantize_per_block, (torch.randn(2, 200, 320),),
                          test_utils=_OPCHECK)
    g, mmax = 3, 16
    x = torch.randn(g, mmax, 320)
    qa, qsa = fp8gemm.quantize_per_token(x)
    qb, qsb = fp8gemm.quantize_per_block(torch.randn(g, 200, 320))
    masked_m = torch.tensor([0, 5, 16], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_masked,
                          (qa, qsa, qb, qsb, masked_m, 8, torch.bfloat16), test_utils=_OPCHECK)
    m_indices = torch.tensor([0] * 10 + [-1] * 3 + [2] * 7, dtype=torch.int32)
    ca, csa = fp8gemm.quantize_per_token(torch.randn(20, 320))
    torch.library.opcheck(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_contiguous,
                          (ca, csa, qb, qsb, m_indices, torch.float32), test_utils=_OPCHECK)
    offsets = torch.tensor([0, 10, 10, 20], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_offsets,
                          (ca, csa, qb, qsb, offsets, torch.bfloat16), test_utils=_OPCHECK)


def test_compile_fullgraph_matches_eager():
    def f(x, w):
        a, sa = torch.ops.fp8gemm.quantize_per_token(x)
        b, sb = torch.ops.fp8gemm.quantize_per_block(w)
        return torch.ops.fp8gemm.fp8_gemm_nt(a, sa, b, sb, None, torch.bfloat16)

    x, w = torch.randn(37, 320), torch.randn(200, 320)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w), f(x, w))


def test_fp8_linear_close_to_linear_and_compiles():
    torch.manual_seed(0)
    lin = torch.nn.Linear(320, 200)
    m = Fp8Linear.from_linear(lin)
    x = torch.randn(3, 5, 320)
    y = m(x)
    assert y.shape == (3, 5, 200) and y.dtype == torch.bfloat16
    # fp8 e4m3 has a 3-bit mantissa: quantisation alone gives calc_diff ~ 1e-3 on random data
    assert fp8gemm.calc_diff(y, lin(x)) < 3e-3
    assert torch.equal(torch.compile(m, backend="aot_eager", fullgraph=True)(x), y)


@pytest.mark.parametrize("layout", ["auto", "masked", "contiguous"])
def test_fp8_moe_matches_dense_per_token_computation(layout):
    torch.manual_seed(0)
    g, h, i, t, topk = 4, 256, 192, 9, 2
    moe = Fp8MoE(g, h, i)
    w13, w2 = torch.randn(g, 2 * i, h) / 16, torch.randn(g, h, i) / 16
    moe.load_weights(w13, w2)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(g)[:topk] for _ in range(t)])
    ids[0, 1] = -1  # a dropped slot contributes nothing
    wts = torch.rand(t, topk)
    ref = torch.zeros(t, h)
    for tok in range(t):
        for j in range(topk):
            e = int(ids[tok, j])
            if e < 0:
                continue
            hid = w13[e] @ x[tok]
            ref[tok] += wts[tok, j] * (w2[e] @ (F.silu(hid[:i]) * hid[i:]))
    # two fp8 layers and a bf16 intermediate: a few 1e-3 of quantisation error
    assert fp8gemm.calc_diff(moe(x, ids, wts, layout=layout), ref) < 1e-2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layout", ["masked", "contiguous", "offsets"])
def test_fp8_moe_reads_no_unwritten_memory(layout, device, monkeypatch):
    """Every buffer the layer allocates without zeroing starts as NaN (fp8: its NaN bytes): the
    output has the same bits, so no row of no token (the masked layout's rows past masked_m,
    padding rows) is read before it is written."""
    torch.manual_seed(1)
    g, h, i, t, topk = 4, 256, 192, 9, 2
    moe = Fp8MoE(g, h, i, device=device)
    moe.load_weights(torch.randn(g, 2 * i, h) / 16, torch.randn(g, h, i) / 16)
    x, wts = torch.randn(t, h, device=device), torch.rand(t, topk, device=device)
    ids = torch.stack([torch.randperm(g)[:topk] for _ in range(t)]).to(device)
    want = moe(x, ids, wts, layout=layout)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        if out.dtype.is_floating_point and out.element_size() == 1:
            out.view(torch.uint8).fill_(0x7F)
        elif out.dtype.is_floating_point:
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", poisoned)
    assert torch.equal(moe(x, ids, wts, layout=layout), want)


def test_fp8_moe_masked_capacity_and_bad_layout():
    moe = Fp8MoE(2, 128, 128)
    moe.load_weights(torch.randn(2, 256, 128) / 16, torch.randn(2, 128, 128) / 16)
    x, wts = torch.randn(4, 128), torch.ones(4, 1)
    ids = torch.zeros(4, 1, dtype=torch.int64)  # all four tokens to expert 0
    y = moe(x, ids, wts, layout="masked", max_m=2)  # capacity 2: tokens 2 and 3 dropped
    assert torch.equal(y[2:], torch.zeros_like(y[2:])) and bool(y[:2].abs().sum() > 0)
    with pytest.raises(ValueError, match="^layout must be"):
        moe(x, ids, wts, layout="dense")

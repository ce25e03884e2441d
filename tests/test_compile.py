"""The public API under torch.compile(fullgraph=True): every op and quantiser, eager's bits, no NaN.

torch.compile is slow on the CPU (an inductor compile takes tens of seconds on two cores), so
each backend compiles one function that calls every public op on small awkward shapes.
"""

import pytest
import torch

import fp8gemm

BACKENDS = ("eager", "aot_eager", "inductor")
KS = (128, 320, 1000, 7168)  # K % 128 = 0, 64, 104, 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _every_op(xs, w, xg, wg, m_indices, offsets, masked_m):
    out = []
    for x in xs:  # the quantisers at every K
        out += fp8gemm.quantize_per_token(x)
        out += fp8gemm.quantize_per_token(x, "e5m2", pow2_scales=True, col_major_scales=False)
        out += fp8gemm.quantize_per_block(x)
        out += fp8gemm.silu_mul_quantize_per_token(x)
        out += fp8gemm.quantize_per_tensor(x)
        out += fp8gemm.quantize_per_channel(x)
        out += fp8gemm.quantize_per_token_transposed(x, pow2_scales=True)
        out += fp8gemm.quantize_per_block_transposed(x, "e5m2")
    a, sa = fp8gemm.quantize_per_token(xs[1])
    b, sb = fp8gemm.quantize_per_block(w)
    y = fp8gemm.fp8_gemm_nt((a, sa), (b, sb))
    y32 = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    fp8gemm.fp8_gemm_nt((a, sa), (b, sb), y32, c=y.float())  # out= and c
    ga, gsa = fp8gemm.quantize_per_token(xg)
    gb, gsb = fp8gemm.quantize_per_block(wg)
    yc = fp8gemm.m_grouped_fp8_gemm_nt_contiguous((ga, gsa), (gb, gsb), None, m_indices)
    yo = fp8gemm.m_grouped_fp8_gemm_nt_offsets((ga, gsa), (gb, gsb), None, offsets,
                                               out_dtype=torch.float32)
    ma, msa = fp8gemm.quantize_per_token(xg.view(2, 5, -1))
    ym = torch.full((2, 5, wg.shape[1]), 7.0, dtype=torch.bfloat16,
                    device=y.device)  # rows past masked_m kept
    fp8gemm.m_grouped_fp8_gemm_nt_masked((ma, msa), (gb[:2], gsb[:2]), ym, masked_m, 3)
    # masked_m = [3, 5] of Mmax 5: expert 0's rows 3 and 4 are unspecified
    qm, sm = fp8gemm.silu_mul_quantize_per_token(torch.cat([xg.view(2, 5, -1)] * 2, dim=-1),
                                                 masked_m=masked_m)
    return out + [y, y32, yc, yo, ym, qm[0, :3], qm[1], sm]


def _inputs(device):
    torch.manual_seed(0)
    xs = [torch.randn(37, k) * 3 for k in KS]
    args = (xs, torch.randn(200, 320), torch.randn(10, 320), torch.randn(3, 72, 320),
            torch.tensor([0] * 4 + [-1] * 2 + [2] * 4, dtype=torch.int32),
            torch.tensor([0, 4, 4, 10], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32))
    return ([x.to(device) for x in args[0]],) + tuple(t.to(device) for t in args[1:])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_public_op_compiles_fullgraph_to_eager_bits(backend, device):
    """On a GPU eager runs the Triton and CUDA kernels, the compiled graph their custom ops
    (the transposing quantisers as the quantisers on the transposed view): the same bits."""
    args = _inputs(device)
    ref = _every_op(*args)
    torch._dynamo.reset()
    got = torch.compile(_every_op, backend=backend, fullgraph=True)(*args)
    assert len(got) == len(ref)
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g.dtype == r.dtype and g.shape == r.shape, i
        assert torch.equal(_bits(g), _bits(r)), f"output {i} differs from eager under {backend}"
        if g.is_floating_point() and g.element_size() > 1:
            assert not bool(g.isnan().any()), i
        else:
            assert not bool(g.float().isnan().any()), i


def test_custom_ops_take_the_public_defaults():
    x, w = torch.randn(37, 320), torch.randn(200, 320)
    a, sa = torch.ops.fp8gemm.quantize_per_token(x)
    b, sb = torch.ops.fp8gemm.quantize_per_block(w)
    y = torch.ops.fp8gemm.fp8_gemm_nt(a, sa, b, sb)
    assert y.dtype == torch.bfloat16 and torch.equal(y, fp8gemm.fp8_gemm_nt((a, sa), (b, sb)))
    qa, qsa = fp8gemm.quantize_per_token(torch.randn(2, 5, 320))
    qb, qsb = fp8gemm.quantize_per_block(torch.randn(2, 72, 320))
    masked_m = torch.tensor([2, 5], dtype=torch.int32)
    ym = torch.ops.fp8gemm.m_grouped_fp8_gemm_nt_masked(qa, qsa, qb, qsb, masked_m)
    assert torch.equal(ym, fp8gemm.m_grouped_fp8_gemm_nt_masked((qa, qsa), (qb, qsb), None,
                                                                masked_m))


def test_fake_implementations_match_real_outputs():
    """Shapes, dtypes and strides of every fake implementation against the real op."""
    only_fake = ("test_faketensor",)  # the schema test compares fp8 with allclose: none on CPU
    x = torch.randn(37, 320)
    a, sa = fp8gemm.quantize_per_token(x)
    b, sb = fp8gemm.quantize_per_block(torch.randn(200, 320))
    ops = torch.ops.fp8gemm
    for op, args in [
        (ops.fp8_gemm_nt, (a, sa, b, sb)),
        (ops.fp8_gemm_nt, (a, sa, b, sb, torch.randn(37, 200), torch.float32)),
        (ops.quantize_per_token, (x,)),
        (ops.quantize_per_token, (torch.randn(3, 37, 100), "e5m2", True, False)),
        (ops.quantize_per_token, (torch.randn(3, 8, 128),)),
        (ops.silu_mul_quantize_per_token, (torch.randn(3, 7, 512),)),
        (ops.silu_mul_quantize_per_token, (torch.randn(2, 7, 512), "e4m3", False, True,
                                           torch.tensor([3, 7], dtype=torch.int32))),
        (ops.quantize_per_block, (torch.randn(2, 200, 320),)),
    ]:
        torch.library.opcheck(op, args, test_utils=only_fake)
    ga, gsa = fp8gemm.quantize_per_token(torch.randn(20, 320))
    gb, gsb = fp8gemm.quantize_per_block(torch.randn(3, 200, 320))
    m_indices = torch.tensor([0] * 10 + [-1] * 3 + [2] * 7, dtype=torch.int32)
    torch.library.opcheck(ops.m_grouped_fp8_gemm_nt_contiguous, (ga, gsa, gb, gsb, m_indices),
                          test_utils=only_fake)
    offsets = torch.tensor([0, 10, 10, 20], dtype=torch.int32)
    torch.library.opcheck(ops.m_grouped_fp8_gemm_nt_offsets,
                          (ga, gsa, gb, gsb, offsets, torch.float32), test_utils=only_fake)
    ma, msa = fp8gemm.quantize_per_token(torch.randn(3, 16, 320))
    torch.library.opcheck(ops.m_grouped_fp8_gemm_nt_masked,
                          (ma, msa, gb, gsb, torch.tensor([0, 5, 16], dtype=torch.int32), 8),
                          test_utils=only_fake)


def test_shape_errors_surface_while_tracing_with_the_eager_message():
    a, sa = fp8gemm.quantize_per_token(torch.randn(8, 320))
    b, sb = fp8gemm.quantize_per_block(torch.randn(64, 256))

    def f(a, sa, b, sb):
        return fp8gemm.fp8_gemm_nt((a, sa), (b, sb))

    with pytest.raises(Exception, match="b must be \\[N, K\\] with K = 320"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(a, sa, b, sb)


def test_scale_values_are_still_checked_when_a_compiled_graph_runs_on_the_cpu():
    a, sa = fp8gemm.quantize_per_token(torch.randn(8, 320))
    b, sb = fp8gemm.quantize_per_block(torch.randn(64, 320))
    sb = sb.clone()
    sb[0, 0] = float("nan")
    f = torch.compile(lambda a, sa, b, sb: fp8gemm.fp8_gemm_nt((a, sa), (b, sb)),
                      backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="b scales must be finite"):
        f(a, sa, b, sb)

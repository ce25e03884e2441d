"""Quantisation helpers: rounding error, range, scale rules, layouts, delayed scaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8gemm
from fp8gemm import quant
from fp8gemm.layout import get_tma_aligned_size, is_col_major_tma_aligned
from fp8gemm.problem import Recipe
from fp8gemm.quant import AMAX_FLOOR
from helpers import (E4M3, E5M2, FP8_MAX, FP8_STEP_FRACTION, QUANT_TOL, calc_diff, dequant_b,
                     fp8_half_step, fp8_steps, is_pow2)

FMTS = {"e4m3": E4M3, "e5m2": E5M2}

# quantiser -> the recipe of the scales it returns (`helpers.dequant_b` reads every recipe)
QUANTISERS = {
    "per_token": (fp8gemm.quantize_per_token, "1x128"),
    "per_block": (fp8gemm.quantize_per_block, "128x128"),
    "per_tensor": (fp8gemm.quantize_per_tensor, "tensor"),
    "per_channel": (fp8gemm.quantize_per_channel, "row"),
}


def wide_range(shape) -> torch.Tensor:
    """Normal values whose rows and columns span 2^-8 .. 2^8 in magnitude, in bfloat16."""
    x = torch.randn(shape)
    x *= torch.exp2(torch.empty(shape[0], 1).uniform_(-8, 8))
    x *= torch.exp2(torch.empty(1, shape[1]).uniform_(-2, 2))
    return x.to(torch.bfloat16)


def scaled_value(x, s, recipe):
    """x / scale in float64, scales expanded like dequant_b does."""
    return x.double() / dequant_b(torch.ones_like(x, dtype=torch.float64), s, recipe, False)


@pytest.mark.parametrize("pow2", (False, True), ids=("exact", "pow2"))
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", QUANTISERS)
def test_error_within_half_step(name, fmt, pow2):
    """Every element lands within half an fp8 step of its scaled value x / scale (rounding to
    nearest; 2^-20 relative slack covers the float32 division), and no element leaves the range."""
    fn, recipe = QUANTISERS[name]
    dtype, fmax = FMTS[fmt], FP8_MAX[FMTS[fmt]]
    x = wide_range((200, 320))
    q, s = fn(x, fmt, pow2_scales=pow2)
    assert q.dtype == dtype and q.shape == x.shape and s.dtype == torch.float32
    v = scaled_value(x, s, recipe)
    err = (q.double() - v).abs()
    bound = fp8_half_step(v, dtype) + v.abs() * 2.0 ** -20
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3e}"
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= fmax
    if not pow2:  # scale = amax / fmax: the largest element of every group maps to fmax
        assert q.float().abs().max() == fmax


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", QUANTISERS)
def test_never_beyond_format_max(name, fmt):
    """Huge outliers (and pow2 scales, which round the scale up) never give values beyond
    the format's max or non-finite values: e4m3 stays within 448, e5m2 within 57344."""
    fn, _ = QUANTISERS[name]
    x = torch.randn(130, 320)
    x[3, 7], x[100, 300], x[64, 128] = 1e30, -3e38, 7e4
    for pow2 in (False, True):
        q, s = fn(x, fmt, pow2_scales=pow2)
        qf = q.float()
        assert torch.isfinite(qf).all() and qf.abs().max() <= FP8_MAX[FMTS[fmt]]
        assert torch.isfinite(s).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_scaling_clamps_to_format_max(fmt):
    """Delayed scaling uses an older, smaller amax, so values beyond the format's max occur and
    must be clamped (torch's cast gives inf for e5m2 beyond 57344)."""
    ds = fp8gemm.DelayedScaling(fmt=fmt)
    x = torch.randn(64, 64)
    ds.quantize(x)
    q, _ = ds.quantize(x * 100)
    qf = q.float()
    assert torch.isfinite(qf).all() and qf.abs().max() == FP8_MAX[FMTS[fmt]]


@pytest.mark.parametrize("pow2", (False, True), ids=("exact", "pow2"))
@pytest.mark.parametrize("fmt", FMTS)
def test_all_zero_groups_finite_scale(fmt, pow2):
    """An all-zero group gets the floor scale (finite, positive) and zero values."""
    fmax = FP8_MAX[FMTS[fmt]]
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32) / fmax
    if pow2:
        floor = torch.exp2(torch.ceil(torch.log2(floor)))
    x = torch.randn(256, 384)
    x[:, 128:256] = 0  # one 1x128 group in every row, and two 128x128 blocks
    x[5] = 0  # one whole row
    q, s = fp8gemm.quantize_per_token(x, fmt, pow2_scales=pow2)
    assert torch.equal(s[:, 1], floor.expand(256)) and s[5].eq(floor).all()
    assert (q[:, 128:256].float() == 0).all()
    q, s = fp8gemm.quantize_per_block(x, fmt, pow2_scales=pow2)
    assert torch.equal(s[:, 1], floor.expand(2)) and (q[:, 128:256].float() == 0).all()
    q, s = fp8gemm.quantize_per_channel(x, fmt, pow2_scales=pow2)
    assert s[5] == floor and (q[5].float() == 0).all()
    q, s = fp8gemm.quantize_per_tensor(torch.zeros(4, 8), fmt, pow2_scales=pow2)
    assert torch.equal(s, floor.reshape(1)) and (q.float() == 0).all()
    for t in (s,):
        assert torch.isfinite(t).all() and (t > 0).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", QUANTISERS)
def test_pow2_scales_exact_powers_of_two(name, fmt):
    fn, _ = QUANTISERS[name]
    x = wide_range((130, 320))
    _, s = fn(x, fmt, pow2_scales=True)
    assert is_pow2(s)
    _, s = fn(x, fmt)  # and without the option they are generally not
    assert not is_pow2(s)


@pytest.mark.parametrize("k", (100, 128, 320, 7168))
@pytest.mark.parametrize("m", (1, 37, 128, 130))
def test_per_token_scales_col_major_tma_aligned(m, k):
    """Per-token scales come back [M, ceil(K/128)], column-major, M padded to 4 floats (16 B)."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    q, s = fp8gemm.quantize_per_token(x)
    kb, mp = -(-k // 128), get_tma_aligned_size(m, 4)
    assert s.shape == (m, kb) and mp % 4 == 0
    assert is_col_major_tma_aligned(s)
    if kb > 1:
        assert s.stride() == (1, mp)
    assert fp8gemm.get_col_major_tma_aligned_tensor(s) is s
    q2, s2 = fp8gemm.quantize_per_token(x, col_major_scales=False)
    assert s2.is_contiguous() and torch.equal(s2, s) and torch.equal(q2.float(), q.float())


@pytest.mark.parametrize("name", QUANTISERS)
def test_e5m2(name):
    fn, recipe = QUANTISERS[name]
    x = wide_range((130, 320))
    q, s = fn(x, "e5m2")
    assert q.dtype == torch.float8_e5m2 and q.float().abs().max() == 57344.0
    assert calc_diff(dequant_b(q, s, recipe, False), x) < QUANT_TOL[E5M2]


def test_irregular_k_and_n():
    """K and N not multiples of 128: the last group's scale comes from its real elements only."""
    x = torch.randn(200, 320) * 3
    x[:, 256:] *= 0.01  # a small last K group: padding must not change its scale
    q, s = fp8gemm.quantize_per_token(x)
    assert s.shape == (200, 3)
    torch.testing.assert_close(s[:, 2], x[:, 256:].abs().amax(1) / 448, rtol=1e-6, atol=0)
    q, s = fp8gemm.quantize_per_block(x)
    assert s.shape == (2, 3)
    torch.testing.assert_close(s[1, 2], x[128:, 256:].abs().amax() / 448, rtol=1e-6, atol=0)
    for k in (1, 100, 129):
        xk = torch.randn(37, k)
        for fn, recipe in QUANTISERS.values():
            q, s = fn(xk)
            assert q.shape == (37, k)
            assert calc_diff(dequant_b(q, s, recipe, False), xk) < QUANT_TOL[E4M3]


@pytest.mark.parametrize("name", ("per_token", "per_block", "per_channel"))
def test_leading_batch_dims(name):
    """[G, M, K] quantises like each [M, K] slice: per-token (activations of masked MoE),
    per-block (expert weights [G, N, K]), per-channel."""
    fn, _ = QUANTISERS[name]
    x = torch.randn(3, 37, 320, dtype=torch.bfloat16)
    q, s = fn(x)
    assert q.shape == x.shape and s.shape[0] == 3
    for g in range(3):
        qg, sg = fn(x[g])
        assert torch.equal(q[g].float(), qg.float()) and torch.equal(s[g], sg)
    if name == "per_token":
        assert s.shape == (3, 37, 3) and is_col_major_tma_aligned(s)
        assert fp8gemm.get_col_major_tma_aligned_tensor(s) is s
    if name == "per_block":
        assert s.shape == (3, 1, 3)


def test_empty_inputs():
    """M = 0 (an expert that got no tokens) quantises to empty tensors."""
    x = torch.zeros(0, 320)
    for name, (fn, _) in QUANTISERS.items():
        q, s = fn(x)
        assert q.shape == (0, 320), name


def test_silu_mul_quantize_per_token():
    x = torch.randn(37, 2 * 320, dtype=torch.bfloat16)
    q, s = fp8gemm.silu_mul_quantize_per_token(x)
    g, u = x.float().chunk(2, dim=-1)
    q2, s2 = fp8gemm.quantize_per_token(F.silu(g) * u)
    assert torch.equal(q.float(), q2.float()) and torch.equal(s, s2) and is_col_major_tma_aligned(s)
    with pytest.raises(ValueError, match="x"):
        fp8gemm.silu_mul_quantize_per_token(torch.randn(4, 7))


def _check_masked_rows(got, x, masked_m):
    """The tokens' rows of silu_mul_quantize_per_token(x, masked_m=...) equal the unmasked
    result on them; every other row has an all-zero group's scale."""
    q, s = got
    q0, s0 = fp8gemm.silu_mul_quantize_per_token(torch.nan_to_num(x))
    zero_scale = quant.silu_mul_per_token_torch(torch.zeros(1, 1, 256), "e4m3", False, True)[1]
    for e, rows in enumerate(masked_m.tolist()):
        rows = min(max(rows, 0), x.shape[1])
        assert torch.equal(q[e, :rows].view(torch.uint8), q0[e, :rows].view(torch.uint8)), e
        assert torch.equal(s[e, :rows], s0[e, :rows]), e
        assert bool((s[e, rows:] == zero_scale.flatten()[0]).all()), e


def test_silu_mul_masked_m_reads_only_the_tokens_rows():
    """masked_m (decode MoE's masked layout): the rows of no token are not read on any path, so
    they may hold anything (NaN, inf: an output buffer nobody zeroed); masked_m is clamped to
    [0, Mmax] and may be strided."""
    x = torch.randn(5, 6, 2 * 256, dtype=torch.bfloat16)
    mm = torch.tensor([0, 2, 9, -1, 6], dtype=torch.int32)
    for e, rows in enumerate(mm.tolist()):
        x[e, max(rows, 0):, ::3] = float("nan")
        x[e, max(rows, 0):, 1::3] = float("inf")
    _check_masked_rows(fp8gemm.silu_mul_quantize_per_token(x, masked_m=mm), x, mm)
    strided = torch.stack([mm, mm], dim=1)[:, 0]
    assert not strided.is_contiguous()
    _check_masked_rows(fp8gemm.silu_mul_quantize_per_token(x, masked_m=strided), x, mm)


def test_silu_mul_masked_m_is_checked():
    x = torch.randn(3, 6, 2 * 256, dtype=torch.bfloat16)
    mm = torch.tensor([0, 2, 9], dtype=torch.int32)
    for bad, err, match in [
            (torch.tensor([1, 2, 3]), TypeError, "^masked_m must be torch.int32, got torch.int64"),
            (torch.tensor([1, 2], dtype=torch.int32), ValueError,
             r"^masked_m must have shape \[3\], got \[2\]"),
            (torch.tensor([[1, 2, 3]], dtype=torch.int32), ValueError, "^masked_m must have shape"),
            (mm.to("meta"), ValueError, "^masked_m must be on cpu like x, got meta"),
            ([1, 2, 3], TypeError, "^masked_m must be a torch.int32 tensor, got list")]:
        with pytest.raises(err, match=match):
            fp8gemm.silu_mul_quantize_per_token(x, masked_m=bad)
    with pytest.raises(ValueError, match=r"x must be \[G, Mmax, 2I\]"):
        fp8gemm.silu_mul_quantize_per_token(x[0], masked_m=mm)


# ---------------------------------------------------------------------------------------------
# Delayed scaling


def test_delayed_scaling_history():
    ds = fp8gemm.DelayedScaling(history_len=3)
    x1 = torch.randn(64, 64)
    a1 = x1.abs().max()
    # first call: no history yet, the current amax sets the scale
    q, s = ds.quantize(x1)
    torch.testing.assert_close(s, (a1 / 448).reshape(1), rtol=1e-6, atol=0)
    assert ds.amax_history[0] == a1 and (ds.amax_history[1:] == 0).all()
    # later calls: the history max sets the scale, not the current amax; values beyond clamp
    x2 = x1 * 4
    q, s = ds.quantize(x2)
    torch.testing.assert_close(s, (a1 / 448).reshape(1), rtol=1e-6, atol=0)
    assert q.float().abs().max() == 448 and torch.isfinite(q.float()).all()
    assert ds.amax_history[0] == 4 * a1 and ds.amax_history[1] == a1
    _, s = ds.quantize(x1 * 0.5)
    torch.testing.assert_close(s, (4 * a1 / 448).reshape(1), rtol=1e-6, atol=0)
    # the window is history_len long: after 3 more small calls the large amax is gone
    for _ in range(3):
        _, s = ds.quantize(x1 * 0.5)
    torch.testing.assert_close(s, (0.5 * a1 / 448).reshape(1), rtol=1e-6, atol=0)
    assert torch.equal(ds.amax_history, (0.5 * a1).expand(3))


def test_delayed_scaling_options():
    x = torch.randn(64, 64)
    a = x.abs().max()
    _, s = fp8gemm.DelayedScaling(margin=2).quantize(x)
    torch.testing.assert_close(s, (4 * a / 448).reshape(1), rtol=1e-6, atol=0)
    _, s = fp8gemm.DelayedScaling(pow2_scales=True).quantize(x)
    assert is_pow2(s) and s >= a / 448
    q, s = fp8gemm.DelayedScaling(fmt="e5m2").quantize(x)
    assert q.dtype == torch.float8_e5m2 and q.float().abs().max() == 57344
    for bad in ({"history_len": 0}, {"margin": -1}, {"fmt": "e3m4"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fp8gemm.DelayedScaling(**bad)


def test_delayed_scaling_needs_no_host_sync():
    """On 'meta' tensors there are no values to read, so any host synchronisation (item(),
    bool(), tolist()) would raise: quantising there shows the helper never reads back."""
    ds = fp8gemm.DelayedScaling(history_len=4, device="meta")
    for _ in range(2):
        q, s = ds.quantize(torch.empty(16, 64, device="meta"))
    assert q.device.type == "meta" and s.shape == (1,)


# ---------------------------------------------------------------------------------------------
# calc_diff


def test_calc_diff():
    x = torch.randn(100, 100)
    assert fp8gemm.calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert fp8gemm.calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert fp8gemm.calc_diff(x, -x) == pytest.approx(2.0)
    y = x + 0.01 * torch.randn(100, 100)
    assert fp8gemm.calc_diff(x, y) == pytest.approx(calc_diff(x, y), rel=1e-9)
    assert fp8gemm.calc_diff(1e3 * x, 1e3 * y) == pytest.approx(calc_diff(x, y), rel=1e-6)
    assert fp8gemm.calc_diff(x.bfloat16(), y) == pytest.approx(calc_diff(x.bfloat16(), y))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["per_token", "per_block", "silu_mul", "per_token_transposed",
                                  "per_block_transposed"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cuda_quantisation_matches_cpu_spec(name, fmt):
    """On a GPU the public quantisers run Triton kernels; the torch code on the CPU is their spec.
    Scales must agree to float rounding, and values to one fp8 step on a small fraction of the
    elements (x/scale computed as a product with the reciprocal may round a near-tie the other
    way)."""
    fn = {"per_token": fp8gemm.quantize_per_token, "per_block": fp8gemm.quantize_per_block,
          "silu_mul": fp8gemm.silu_mul_quantize_per_token,
          "per_token_transposed": fp8gemm.quantize_per_token_transposed,
          "per_block_transposed": fp8gemm.quantize_per_block_transposed}[name]
    x = torch.randn(3, 301, 1000) * 4
    q_cpu, s_cpu = fn(x, fmt)
    q_gpu, s_gpu = fn(x.cuda(), fmt)
    torch.testing.assert_close(s_gpu.cpu(), s_cpu, rtol=1e-6, atol=0)
    assert s_gpu.stride() == s_cpu.stride()
    steps = fp8_steps(q_gpu.cpu(), q_cpu)
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) <= FP8_STEP_FRACTION


def test_triton_quantisers_compile_for_sm90():
    """The quantisation kernels as launched (rows with SiLU*mul, also on the masked layout, rows
    of a transposed view, the transposing per-token kernel, blocks with power-of-two scales,
    blocks transposed) compile for sm_90a with no local memory."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from fp8gemm.backends.triton import quant as kernels

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton without its ptxas")
    compiled = kernels.compile_kernels(GPUTarget("cuda", 90, 32))
    assert len(compiled) == 6
    for name, k in compiled:
        ptx = k.asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx, name
        assert "ld.global" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx, name


@pytest.mark.parametrize("fmt", ("e4m3", "e5m2"))
def test_dequantize_per_block_is_q_times_its_block_scale(fmt):
    """dequantize_per_block multiplies each element by its own 128x128 block's scale (irregular
    N and K, leading expert dim), matching the tests' float64 dequantisation."""
    w = torch.randn(3, 300, 260) * torch.logspace(-3, 2, 260)
    q, s = fp8gemm.quantize_per_block(w, fmt)
    d = fp8gemm.dequantize_per_block(q, s, torch.float64)
    for g in range(3):
        assert torch.equal(d[g], dequant_b(q[g], s[g], Recipe.BLOCK, False))
    assert calc_diff(d, w) < QUANT_TOL[E4M3 if fmt == "e4m3" else E5M2]
    assert fp8gemm.dequantize_per_block(q, s).dtype == torch.bfloat16
    assert torch.equal(fp8gemm.dequantize_per_block(q, s, torch.float32),
                       (q.float() * s.repeat_interleave(128, -2)[:, :300]
                        .repeat_interleave(128, -1)[..., :260]))


def test_dequantize_per_block_errors():
    q, s = fp8gemm.quantize_per_block(torch.randn(130, 260))
    with pytest.raises(TypeError, match="q must be a float8_e4m3fn or float8_e5m2 tensor, got "
                                        "torch.float32"):
        fp8gemm.dequantize_per_block(q.float(), s)
    with pytest.raises(ValueError, match=r"scale must be \[2, 3\] for q of shape \[130, 260\] "
                                         r"\(one per 128x128 block\), got \[3, 2\]"):
        fp8gemm.dequantize_per_block(q, s.T)
    with pytest.raises(TypeError, match="scale must be a float32, float16 or bfloat16"):
        fp8gemm.dequantize_per_block(q, q[:2, :3])
    with pytest.raises(TypeError, match="dtype must be a float32, float16 or bfloat16 dtype"):
        fp8gemm.dequantize_per_block(q, s, torch.int32)

"""Training through FP8 GEMMs: the transposing quantisers, the autograd of Fp8Linear and Fp8MoE,
and small models trained against the same models in float32.

CPU tests run the reference backend; every test has a `gpu` twin on CUDA tensors (Hopper).
Gradients are checked two ways: against float64 on the dequantised operands the backward
multiplies (so only the GEMMs' own error is counted), and against the float64 gradient of the
unquantised layer (where quantisation error is counted, with a bound from the tolerance table).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8gemm
from fp8gemm.nn import Fp8Linear, Fp8MoE
from fp8gemm.problem import SCALE_BLOCK, Recipe, ceil_div
from helpers import (E4M3, E5M2, FP8_STEP_FRACTION, QUANT_TOL, TENSOR_CORE_FP32_DIFF, TOL,
                     calc_diff, dequant_a, dequant_b, fp8_steps, is_pow2, ref_gemm,
                     ref_quant_groups)

FMT_DTYPE = {"e4m3": E4M3, "e5m2": E5M2}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def one_thread():
    """One intra-op thread: the reference backend's small GEMMs run several times faster on a
    shared 2-core machine than with a thread pool fighting the other processes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Quantise-and-transpose


def _ref_token_transposed(x: torch.Tensor, fmt: str, pow2: bool):
    """float64 spec of quantize_per_token_transposed: x [T, C] -> (q [C, T], s [C, ceil(T/128)]),
    groups of 128 along T, the short last group padded with zeros (which leave amax alone)."""
    t, c = x.shape
    tb = ceil_div(t, SCALE_BLOCK)
    xt = torch.zeros(c, tb * SCALE_BLOCK, dtype=torch.float64, device=x.device)
    xt[:, :t] = x.double().t()
    q, s = ref_quant_groups(xt.view(c, tb, SCALE_BLOCK), fmt, pow2)
    return q.view(c, -1)[:, :t], s


def _check_cast(q, s, q_ref, s_ref, pow2: bool, what: str) -> None:
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape, what
    assert q.is_contiguous(), f"{what}: q must be row-major"
    if pow2:
        assert is_pow2(s) and torch.equal(s.double(), s_ref), f"{what}: power-of-two scales"
    else:
        torch.testing.assert_close(s.double(), s_ref, rtol=1e-6, atol=0, msg=what)
    steps = fp8_steps(q.cpu(), q_ref.cpu())
    if steps.numel() == 0:
        return
    assert int(steps.max()) <= 1, f"{what}: an element {int(steps.max())} fp8 steps off"
    assert float((steps > 0).float().mean()) <= FP8_STEP_FRACTION, what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("t, c", [(1, 1), (37, 200), (128, 128), (300, 257), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_per_token_transposed(device, fmt, pow2, t, c, dtype):
    x = (torch.randn(t, c, device=device) * torch.logspace(-3, 2, c, device=device)).to(dtype)
    q, s = fp8gemm.quantize_per_token_transposed(x, fmt, pow2_scales=pow2)
    q_ref, s_ref = _ref_token_transposed(x, fmt, pow2)
    assert tuple(s.shape) == (c, ceil_div(t, SCALE_BLOCK))
    if c and t:
        assert s.stride(0) == 1, "scales column-major (the A-scale layout the kernels read)"
    _check_cast(q, s, q_ref, s_ref, pow2, f"[{t}, {c}] {dtype} {fmt}")
    _, s_rows = fp8gemm.quantize_per_token_transposed(x, fmt, pow2_scales=pow2,
                                                      col_major_scales=False)
    assert s_rows.is_contiguous() and torch.equal(s_rows, s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (200, 320), (256, 128), (3, 130, 70)])
def test_quantize_per_block_transposed(device, fmt, pow2, shape):
    """float64 spec: W^T [..., K, N] in 128x128 blocks; and the bits of the forward copy
    transposed (a block of W^T holds one block of W)."""
    w = torch.randn(shape, device=device) * torch.logspace(-2, 2, shape[-1], device=device)
    q, s = fp8gemm.quantize_per_block_transposed(w, fmt, pow2_scales=pow2)
    *lead, n, k = shape
    kb, nb = ceil_div(k, SCALE_BLOCK), ceil_div(n, SCALE_BLOCK)
    assert tuple(q.shape) == (*lead, k, n) and tuple(s.shape) == (*lead, kb, nb)
    wt = torch.zeros(*lead, kb * SCALE_BLOCK, nb * SCALE_BLOCK, dtype=torch.float64,
                     device=device)
    wt[..., :k, :n] = w.double().transpose(-1, -2)
    blocks = wt.unflatten(-1, (nb, SCALE_BLOCK)).unflatten(-3, (kb, SCALE_BLOCK))
    blocks = blocks.transpose(-3, -2).flatten(-2)  # [..., kb, nb, 128*128]
    q_ref, s_ref = ref_quant_groups(blocks, fmt, pow2)
    q_ref = q_ref.unflatten(-1, (SCALE_BLOCK, SCALE_BLOCK)).transpose(-3, -2)
    q_ref = q_ref.flatten(-4, -3).flatten(-2, -1)[..., :k, :n]
    _check_cast(q, s, q_ref, s_ref, pow2, f"{shape} {fmt}")
    qf, sf = fp8gemm.quantize_per_block(w, fmt, pow2_scales=pow2)
    assert torch.equal(q.view(torch.uint8), qf.transpose(-1, -2).view(torch.uint8))
    assert torch.equal(s, sf.transpose(-1, -2))


def test_transposed_quantisers_errors():
    with pytest.raises(TypeError, match="x must be"):
        fp8gemm.quantize_per_token_transposed(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 2 dims"):
        fp8gemm.quantize_per_block_transposed(torch.zeros(4))
    with pytest.raises(ValueError, match="fmt"):
        fp8gemm.quantize_per_token_transposed(torch.zeros(4, 4), "e3m4")


_INTERPRETED = """
import torch
from fp8gemm.backends.triton import quant as tq
from fp8gemm.quant import per_block_torch, per_token_torch
torch.manual_seed(0)
for fmt in ("e4m3", "e5m2"):
    x = torch.randn(300, 200, dtype=torch.bfloat16)
    q, s = tq.quantize_per_token(x.t(), fmt)          # the GPU path: strided read, one pass
    q0, s0 = per_token_torch(x.t().contiguous(), fmt, False, True)
    w = torch.randn(200, 300)
    qb, sb = tq.quantize_per_block(w.t(), fmt)
    qb0, sb0 = per_block_torch(w.t().contiguous(), fmt, False)
    for a, b in ((q, q0), (qb, qb0)):
        d = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
        assert a.is_contiguous() and float((d > 0).float().mean()) <= 1e-3 and int(d.max()) <= 1
    assert torch.allclose(s, s0, rtol=1e-6) and torch.allclose(sb, sb0, rtol=1e-6)
print("ok")
"""


def test_transposed_quantisers_triton_interpreted():
    """On a GPU the transposing quantisers are the Triton kernels reading a transposed view;
    under TRITON_INTERPRET=1 they give the torch spec's values on it (a fresh process:
    Triton chooses the interpreter when first imported)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


# ---------------------------------------------------------------------------------------------
# Fp8Linear gradients


def _linear(k, n, device, master=torch.float32, grad_format="e4m3", pow2=False, bias=True,
            out_dtype=torch.float32):
    return Fp8Linear(k, n, bias, trainable=True, master_dtype=master, grad_format=grad_format,
                     pow2_scales=pow2, out_dtype=out_dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("t, k, n", [(37, 200, 300), (1, 128, 64), (130, 256, 129)])
def test_linear_gradients_on_dequantised_operands(device, grad_format, pow2, t, k, n):
    """dX, dW, db against float64 on exactly the fp8 operands the backward multiplies, so the
    GEMMs' error is all that counts: the float32 bound of the tolerance table (on the GPU its
    tensor-core bound)."""
    layer = _linear(k, n, device, grad_format=grad_format, pow2=pow2)
    x = torch.randn(t, k, device=device, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = layer.weight.detach()
    g, sg = fp8gemm.quantize_per_token(dy, grad_format, pow2_scales=pow2)
    wt, swt = fp8gemm.quantize_per_block_transposed(w, "e4m3", pow2_scales=pow2)
    dx_ref = ref_gemm(g, sg, Recipe.GROUP, wt, swt, Recipe.BLOCK)
    gt, sgt = fp8gemm.quantize_per_token_transposed(dy, grad_format, pow2_scales=pow2)
    xt, sxt = fp8gemm.quantize_per_token_transposed(x.detach(), "e4m3", pow2_scales=pow2)
    dw_ref = dequant_a(gt, sgt, Recipe.GROUP) @ dequant_b(xt, sxt, Recipe.GROUP, False).T
    fp32 = TOL[torch.float32] if x.device.type == "cpu" else TENSOR_CORE_FP32_DIFF
    for got, ref, what in ((x.grad, dx_ref, "dX"), (layer.weight.grad, dw_ref, "dW"),
                           (layer.bias.grad, dy.double().sum(0), "db")):
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), what
        assert calc_diff(got, ref) < fp32, f"{what}: {calc_diff(got, ref):.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_linear_gradients_against_unquantised(device, grad_format):
    """Against the float64 gradient of the unquantised layer. Each GEMM multiplies two rounded
    operands whose errors are independent, so calc_diff is about the sum of their quantisation
    calc_diffs: dX rounds dY (grad_format) and W^T (e4m3), dW rounds dY^T and X^T. Bound: the
    sum of the two formats' quantisation bounds (3x over the expected values)."""
    layer = _linear(320, 200, device, grad_format=grad_format)
    x = torch.randn(150, 320, device=device, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, wd, bd = (v.detach().double().requires_grad_() for v in (x, layer.weight, layer.bias))
    nn.functional.linear(xd, wd, bd).backward(dy.double())
    bound = QUANT_TOL[FMT_DTYPE[grad_format]] + QUANT_TOL[E4M3]
    for got, ref, what in ((x.grad, xd.grad, "dX"), (layer.weight.grad, wd.grad, "dW")):
        assert calc_diff(got, ref) < bound, f"{what}: {calc_diff(got, ref):.2e} >= {bound:.1e}"


def test_linear_bias_gradient_finite_differences():
    """Finite differences are meaningful for the bias only: it is added in float32, unquantised,
    so L = sum(y * dy) is affine in it (x and W pass through fp8 rounding, which makes L
    piecewise constant in them and their difference quotients zero or jumps). With step h the
    central difference is exact up to float32 rounding of L: |L| * 2^-24 * 2 / (2h)."""
    layer = _linear(256, 64, "cpu")
    x = torch.randn(40, 256)
    dy = torch.randn(40, 64)
    out = layer(x)
    (out * dy).sum().backward()
    h = 0.5
    with torch.no_grad():
        for i in (0, 17, 63):
            layer.bias[i] += h
            up = float((layer(x).double() * dy).sum())
            layer.bias[i] -= 2 * h
            down = float((layer(x).double() * dy).sum())
            layer.bias[i] += h
            fd = (up - down) / (2 * h)
            slack = 4 * abs(up) * 2.0**-24 / h + 1e-6
            assert abs(fd - float(layer.bias.grad[i])) <= slack, (i, fd, float(layer.bias.grad[i]))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_master_bf16_and_requantise(device):
    """bf16 master weights get bf16 gradients; the fp8 copy follows every in-place update of the
    master (its version counter), and refresh_weight() catches writes through .data."""
    layer = _linear(256, 128, device, master=torch.bfloat16, out_dtype=torch.bfloat16)
    x = torch.randn(16, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().square().sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.bias.grad.dtype == torch.float32

    def expected():
        b, sb = fp8gemm.quantize_per_block(layer.weight.detach())
        a, sa = fp8gemm.quantize_per_token(x.detach())
        return fp8gemm.fp8_gemm_nt((a, sa), (b, sb), c=layer.bias.detach().expand(16, 128))

    with torch.no_grad():
        before = layer(x)
        torch.optim.SGD(layer.parameters(), lr=1.0).step()  # in place: the version moves
        after = layer(x)
        assert not torch.equal(before, after) and torch.equal(after, expected())
        layer.weight.data.mul_(2)  # bypasses the version counter
        layer.refresh_weight()
        assert torch.equal(layer(x), expected())


def test_linear_training_options_errors():
    with pytest.raises(TypeError, match="master_dtype"):
        Fp8Linear(128, 128, trainable=True, master_dtype=torch.float16)
    with pytest.raises(ValueError, match="grad_format"):
        Fp8Linear(128, 128, trainable=True, grad_format="e4m4")
    with pytest.raises(TypeError, match="trainable"):
        Fp8Linear(128, 128, trainable=1)
    with pytest.raises(ValueError, match="reset_parameters needs trainable"):
        Fp8Linear(128, 128).reset_parameters()


def test_linear_inference_mode_unchanged():
    """The default layer keeps fp8 buffers and no parameters that train."""
    layer = Fp8Linear(256, 128)
    assert layer.weight.dtype == E4M3 and not layer.bias.requires_grad
    assert set(layer.state_dict()) == {"weight", "weight_scale", "bias"}
    trained = _linear(256, 128, "cpu")
    assert set(trained.state_dict()) == {"weight", "bias"}
    assert all(p.requires_grad for p in trained.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_linear_compiled_step_gives_eager_bits(device, one_thread):
    """torch.compile(fullgraph=True) of forward + loss, with its compiled backward (aot_eager):
    the same bits as eager for dX, dW, db."""
    torch._dynamo.reset()
    layer = _linear(200, 136, device, grad_format="e5m2")
    x = torch.randn(37, 200, device=device, requires_grad=True)
    target = torch.randn(37, 136, device=device)

    def step(x, target):
        return (layer(x) - target).square().mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (compiled, step):
        x.grad = None
        layer.zero_grad()
        loss = fn(x, target)
        loss.backward()
        grads.append((loss.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# Fp8MoE gradients


def _route(t, g, topk, device, gen):
    logits = torch.randn(t, g, device=device, generator=gen)
    w, ids = logits.topk(topk, dim=-1)
    return ids, torch.softmax(w, dim=-1)


def _moe_reference(x, ids, tw, w13, w2):
    """y[t] = sum_k tw[t, k] * W2[e] . (silu(W1[e] x) * W3[e] x), in x's dtype (autograd)."""
    i = w2.shape[-1]
    y = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].T
        z = nn.functional.silu(h[:, :i]) * h[:, i:]
        y = y.index_add(0, tok, (z @ w2[e].T) * tw[tok, slot, None])
    return y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "offsets"])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_moe_gradients_against_unquantised(device, layout, grad_format, one_thread):
    """Against float64 autograd of the unquantised MoE, with an expert that gets no token. The
    forward rounds x, W13, z, W2 (e4m3) and h13, y (bf16): calc_diff about 4 e4m3 roundings;
    each gradient GEMM adds its two operands' roundings to the error of what it is fed. Bound:
    the forward's 4 e4m3 bounds plus two grad_format bounds (3x over the expected values)."""
    gen = torch.Generator(device=device).manual_seed(3)
    g, h, i, t = 6, 256, 128, 40
    moe = Fp8MoE(g, h, i, trainable=True, master_dtype=torch.float32, grad_format=grad_format,
                 device=device)
    ids, tw = _route(t, g - 1, 2, device, gen)  # expert g - 1 gets no token
    tw.requires_grad_()
    x = torch.randn(t, h, device=device, generator=gen, requires_grad=True)
    y = moe(x, ids, tw, layout=layout)
    dy = torch.randn(y.shape, device=device, generator=gen)
    y.backward(dy)
    leaves = [v.detach().double().requires_grad_() for v in (x, moe.w13, moe.w2, tw)]
    y_ref = _moe_reference(leaves[0], ids, leaves[3], leaves[1], leaves[2])
    y_ref.backward(dy.double())
    bound = 4 * QUANT_TOL[E4M3] + 2 * QUANT_TOL[FMT_DTYPE[grad_format]]
    assert calc_diff(y, y_ref) < 4 * QUANT_TOL[E4M3]
    for got, ref, what in zip((x.grad, moe.w13.grad, moe.w2.grad, tw.grad),
                              [v.grad for v in leaves], ("dX", "dW13", "dW2", "dtopk_weights")):
        assert torch.isfinite(got).all(), what
        assert calc_diff(got, ref) < bound, f"{what}: {calc_diff(got, ref):.2e} >= {bound:.1e}"
    assert torch.equal(moe.w13.grad[g - 1], torch.zeros_like(moe.w13.grad[g - 1]))


def test_moe_training_refuses_masked():
    moe = Fp8MoE(4, 128, 128, trainable=True)
    x = torch.randn(8, 128)
    ids = torch.zeros(8, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="layout='masked'"):
        moe(x, ids, torch.ones(8, 1), layout="masked")
    with torch.no_grad():  # no gradient: the masked inference path on the fp8 copies
        assert moe(x, ids, torch.ones(8, 1), layout="masked").shape == (8, 128)


# ---------------------------------------------------------------------------------------------
# Training runs


E4M3_ROUNDING = 2 * QUANT_TOL[E4M3] / 3  # relative mean-square error of one e4m3 rounding
GRAD_ROUNDING = {"e4m3": E4M3_ROUNDING, "e5m2": 2 * QUANT_TOL[E5M2] / 3}


def loss_gap_bound(forward_roundings: int, grad_format: str, target_power: float,
                   first_loss: float, last_loss: float, steps: int) -> float:
    """The largest |L_fp8 - L_ref| expected after `steps` steps from the same start on the same
    batches (derived in `test_mlp_trains_like_float32`), with a safety factor of 2."""
    rho_f = forward_roundings * E4M3_ROUNDING
    rho_g = GRAD_ROUNDING[grad_format] + E4M3_ROUNDING
    return 2 * (rho_f * target_power + math.sqrt(rho_g / steps) * (first_loss - last_loss))


def _train(model_fn, batches, steps, lr=2e-3):
    model, forward = model_fn()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        x, y = batches(s)
        loss = (forward(x).float() - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _tail(losses, n=20):
    return sum(losses[-n:]) / n


@pytest.mark.parametrize("device, steps", [("cpu", 150),
                                           pytest.param("cuda", 400, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_mlp_trains_like_float32(device, steps, grad_format, one_thread):
    """Two Fp8Linear (256 wide, ReLU between, float32 master weights) against the same MLP of
    nn.Linear in float32, same start, same batches, Adam: the mean loss of the last 20 steps
    within `loss_gap_bound`.

    Derivation. Rounding a value to e4m3 leaves a relative mean-square error rho_1 = 2/3 of the
    e4m3 quantisation bound (calc_diff is half the relative mean-square error and its bound is
    3x the expected value), independent between operands. A GEMM output then carries the sum of
    its operands' rho, and a second layer adds its own: the fp8 forward gives y8 = y (1 + d)
    with E[d^2] = rho_f = 4 rho_1 (x and W of both layers; the bf16/fp32 output rounding is
    1e4 times smaller). d is zero-mean and independent of the residual, so the loss rises by
    rho_f * E[y^2] <= rho_f * E[target^2] (a fit no worse than zero). The gradients carry
    rho_g = rho(grad_format) + rho_1; a zero-mean relative error in each step's update moves the
    trajectory by independent kicks of relative size sqrt(rho_g), whose effect on the loss after
    S steps is a random walk: sqrt(rho_g / S) of the loss the reference run descended. Bound:
    twice the sum (correlations between the terms, the relu's gain).

    Measured on the CPU (150 steps): float32 0.1443, fp8 0.1449 (e4m3 gradients, gap 6e-4,
    bound 5.1e-3) and 0.1451 (e5m2, gap 8e-4, bound 8.3e-3): 0.4-0.5 % of the loss.
    """
    width, t = 256, 64
    gen = torch.Generator(device=device).manual_seed(1)
    teacher = [torch.randn(width, width, device=device, generator=gen) / width**0.5
               for _ in range(2)]
    data = []
    for _ in range(steps):
        x = torch.randn(t, width, device=device, generator=gen)
        data.append((x, torch.relu(x @ teacher[0]) @ teacher[1]))
    torch.manual_seed(2)
    start = [nn.Linear(width, width, device=device) for _ in range(2)]

    def reference():
        layers = [nn.Linear(width, width, device=device) for _ in range(2)]
        for new, old in zip(layers, start):
            new.load_state_dict(old.state_dict())
        model = nn.Sequential(layers[0], nn.ReLU(), layers[1])
        return model, model

    def fp8():
        layers = [Fp8Linear.from_linear(old, out_dtype=torch.float32, trainable=True,
                                        master_dtype=torch.float32, grad_format=grad_format)
                  for old in start]
        model = nn.Sequential(layers[0], nn.ReLU(), layers[1])
        return model, model

    ref = _train(reference, data.__getitem__, steps)
    got = _train(fp8, data.__getitem__, steps)
    power = float(torch.stack([y.square().mean() for _, y in data]).mean())
    bound = loss_gap_bound(4, grad_format, power, ref[0], _tail(ref), steps)
    gap = abs(_tail(got) - _tail(ref))
    assert _tail(ref) < 0.5 * ref[0], "the reference must learn for the comparison to mean much"
    assert gap < bound, f"fp8 {_tail(got):.5f} vs float32 {_tail(ref):.5f}: gap {gap:.2e} >= " \
                        f"{bound:.2e}"


MOE_TASK = (8, 256, 128)  # experts, hidden, intermediate of the MoE training tests


def _moe_task_batches(device, t=32, batches=8):
    """`batches` batches of `t` tokens, their top-2 routes and the targets of a random teacher
    MoE of the MOE_TASK shape, to be cycled so that a student can fit them.
    NOTE: the data comes from the CPU generator on every device, so the GPU runs train on the
    same batches as the CPU ones (whose references are known to learn)."""
    g, h, i = MOE_TASK
    gen = torch.Generator().manual_seed(5)
    teacher = (torch.randn(g, 2 * i, h, generator=gen) / h**0.5,
               torch.randn(g, h, i, generator=gen) / i**0.5)
    data = []
    for _ in range(batches):
        x = torch.randn(t, h, generator=gen)
        ids, tw = _route(t, g, 2, "cpu", gen)
        y = _moe_reference(x, ids, tw, *teacher)
        data.append(((x.to(device), ids.to(device), tw.to(device)), y.to(device)))
    return data


@pytest.mark.parametrize("device, steps", [("cpu", 100),
                                           pytest.param("cuda", 100, marks=pytest.mark.gpu)])
def test_moe_trains_like_float32(device, steps, one_thread):
    """Fp8MoE (8 experts, top-2, hidden 256, intermediate 128, float32 masters, e5m2 gradients,
    offsets layout on the CPU, contiguous on the GPU) against the same MoE in float32 torch,
    same start, same batches and routes (a random teacher MoE of the same shape gives the
    targets; 8 batches of 32 tokens, cycled, so that the student can fit them), Adam: the mean
    loss of the last 20 steps within `loss_gap_bound`, derived as for the MLP with 4 e4m3
    roundings in the forward (x, W13, z, W2; the bf16 roundings of h13 and y are 1e2 times
    smaller). Measured (100 steps): on the CPU float32 0.01238, fp8 0.01244, gap 5.8e-5
    (0.5 %) against a bound of 4.7e-3; on the H200 (its own start) float32 0.01173, fp8
    0.01282, gap 1.1e-3 (9 %), within the bound. On fresh batches every step the student cannot
    learn this teacher (the loss stays at 0.207-0.216). Near fp8's noise floor (5.4e-4 here) the
    relative gap grows: after 300 CPU steps (float32 5.0e-3) it is 6.0e-4 (12 %), still within
    the bound; `test_moe_loss_within_2_percent_of_bf16` says where the 2 % target holds."""
    g, h, i = MOE_TASK
    data = _moe_task_batches(device)
    torch.manual_seed(6)
    start = Fp8MoE(g, h, i, trainable=True, master_dtype=torch.float32, device=device)
    layout = "contiguous" if device == "cuda" else "offsets"

    def reference():
        w13 = nn.Parameter(start.w13.detach().clone())
        w2 = nn.Parameter(start.w2.detach().clone())
        return nn.ParameterList([w13, w2]), lambda a: _moe_reference(a[0], a[1], a[2], w13, w2)

    def fp8():
        moe = Fp8MoE(g, h, i, trainable=True, master_dtype=torch.float32, grad_format="e5m2",
                     device=device)
        moe.load_weights(start.w13.detach(), start.w2.detach())
        return moe, lambda a: moe(*a, layout=layout)

    def batch(step):
        return data[step % len(data)]

    ref = _train(reference, batch, steps, lr=3e-3)
    got = _train(fp8, batch, steps, lr=3e-3)
    power = float(torch.stack([y.square().mean() for _, y in data]).mean())
    bound = loss_gap_bound(4, "e5m2", power, ref[0], _tail(ref), steps)
    gap = abs(_tail(got) - _tail(ref))
    assert _tail(ref) < 0.95 * ref[0], "the reference must learn for the comparison to mean much"
    assert gap < bound, f"fp8 {_tail(got):.5f} vs float32 {_tail(ref):.5f}: gap {gap:.2e} >= " \
                        f"{bound:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_moe_loss_within_2_percent_of_bf16(device, one_thread):
    """The training target: Fp8MoE's loss within 2 % of the same MoE computed in bf16 (float32
    masters for both, e5m2 gradients), the mean over 8 starts of the last 10 of 50 steps on the
    cycled batches of `test_moe_trains_like_float32`.

    Where this holds, and why not later. The fp8 forward's 4 e4m3 roundings raise the loss by
    about rho_f * E[target^2] (derived in `test_mlp_trains_like_float32`): 5.4e-4 on this task.
    That floor stays while the loss falls, so the fp8 / bf16 gap grows as the student fits: on
    the CPU, mean over these 8 starts, +0.2 % at step 20, +1 % at 50, +4 % at 75 and 100,
    +6-7 % at 150-200, where the floor is 0.4 %, 1.5 %, 3.1 %, 4.6 % and 7-8 % of the bf16 loss.
    No FP8 forward of this recipe stays within 2 % of bf16 once the loss is under about 50x that
    floor, so the check is made where the floor is under 2 % of the loss, which it asserts
    first. One start is not enough: at 100 steps one start's fp8 / float32 gap ranged from -7 %
    to +12 % over these 8 starts on the CPU (the H200's 9 % in `test_moe_trains_like_float32` is
    inside that range), bf16's from -3.5 % to +3.5 %.
    Measured on the CPU: bf16 0.03548, fp8 0.03582 (+1.0 %)."""
    g, h, i = MOE_TASK
    steps, tail = 50, 10
    data = _moe_task_batches(device)
    layout = "contiguous" if device == "cuda" else "offsets"

    def batch(step):
        return data[step % len(data)]

    bf16, fp8 = [], []
    for seed in range(6, 14):
        # the starts drawn on the CPU, so that every device trains from the same ones
        torch.manual_seed(seed)
        start = Fp8MoE(g, h, i, trainable=True, master_dtype=torch.float32)
        w13_0, w2_0 = start.w13.detach().to(device), start.w2.detach().to(device)

        def reference():
            w13, w2 = nn.Parameter(w13_0.clone()), nn.Parameter(w2_0.clone())
            return nn.ParameterList([w13, w2]), lambda a: _moe_reference(
                a[0].bfloat16(), a[1], a[2].bfloat16(), w13.bfloat16(), w2.bfloat16()).float()

        def student():
            moe = Fp8MoE(g, h, i, trainable=True, master_dtype=torch.float32,
                         grad_format="e5m2", device=device)
            moe.load_weights(w13_0, w2_0)
            return moe, lambda a: moe(*a, layout=layout)

        bf16.append(_tail(_train(reference, batch, steps, lr=3e-3), tail))
        fp8.append(_tail(_train(student, batch, steps, lr=3e-3), tail))
    ref, got = sum(bf16) / len(bf16), sum(fp8) / len(fp8)
    power = float(torch.stack([y.square().mean() for _, y in data]).mean())
    floor = 4 * E4M3_ROUNDING * power
    assert floor < 0.02 * ref, f"the fp8 floor {floor:.2e} is over 2 % of the loss {ref:.5f}"
    assert abs(got - ref) < 0.02 * ref, f"fp8 {got:.5f} vs bf16 {ref:.5f}: {got / ref - 1:+.2%}"

"""Shared helpers of the Triton backend tests (no tests here): random FP8 operands with normalised
scales, a float64 reference on the dequantised inputs, and calc_diff.

Tolerances (basis): the kernel accumulates in FP32, so against a float64 reference on the same
dequantised inputs its error is FP32 rounding of a K-term sum (~1e-7 relative, calc_diff ~1e-13);
bf16 output adds one rounding (relative error <= 2^-8; calc_diff = mean squared relative error / 2
~ 1.4e-6 with round-to-nearest, ~5e-6 with the interpreter's truncating cast). Hence
calc_diff < 1e-5 for bf16 out and < 1e-9 for fp32 out.
"""

from __future__ import annotations

import torch

from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div
from fp8gemm.quant import calc_diff  # noqa: F401  (the tests importing it from here)

BF16_DIFF = 1e-5
FP32_DIFF = 1e-9
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _device_gen(device, gen):
    """A generator on `device` seeded from `gen` (so GPU inputs are drawn on the GPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def rand_fp8(shape, dtype, device, gen=None) -> torch.Tensor:
    # normal values spread over the FP8 range (x16 keeps e5m2 away from subnormals' coarse steps)
    x = torch.randn(shape, generator=_device_gen(device, gen), device=device)
    return (x * 16).clamp(-400, 400).to(dtype)


def rand_scales(shape, device, gen=None) -> torch.Tensor:
    return torch.rand(shape, generator=_device_gen(device, gen), device=device) * 1.5 + 0.25


def a_scales(recipe: Recipe, m: int, k: int, device, lead: int | None = None, col_major=False,
             gen=None) -> torch.Tensor:
    """Normalised A scales; `lead` = G for masked A ([G, Mmax, ...])."""
    kb = ceil_div(k, 128)
    pre = [lead] if lead is not None else []
    if recipe is Recipe.TENSOR:
        return rand_scales([1], device, gen)
    if recipe is Recipe.ROW:
        return rand_scales(pre + [m], device, gen)
    s = rand_scales(pre + [m, kb], device, gen)
    if col_major:  # strides (.., 1, align(m, 4)): the layout quantize_per_token writes
        ma = ceil_div(m, 4) * 4
        buf = torch.empty(pre + [kb, ma], device=device)
        buf[..., :m] = s.transpose(-1, -2)
        s = buf[..., :m].transpose(-1, -2)
    return s


def b_scales(recipe: Recipe, n: int, k: int, device, groups: int | None = None,
             gen=None) -> torch.Tensor:
    """Normalised B scales; `groups` adds the leading [G] of grouped B."""
    kb, nb = ceil_div(k, 128), ceil_div(n, 128)
    pre = [groups] if groups is not None else []
    shape = {Recipe.TENSOR: pre or [1], Recipe.ROW: pre + [n], Recipe.BLOCK: pre + [nb, kb],
             Recipe.GROUP: pre + [n, kb]}[recipe]
    return rand_scales(shape, device, gen)


def dequant_a(a: torch.Tensor, sa: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """[..., M, K] float64 values of A (sa per recipe, leading dims broadcast)."""
    k = a.shape[-1]
    x = a.double()
    s = sa.double()
    if recipe is Recipe.TENSOR:
        return x * s.reshape(())
    if recipe is Recipe.ROW:
        return x * s[..., None]
    return x * s.repeat_interleave(128, dim=-1)[..., :k]


def dequant_b(b: torch.Tensor, sb: torch.Tensor, recipe: Recipe, grouped: bool) -> torch.Tensor:
    """[(G,) N, K] float64 values of B."""
    n, k = b.shape[-2:]
    x = b.double()
    s = sb.double()
    if recipe is Recipe.TENSOR:
        return x * (s.reshape(-1, 1, 1) if grouped else s.reshape(()))
    if recipe is Recipe.ROW:
        return x * s[..., None]
    if recipe is Recipe.BLOCK:
        s = s.repeat_interleave(128, dim=-2)[..., :n, :]
    return x * s.repeat_interleave(128, dim=-1)[..., :k]


def problem(kind, m, n, k, groups, a, b, ra, rb, out_dtype, has_c=False, expected_m=0):
    return GemmProblem(kind, m, n, k, groups, a.dtype, b.dtype, ra, rb, out_dtype, has_c,
                       expected_m or m)


def make_dense(m, n, k, ra, rb, device, da=E4M3, db=E4M3, col_major=False, gen=None):
    a = rand_fp8((m, k), da, device, gen)
    b = rand_fp8((n, k), db, device, gen)
    sa = a_scales(ra, m, k, device, col_major=col_major, gen=gen)
    sb = b_scales(rb, n, k, device, gen=gen)
    ref = dequant_a(a.cpu(), sa.cpu(), ra) @ dequant_b(b.cpu(), sb.cpu(), rb, False).T
    return a, sa, b, sb, ref


def ref_grouped_rows(a, sa, ra, b, sb, rb, row_groups) -> torch.Tensor:
    """float64 [M, N] with row m = A[m] @ B[row_groups[m]]^T (NaN rows where the group is < 0)."""
    bd = dequant_b(b.cpu(), sb.cpu(), rb, True)
    ad = dequant_a(a.cpu(), sa.cpu(), ra)
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.float64)
    for g in range(b.shape[0]):
        rows = (row_groups == g).nonzero().flatten()
        if len(rows):
            out[rows] = ad[rows] @ bd[g].T
    return out


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "torch")]
__all__ += ["GemmKind", "Recipe", "ceil_div"]


def ref_quant_groups(x: torch.Tensor, fmt: str, pow2: bool):
    """x [..., G, 128] fp32 -> (q, scale [..., G]): the semantics of fp8gemm.quant."""
    dtype = {"e4m3": E4M3, "e5m2": E5M2}[fmt]
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(-1).clamp(min=1e-4)
    scale = amax / fmax
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (x / scale[..., None]).clamp(-fmax, fmax).to(dtype)
    return q, scale

"""Test helpers: random FP8 operands per scale recipe and a float64 reference on dequantised inputs.

The reference here is written independently of `fp8gemm.backends.reference` (scales are applied
by index arithmetic, not by `repeat_interleave`), so the two cannot share a mistake.

Random operands use random fp8 values *and* random scales spread over two octaves either side
of 1 (log-uniform in [1/4, 4]). Scales computed by quantising random data are all nearly equal,
so a kernel that read the wrong scale (transposed blocks, an off-by-one group) would still look
right; independent scales make every such mistake a large error.
"""

from __future__ import annotations

import math

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_COMBOS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]
OUT_DTYPES = (torch.bfloat16, torch.float32)
A_RECIPES = ("tensor", "row", "1x128")
B_RECIPES = ("tensor", "column", "128x128", "1x128")
BLOCK = 128

# Mantissa bits and smallest normal exponent of each format (OCP FP8: e4m3 has 3 mantissa bits
# and minimum normal 2^-6; e5m2 has 2 and 2^-14).
_FP8_BITS = {E4M3: (3, -6), E5M2: (2, -14)}
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}

# calc_diff tolerances for the reference backend against float64 on dequantised inputs.
# bf16 out: the contract's bound (DESIGN.md section 2). Rounding to bf16 alone costs about
#   E[delta^2]/2 with |delta| <= 2^-9 relative, i.e. ~5e-7, so 1e-5 leaves a 20x margin.
# fp32 out: float32 accumulation over K terms errs ~sqrt(K) * 2^-24 relative (random walk), so
#   calc_diff ~ K * 2^-48 ~ 3e-11 at K = 16384; 1e-9 is 30x that. A kernel that kept only ~14
#   bits of the FP8 product sum (no promotion every 128 of K) gives ~K * 2^-28 ~ 6e-5: caught.
TOL = {torch.bfloat16: 1e-5, torch.float32: 1e-9}


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2 sum(xy) / sum(x^2 + y^2) in float64 (DeepGEMM's measure); 0 when equal or both 0."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum().item()
    if denom == 0.0:
        return 0.0
    return 1.0 - 2.0 * (x * y).sum().item() / denom


# ---------------------------------------------------------------------------------------------
# Random operands


def random_fp8(shape, dtype: torch.dtype) -> torch.Tensor:
    """Random normal values rounded to `dtype` (never all zero)."""
    return torch.randn(shape).to(dtype)


def random_scales(shape) -> torch.Tensor:
    """float32 scales log-uniform in [1/4, 4]."""
    return torch.exp2(torch.empty(shape).uniform_(-2.0, 2.0))


def scale_shape_a(recipe: str, m: int, k: int, lead: tuple = ()) -> tuple:
    """A's scale shape for a recipe; `lead` is (G,) for masked A (per-tensor stays [])."""
    if recipe == "tensor":
        return ()
    if recipe == "row":
        return lead + (m,)
    if recipe == "1x128":
        return lead + (m, ceil_div(k, BLOCK))
    raise ValueError(recipe)


def scale_shape_b(recipe: str, n: int, k: int, lead: tuple = ()) -> tuple:
    """B's scale shape for a recipe; `lead` is (G,) for grouped B."""
    if recipe == "tensor":
        return lead if lead else ()
    if recipe == "column":
        return lead + (n,)
    if recipe == "128x128":
        return lead + (ceil_div(n, BLOCK), ceil_div(k, BLOCK))
    if recipe == "1x128":
        return lead + (n, ceil_div(k, BLOCK))
    raise ValueError(recipe)


def make_a(m: int, k: int, recipe: str, dtype=E4M3, lead: tuple = ()):
    """(A [*lead, M, K] fp8, scale) with random values and scales of `recipe`."""
    return random_fp8(lead + (m, k), dtype), random_scales(scale_shape_a(recipe, m, k, lead))


def make_b(n: int, k: int, recipe: str, dtype=E4M3, lead: tuple = ()):
    """(B [*lead, N, K] fp8, scale) with random values and scales of `recipe`."""
    return random_fp8(lead + (n, k), dtype), random_scales(scale_shape_b(recipe, n, k, lead))


# ---------------------------------------------------------------------------------------------
# float64 reference


def dequant(t: torch.Tensor, s: torch.Tensor, recipe: str) -> torch.Tensor:
    """Real values of a 2-D fp8 operand t [R, K] under `recipe`, in float64.

    recipe: "tensor" (s has one element), "row"/"column" (s [R] or [R, 1]), "1x128"
    (s [R, ceil(K/128)]), "128x128" (s [ceil(R/128), ceil(K/128)]).
    """
    rows, k = t.shape
    x, s = t.double(), s.double()
    if recipe == "tensor":
        return x * s.reshape(-1)[0]
    if recipe in ("row", "column"):
        return x * s.reshape(rows, 1)
    kidx = torch.arange(k) // BLOCK
    if recipe == "1x128":
        return x * s[:, kidx]
    if recipe == "128x128":
        ridx = torch.arange(rows) // BLOCK
        return x * s[ridx][:, kidx]
    raise ValueError(recipe)


def ref_gemm(a, b, recipe_a: str, recipe_b: str, c: torch.Tensor | None = None) -> torch.Tensor:
    """float64 (A * sa) @ (B * sb)^T (+ C) for 2-D operands given as (tensor, scale) pairs."""
    out = dequant(*a, recipe_a) @ dequant(*b, recipe_b).T
    return out if c is None else out + c.double()


def group_scale_b(sb: torch.Tensor, recipe: str, g: int) -> torch.Tensor:
    """Group g's slice of a grouped B scale ([] per-tensor scales are shared by all groups)."""
    return sb if sb.dim() == 0 else sb[g]


def ref_grouped_rows(a, b, recipe_a: str, recipe_b: str, group_of_row: torch.Tensor):
    """float64 rows of a grouped GEMM with A [R, K]: row i uses B[group_of_row[i]]; rows with
    a group < 0 are NaN (they must not be compared)."""
    (at, sa), (bt, sb) = a, b
    a64 = dequant(at, sa, recipe_a)
    out = torch.full((at.shape[0], bt.shape[1]), float("nan"), dtype=torch.float64)
    for g in range(bt.shape[0]):
        rows = (group_of_row == g).nonzero().flatten()
        if rows.numel():
            out[rows] = a64[rows] @ dequant(bt[g], group_scale_b(sb, recipe_b, g), recipe_b).T
    return out


def ref_masked(a, b, recipe_a: str, recipe_b: str, masked_m) -> torch.Tensor:
    """float64 [G, Mmax, N] of the masked GEMM; rows at or past masked_m[g] are NaN."""
    (at, sa), (bt, sb) = a, b
    g_, mmax, _ = at.shape
    out = torch.full((g_, mmax, bt.shape[1]), float("nan"), dtype=torch.float64)
    for g in range(g_):
        m = int(masked_m[g])
        if m == 0:
            continue
        sag = sa if recipe_a == "tensor" else sa[g, :m]
        out[g, :m] = ref_gemm((at[g, :m], sag), (bt[g], group_scale_b(sb, recipe_b, g)),
                              recipe_a, recipe_b)
    return out


# ---------------------------------------------------------------------------------------------
# Output checks


def poisoned(shape, dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype)


def fp8_half_step(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of the fp8 grid at |v| (float64): the most round-to-nearest may move v."""
    mant, emin = _FP8_BITS[dtype]
    av = v.double().abs()
    e = torch.floor(torch.log2(av.clamp_min(2.0 ** emin))).clamp_min(emin)
    return torch.exp2(e - mant) / 2


def is_pow2(s: torch.Tensor) -> bool:
    """Every element an exact (positive) power of two."""
    mantissa, _ = torch.frexp(s.double())
    return bool((mantissa == 0.5).all())


def assert_close_diff(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """No NaN/Inf in `out` and calc_diff(out, ref) < tol."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output (an element was not written?)"
    d = calc_diff(out, ref)
    assert d < tol, f"{what}: calc_diff {d:.3e} >= {tol:.0e}"
    assert math.isfinite(d)


# sm90 configs the heuristic may not pick for the suite, built directly by the tests: 2-CTA multicast
# of A and of B, wide odd tiles, BLOCK_M 256 (two waves), two accumulators in flight.
# (m, n, k, bm, bn, multicast, on_a, two_accum)
FORCED_CONFIGS = [
    (512, 2048, 1024, 128, 128, 2, False, False),   # multicast of B: pairs share n_block
    (512, 2048, 1024, 128, 128, 2, True, False),    # multicast of A: pairs share m_block
    (768, 1088, 640, 128, 136, 2, True, False),     # 136 wide, tiles straddling B scale blocks
    (300, 1280, 2048, 64, 160, 2, True, False),     # BLOCK_M 64, 160 wide, M tail
    (4096, 576, 320, 128, 144, 2, False, False),
    (1000, 2112, 7168, 256, 128, 1, False, False),   # BLOCK_M 256, M tail inside the second wave
    (200, 1088, 640, 256, 136, 1, False, False),    # one 256 block, M tail inside the first wave
    (1024, 2048, 1536, 256, 112, 2, False, False),   # BLOCK_M 256 with multicast of B
    (768, 1536, 1024, 256, 64, 2, True, False),     # BLOCK_M 256 with multicast of A, 64 wide
    (130, 576, 16384, 256, 96, 1, False, False),    # BLOCK_M 256, long K
    # Two accumulators: the k-blocks run in unrolled chunks of 8 plus a tail chunk.
    (4096, 2112, 7168, 128, 128, 1, False, True),   # 56 k-blocks: 7 chunks, no tail
    (300, 576, 320, 128, 128, 1, False, True),      # 3 k-blocks (tail only), K and M tails
    (1000, 2112, 1152, 128, 112, 1, False, True),   # 9 k-blocks: a chunk and a tail of one
    (37, 1000, 1040, 128, 128, 1, False, True),     # M < 64, K tail of 16
    (130, 576, 16384, 128, 96, 1, False, True),     # long K
    (512, 2048, 1024, 128, 128, 2, False, True),    # with multicast of B
]

"""The test helpers of every test file: random FP8 operands per scale recipe, a float64 reference
on the dequantised inputs, calc_diff, output checks, and the one table of tolerances.

The reference here is written independently of `fp8gemm.backends.reference` (scales are applied
by index arithmetic, not by `repeat_interleave`), so the two cannot share a mistake; it computes
on the device of its inputs.

Random operands use random fp8 values *and* random scales spread over two octaves either side
of 1 (log-uniform in [1/4, 4]). Scales computed by quantising random data are all nearly equal,
so a kernel that read the wrong scale (transposed blocks, an off-by-one group) would still look
right; independent scales make every such mistake a large error.

Recipes are `fp8gemm.problem.Recipe` members (or their values, "1x128" ...); scale shapes are the
normalised ones of `Recipe`: per-tensor [1] ([G] for grouped B), per-row [rows], 1x128
[rows, ceil(K/128)], 128x128 [ceil(N/128), ceil(K/128)], with a leading [G] for grouped B and
masked A.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fp8gemm.jit.compiler import CompilerUnavailable, get_compiler
from fp8gemm.problem import SCALE_BLOCK, GemmProblem, Recipe, ceil_div
from fp8gemm.problem import GemmKind  # noqa: F401 (re-exported: tests import it from here)

HOPPER_CAPABILITY = (9, 0)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_COMBOS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]
OUT_DTYPES = (torch.bfloat16, torch.float32)
FP8_MAX = {d: torch.finfo(d).max for d in FP8_DTYPES}  # e4m3 448, e5m2 57344


# ---------------------------------------------------------------------------------------------
# Tolerances
#
# calc_diff(x, y) = sum((x - y)^2) / sum(x^2 + y^2): for y = x (1 + d) it is about half the mean
# of d^2 weighted by x^2. Rounding to nearest with p significant bits moves x in [1, 2) by at most
# 2^-p, evenly spread, so E[(x - y)^2] = 2^-2p / 3 against E[x^2] ~ 2: calc_diff ~ 2^-2p / 12, and
# at most 2^-2p / 2 however the errors fall. Measured values below: GEMMs on this module's random
# operands at K = 7168, quantisation on normal data.


@dataclass(frozen=True)
class Tolerance:
    """A bound a test checks: what it measures, and why it is that number."""

    bound: float
    measure: str
    basis: str


_GEMM = "calc_diff of the output against float64 on the dequantised inputs"
_QUANT = "calc_diff of the dequantised result against the input"

TOLERANCES = {
    ("gemm", torch.bfloat16): Tolerance(1e-5, _GEMM, (
        "bf16 has 8 significant bits: rounding the output to nearest gives calc_diff ~ 2^-16 / 12 "
        "= 1.3e-6 (1.4e-6 measured) and at most 2^-16 / 2 = 7.6e-6. FP32 accumulation adds "
        "< 1e-10. One 128x128 B block read from its neighbour gives 1.1e-3, a lost 64-wide K "
        "tail 2.2e-3.")),
    ("gemm interpreted", torch.bfloat16): Tolerance(4e-5, _GEMM, (
        "the Triton interpreter's float32 -> bf16 cast truncates: |d| < 2^-7, so calc_diff < "
        "2^-14 / 2 = 3.1e-5 however the errors fall (5.5e-6 on large outputs; a small output "
        "whose scales let a few elements dominate reaches 1.2e-5). Errors of 1e-3 and more "
        "(a wrong scale block, a lost K tail) are still caught.")),
    ("gemm", torch.float32): Tolerance(1e-9, _GEMM, (
        "float32 accumulation of K products in any order errs ~sqrt(K / 2) * 2^-24 relative "
        "(a random walk of roundings against a sum of size sqrt(K)), so calc_diff ~ K * 2^-50: "
        "1.5e-11 at K = 16384, 60x under the bound; blocked summation errs less (7e-14 "
        "measured at K = 16384 on the CPU). One bf16 rounding anywhere on the path (~1e-6) is "
        "caught.")),
    ("gemm tensor cores", torch.float32): Tolerance(1e-8, _GEMM, (
        "on the GPU the FP8 tensor cores sum each 128-deep block with about 14 significant bits "
        "(truncated) before the FP32 promotion, so an fp32 output errs ~2^-28 / 12 ~ 3e-10 per "
        "block sum, with room for the truncation's bias: 1.0e-9 to 6.8e-9 measured on the H200 "
        "for the backward GEMMs (e4m3 and e5m2, K <= 300). A wrong scale block or a lost K tail "
        "gives ~1e-3.")),
    ("bench peer", "torch-bf16"): Tolerance(1e-4, _GEMM, (
        "the dequantised inputs rounded to bf16 (8 significant bits) before a float32 matmul: two "
        "independent input roundings and the output's give calc_diff ~ 3 * 2^-16 / 12 = 3.8e-6 "
        "(4e-6 measured). The bound only has to tell a right call from a wrong one (a transposed "
        "operand or a missed scale gives ~1).")),
    ("bench peer", "other quantisation"): Tolerance(2e-3, _GEMM, (
        "a peer that quantises the same bf16 sources itself (per-tensor or per-row e4m3 scales): "
        "its rounding of each operand and ours are independent, so calc_diff ~ 4 * 2^-8 / 12 = "
        "1.3e-3 (1.2e-3 to 1.3e-3 measured with both scalings).")),
    ("moe layer", "expert parallel"): Tolerance(1e-5, (
        "calc_diff of the expert-parallel MoE layer's output against the one-process Fp8MoE on "
        "the same tokens"), (
        "both quantise each token once with the same quantiser and run each of its rows "
        "through the same expert GEMMs, and each output row of a grouped GEMM depends only on "
        "its own A row (0.0 measured on the reference backend, 2 and 4 gloo ranks). The bound "
        "leaves room for one bf16 output rounding per element, 2^-16 / 2 = 7.6e-6 at most, for "
        "a kernel whose rounding depended on the rows that share its launch; a row sent to the "
        "wrong expert, a lost scale or a slot combined twice gives > 1e-2.")),
    ("quantise", E4M3): Tolerance(1e-3, _QUANT, (
        "e4m3 has 4 significant bits: round to nearest gives calc_diff ~ 2^-8 / 12 = 3.3e-4 "
        "(3.5e-4 measured), 3x under the bound; a scale off by 2x gives 0.2.")),
    ("quantise", E5M2): Tolerance(1e-2, _QUANT, (
        "e5m2 has 3 significant bits: calc_diff ~ 2^-6 / 12 = 1.3e-3 (1.4e-3 measured) and at "
        "most 2^-6 / 2 = 7.8e-3.")),
    ("quantise", "fp8-step"): Tolerance(5e-3, (
        "fraction of elements one fp8 step from the quantisation spec (none further)"), (
        "a kernel that forms x / scale as x * (1 / scale), or rounds to the fp8 grid in its own "
        "float32 arithmetic (the Triton interpreter's fp8 cast does not round to nearest), "
        "agrees with the exact float64 spec but for values within one float32 rounding of a "
        "midpoint between two fp8 values, which go either way. Inputs with few significant bits "
        "(bf16) land on midpoints often: 1.2e-3 measured (Triton under the interpreter and on "
        "the H200, e4m3, [37, 200]); on the H200 at [4096, 7168] 1.5e-3 (e4m3) and 3.6e-4 "
        "(e5m2). A wrong scale moves most elements by more than one step.")),
}

# The bounds by the name tests use them under.
TOL = {dt: TOLERANCES["gemm", dt].bound for dt in OUT_DTYPES}  # GEMM calc_diff per output dtype
BF16_DIFF, FP32_DIFF = TOL[torch.bfloat16], TOL[torch.float32]
TENSOR_CORE_FP32_DIFF = TOLERANCES["gemm tensor cores", torch.float32].bound  # fp32 out on the GPU
INTERPRETED_BF16_DIFF = TOLERANCES["gemm interpreted", torch.bfloat16].bound
QUANT_TOL = {dt: TOLERANCES["quantise", dt].bound for dt in FP8_DTYPES}
FP8_STEP_FRACTION = TOLERANCES["quantise", "fp8-step"].bound
BENCH_PEER_TOL = {"torch-bf16": TOLERANCES["bench peer", "torch-bf16"].bound,
                  "other quantisation": TOLERANCES["bench peer", "other quantisation"].bound}


# SASS of a 2-D TMA load that carries an L2 cache policy (cp.async.bulk.tensor ... .L2::cache_hint).
TMA_LOAD_WITH_POLICY = r"UTMALDG\.2D \[UR\d+\], \[UR\d+\], desc\[UR\d+\]"


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2 sum(xy) / sum(x^2 + y^2) in float64; 0 when equal or both 0. Written here, not
    imported, so the tests of `fp8gemm.calc_diff` have something to compare with."""
    if x.shape != y.shape:
        raise ValueError(f"calc_diff needs two tensors of one shape, got {list(x.shape)} and "
                         f"{list(y.shape)}")
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum().item()
    if denom == 0.0:
        return 0.0
    return 1.0 - 2.0 * (x * y).sum().item() / denom


@functools.lru_cache(maxsize=None)
def hopper_available() -> bool:
    """True when torch sees a CUDA device of compute capability 9.0 (what `gpu` tests need)."""
    try:
        return (torch.cuda.is_available()
                and torch.cuda.get_device_capability(0) == HOPPER_CAPABILITY)
    except Exception:  # a broken driver or a CPU-only build: no GPU
        return False


def load_script(path: str):
    """The module of a file of the repository that is not in the package (`scripts/x.py`,
    `examples/x.py`), imported under its stem and registered in sys.modules (dataclasses look
    their module up there)."""
    file = Path(__file__).resolve().parents[1] / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compiler_or_skip(name: str | None = None):
    """The CUDA compiler `name` (None: the one fp8gemm.jit would use), or skip the test."""
    try:
        return get_compiler(name)
    except CompilerUnavailable as e:
        pytest.skip(f"no CUDA compiler{'' if name is None else ' ' + name} here: {e}")


# ---------------------------------------------------------------------------------------------
# Random operands


def _device_gen(device, gen):
    """A generator on `device` seeded from `gen` (so GPU inputs are drawn on the GPU)."""
    if gen is None or torch.device(device).type == "cpu":
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def rand_fp8(shape, dtype: torch.dtype, device="cpu", gen=None) -> torch.Tensor:
    """Normal values times 16, rounded to `dtype`: most land on normal fp8 numbers (e4m3's
    smallest normal is 2^-6), none beyond e4m3's range."""
    x = torch.randn(shape, generator=_device_gen(device, gen), device=device)
    return (x * 16).clamp(-400, 400).to(dtype)


def rand_scales(shape, device="cpu", gen=None) -> torch.Tensor:
    """float32 scales log-uniform in [1/4, 4]."""
    u = torch.rand(shape, generator=_device_gen(device, gen), device=device)
    return torch.exp2(u * 4.0 - 2.0)


def col_major_tma(s: torch.Tensor) -> torch.Tensor:
    """The same [..., M, kb] scales column-major with M padded to 4 floats (16 bytes): strides
    (..., 1, align(M, 4)), the layout quantize_per_token writes and the sm90 kernels read."""
    m, kb = s.shape[-2:]
    buf = torch.empty(s.shape[:-2] + (kb, ceil_div(m, 4) * 4), dtype=s.dtype, device=s.device)
    buf[..., :m] = s.transpose(-1, -2)
    return buf[..., :m].transpose(-1, -2)


def a_scales(recipe, m: int, k: int, device="cpu", lead: int | None = None, col_major=False,
             gen=None) -> torch.Tensor:
    """Normalised A scales; `lead` = G for masked A ([G, Mmax, ...]; per-tensor stays [1]);
    `col_major` gives 1x128 scales in the layout of `col_major_tma`."""
    recipe = Recipe(recipe)
    pre = [] if lead is None else [lead]
    if recipe is Recipe.TENSOR:
        return rand_scales([1], device, gen)
    if recipe is Recipe.ROW:
        return rand_scales(pre + [m], device, gen)
    if recipe is not Recipe.GROUP:
        raise ValueError(f"A scales have no {recipe} recipe")
    s = rand_scales(pre + [m, ceil_div(k, SCALE_BLOCK)], device, gen)
    return col_major_tma(s) if col_major else s


def b_scales(recipe, n: int, k: int, device="cpu", groups: int | None = None,
             gen=None) -> torch.Tensor:
    """Normalised B scales; `groups` adds the leading [G] of grouped B (per-tensor: [G])."""
    recipe = Recipe(recipe)
    kb, nb = ceil_div(k, SCALE_BLOCK), ceil_div(n, SCALE_BLOCK)
    pre = [] if groups is None else [groups]
    shape = {Recipe.TENSOR: pre or [1], Recipe.ROW: pre + [n], Recipe.BLOCK: pre + [nb, kb],
             Recipe.GROUP: pre + [n, kb]}[recipe]
    return rand_scales(shape, device, gen)


def make_a(m: int, k: int, recipe, dtype=E4M3, lead: int | None = None, device="cpu"):
    """(A [(G,) M, K] fp8, scale) with random values and scales of `recipe`: the pair the public
    ops take. `lead` = G gives masked A."""
    shape = (m, k) if lead is None else (lead, m, k)
    return rand_fp8(shape, dtype, device), a_scales(recipe, m, k, device, lead=lead)


def make_b(n: int, k: int, recipe, dtype=E4M3, groups: int | None = None, device="cpu"):
    """(B [(G,) N, K] fp8, scale) with random values and scales of `recipe`; `groups` = G gives
    grouped B."""
    shape = (n, k) if groups is None else (groups, n, k)
    return rand_fp8(shape, dtype, device), b_scales(recipe, n, k, device, groups=groups)


def problem(kind, m, n, k, groups, a, b, ra, rb, out_dtype, has_c=False, expected_m=0):
    """The GemmProblem of a backend-level call on operands a and b."""
    return GemmProblem(kind, m, n, k, groups, a.dtype, b.dtype, Recipe(ra), Recipe(rb),
                       out_dtype, has_c, expected_m or m)


# ---------------------------------------------------------------------------------------------
# float64 reference


def _dequant(t: torch.Tensor, s: torch.Tensor, recipe: Recipe, per_lead_tensor: bool):
    """float64 values of t [..., R, K] under `recipe`; s has t's leading dims (per-tensor: one
    scale, or one per leading index when `per_lead_tensor`)."""
    rows, k = t.shape[-2:]
    x, s = t.double(), s.double()
    if recipe is Recipe.TENSOR:
        return x * (s.reshape(t.shape[:-2] + (1, 1)) if per_lead_tensor else s.reshape(()))
    if recipe is Recipe.ROW:
        return x * s.reshape(t.shape[:-1] + (1,))
    kidx = torch.arange(k, device=t.device) // SCALE_BLOCK
    if recipe is Recipe.GROUP:
        return x * s[..., kidx]
    ridx = torch.arange(rows, device=t.device) // SCALE_BLOCK
    return x * s[..., ridx, :][..., kidx]  # Recipe.BLOCK


def dequant_a(a: torch.Tensor, sa: torch.Tensor, recipe) -> torch.Tensor:
    """float64 [..., M, K] values of A (per-tensor: one scale for every leading index;
    per-row [..., M] or [..., M, 1]; 1x128 [..., M, ceil(K/128)])."""
    return _dequant(a, sa, Recipe(recipe), per_lead_tensor=False)


def dequant_b(b: torch.Tensor, sb: torch.Tensor, recipe, grouped: bool) -> torch.Tensor:
    """float64 [(G,) N, K] values of B; `grouped` B has one per-tensor scale per group ([G];
    [] or [1] is shared by all groups)."""
    return _dequant(b, sb, Recipe(recipe), per_lead_tensor=grouped and sb.numel() > 1)


def ref_gemm(a, sa, ra, b, sb, rb, c: torch.Tensor | None = None) -> torch.Tensor:
    """float64 (A * sa) @ (B * sb)^T (+ C) for 2-D A and B."""
    out = dequant_a(a, sa, ra) @ dequant_b(b, sb, rb, False).T
    return out if c is None else out + c.double()


def make_dense(m, n, k, ra, rb, device="cpu", da=E4M3, db=E4M3, col_major=False, gen=None):
    """(a, sa, b, sb, ref) of a dense GEMM: random operands and their float64 result (on
    `device`)."""
    a = rand_fp8((m, k), da, device, gen)
    b = rand_fp8((n, k), db, device, gen)
    sa = a_scales(ra, m, k, device, col_major=col_major, gen=gen)
    sb = b_scales(rb, n, k, device, gen=gen)
    return a, sa, b, sb, ref_gemm(a, sa, ra, b, sb, rb)


def ref_grouped_rows(a, sa, ra, b, sb, rb, row_groups) -> torch.Tensor:
    """float64 [M, N] with row m = A[m] @ B[row_groups[m]]^T for grouped B [G, N, K]; rows with
    a group < 0 are NaN (they must not be compared)."""
    ad = dequant_a(a, sa, ra)
    bd = dequant_b(b, sb, rb, True)
    row_groups = row_groups.to(a.device)
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.float64,
                     device=a.device)
    for g in range(b.shape[0]):
        rows = (row_groups == g).nonzero().flatten()
        if rows.numel():
            out[rows] = ad[rows] @ bd[g].T
    return out


def ref_masked(a, sa, ra, b, sb, rb, masked_m) -> torch.Tensor:
    """float64 [G, Mmax, N] of the masked GEMM on A [G, Mmax, K]; rows at or past masked_m[g]
    are NaN."""
    groups, mmax, _ = a.shape
    out = dequant_a(a, sa, ra) @ dequant_b(b, sb, rb, True).transpose(-1, -2)
    past = torch.arange(mmax, device=a.device)[None, :] >= masked_m.to(a.device)[:, None]
    out[past] = float("nan")
    return out


def ref_quant_groups(x: torch.Tensor, fmt: str, pow2: bool):
    """x [..., G, 128] fp32 -> (q, scale [..., G]): the semantics of fp8gemm.quant (scale =
    amax / fmt max, amax floored at 1e-4; pow2 rounds the scale up to a power of two)."""
    dtype = {"e4m3": E4M3, "e5m2": E5M2}[fmt]
    fmax = FP8_MAX[dtype]
    amax = x.double().abs().amax(-1).clamp(min=1e-4)
    scale = amax / fmax
    if pow2:
        scale = pow2_ceil(scale)
    # NOTE: the scale in x's precision (one correctly rounded division, as the kernels make it),
    # and q from that scale.
    scale = scale.to(x.dtype)
    q = round_to_fp8(x.double() / scale.double()[..., None], dtype)
    return q, scale


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= v > 0, exactly (frexp, not log2: CUDA's float64 log2 of a
    power of two can land an ulp below it, and its ceil a binade too high)."""
    m, e = torch.frexp(v.double())
    return torch.where(m == 0.5, v.double(), torch.ldexp(torch.ones_like(v, dtype=torch.float64), e))


def round_to_fp8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 v rounded once to the nearest fp8 value (ties to even), clamped to the format's
    range: the exact cast (a cast through float32 would round twice)."""
    fi = torch.finfo(dtype)
    mant = {E4M3: 3, E5M2: 2}[dtype]
    emin = int(torch.frexp(torch.tensor(fi.tiny, dtype=torch.float64))[1]) - 1  # smallest normal
    a = v.double().abs()
    _, e = torch.frexp(a)
    step = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=emin) - mant)
    q = torch.round(a / step) * step
    q = torch.copysign(q.clamp(max=fi.max), v.double())
    return q.to(dtype)


# ---------------------------------------------------------------------------------------------
# Output checks


def padded_view(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view: every row of a buffer padded by 16 columns, the
    values 8 columns in (so the view does not start at the buffer's start either)."""
    big = torch.zeros(*t.shape[:-1], t.shape[-1] + 16, dtype=t.dtype, device=t.device)
    view = big[..., 8 : 8 + t.shape[-1]]
    view.copy_(t)
    return view


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def fp8_half_step(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of the fp8 grid at |v| (float64): the most round-to-nearest may move v.
    Below the smallest normal the spacing is that of the smallest binade."""
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(v.double().abs().clamp_min(fi.tiny)))
    return torch.exp2(e) * fi.eps / 2


def fp8_steps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x - y| in fp8 grid steps for two fp8 tensors of one dtype (int32; +0 and -0 are 0 apart)."""
    def ordinal(t):
        bits = t.view(torch.uint8).to(torch.int32)
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits)
    return (ordinal(x) - ordinal(y)).abs()


def is_pow2(s: torch.Tensor) -> bool:
    """Every element an exact (positive) power of two."""
    mantissa, _ = torch.frexp(s.double())
    return bool((mantissa == 0.5).all())


# Global memory accesses in SASS, and L1 prefetches (CCTL.E.PF1: L1 is not coherent, so a line
# fetched before the wait could shadow what the grid before writes); L2 and descriptor prefetches
# (UTMAPF, UTMACCTL.PF) are not among them.
_SASS_GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|RED|REDG|ATOM|ATOMG|UTMALDG|UTMASTG|UTMAREDG|UBLKCP|"
                                 r"UBLKRED|LDGSTS|CCTL\.E\.PF1)\b")


def assert_waits_before_global_access(sass: str, what: str) -> None:
    """The kernel waits for the grids it depends on (griddepcontrol.wait: ACQBULK) before any
    global load or store in code order, and lets its dependents launch (PREEXIT): what a launch
    with programmatic stream serialization (FP8GEMM_PDL) needs of it."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
    wait = next((i for i, line in enumerate(lines) if "ACQBULK" in line), None)
    assert wait is not None, f"{what}: no griddepcontrol.wait (ACQBULK)"
    assert any("PREEXIT" in line for line in lines), f"{what}: no launch_dependents (PREEXIT)"
    early = [line.strip() for line in lines[:wait] if _SASS_GLOBAL_ACCESS.search(line)]
    assert not early, f"{what}: global access before griddepcontrol.wait: {early[:3]}"
    # The L2 prefetch of B before the wait stays short: a ring's worth of boxes queued ahead of the
    # ring's own loads and cost decode GEMMs 3-7 % (docs/cuda.md, programmatic dependent launch).
    prefetches = sum("UTMAPF" in line for line in lines[:wait])
    assert prefetches <= prefetch_k_blocks(), \
        f"{what}: {prefetches} L2 box prefetches before griddepcontrol.wait"


def prefetch_k_blocks() -> int:
    """kPrefetchKBlocks of sm90_utils.cuh: the k-blocks of B a decode GEMM sends to L2 before
    its dependency wait."""
    text = (Path(__file__).resolve().parents[1] / "fp8gemm" / "backends" / "cuda" / "include" /
            "fp8gemm" / "sm90_utils.cuh").read_text()
    return int(re.search(r"kPrefetchKBlocks = (\d+);", text).group(1))


def assert_close_diff(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """No NaN/Inf in `out` and calc_diff(out, ref) < tol."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output (an element was not written?)"
    d = calc_diff(out, ref)
    assert math.isfinite(d) and d < tol, f"{what}: calc_diff {d:.3e} >= {tol:.0e}"


# sm90 configs the heuristic may not pick for the suite, built directly by the tests: 2-CTA multicast
# of A and of B, wide odd tiles, BLOCK_M 256 (two waves), two accumulators in flight.
# (m, n, k, bm, bn, multicast, on_a, two_accum)
# Split-K configs of the dense 1D2D kernel (the heuristic does not offer split-K yet: built
# directly): (M, N, K, BLOCK_M, BLOCK_N, splits).
SPLIT_K_CONFIGS = [
    (1000, 512, 32768, 128, 128, 4),   # a dgrad shape: thin N, long K, one wave of tiles
    (192, 7168, 16384, 128, 128, 2),   # M between 128 and 256
    (37, 576, 320, 128, 128, 2),       # 3 k-blocks in parts of 1 and 2, K and M tails
    (300, 1088, 640, 128, 136, 3),     # 136 wide (tiles straddling B scale blocks), 5 k-blocks in 3
    (130, 576, 16384, 64, 160, 8),     # BLOCK_M 64, 160 wide, 8 parts
]

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
    (1000, 7168, 2112, 256, 128, 1, False, False),  # one accumulator, partial last k-block
    # One accumulator, the tile's B-scale split a constant per n0 % 128 (96, 160, 192 wide).
    (1000, 2112, 7168, 128, 192, 1, False, False),  # 192 wide: splits 0 and 64, M tail
    (300, 1000, 1040, 128, 192, 2, True, False),    # with multicast of A, N and K tails
    (520, 1056, 2048, 128, 96, 1, False, False),    # 96 wide: all four splits
    (300, 1088, 7168, 64, 192, 1, False, False),    # one math warpgroup, 192 wide
    # Two accumulators: the k-blocks run in unrolled chunks of 8 plus a tail chunk.
    (4096, 2112, 7168, 128, 128, 1, False, True),   # 56 k-blocks: 7 chunks, no tail
    (300, 576, 320, 128, 128, 1, False, True),      # 3 k-blocks (tail only), K and M tails
    (1000, 2112, 1152, 128, 112, 1, False, True),   # 9 k-blocks: a chunk and a tail of one
    (600, 2048, 2016, 128, 128, 1, False, True),    # 16 k-blocks, the last partial: 2 chunks
    (2048, 7168, 2112, 128, 128, 1, False, True),   # 17: the partial last one a chunk alone
    (37, 1000, 1040, 128, 128, 1, False, True),     # M < 64, K tail of 16
    (130, 576, 16384, 128, 96, 1, False, True),     # long K
    (512, 2048, 1024, 128, 128, 2, False, True),    # with multicast of B
    (1000, 2112, 1152, 128, 56, 1, False, True),    # narrow, N tail
    # One math warpgroup with two accumulators.
    (300, 1088, 7168, 64, 128, 1, False, True),     # 56 k-blocks, M and N tails
    (100, 576, 320, 64, 16, 1, False, True),        # 3 k-blocks (tail only)
    (37, 1000, 1040, 64, 96, 1, False, True),       # K tail of 16, N tail
    (256, 2048, 1152, 64, 64, 2, True, True),       # with multicast of A, a chunk and a tail
]


# --- a model of an mbarrier, for the protocol simulations -----------------------------------
class MBarrier:
    """An mbarrier as the protocol simulations (tests/test_*_protocol.py) model it: phase parity,
    pending arrivals and the transaction bytes still expected (a full barrier's loads)."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.completed, self.tx = count, count, 0, 0

    def arrive(self, tx: int = 0) -> None:
        self.pending -= 1
        self.tx += tx
        self._maybe_complete()

    def complete_tx(self, tx: int) -> None:
        self.tx -= tx
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        assert self.pending >= 0, "more arrivals than the barrier's count"
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def done(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity has completed."""
        return (self.completed & 1) != parity

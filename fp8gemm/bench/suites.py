"""Benchmark suites: the shapes, with the arithmetic and byte counts each result is judged by.

- `deepseek-dense`, `deepseek-grouped`: the DeepSeek-V3 shapes DeepGEMM publishes, every group
  full and equal.
- `irregular`: shapes no tile divides (M = 1, 37; N = 200; K = 320).
- `m-sweep`: M = 1 ... 256 on the six dense N x K, where a GEMM should cost what moving its bytes
  costs (the memory floor, `Case.floor_us`).
- `moe-skewed`: grouped GEMMs with skewed expert loads (8, 16 and 32 experts) at the grouped
  suite's total rows: contiguous (padded to 128 rows per expert) and offsets (the same rows
  unpadded), masked with `masked_m` varying per expert.
- `backward`: the training GEMMs of the dense layers at 4096 and 1000 tokens, the weight
  gradient (wgrad, K = tokens) and the input gradient (dgrad, through the forward kernels on
  the transposed weight), and the weight gradient of 8 experts in one k-grouped GEMM, with
  equal and with skewed token counts (some experts get none). The skewed cases are reported as
  suite `backward-skewed`: a result row's shape (M, N, K, G) does not hold the token counts, and
  would not tell them from the equal ones.
- `moe-layer`: a DeepSeek-V3 expert layer end to end, prefill and decode.
- `moe-decode`: masked grouped GEMMs of one, two and four local experts of 32 and 128 rows
  each, the decode step of wide expert parallelism (DeepSeek-V3's 256 experts over 64-256 GPUs):
  few tiles of B for the SMs, where split-K pays.

--quick trims `irregular`, `m-sweep` (fewer M) and `backward` (fewer dense N x K) for a
time-limited run; the other suites are what every figure is compared on.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

__all__ = ["Case", "SUITES", "OPS", "BASELINE", "suite_cases", "all_suite_names",
           "skewed_sizes", "backward_skewed_sizes", "SKEW_EXPONENT", "MOE_LAYER",
           "FLOOR_BYTES_PER_US", "FLOOR_FIXED_US", "DENSE_LIKE_OPS"]

OPS = ("dense", "contiguous", "offsets", "masked", "wgrad", "dgrad", "k_grouped_wgrad",
       "moe_layer")
# Ops that are one plain D = A . B^T with A in 1x128 groups and B in 128x128 blocks (dgrad is
# the forward GEMM on other operands).
DENSE_LIKE_OPS = ("dense", "dgrad")
# The peer every impl of an op is compared with (ratio = baseline us / impl us).
BASELINE = {"dense": "cublas-block", "contiguous": "cublas-rowwise-grouped",
            "offsets": "cublas-rowwise-grouped", "masked": "torch-bf16", "wgrad": "cublas-block",
            "dgrad": "cublas-block", "k_grouped_wgrad": "cublas-block-loop",
            "moe_layer": "torch-bf16"}

# The memory floor of a problem on the H200: its fewest bytes (`Case.min_bytes`) at the device's
# copy bandwidth, plus the time of an almost-empty kernel. 4.25 TB/s is a device-to-device copy
# of 2 GB (read + write counted) measured on the H200 (HBM3e, 4.8 TB/s peak); 4 us is a kernel
# that does almost nothing, timed as every figure here is (cold L2, launch hidden: timing.py).
# A small-M GEMM is memory-bound: it cannot beat this, and should come close.
FLOOR_BYTES_PER_US = 4.25e6
FLOOR_FIXED_US = 4.0

_BLOCK = 128
_GROUPED_OPS = ("contiguous", "offsets", "masked")


def _ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def _align(x: int, y: int) -> int:
    return _ceil_div(x, y) * y


@dataclass(frozen=True)
class MoeLayerShape:
    """A DeepSeek-V3 routed-expert layer as one rank of expert parallelism holds it."""

    hidden: int = 7168
    width: int = 2048  # each expert's intermediate size (w13 is [2 * width, hidden])
    experts: int = 256
    topk: int = 8
    ranks: int = 8

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks


MOE_LAYER = MoeLayerShape()


@dataclass(frozen=True)
class Case:
    """One benchmark problem.

    Every GEMM is named as D [M, N] = A [M, K] . B [N, K]^T. dense: the forward GEMM.
    contiguous / offsets / masked: `m` is the mean rows per group; `sizes` holds each group's
    rows when they differ (empty: every group has `m`); masked groups live in [G, mmax, K]
    buffers. A layer Y [T, N_out] = X [T, K_in] . W [N_out, K_in]^T has two backward GEMMs:
    wgrad dW = dY^T . X, fp32 out, M = N_out, N = K_in, K = T tokens, 1x128 scales along the
    tokens on both operands; dgrad dX = dY . W, bf16 out, M = T, N = K_in, K = N_out, A = dY in
    1x128 groups and B = W^T in 128x128 blocks (the forward GEMM's recipe). k_grouped_wgrad:
    out [G, M, N], group g with K = sizes[g] tokens (`k` the mean). moe_layer: `m` tokens
    through `groups` local experts of hidden `n` and width `k` (MOE_LAYER).
    """

    suite: str
    op: str
    m: int
    n: int
    k: int
    groups: int = 1
    sizes: tuple[int, ...] = ()

    def __post_init__(self):
        if self.sizes and (len(self.sizes) != self.groups
                           or sum(self.sizes) != self.groups * self.mean_size):
            raise ValueError(f"sizes must be {self.groups} values summing to "
                             f"{self.groups * self.mean_size}, got {self.sizes}")

    @property
    def mean_size(self) -> int:
        return self.k if self.op == "k_grouped_wgrad" else self.m

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Rows (K for k_grouped_wgrad) of each group."""
        return self.sizes or (self.mean_size,) * self.groups

    @property
    def mmax(self) -> int:
        """Rows per group of the masked buffers: the largest group, rounded up to 128 when
        groups differ (a capacity every masked kernel takes)."""
        return _align(max(self.sizes), _BLOCK) if self.sizes else self.m

    @property
    def total_m(self) -> int:
        """Rows of A that carry data (padding and rows past masked_m excluded)."""
        return self.m * (self.groups if self.op in _GROUPED_OPS else 1)

    @property
    def flops(self) -> int:
        if self.op == "k_grouped_wgrad":
            return 2 * self.m * self.n * self.k * self.groups
        if self.op == "moe_layer":
            # NOTE: the expected local slots, tokens * topk * local / all experts (= tokens for
            # DeepSeek-V3 on 8 ranks), each through w13 [2I, H] and w2 [H, I].
            slots = self.m * MOE_LAYER.topk * self.groups // MOE_LAYER.experts
            return 2 * slots * 3 * self.n * self.k
        return 2 * self.total_m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Fewest bytes any implementation of the fp8 problem moves, each once: fp8 A and B
        with their fp32 scales (1x128 for A, 128x128 for forward B, 1x128 for backward B) and
        the output (bf16 forward, fp32 backward); for moe_layer the experts' fp8 weights and
        the bf16 tokens in and out."""
        if self.op == "moe_layer":
            h, i, g = self.n, self.k, self.groups
            w = g * (3 * h * i + 4 * (_ceil_div(2 * i, _BLOCK) * _ceil_div(h, _BLOCK)
                                      + _ceil_div(h, _BLOCK) * _ceil_div(i, _BLOCK)))
            return w + 2 * 2 * self.m * h
        if self.op in ("wgrad", "k_grouped_wgrad"):
            ks = self.group_sizes if self.op == "k_grouped_wgrad" else (self.k,)
            kb = sum(_ceil_div(k, _BLOCK) for k in ks)
            return ((self.m + self.n) * (sum(ks) + 4 * kb)
                    + 4 * self.m * self.n * len(ks))
        kb = _ceil_div(self.k, _BLOCK)
        g = self.groups if self.op != "dense" else 1
        a = self.total_m * self.k + self.total_m * kb * 4
        b = g * (self.n * self.k + _ceil_div(self.n, _BLOCK) * kb * 4)
        return a + b + self.total_m * self.n * 2

    @property
    def floor_us(self) -> float:
        """The memory floor: fewest bytes / FLOOR_BYTES_PER_US + FLOOR_FIXED_US."""
        return self.min_bytes / FLOOR_BYTES_PER_US + FLOOR_FIXED_US

    @property
    def shape(self) -> dict:
        return {"m": self.m, "n": self.n, "k": self.k, "groups": self.groups}

    @property
    def label(self) -> str:
        if self.op in ("dense", "wgrad", "dgrad"):
            return f"{self.m}x{self.n}x{self.k}"
        if self.op == "k_grouped_wgrad":
            mean = "mean " if len(set(self.group_sizes)) > 1 else ""
            empty = self.group_sizes.count(0)
            none = f" ({empty} with none)" if empty else ""
            return f"{self.groups}x{mean}{self.k} tokens{none}, {self.m}x{self.n}"
        if self.op == "moe_layer":
            return f"{self.m} tokens, {self.groups} experts {self.n}x{self.k}"
        mean = "mean " if len(set(self.group_sizes)) > 1 else ""
        return f"{self.groups}x{mean}{self.m}, {self.n}x{self.k}"

    def __str__(self) -> str:
        return f"{self.suite}/{self.op} {self.label}"


# DeepSeek-V3 (N, K) pairs of the dense layers, and the M of decode and prefill.
_DENSE_NK = ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))
_DENSE_M = (64, 128, 4096)
_GROUPED_NK = ((4096, 7168), (7168, 2048))
_CONTIGUOUS_GM = ((4, 8192), (8, 4096))
_MASKED_GM = ((1, 1024), (2, 512), (4, 256))
_IRREGULAR_M = (1, 37, 130, 1000)
_IRREGULAR_N = (200, 576, 2112)
_IRREGULAR_K = (320, 7168)
_IRREGULAR_QUICK = ((1, 2112, 7168), (37, 200, 320), (37, 576, 7168), (130, 2112, 320),
                    (1000, 200, 7168), (1000, 2112, 7168))
_SWEEP_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# NOTE: DeepGEMM compiles each new (M, N, K) (about 3 s): the quick sweep keeps one M per regime
# (one row, a few, one 64-row tile, one 128-row tile, between one and two tiles).
_SWEEP_M_QUICK = (1, 16, 64, 128, 192)
# Skewed suites: the grouped suite's totals (contiguous 32768 rows, masked 1024 rows).
_SKEW_GROUPS = (8, 16, 32)
_SKEW_CONTIGUOUS_ROWS = 32768
_SKEW_MASKED_ROWS = 1024
# Backward: tokens per dense layer (1000: no 128-token block divides it, and cuBLAS takes no
# K % 16 != 0), the dense N x K of --quick (thin, wide and the last layer's), and 8 experts of
# 4096 tokens each (out [M, N] is an expert weight: w13 [4096, 7168] and w2 [7168, 2048]); the
# skewed token counts keep the total, and this many experts get no token.
_BACKWARD_TOKENS = (4096, 1000)
_BACKWARD_NK_QUICK = ((2112, 7168), (24576, 1536), (7168, 2048))
_KGROUPED_MN = ((4096, 7168), (7168, 2048))
_KGROUPED_EXPERTS, _KGROUPED_TOKENS = 8, 4096
_KGROUPED_EMPTY = 2
_MOE_LAYER_TOKENS = (4096, 128)  # prefill, decode
# Decode under wide expert parallelism: local experts per GPU, and rows (tokens) per expert.
_DECODE_GROUPS = (1, 2, 4)
_DECODE_ROWS = (32, 128)

# The r-th busiest expert draws tokens with weight r^-SKEW_EXPONENT (Zipf-like): at 32 experts
# the busiest gets ~8x the mean load and the idlest ~1/4 of it.
SKEW_EXPONENT = 1.0
_SKEW_SEED = 2024


def skewed_sizes(total: int, groups: int, seed: int = _SKEW_SEED, unit: int = 1,
                 empty: int = 0) -> tuple[int, ...]:
    """`groups` sizes summing to `total`, each a multiple of `unit`: `empty` groups (chosen at
    random) get nothing, and total / unit draws go each to one of the others with Zipf-like
    weights, the busiest groups placed at random. Deterministic in the arguments."""
    if total % unit or total < 0:
        raise ValueError(f"total must be a non-negative multiple of unit = {unit}, got {total}")
    if groups < 1:
        raise ValueError(f"groups must be positive, got {groups}")
    if not 0 <= empty < groups:
        raise ValueError(f"empty must be in [0, groups = {groups}), got {empty}")
    key = f"{seed}/{total}/{groups}/{unit}" + (f"/{empty}" if empty else "")
    rng = random.Random(key)
    full = groups - empty
    weights = [1.0 / (r + 1) ** SKEW_EXPONENT for r in range(full)]
    rng.shuffle(weights)
    counts = [0] * full
    for g in rng.choices(range(full), weights=weights, k=total // unit):
        counts[g] += 1
    sizes = [c * unit for c in counts]
    for g in sorted(rng.sample(range(groups), empty)):
        sizes.insert(g, 0)
    return tuple(sizes)


def _dense(quick: bool) -> list[Case]:
    return [Case("deepseek-dense", "dense", m, n, k) for m in _DENSE_M for n, k in _DENSE_NK]


def _grouped(quick: bool) -> list[Case]:
    cont = [Case("deepseek-grouped", "contiguous", m, n, k, g)
            for g, m in _CONTIGUOUS_GM for n, k in _GROUPED_NK]
    masked = [Case("deepseek-grouped", "masked", m, n, k, g)
              for g, m in _MASKED_GM for n, k in _GROUPED_NK]
    return cont + masked


def _irregular(quick: bool) -> list[Case]:
    shapes = _IRREGULAR_QUICK if quick else itertools.product(_IRREGULAR_M, _IRREGULAR_N,
                                                              _IRREGULAR_K)
    return [Case("irregular", "dense", m, n, k) for m, n, k in shapes]


def _m_sweep(quick: bool) -> list[Case]:
    return [Case("m-sweep", "dense", m, n, k) for n, k in _DENSE_NK
            for m in (_SWEEP_M_QUICK if quick else _SWEEP_M)]


def _skewed(quick: bool) -> list[Case]:
    out = []
    for op, total in (("contiguous", _SKEW_CONTIGUOUS_ROWS), ("offsets", _SKEW_CONTIGUOUS_ROWS),
                      ("masked", _SKEW_MASKED_ROWS)):
        for g in _SKEW_GROUPS:
            sizes = skewed_sizes(total, g)
            out += [Case("moe-skewed", op, total // g, n, k, g, sizes) for n, k in _GROUPED_NK]
    return out


def backward_skewed_sizes(groups: int, tokens: int) -> tuple[int, ...]:
    """The backward-skewed suite's token counts of `groups` experts averaging `tokens`: skewed
    whole 128-token blocks, _KGROUPED_EMPTY experts with none."""
    return skewed_sizes(groups * tokens, groups, unit=_BLOCK, empty=_KGROUPED_EMPTY)


def _backward(quick: bool) -> list[Case]:
    """wgrad and dgrad of each dense layer Y = X . W^T (W [N_out, K_in]) at each token count,
    then the k-grouped wgrad with equal and with skewed token counts."""
    nk = _BACKWARD_NK_QUICK if quick else _DENSE_NK
    wgrad = [Case("backward", "wgrad", n, k, t) for t in _BACKWARD_TOKENS for n, k in nk]
    dgrad = [Case("backward", "dgrad", t, k, n) for t in _BACKWARD_TOKENS for n, k in nk]
    g, t = _KGROUPED_EXPERTS, _KGROUPED_TOKENS
    skewed = backward_skewed_sizes(g, t)
    kgrouped = [Case(suite, "k_grouped_wgrad", m, n, t, g, sizes)
                for suite, sizes in (("backward", ()), ("backward-skewed", skewed))
                for m, n in _KGROUPED_MN]
    return wgrad + dgrad + kgrouped


def _moe_layer(quick: bool) -> list[Case]:
    s = MOE_LAYER
    return [Case("moe-layer", "moe_layer", t, s.hidden, s.width, s.local_experts)
            for t in _MOE_LAYER_TOKENS]


def _moe_decode(quick: bool) -> list[Case]:
    return [Case("moe-decode", "masked", m, n, k, g) for g in _DECODE_GROUPS
            for m in _DECODE_ROWS for n, k in _GROUPED_NK]


SUITES = {"deepseek-dense": _dense, "deepseek-grouped": _grouped, "irregular": _irregular,
          "m-sweep": _m_sweep, "moe-skewed": _skewed, "backward": _backward,
          "moe-layer": _moe_layer, "moe-decode": _moe_decode}


def all_suite_names() -> tuple[str, ...]:
    return tuple(SUITES)


def suite_cases(name: str, quick: bool = False) -> list[Case]:
    """The cases of one suite, or of every suite for "all"; `quick` trims `irregular`, `m-sweep`
    and `backward` (the module's docstring)."""
    if name == "all":
        return [c for s in SUITES for c in SUITES[s](quick)]
    if name not in SUITES:
        raise ValueError(f"suite must be one of {('all',) + all_suite_names()}, got {name!r}")
    return SUITES[name](quick)

"""The sm90 small-M (decode) kernel families: A scaled per 1x128 group, B per 128x128 block, bf16
out, computed as D^T = B . A^T and split along K over a thread-block cluster.

Kernel: include/fp8gemm/sm90_fp8_gemm_small_m.cuh. N, K, the token tile, the split and the
stages are compile-time constants; M is a kernel argument. One CTA per (tile, split), one wave:
a tile is 64 rows of B (wgmma's 64-row side) by `block_m` tokens (wgmma's N, 8..160); the
`num_splits` CTAs of a cluster share its K range and sum their FP32 partial tiles in rank order
through distributed shared memory.

Two families share the kernel:
- `SMALL_M` (dense) sits before the dense family in the backend's table and takes only the
  problems its model says it runs faster (`declines`); everything else stays with
  `sm90_fp8_gemm_1d2d`.
- `MASKED_SMALL_M`: the masked grouped GEMM of decode MoE at few expected rows per expert, where
  the grouped family's tiles leave SMs idle (one or two experts a GPU under wide expert
  parallelism: 32 tiles of 128x128 at N = 4096). The grid holds `num_slots` token tiles per
  group, from the host's expected rows; each cluster walks its group's token tiles below
  `masked_m[g]`, so any `masked_m` up to Mmax is computed. It sits before the grouped family in
  the backend's table and declines what its model gives to that family.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ... import jit
from ..._settings import settings
from ...layout import is_col_major_tma_aligned, num_sms_override
from ...problem import SCALE_BLOCK, GemmKind, GemmProblem, align, ceil_div
from ..family import DeviceFacts, KernelFamily
from . import sm90_fp8_gemm_1d2d as dense
from .launch import cached_plan, kernel_a_scales, launch, row_stride, tma_aligned

__all__ = ["SmallMConfig", "Sm90Fp8Gemm1d2dSmallM", "Sm90MGroupedFp8Gemm1d2dSmallM", "SMALL_M",
           "MASKED_SMALL_M", "smem_bytes", "stage_bytes", "stage_target", "max_stages",
           "cluster_slots", "token_tiles", "estimate_us", "dense_estimate_us", "expected_rows",
           "candidates", "problem_candidates",
           "kernel_source", "compile_kernel", "launcher", "BLOCK_K", "BLOCK_N", "MAX_M",
           "MAX_BLOCK_M", "MAX_SPLITS", "NUM_THREADS"]

BLOCK_K = SCALE_BLOCK
# NOTE: rows of B per tile: wgmma's M is 64, and B's 128-row scale blocks hold two such tiles, so
# a tile's B scale is one value per k-block.
BLOCK_N = 64
# NOTE: tokens are wgmma's N; each math thread holds the accumulator and the FP32 sums, BLOCK_M / 2
# floats each, and BLOCK_M / 4 token scales: at 160 tokens ptxas still fits every variant in the
# math warpgroups' 232 registers without spills (tests/test_cuda_small_m.py compiles them); at 192
# it spills. Above 128, M = 129..160 runs as one token tile with B read once, where two tiles
# would not fit one wave at N = 7168 and the dense family's tiles read B twice (H200 figures:
# docs/cuda.md, "Its heuristic").
MAX_BLOCK_M = 160
# Above two token tiles of 128 the dense family's 128- and 256-row tiles read B fewer times.
MAX_M = 256
# A portable cluster holds at most 8 CTAs.
MAX_SPLITS = 8
# NOTE: a decode CTA streams its k-blocks through the ring, so the bytes it keeps in flight set
# its rate (Little's law): 8 stages of an 8-token tile (9.3 KB each) pulled ~35 GB/s per CTA on
# the H200. The ring is as deep as IN_FLIGHT_BYTES asks, at least BASE_STAGES and at most
# MAX_STAGES: 16 stages ran 1x2112x7168 in 11.6 us against 13.0 at 8 and 1x4096x7168 in 15.0
# against 16.8 (20: no faster), while 64-token tiles (16.6 KB stages) ran no faster at 12 than
# at 8 (128x2112x7168, 64x7168x16384).
IN_FLIGHT_BYTES = 150 * 1024
BASE_STAGES = 8
MAX_STAGES = 16
MIN_STAGES = 2
# NOTE: stage counts are even. The two math warpgroups take alternate k-blocks, and a parity
# wait on a stage's full barrier is unambiguous only if the barrier's previous phase has
# completed. With an even ring each stage feeds one warpgroup, which consumed that previous
# phase itself. With an odd ring the previous phase belonged to the other warpgroup: a
# warpgroup can reach its wait while that load is still in flight (issued earlier, but TMA loads
# need not complete in issue order), and the parity it waits for is then already the barrier's
# completed one, so it reads a stage not yet loaded and arrives on an empty barrier out of turn.
# On the H200, 3 and 5 stages hung, faulted or summed wrong at M = 1 (1-row A boxes); 4 and 6
# gave 300 of 300 runs right. The host and the kernel refuse odd counts.
NUM_THREADS = 384  # one producer and two math warpgroups

# --- cost model ----------------------------------------------------------------------------------
# Time of one wave in microseconds: FIXED_US + max(DRAM time of the bytes moved once, the slowest
# CTA's stream) + SPLIT_US when the tile is split.
# - A CTA streams its k-blocks at the dense model's tile cost (sm90_fp8_gemm_1d2d.tile_cost units,
#   FLOP per unit of K: max(MMA, LOAD_WEIGHT x bytes)); the two math warpgroups alternate
#   k-blocks as the dense kernel's two do, so the MMA side has the two-warpgroup efficiency.
#   SM_FLOPS_PER_US converts: H200's FP8 dense peak (1480 TFLOPS) per SM, which with LOAD_WEIGHT
#   = 128 makes ~88 GB/s a CTA can pull from L2/HBM.
# - DRAM: HBM at 4.25 TB/s, A and D moved once, B once and REREAD_B more for each token tile
#   after the first: the token tiles of one B tile run at the same time, and their loads of it do
#   not all meet in L2.
# - FIXED_US: launch and pipeline ramp, the 4 us of the memory floor (bytes / 4.25 TB/s + 4 us).
# - SPLIT_US: two cluster barriers and the DSMEM reduction of a partial tile (at most 32 KB).
# REREAD_B and SPLIT_US are fitted to every candidate of 34 decode shapes (2112x7168 and
# 4096x7168 at M = 1..192, 7168x2048 and 7168x16384 at M = 1..128) timed on the H200 in one
# run (`scripts/cuda_tiles.py --family sm90_fp8_gemm_1d2d_small_m --sweep`): with B read once
# (REREAD_B = 0, SPLIT_US = 0.5) the model took two token tiles of 16-24 tokens where one tile
# ran 12-15 % faster (4096x7168 at M = 24: 18.1 us against 15.7) and two splits where three ran
# 6-11 % faster (2112x7168 at M = 32 and 48); fitted, its picks ran 0.2 % slower than the
# fastest candidate of each shape (geometric mean), against 1.9 %.
SM_FLOPS_PER_US = 1480e6 / 132
DRAM_BYTES_PER_US = 4.25e6
FIXED_US = 4.0
REREAD_B = 0.25
SPLIT_US = 1.0
# NOTE: the CTAs of a cluster must share a GPC. The H100/H200 GPCs hold 14-18 SMs (8 of them for
# 132 SMs; harvesting varies per chip), so clusters of more than 2 leave SMs idle. The H200's
# driver (cuOccupancyMaxActiveClusters) runs 22 clusters of 5 CTAs (110 SMs) and 17 of 6 (102):
# the model assumes the smaller share, 0.775 of the SMs, for every size of 3..8 (5-CTA: 20,
# 6-CTA: 17, 8-CTA: 12), so that a config it takes for one wave never starts a second (which
# would double the time); tests/test_cuda_small_m.py checks every size against the driver.
CLUSTER_PACKING = 0.775
# The family takes a problem only where its model beats the dense family's by this factor. On
# the H200 at 7168x2048 (both families timed in one session) the small-M kernel ran 13 % faster
# than the dense 64x64 tiles at M = 8 and 4 % at M = 32, equal at M = 64, where the model says
# 0.967, 0.979 and 0.995 of the dense time: the dense model is the more optimistic one there.
WIN_FACTOR = 0.98
# Masked, against the grouped family's narrow tiles (64x32 .. 128x64 streaming all of K), whose
# model is the more optimistic one by more: on an H100 (one run, both families' choices timed
# with masked_m at the expected rows) the small-M kernel ran 4-19 % faster at six decode shapes
# (1 and 2 experts of 32 and 128 rows at 4096x7168, 1 x 32 and 1 x 128 at 7168x2048) where the
# model put it at 0.97-1.03 of the grouped time; the measured over modelled time was 1.53-1.68
# for the small-M kernel and 1.41-1.90 for the grouped one. With the split reduction on mbarriers
# (H100 again) the small-M kernel ran 1.05-1.16x the grouped family at four of those shapes.
# On the H200 (one run, 40 runs each) it ran 1.05-1.33x the grouped family's choice at all six
# masked decode shapes the one-wave rule lets it take (1 and 2 experts of 32 and 128 rows at
# 4096x7168, 1 x 32 and 1 x 128 at 7168x2048), where the model put it at 0.76-1.03 of the
# grouped time: the factor keeps every one, and none was modelled above it.
MASKED_WIN_FACTOR = 1.05


def cluster_slots(num_splits: int, num_sms: int) -> int:
    """Clusters of `num_splits` CTAs the model assumes run at once on `num_sms` SMs."""
    if num_splits <= 2:
        return num_sms // num_splits
    return int(num_sms * CLUSTER_PACKING) // num_splits


def sa_stage(block_m: int) -> int:
    """Sm90Fp8GemmSmallMLayout::kSaStage: floats of A scales per stage (128-byte TMA rows)."""
    return align(block_m, 32)


def smem_bytes(block_m: int, num_splits: int, num_stages: int, k: int,
               masked: bool = False) -> int:
    """Sm90Fp8GemmSmallMLayout::kSmemBytes: the kernel traps when launched with less."""
    per_stage = stage_bytes(block_m)
    sb = align(ceil_div(ceil_div(k, BLOCK_K), num_splits) * 4, 16)
    red = block_m * (BLOCK_N + 4) * 4
    barriers = 2 * num_stages + (2 if masked and num_splits > 1 else 0)
    return 1024 + num_stages * per_stage + sb + red + barriers * 8


def stage_bytes(block_m: int) -> int:
    """Shared memory of one ring stage: 64 rows of B, block_m of A, their A scales."""
    return BLOCK_N * BLOCK_K + block_m * BLOCK_K + sa_stage(block_m) * 4


def stage_target(block_m: int) -> int:
    """Stages that keep IN_FLIGHT_BYTES in flight, at least BASE_STAGES and at most MAX_STAGES."""
    return min(MAX_STAGES, max(BASE_STAGES, IN_FLIGHT_BYTES // stage_bytes(block_m)))


def max_stages(block_m: int, num_splits: int, k: int, smem_limit: int,
               masked: bool = False) -> int:
    """The deepest even pipeline up to `stage_target` that fits `smem_limit` bytes, at most one
    stage per k-block of a split (rounded down to even; 0: none fits)."""
    top = max(MIN_STAGES, min(stage_target(block_m), ceil_div(ceil_div(k, BLOCK_K), num_splits)))
    for s in range(top - top % 2, MIN_STAGES - 1, -2):
        if smem_bytes(block_m, num_splits, s, k, masked) <= smem_limit:
            return s
    return 0


@dataclass(frozen=True)
class SmallMConfig:
    """One instance of the small-M kernel and its launch (one CTA per tile and split)."""

    block_m: int  # tokens per tile: wgmma's N
    num_splits: int  # CTAs per cluster, each over a contiguous range of the k-blocks
    num_stages: int
    grid: int  # CTAs: tiles x num_splits
    num_slots: int = 1  # masked: token tiles per group in the grid (dense: 1)

    @property
    def block_n(self) -> int:
        return BLOCK_N

    @property
    def num_threads(self) -> int:
        return NUM_THREADS

    def smem(self, k: int, masked: bool = False) -> int:
        """Dynamic shared memory of this config at K (of the masked kernel if `masked`), bytes."""
        return smem_bytes(self.block_m, self.num_splits, self.num_stages, k, masked)

    def __str__(self) -> str:
        slots = f" slots={self.num_slots}" if self.num_slots > 1 else ""
        return (f"swap-AB BLOCK {BLOCK_N}(N)x{self.block_m}(M)x{BLOCK_K} split-K={self.num_splits} "
                f"stages={self.num_stages} grid={self.grid} cluster={self.num_splits}{slots} "
                f"threads={NUM_THREADS}")


def token_tiles(m: int) -> tuple[int, ...]:
    """Token tile widths worth pricing for M rows: the fewest tiles of at most MAX_BLOCK_M, and
    one tile more (more CTAs for the same bytes of B, from L2), each as narrow as M allows."""
    fewest = ceil_div(m, MAX_BLOCK_M)
    out = []
    for tiles in (fewest, fewest + 1):
        bm = align(ceil_div(m, tiles), 8)
        if bm not in out and (tiles == fewest or bm < out[0]):
            out.append(bm)
    return tuple(out)


def dram_us(m: int, n: int, k: int, token_tiles: int = 1) -> float:
    return (n * k * (1 + REREAD_B * (token_tiles - 1)) + m * k + 2 * m * n) / DRAM_BYTES_PER_US


def estimate_us(m: int, n: int, k: int, block_m: int, num_splits: int, groups: int = 1) -> float:
    """Modelled time of the small-M kernel (the cost model above) for `groups` GEMMs of M = m
    rows each, rounded so that configs the model prices alike tie exactly and the tie-breaks
    decide."""
    a_rows = min(block_m, m)
    mma = 2 * BLOCK_N * block_m / (block_m / align(block_m, 32))
    per_k = max(mma, dense.LOAD_WEIGHT * (BLOCK_N + a_rows))
    kb = ceil_div(ceil_div(k, BLOCK_K), num_splits)
    cta = kb * BLOCK_K * per_k / SM_FLOPS_PER_US
    split = SPLIT_US if num_splits > 1 else 0.0
    dram = groups * dram_us(m, n, k, ceil_div(m, block_m))
    return round(FIXED_US + max(dram, cta) + split, 3)


def dense_estimate_us(problem: GemmProblem, facts: DeviceFacts) -> float:
    """The same model for the config the dense family (dense problems) or the grouped family
    (masked) chooses: its persistent CTAs walk ceil(tiles / grid) tiles of all of K each, at
    that family's tile cost."""
    m, n, k, groups = problem.m, problem.n, problem.k, 1
    if problem.kind is GemmKind.MASKED:
        m, groups = expected_rows(problem), problem.groups
        cfg = dense.GROUPED.select_config(problem, facts)
    else:
        cfg = dense.DENSE.select_config(problem, facts)
    tiles = groups * ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    per_tile = ceil_div(k, BLOCK_K) * BLOCK_K * dense.tile_cost(cfg.block_m, cfg.block_n, k)
    cta = ceil_div(tiles, cfg.grid) * per_tile / SM_FLOPS_PER_US
    return round(FIXED_US + max(groups * dram_us(m, n, k), cta), 3)


def expected_rows(problem: GemmProblem) -> int:
    """Rows per group the masked model prices: the caller's expected_m, within 1..Mmax."""
    return min(max(1, problem.expected_m), max(1, problem.m))


@dataclass(frozen=True)
class Candidate:
    config: SmallMConfig
    tiles: int
    us: float  # estimate_us


def candidates(m: int, n: int, k: int, facts: DeviceFacts, groups: int = 1,
               masked: bool = False) -> list[Candidate]:
    """Every one-wave config that fits shared memory, with its modelled time, best first:
    least time; among equals fewer splits (less reduction), then fewer tiles. Masked: `groups`
    GEMMs of m expected rows each, the grid holding each group's token tiles (`num_slots`)."""
    out = []
    num_kb = ceil_div(k, BLOCK_K)
    for bm in token_tiles(m):
        slots = ceil_div(m, bm)
        tiles = groups * slots * ceil_div(n, BLOCK_N)
        for splits in range(1, min(MAX_SPLITS, num_kb) + 1):
            if tiles > cluster_slots(splits, facts.num_sms):
                continue
            stages = max_stages(bm, splits, k, facts.smem_per_block, masked)
            if stages == 0:
                continue
            cfg = SmallMConfig(bm, splits, stages, tiles * splits, slots if masked else 1)
            out.append(Candidate(cfg, tiles, estimate_us(m, n, k, bm, splits, groups)))
    out.sort(key=lambda c: (c.us, c.config.num_splits, c.tiles))
    return out


def problem_candidates(problem: GemmProblem, facts: DeviceFacts) -> list[Candidate]:
    """`candidates` of a dense or masked problem (masked: its expected rows per group)."""
    if problem.kind is GemmKind.MASKED:
        return candidates(expected_rows(problem), problem.n, problem.k, facts, problem.groups,
                          masked=True)
    return candidates(problem.m, problem.n, problem.k, facts)


@functools.lru_cache(maxsize=4096)
def _select(problem: GemmProblem, facts: DeviceFacts) -> SmallMConfig | None:
    cands = problem_candidates(problem, facts)
    return cands[0].config if cands else None


@functools.lru_cache(maxsize=4096)
def _declines(problem: GemmProblem, facts: DeviceFacts) -> str | None:
    cands = problem_candidates(problem, facts)
    if not cands:
        return (f"no config fits one wave of {facts.num_sms} SMs (N/{BLOCK_N} x M/"
                f"{MAX_BLOCK_M} tiles, at least one cluster each)")
    mine, theirs = cands[0].us, dense_estimate_us(problem, facts)
    factor = MASKED_WIN_FACTOR if problem.kind is GemmKind.MASKED else WIN_FACTOR
    if mine >= factor * theirs:
        other = "grouped" if problem.kind is GemmKind.MASKED else "dense"
        return f"modelled {mine:.2f} us against the {other} family's {theirs:.2f} us"
    return None


# --- kernel source -------------------------------------------------------------------------------
def kernel_source(n: int, k: int, cfg: SmallMConfig, masked: bool = False) -> tuple[str, str]:
    """(source, name expression) of the kernel instance for (N, K, config), dense or masked."""
    source = "#include <fp8gemm/sm90_fp8_gemm_small_m.cuh>\n"
    name = (f"&fp8gemm::sm90_fp8_gemm_1d2d_small_m_kernel<{n}, {k}, {cfg.block_m}, "
            f"{cfg.num_splits}, {cfg.num_stages}, {'true' if masked else 'false'}>")
    return source, name


def compile_kernel(n: int, k: int, cfg: SmallMConfig, compiler: str | None = None,
                   masked: bool = False):
    """Compile without loading (no GPU needed): (key, CompiledCubin, path, was_cached)."""
    source, name = kernel_source(n, k, cfg, masked)
    return jit.compile_cached(source, name, (str(dense.INCLUDE_DIR),), compiler=compiler)


# --- launch --------------------------------------------------------------------------------------
class SmallMPlan:
    """Everything fixed for one (problem, device, config): kernel, launch config, and the
    argument packs of the tensors it has seen (tensor maps encoded once per pointer set)."""

    __slots__ = ("cfg", "kernel", "launch", "device_index", "m", "n", "k", "groups", "masked",
                 "packs", "tmaps", "sm_override")

    def __init__(self, problem: GemmProblem, device_index: int, cfg: SmallMConfig) -> None:
        self.sm_override = num_sms_override()
        self.cfg, self.m, self.n, self.k = cfg, problem.m, problem.n, problem.k
        self.masked = problem.kind is GemmKind.MASKED
        self.groups = problem.groups if self.masked else 1
        m_tiles = cfg.num_slots if self.masked else ceil_div(problem.m, cfg.block_m)
        tiles = self.groups * m_tiles * ceil_div(problem.n, BLOCK_N)
        if cfg.grid != tiles * cfg.num_splits or not 1 <= cfg.num_splits <= MAX_SPLITS \
                or cfg.num_splits > ceil_div(problem.k, BLOCK_K) or cfg.num_slots < 1:
            raise ValueError(f"config {cfg}: grid must be tiles x splits = {tiles} x "
                             f"{cfg.num_splits}, with 1..{MAX_SPLITS} splits of at least one "
                             f"k-block each (and at least one slot)")
        if cfg.num_stages < MIN_STAGES or cfg.num_stages % 2:
            raise ValueError(f"config {cfg}: the kernel takes an even number of stages, at least "
                             f"{MIN_STAGES}")
        self.device_index = device_index
        smem = cfg.smem(problem.k, self.masked)
        self.kernel = jit.build(*kernel_source(problem.n, problem.k, cfg, self.masked),
                                (str(dense.INCLUDE_DIR),))
        self.kernel.set_max_dynamic_smem(smem, device_index)
        self.launch = jit.LaunchConfig((cfg.grid, 1, 1), (NUM_THREADS, 1, 1), smem,
                                       (cfg.num_splits, 1, 1), pdl=settings.pdl)
        self.packs: dict[tuple, jit.ParamPack] = {}
        self.tmaps = jit.TensorMapCache(capacity=512)

    def params(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               out: torch.Tensor, ld: int, masked_m: torch.Tensor | None,
               key: tuple) -> jit.ParamPack:
        cfg, m, n, k, g, tm = self.cfg, self.m, self.n, self.k, self.groups, self.tmaps
        kb = ceil_div(k, BLOCK_K)
        # NOTE: boxes of min(BLOCK_M, M) token rows and min(64, N) rows of B: the kernel expects
        # exactly these bytes per stage. Masked, A, B and D are their groups' rows one after
        # another (M = Mmax), and the A scales a 3-D map, so that a box never reads another
        # group's.
        a_stride = (row_stride(a.view(-1, k)) * a.element_size(),)
        map_a = tm.get(a.dtype, a.data_ptr(), (k, g * m), a_stride,
                       (BLOCK_K, min(cfg.block_m, m)), jit.Swizzle.B128)
        map_b = tm.get(b.dtype, b.data_ptr(), (k, g * n), (k * b.element_size(),),
                       (BLOCK_K, min(BLOCK_N, n)), jit.Swizzle.B128)
        mp = align(m, 4)  # the A-scale column stride (layout.get_col_major_tma_aligned_tensor)
        if self.masked:
            map_sa = tm.get(torch.float32, sa.data_ptr(), (m, kb, g), (mp * 4, kb * mp * 4),
                            (cfg.block_m, 1, 1))
        else:
            map_sa = tm.get(torch.float32, sa.data_ptr(), (m, kb), (mp * 4,), (cfg.block_m, 1))
        pack = jit.ParamPack([ctypes.c_uint64(sb.data_ptr()), ctypes.c_uint32(m),
                              ctypes.c_uint64(out.data_ptr()), ctypes.c_uint32(ld),
                              map_a, map_b, map_sa,
                              ctypes.c_uint64(0 if masked_m is None else masked_m.data_ptr()),
                              ctypes.c_uint32(cfg.num_slots)])
        if len(self.packs) >= 1024:
            self.packs.clear()
        self.packs[key] = pack
        return pack

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, masked_m: torch.Tensor | None = None) -> None:
        """out = (a * sa) @ (b * sb)^T (per group when masked); tensors as the backend contract
        hands them over (a, b, masked_m contiguous; scales float32, any strides); dense out
        [M, N] contiguous or rows of any stride, masked out [G, Mmax, N] contiguous."""
        if self.masked and masked_m is None:
            raise ValueError("the masked small-M kernel needs masked_m")
        sa = kernel_a_scales(sa)
        if not sb.is_contiguous():
            sb = sb.contiguous()
        dst = out
        if (a.data_ptr() | b.data_ptr() | out.data_ptr()) % 16:
            # A contiguous view at an odd storage offset: TMA cannot address it (slow path).
            a, b = tma_aligned(a), tma_aligned(b)
        # Output rows: dense any row stride; masked [G, Mmax, N] as G * Mmax rows of N.
        ld = self.n if self.masked else row_stride(out)
        if out.data_ptr() % 16 or ld % 8 or out.stride(-1) != 1 or \
                (self.masked and not out.is_contiguous()):
            # The kernel stores 16 bytes at a time: rows on 16 bytes, elements contiguous.
            # NOTE: masked rows at or past masked_m are left untouched: start from out's values.
            fmt = torch.contiguous_format
            dst = (out.clone(memory_format=fmt) if self.masked
                   else torch.empty_like(out, memory_format=fmt))
            ld = self.n
        # NOTE: with a, b contiguous and the plan fixing the shapes, these pointers, sa's strides
        # (fixed per call site) and out's row stride are all the arguments depend on.
        key = (a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), dst.data_ptr(), ld,
               0 if masked_m is None else masked_m.data_ptr())
        pack = self.packs.get(key)
        if pack is None:
            pack = self.params(a, sa, b, sb, dst, ld, masked_m, key)
        launch(self.kernel, self.launch, self.device_index, pack)
        if dst is not out:
            out.copy_(dst)


_plans: dict[tuple, SmallMPlan] = {}


def get_plan(problem: GemmProblem, device_index: int, cfg: SmallMConfig) -> SmallMPlan:
    """The plan of (problem, device, config), built on first use."""
    key = (problem.kind, problem.m, problem.n, problem.k, problem.groups, device_index, cfg)
    fam = MASKED_SMALL_M if problem.kind is GemmKind.MASKED else SMALL_M
    return cached_plan(_plans, key, lambda: SmallMPlan(problem, device_index, cfg), fam.name,
                       problem, cfg)


# --- families -------------------------------------------------------------------------------------
class _SmallMFamily(KernelFamily):
    Config = SmallMConfig

    def _refusal(self, problem: GemmProblem) -> str | None:
        why = dense._common_refusal(problem)
        if why is not None:
            return why
        if problem.a_dtype != torch.float8_e4m3fn:
            return "takes A in e4m3 only (A is wgmma's e4m3 B operand here)"
        if problem.has_c:
            return "has no C input (the dense family adds C)"
        return None

    def declines(self, problem: GemmProblem, facts: DeviceFacts) -> str | None:
        return _declines(problem, facts)

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> SmallMConfig:
        cfg = _select(problem, facts)
        if cfg is None:
            raise ValueError(f"{self.name} has no one-wave config for {problem} on "
                             f"{facts.num_sms} SMs: {_declines(problem, facts)}")
        return cfg

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[SmallMConfig]:
        """Every one-wave config that fits, the chosen one first."""
        return [c.config for c in problem_candidates(problem, facts)]

    def config_for(self, problem: GemmProblem, device: torch.device) -> SmallMConfig:
        return self.select_config(problem, DeviceFacts.of(device))

    def run(self, config: SmallMConfig, problem: GemmProblem, a: torch.Tensor, sa: torch.Tensor,
            b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, c: torch.Tensor | None = None,
            index: torch.Tensor | None = None) -> None:
        """`index`: the masked family's masked_m; the dense family takes none."""
        if c is not None:
            raise ValueError(f"{self.name} has no C input (supports() refuses has_c)")
        if index is not None and problem.kind is not GemmKind.MASKED:
            raise ValueError(f"{self.name} runs dense GEMMs only: no group index")
        get_plan(problem, a.device.index, config).run(a, sa, b, sb, out, index)


class Sm90Fp8Gemm1d2dSmallM(_SmallMFamily):
    """Dense GEMMs of M <= MAX_M, swapped (B fills wgmma's 64-row side) and split along K over
    a cluster; declines what the dense family runs faster by the model."""

    name = "sm90_fp8_gemm_1d2d_small_m"

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind is not GemmKind.DENSE:
            return f"takes dense GEMMs, not {problem.kind.value}"
        if problem.m > MAX_M:
            return f"takes M <= {MAX_M} (decode sizes), got M={problem.m}"
        return self._refusal(problem)


class Sm90MGroupedFp8Gemm1d2dSmallM(_SmallMFamily):
    """Masked grouped GEMMs of at most MAX_M expected rows per group, swapped and split along K
    as the dense small-M GEMMs; declines what the grouped family runs faster by the model."""

    name = "sm90_m_grouped_fp8_gemm_1d2d_small_m"

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind is not GemmKind.MASKED:
            return f"takes masked grouped GEMMs, not {problem.kind.value}"
        if expected_rows(problem) > MAX_M:
            return (f"takes at most {MAX_M} expected rows per group (decode sizes), got "
                    f"expected_m={problem.expected_m}")
        return self._refusal(problem)


SMALL_M = Sm90Fp8Gemm1d2dSmallM()
MASKED_SMALL_M = Sm90MGroupedFp8Gemm1d2dSmallM()


# --- the ops layer's warm-call fast path ---------------------------------------------------------
class _Launcher:
    """Warm calls of one metadata signature (see sm90_fp8_gemm_1d2d._Launcher): a hit in the
    plan's argument packs launches at once; anything else (new pointers, set_num_sms since)
    goes to `slow`, the backend's full path, which chooses the family again."""

    __slots__ = ("family", "plan", "problem", "device", "device_index", "slow", "masked")

    def __init__(self, family: _SmallMFamily, problem: GemmProblem, device: torch.device,
                 slow) -> None:
        self.plan = get_plan(problem, device.index, family.config_for(problem, device))
        self.family, self.problem, self.device, self.device_index, self.slow = (
            family, problem, device, device.index, slow)
        self.masked = problem.kind is GemmKind.MASKED

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, x: torch.Tensor | None) -> None:
        """`x`: a dense call's c (the families take none: `slow` says so), a masked call's
        masked_m."""
        plan = self.plan
        # SmallMPlan.run's pack key; out is contiguous here, so its row stride is N.
        pack = plan.packs.get((a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(),
                               out.data_ptr(), plan.n, x.data_ptr() if self.masked else 0))
        if pack is not None and plan.sm_override == num_sms_override():
            launch(plan.kernel, plan.launch, self.device_index, pack)
        else:
            self.slow(a, sa, b, sb, out, x)
            if plan.sm_override != num_sms_override():
                facts = DeviceFacts.of(self.device)
                if self.family.declines(self.problem, facts) is None:
                    self.plan = get_plan(self.problem, self.device_index,
                                         self.family.select_config(self.problem, facts))


def launcher(family: _SmallMFamily, problem: GemmProblem, sa: torch.Tensor, sb: torch.Tensor,
             slow):
    """`_Launcher.run` of `family` (SMALL_M or MASKED_SMALL_M) for warm calls with contiguous
    a, b, out (and masked_m) and scales with the metadata of sa and sb, or None when those
    scales need converting on every call (the general path). `slow(a, sa, b, sb, out, x)` runs
    a call the launcher has no argument pack for."""
    if not (is_col_major_tma_aligned(sa) and sb.is_contiguous()):
        return None
    return _Launcher(family, problem, sa.device, slow).run

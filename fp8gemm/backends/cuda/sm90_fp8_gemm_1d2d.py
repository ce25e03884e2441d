"""The sm90 1D2D kernel families: A scaled per 1x128 group, B per 128x128 block, bf16 out.

Kernel: include/fp8gemm/sm90_fp8_gemm_1d2d.cuh, one template for the dense GEMM and the three
MoE-grouped kinds (one scheduler walks all of them). N and K are compile-time constants; M, the
group count and the grouped layout (m_indices, offsets, masked_m) are kernel arguments.

Two families share it: `sm90_fp8_gemm_1d2d` (dense) and `sm90_m_grouped_fp8_gemm_1d2d`
(contiguous, offsets, masked). Each owns its heuristic; both run through `Sm90Plan`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ... import jit
from ..._settings import settings
from ...layout import is_col_major_tma_aligned, num_sms_override
from ...problem import SCALE_BLOCK, GemmKind, GemmProblem, Recipe, align, ceil_div
from ..family import DeviceFacts, KernelFamily
from .launch import (cached_plan, kernel_a_scales, launch, row_stride, split_workspace,
                     tma_aligned)

__all__ = ["Sm90Config", "Sm90Fp8Gemm1d2d", "Sm90MGroupedFp8Gemm1d2d", "Sm90Fp8Gemm1d2dSplitK",
           "DENSE", "GROUPED", "SPLIT_K", "split_candidates",
           "smem_bytes", "smem_limit", "sa_pad", "sa_box", "max_stages", "num_threads",
           "tile_cost", "mma_efficiency", "use_two_accum", "kernel_source", "compile_kernel",
           "BLOCK_K", "BLOCK_N_CHOICES", "MAX_K"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
# NOTE: one k-block is one scale block: partial sums are promoted (and scaled) every 128 of K.
BLOCK_K = SCALE_BLOCK
# NOTE: wgmma N goes up to 256, but each math thread holds two BLOCK_N/2 float accumulators
# (wgmma's and the promoted FP32 one) in 232 registers. Above 128 only widths that never straddle
# three 128-wide B scale blocks (BLOCK_N <= 128 + largest power of two dividing it): 136, 144,
# 160, 192 (224 and 256 would); 192 compiles without spills up to K = MAX_K.
BLOCK_N_CHOICES = tuple(range(16, 129, 8)) + (136, 144, 160, 192)
BLOCK_M_CHOICES = (64, 128, 256)
# BLOCK_M = 256 keeps two FP32 sums per thread besides the wgmma accumulator: BLOCK_N <= 136 fits
# without spills (144 spills). Narrower tiles gain nothing from the second wave: on the M = 4096
# shapes 256x96 and 256x112 ran 20-28 % slower than 256x128 (more than their wave counts say).
BLOCK_N_CHOICES_256 = (128, 136)
MAX_STAGES = 8
# A 64x32 tile's stage is 12 KB: 8 of them hold too little in flight for one CTA streaming a long
# K. On the H200 (one run, 64x32 tiles, K = 7168) 14 stages ran 6-11 % faster than 8 from 32 rows
# of A up (4096x7168 at M = 32, 48, 64: 16.0, 16.8, 16.5 us against 17.9, 18.2, 18.4; 96x2112x7168
# 14.3 against 15.2), 12 stages at M = 1 1.7 % slower (a stage of one A row and 32 B rows), and
# 64x64 tiles at 7168x2048 no faster with 10 or 12. Masked groups of as many expected rows take
# the same ring: the grouped family picks 64x32 tiles only for one or two experts, whose CTAs
# stream a long K alone as the dense ones do (the grouped kinds' 7-stage cap is for the register
# pressure of wider tiles; a masked 64x32 tile at 14 stages compiles without spills).
DEEP_RING_STAGES = 14
DEEP_RING_TILE = (64, 32)
DEEP_RING_MIN_ROWS = 32
# NOTE: with the grouped scheduler's state live, ptxas spilled 64x96..64x128 tiles at 8 stages
# (K = 2048: 84 bytes); 7 stages compile clean.
GROUPED_MAX_STAGES = 7
MIN_STAGES = 3
# Tiles per rasterisation band (even: a 2-CTA cluster's two tiles must share a band).
BAND_SIZE = 16
# NOTE: cost model of one tile per unit of K: max(MMA time, load time), in FLOP units, fitted to
# H200 runs timed as the bench times (cold L2, GPU kept busy before the start).
# - MMA: 2*BM*BN / efficiency. The tensor cores take N in steps of 32 (N = 136 costs about what
#   160 does), so efficiency is BN / align(BN, 32), times WIDE_TILE_EFFICIENCY above 128. One math
#   warpgroup (BLOCK_M = 64) waits for its own wgmma before each promotion and reaches well under
#   half the rate of two, which alternate (0.4 fits the M = 128 shapes, where both tile heights
#   compete). BLOCK_M = 256 (two 128-row waves per k-block) ran 3-11 % faster per FLOP than 128
#   at equal wave counts on the six M = 4096 suite shapes: 1.06. Tiles wider than 128: 0.96 at
#   BLOCK_M <= 128, 1.02 at 256 (256x136 ran 0.87x 256x128's per-FLOP rate; 136/160 alone says
#   0.85). Two wgmma accumulators in flight (use_two_accum), with the epilogue under the next
#   tile's first wgmma: on 128x128, 256x128 still ran 2-5 % faster at equal waves on the M = 4096
#   shapes, so the two accumulators' tile costs / 1.02 at K >= 1024. A tile that straddles two
#   B-scale blocks at a split with at most 4 values (160, 192 wide; split_per_tile) runs its
#   k-loop with the split a constant: against the selects, 128x160 ran 1.07x faster, 128x192
#   1.03-1.04x (H200, same run, M = 4096 dense and 8-32 expert contiguous): SPLIT_PER_TILE_GAIN.
# - Loads: LOAD_WEIGHT * (BM + BN) bytes of A and B per unit of K; LOAD_WEIGHT is the FLOPs an SM
#   does while pulling one byte from L2 (1480 TFLOPS / 132 SMs over ~90 GB/s per SM).
LOAD_WEIGHT = 128
ONE_WARPGROUP_EFFICIENCY = 0.4
TWO_WAVE_EFFICIENCY = 1.06
TWO_ACCUM_EFFICIENCY = 1.02
TWO_ACCUM_MIN_K = 1024
TWO_ACCUM_MAX_K = 49152
WIDE_TILE_EFFICIENCY = {64: 0.96, 128: 0.96, 256: 1.02}
SPLIT_PER_TILE_GAIN = 1.03
# Contiguous and offsets tiles read more per FLOP from L2 than the dense model's LOAD_WEIGHT says:
# each group brings its own B, and the band walk that keeps a dense B panel in L2 ends at every
# group boundary. In Nsight Compute on 16 skewed experts (4096x7168), 128x128 tiles with two
# accumulators ran the L2 at 82 % of its peak bandwidth; on the H200 (two runs, each against them
# in the same run) 128x192 tiles, a fifth less L2 traffic per FLOP, ran 0-3 % faster on 16 and 32
# skewed experts (2048 and 1024 rows each, 4096x7168 and 7168x2048) and offsets 9-12 % faster on
# 32, where the dense weight priced them 3 % slower.
CONTIGUOUS_LOAD_FACTOR = 1.1
# 128-row tiles 136-160 wide (five 32-column wgmma steps) ran 4-7 % slower than 128x192 (six) on
# the same problems (H200, same run: contiguous, 8-32 experts, 4096x7168 and 7168x2048; a few
# per cent more per FLOP after the wave counts): a k-block's fixed part (the barrier wait, the
# scale loads, the promotion's tail) is spread over fewer columns.
FIVE_STEP_EFFICIENCY = 0.94
# 2-CTA TMA multicast halves the L2 reads of the shared operand; measured on the suite's
# compute-bound M = 4096 shapes it changed times by -3..+2 % (noise), so it is chosen only where
# the model says loads bound the tile.
MULTICAST_MIN_M = 512
# NOTE: clearing the reuse and no-yield bits of the promotion FFMAs in the SASS (so the other
# math warpgroup issues its wgmma sooner) ran 1-5 % slower on every M = 4096 suite shape on the
# H200 with 128x128 and 256x128 tiles: the cubins are used as ptxas writes them.
# NOTE: the kernel keeps every k-block's B scales in shared memory (8 bytes per 128 of K) and
# prefetches them into registers (2 * K/128 / math threads per thread): at K = 262144 a 64x160 tile
# spills, and near K = 4M no tile fits shared memory. 131072 is the largest K checked to compile
# without spills for the widest tiles (tests/test_cuda_compile.py); larger K goes to another backend.
MAX_K = 131072
# Split-K (dense): a tile's k-blocks in `splits` parts, each a work item, the last part to finish
# summing the others' FP32 slots from L2 (the kernel's split_fixup). 256-row tiles (two waves of
# sums a thread) spilled with the fix-up beside the C read, so parts are 64 or 128 rows.
# The model: the items' waves of the part's k-blocks at the one-accumulator tile cost, plus per
# wave the critical fix-up (a slot stored, the other splits - 1 read) at LOAD_WEIGHT a byte.
# SPLIT_MIN_GAIN: the split-K family (SPLIT_K) declines where that is above this fraction of
# the dense family's best whole-tile time.
# Fitted to splits timed against the whole-tile pick: 1000x512x32768, 4 parts of 128x128,
# modelled 0.46, ran 42.8 us against 55.0 for 128x32 tiles (H100, same run; on the H200 with the
# parts summed by the host 43.8 against 50.8); 1000x1536x24576, 128x192 in 2 parts, modelled 0.92,
# 1.02-1.07x (H100); 1000x2048x7168, modelled 1.2, 0.68x (H100); with the host's sum on the H200,
# 192x7168x16384 and 256x7168x2048 (modelled 1.0-1.5) 0.4-0.8x.
# SPLIT_MIN_M: decode sizes are the small-M family's, which splits K over a cluster and sums in
# distributed shared memory (fitted to 34 decode shapes); the split-K family, timed at M = 1000
# only, takes M from 512.
SPLIT_MAX_BLOCK_M = 128
SPLIT_MIN_M = 512
SPLIT_CHOICES = (2, 3, 4, 6, 8)
SPLIT_MIN_GAIN = 0.5


def use_two_accum(block_m: int, block_n: int, k: int) -> bool:
    """Two accumulators in flight (and the epilogue under the next tile's first wgmma): every tile
    of one wave (BLOCK_M 64 or 128) up to 128 wide, up to K = TWO_ACCUM_MAX_K (128x128 spilled at
    K = 65536). Against one accumulator on the H200, same run: 128x128 3-7 % faster, 128x64 3-4 %,
    128x56 1-2 %, 128x96 +-1 %; one math warpgroup, which otherwise leaves the tensor cores idle
    while it promotes: 64x32 to 64x128 3-9 % faster (M = 64 suite shapes, K 512 to 7168).
    tests/test_cuda_compile.py compiles the range clean."""
    return block_m <= 128 and block_n <= 128 and k <= TWO_ACCUM_MAX_K


def split_per_tile(block_n: int) -> bool:
    """Whether the kernel's one-accumulator k-loop takes a tile's B-scale split (n0 % 128, a
    multiple of the largest power of two dividing BLOCK_N) as a constant, one instance per value:
    tiles that can straddle two scale blocks at at most 4 splits (the kernel's kSplitStep >= 32)."""
    return 128 % block_n != 0 and min(block_n & -block_n, 128) >= 32


def mma_efficiency(block_m: int, block_n: int) -> float:
    eff = block_n / align(block_n, 32)
    if block_n > 128:
        eff *= WIDE_TILE_EFFICIENCY[block_m]
        if split_per_tile(block_n):
            eff *= SPLIT_PER_TILE_GAIN
        if block_m == 128 and block_n <= 160:
            eff *= FIVE_STEP_EFFICIENCY
    if block_m == 64:
        eff *= ONE_WARPGROUP_EFFICIENCY
    elif block_m == 256:
        eff *= TWO_WAVE_EFFICIENCY
    return eff


def tile_cost(block_m: int, block_n: int, k: int = 0, load_weight: float = LOAD_WEIGHT) -> float:
    cost = max(2 * block_m * block_n / mma_efficiency(block_m, block_n),
               load_weight * (block_m + block_n))
    # The two accumulators' gain is measured on the whole tile (the model calls 128x128
    # load-bound; it ran faster than that bound with them).
    if use_two_accum(block_m, block_n, k) and k >= TWO_ACCUM_MIN_K:
        cost /= TWO_ACCUM_EFFICIENCY
    return cost



# --- config ---------------------------------------------------------------------------------------
def num_threads(block_m: int) -> int:
    """One producer warpgroup and one (BLOCK_M = 64) or two math warpgroups (the kernel's
    sm90_num_math_threads + 128)."""
    return 128 + (128 if block_m == 64 else 256)


def sa_pad(kind: GemmKind) -> int:
    """Sm90Fp8Gemm1d2dLayout::kSaPad: extra A-scale rows per stage (offsets tiles start at any
    row, TMA boxes on 16 bytes)."""
    return 4 if kind is GemmKind.OFFSETS else 0


def sa_box(kind: GemmKind, block_m: int) -> int:
    """Sm90Fp8Gemm1d2dLayout::kSaBox: rows of one A-scale TMA box."""
    pad = sa_pad(kind)
    return (128 if pad and block_m > 128 else block_m) + pad


def smem_bytes(block_m: int, block_n: int, num_stages: int, k: int,
               kind: GemmKind = GemmKind.DENSE) -> int:
    """Sm90Fp8Gemm1d2dLayout::kSmemBytes: the kernel traps when launched with less."""
    # NOTE: a stage's A scales start on 128 bytes (TMA's shared-memory alignment).
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + align(block_m + sa_pad(kind), 32) * 4
    sb = align(2 * ceil_div(k, BLOCK_K) * 4, 8)
    return 1024 + block_m * block_n * 2 + num_stages * per_stage + sb + 2 * num_stages * 8


@dataclass(frozen=True)
class Sm90Config:
    """One instance of the sm90 1D2D kernel and its launch."""

    block_m: int
    block_n: int
    num_stages: int
    num_multicast: int  # CTAs per cluster sharing one TMA load (1 or 2; dense, contiguous B)
    multicast_on_a: bool  # which operand the cluster shares (meaningful when num_multicast == 2)
    band_size: int
    grid: int  # persistent CTAs
    two_accum: bool = False  # two wgmma accumulators in flight (BLOCK_M <= 128, BLOCK_N <= 128)
    # split-K (dense, one CTA per cluster, one accumulator): each tile's K range in `splits`
    # parts, their FP32 sums added in the kernel, in a fixed order, by the last part to finish
    splits: int = 1
    # CTAs resident on an SM: 2 (BLOCK_M = 64, no cluster) gives each half the registers and
    # shared memory (smem_limit), so that two math warpgroups of different tiles feed the tensor
    # cores where one 64-row tile's warpgroup leaves them idle while it promotes
    ctas_per_sm: int = 1

    @property
    def num_threads(self) -> int:
        return num_threads(self.block_m)

    def smem(self, k: int, kind: GemmKind = GemmKind.DENSE) -> int:
        """Dynamic shared memory of this config for a GEMM of this kind at K, bytes."""
        return smem_bytes(self.block_m, self.block_n, self.num_stages, k, kind)

    def smem_limit(self, facts: DeviceFacts) -> int:
        """The shared memory one CTA of this config may use on the device, bytes."""
        return smem_limit(facts, self.ctas_per_sm)

    def __str__(self) -> str:
        mc = "none" if self.num_multicast == 1 else ("A" if self.multicast_on_a else "B")
        return (f"BLOCK {self.block_m}x{self.block_n}x{BLOCK_K} stages={self.num_stages} "
                f"multicast={mc} grid={self.grid} threads={self.num_threads}"
                + (" accum=2" if self.two_accum else "")
                + (f" splits={self.splits}" if self.splits > 1 else "")
                + (f" ctas/SM={self.ctas_per_sm}" if self.ctas_per_sm > 1 else ""))


# NOTE: sm_90 reserves 1 KB of an SM's shared memory for each resident block; the opt-in limit
# per block (facts.smem_per_block, 227 KB) is the SM's 228 KB less that. The kernels' cubins also
# declare 1 KB of static shared memory (cuobjdump -res-usage: SHARED:1024); whether the driver
# counts it apart from the reservation is not documented, so a CTA that shares its SM leaves it
# room as well (the GPU test asks the occupancy API that two fit).
SMEM_RESERVED_PER_BLOCK = 1024
SMEM_STATIC_PER_BLOCK = 1024


def smem_limit(facts: DeviceFacts, ctas_per_sm: int = 1) -> int:
    """Dynamic shared memory each of `ctas_per_sm` CTAs resident on one SM may use, bytes."""
    if ctas_per_sm == 1:
        return facts.smem_per_block
    per_sm = facts.smem_per_block + SMEM_RESERVED_PER_BLOCK
    return per_sm // ctas_per_sm - SMEM_RESERVED_PER_BLOCK - SMEM_STATIC_PER_BLOCK


def max_stages(block_m: int, block_n: int, k: int, smem_limit: int,
               kind: GemmKind = GemmKind.DENSE, top: int = 0) -> int:
    """The deepest pipeline of this tile, of at most `top` stages (default: the kind's
    MAX_STAGES), that fits `smem_limit` bytes (0: none fits)."""
    top = top or (MAX_STAGES if kind is GemmKind.DENSE else GROUPED_MAX_STAGES)
    for s in range(top, MIN_STAGES - 1, -1):
        if smem_bytes(block_m, block_n, s, k, kind) <= smem_limit:
            return s
    return 0


@dataclass(frozen=True)
class Candidate:
    block_m: int
    block_n: int
    num_stages: int
    tiles: int
    waves: int
    last_wave: int  # tiles in the last wave
    cost: float  # modelled time: waves * tile_cost (max of MMA and loads per unit of K)
    splits: int = 1  # split-K parts a tile (split_candidates; `tiles` then counts the parts)


def candidate_tiles(m: int, n: int, k: int, facts: DeviceFacts, groups: int = 1,
                    block_ms: tuple[int, ...] = BLOCK_M_CHOICES,
                    kind: GemmKind = GemmKind.DENSE) -> list[Candidate]:
    """Every tile shape that fits shared memory, with its modelled cost, for `groups` GEMMs of
    M = m rows each."""
    load_weight = LOAD_WEIGHT
    if kind in (GemmKind.CONTIGUOUS, GemmKind.OFFSETS):
        load_weight *= CONTIGUOUS_LOAD_FACTOR
    out = []
    for bm in block_ms:
        if (bm == 128 and m <= 64) or (bm == 256 and m <= 128):
            continue  # a second math warpgroup or wave would only multiply zeros
        for bn in BLOCK_N_CHOICES:
            if bn > align(n, 8) and bn != BLOCK_N_CHOICES[0]:
                continue  # wider than N: only zero columns
            if bm == 256 and bn not in BLOCK_N_CHOICES_256:
                continue
            deep = (kind in (GemmKind.DENSE, GemmKind.MASKED) and (bm, bn) == DEEP_RING_TILE
                    and m >= DEEP_RING_MIN_ROWS)
            stages = max_stages(bm, bn, k, facts.smem_per_block, kind,
                                DEEP_RING_STAGES if deep else 0)
            if stages == 0:
                continue
            tiles = groups * ceil_div(m, bm) * ceil_div(n, bn)
            waves = ceil_div(tiles, facts.num_sms)
            last = tiles - (waves - 1) * facts.num_sms
            # NOTE: rounded, so that tiles the model prices alike tie exactly and the tie-breaks
            # decide (7168 / 0.35 came out 1 ulp under 8192 / 0.4, and 64x56 beat 64x64 on that).
            cost = round(waves * tile_cost(bm, bn, k, load_weight), 6)
            out.append(Candidate(bm, bn, stages, tiles, waves, last, cost))
    return out


def _rank(c: Candidate) -> tuple:
    # Least modelled time (waves x tile cost: fewest waves for what a tile costs); among equals,
    # fewer tiles (less per-tile overhead: epilogue, pipeline ramp), two math warpgroups, the
    # fullest last wave, then the wider tile.
    return (c.cost, c.tiles, -c.block_m, -c.last_wave, -c.block_n)


def _config(best: Candidate, k: int, facts: DeviceFacts, multicast: int = 1,
            on_a: bool = True) -> Sm90Config:
    grid = min(facts.num_sms, best.tiles)
    grid -= grid % multicast
    return Sm90Config(block_m=best.block_m, block_n=best.block_n, num_stages=best.num_stages,
                      num_multicast=multicast, multicast_on_a=on_a, band_size=BAND_SIZE,
                      grid=max(grid, multicast),
                      two_accum=use_two_accum(best.block_m, best.block_n, k))


def split_candidates(m: int, n: int, k: int, facts: DeviceFacts) -> list[Candidate]:
    """Split-K configs with their modelled cost (per unit of K, as candidate_tiles'), `tiles`
    counting the parts."""
    num_kb = ceil_div(k, BLOCK_K)
    out = []
    for c in candidate_tiles(m, n, k, facts):
        if c.block_m > SPLIT_MAX_BLOCK_M:
            continue
        cost = tile_cost(c.block_m, c.block_n)  # (one accumulator)
        fixup = LOAD_WEIGHT * 4 * c.block_m * c.block_n / (num_kb * BLOCK_K)
        for splits in SPLIT_CHOICES:
            if splits > num_kb:
                break
            items = c.tiles * splits
            waves = ceil_div(items, facts.num_sms)
            time = waves * (cost * ceil_div(num_kb, splits) / num_kb + fixup * splits)
            out.append(Candidate(c.block_m, c.block_n, c.num_stages, items, waves,
                                 items - (waves - 1) * facts.num_sms, round(time, 6), splits))
    return out


@functools.lru_cache(maxsize=4096)
def _select_dense(m: int, n: int, k: int, facts: DeviceFacts) -> Sm90Config:
    cands = candidate_tiles(m, n, k, facts)
    if not cands:
        raise ValueError(f"no sm90 tile fits {facts.smem_per_block} bytes of shared memory for K={k}")
    best = min(cands, key=_rank)
    num_m_blocks, num_n_blocks = ceil_div(m, best.block_m), ceil_div(n, best.block_n)
    # NOTE: a 2-CTA cluster shares one operand's tile; both CTAs must run the same tiles in step,
    # so the shared side needs an even block count (pairs of tiles never straddle a band) and the
    # grid an even CTA count.
    multicast, on_a = 1, True
    load_bound = LOAD_WEIGHT * (best.block_m + best.block_n) > \
        2 * best.block_m * best.block_n / mma_efficiency(best.block_m, best.block_n)
    if (m >= MULTICAST_MIN_M and load_bound and facts.num_sms >= 2
            and best.tiles >= facts.num_sms):
        b_ok, a_ok = num_m_blocks % 2 == 0, num_n_blocks % 2 == 0
        if b_ok and (best.block_n >= best.block_m or not a_ok):
            multicast, on_a = 2, False
        elif a_ok:
            multicast, on_a = 2, True
    return _config(best, k, facts, multicast, on_a)


# NOTE: the grouped tiles never cross a group: a group's last tile is partial, and a contiguous
# block that holds several groups (a layout padded to 128 rows, tiles of 256) runs once per
# group. A 256-row tile whose group fills one 128-row half only runs that half alone (the kernel's
# kHalfTiles: about the cost of a 128-row tile), so the waste is a partial half per group end.
# 256-row tiles (3-11 % faster per FLOP than 128 where both fill the waves alike) therefore need
# groups of a few blocks: offsets from GROUPED_TALL_MIN_ROWS rows per group, contiguous from
# CONTIGUOUS_TALL_MIN_ROWS padded rows per group on average (which blocks hold two groups is not
# known on the host). On an H100, same run, the moe-skewed suite's experts (N x K = 4096x7168 /
# 7168x2048) in 256x128 tiles against the 128x192 ones the model picks: contiguous 16 experts of
# 2048 rows on average 1.09x / 1.05x, 32 of 1024 0.92x / 0.94x; offsets 32 of 1024 1.12x / 1.02x.
# Masked groups start on their own [Mmax, K] slice, so only the expected rows decide: from
# MASKED_TALL_MIN_ROWS (on the H200, 4 x 256 and 2 x 512 rows of N = 4096, K = 7168 ran 1.13x and
# 1.07x faster in 256-row tiles than in the 128-row ones the model picked).
GROUPED_BLOCK_M_CHOICES = (64, 128, 256)
GROUPED_TALL_MIN_ROWS = 1024
CONTIGUOUS_TALL_MIN_ROWS = 2048
MASKED_TALL_MIN_ROWS = 256


def _grouped_block_ms(kind: GemmKind, rows_per_group: int) -> tuple[int, ...]:
    tall = {GemmKind.CONTIGUOUS: CONTIGUOUS_TALL_MIN_ROWS,
            GemmKind.MASKED: MASKED_TALL_MIN_ROWS}.get(kind, GROUPED_TALL_MIN_ROWS)
    return GROUPED_BLOCK_M_CHOICES if rows_per_group >= tall else (64, 128)


@functools.lru_cache(maxsize=4096)
def _select_grouped(kind: GemmKind, rows: int, groups: int, n: int, k: int,
                    facts: DeviceFacts) -> Sm90Config:
    # Contiguous / offsets: the rows of all groups tile as one M (groups end on tile boundaries
    # in the padded layout); masked: `groups` GEMMs of the expected rows each.
    if kind is GemmKind.MASKED:
        cands = candidate_tiles(rows, n, k, facts, groups, _grouped_block_ms(kind, rows), kind)
    else:
        cands = candidate_tiles(rows, n, k, facts, 1, _grouped_block_ms(kind, rows // groups), kind)
    if not cands:
        raise ValueError(f"no sm90 tile fits {facts.smem_per_block} bytes of shared memory for K={k}")
    # NOTE: no clusters. Contiguous 128-row tiles in pairs sharing B (num_multicast=2, the
    # kernel's kPairs) ran 0.81-0.86x single-CTA 128x128 tiles with two accumulators on the
    # H200, and 128x160 pairs 0.85-0.91x; 256x128 pairs 0.84-0.96x single 256x128 CTAs on an
    # H100 (docs/cuda.md, "The grouped kinds" and "Where the time goes").
    return _config(min(cands, key=_rank), k, facts)


# --- kernel source -------------------------------------------------------------------------------
_KIND = {GemmKind.DENSE: 0, GemmKind.CONTIGUOUS: 1, GemmKind.OFFSETS: 2, GemmKind.MASKED: 3}


def kernel_source(kind: GemmKind, n: int, k: int, cfg: Sm90Config, has_c: bool = False,
                  a_e5m2: bool = False) -> tuple[str, str]:
    """(source, name expression) of the kernel instance for (kind, N, K, config, C or not, A in
    e4m3 or e5m2)."""
    source = "#include <fp8gemm/sm90_fp8_gemm_1d2d.cuh>\n"
    b = {True: "true", False: "false"}
    name = (f"&fp8gemm::sm90_fp8_gemm_1d2d_kernel<{_KIND[kind]}, {n}, {k}, {cfg.block_m}, "
            f"{cfg.block_n}, {cfg.num_stages}, {cfg.num_multicast}, {b[cfg.multicast_on_a]}, "
            f"{cfg.band_size}, {b[cfg.two_accum]}, {b[has_c]}, "
            f"{b[a_e5m2]}, {cfg.splits}, {cfg.ctas_per_sm}>")
    return source, name


def compile_kernel(kind: GemmKind, n: int, k: int, cfg: Sm90Config, compiler: str | None = None,
                   has_c: bool = False, a_e5m2: bool = False, include_dir: Path | None = None):
    """Compile without loading (no GPU needed): (key, CompiledCubin, path, was_cached).
    include_dir: another copy of the kernel headers (to read a variant's SASS); None: the
    module's INCLUDE_DIR, read at the call (scripts/cuda_tiles.py swaps it)."""
    source, name = kernel_source(kind, n, k, cfg, has_c, a_e5m2)
    return jit.compile_cached(source, name, (str(include_dir or INCLUDE_DIR),), compiler=compiler)


# --- launch --------------------------------------------------------------------------------------
class Sm90Plan:
    """Everything fixed for one (problem, device, config): kernel, launch config, and the
    argument packs of the tensors it has seen (tensor maps encoded once per pointer set)."""

    __slots__ = ("cfg", "kind", "has_c", "kernel", "launch", "device_index", "m", "n", "k",
                 "groups", "num_kb", "packs", "tmaps", "sm_override", "split_floats",
                 "split_tiles")

    def __init__(self, problem: GemmProblem, device_index: int, cfg: Sm90Config) -> None:
        # The set_num_sms value the config was chosen under (warm launches compare it).
        self.sm_override = num_sms_override()
        self.cfg, self.kind, self.has_c = cfg, problem.kind, problem.has_c
        self.m, self.n, self.k, self.groups = problem.m, problem.n, problem.k, problem.groups
        self.num_kb = ceil_div(problem.k, BLOCK_K)
        self.device_index = device_index
        if cfg.num_multicast == 2:
            if cfg.band_size % 2 or cfg.grid % 2:
                raise ValueError(f"config {cfg}: multicast needs an even band and an even grid")
            if problem.kind is GemmKind.CONTIGUOUS:
                # pairs of m-blocks sharing B (the kernel's kPairs): any block count
                if cfg.multicast_on_a or cfg.block_m < 128:
                    raise ValueError(f"config {cfg}: a contiguous GEMM multicasts B between "
                                     f"128- or 256-row tiles only")
            else:
                blocks = (ceil_div(self.n, cfg.block_n) if cfg.multicast_on_a
                          else ceil_div(self.m, cfg.block_m))
                if problem.kind is not GemmKind.DENSE or blocks % 2:
                    raise ValueError(f"config {cfg}: multicast needs a dense or contiguous "
                                     f"problem and, dense, an even block count on the shared "
                                     f"side")
        if cfg.splits > 1 and (problem.kind is not GemmKind.DENSE
                               or cfg.block_m > SPLIT_MAX_BLOCK_M or cfg.num_multicast != 1
                               or cfg.two_accum or not cfg.splits <= self.num_kb):
            raise ValueError(f"config {cfg}: split-K needs a dense problem, tiles of at most "
                             f"{SPLIT_MAX_BLOCK_M} rows, no multicast, one accumulator and at "
                             f"least one of the {self.num_kb} k-blocks a part")
        if cfg.ctas_per_sm not in (1, 2) or (cfg.ctas_per_sm == 2 and (
                cfg.block_m != 64 or cfg.num_multicast != 1 or cfg.smem(problem.k, problem.kind)
                > smem_limit(DeviceFacts.of(torch.device("cuda", device_index)), 2))):
            raise ValueError(f"config {cfg}: two CTAs an SM need 64-row tiles, no multicast and "
                             f"half the SM's shared memory at most; one or two CTAs an SM only")
        # split-K: each tile's parts in float32 slots, a counter per tile (split_workspace)
        self.split_tiles = (ceil_div(problem.m, cfg.block_m) * ceil_div(problem.n, cfg.block_n)
                            if cfg.splits > 1 else 0)
        self.split_floats = self.split_tiles * cfg.splits * cfg.block_m * cfg.block_n
        smem = cfg.smem(problem.k, problem.kind)
        self.kernel = jit.build(*kernel_source(problem.kind, problem.n, problem.k, cfg,
                                               problem.has_c,
                                               problem.a_dtype == torch.float8_e5m2),
                                (str(INCLUDE_DIR),))
        self.kernel.set_max_dynamic_smem(smem, device_index)
        if cfg.ctas_per_sm > 1:
            self.kernel.prefer_max_shared(device_index)
            resident = self.kernel.max_active_blocks(cfg.num_threads, smem)
            if resident < cfg.ctas_per_sm:
                raise ValueError(f"config {cfg}: only {resident} CTA(s) of {smem} bytes of shared "
                                 f"memory fit an SM of this device")
        self.launch = jit.LaunchConfig((cfg.grid, 1, 1), (cfg.num_threads, 1, 1), smem,
                                       (cfg.num_multicast, 1, 1), pdl=settings.pdl)
        self.packs: dict[tuple, jit.ParamPack] = {}
        self.tmaps = jit.TensorMapCache(capacity=512)

    def params(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               out: torch.Tensor, index: torch.Tensor | None, key: tuple,
               c: torch.Tensor | None = None,
               split: tuple[torch.Tensor, torch.Tensor] | None = None) -> jit.ParamPack:
        cfg, m, n, k, kb = self.cfg, self.m, self.n, self.k, self.num_kb
        tm = self.tmaps
        masked = self.kind is GemmKind.MASKED
        rows = self.groups * m if masked else m  # rows of the 2-D views of A and D
        a2, b_rows = a.view(rows, k), self.groups * n
        # NOTE: a box of min(BLOCK_M, m) rows, m a group's rows when masked: the kernel expects
        # exactly these bytes per stage (a taller box over several groups' rows would never
        # complete the stage's barrier).
        map_a = tm.get(a.dtype, a.data_ptr(), (k, rows), (row_stride(a2) * a.element_size(),),
                       (BLOCK_K, min(cfg.block_m, m)), jit.Swizzle.B128)
        # The kernel's tmap_a_tail, unused otherwise: dense, the last m-block's rows when M is
        # not a multiple of BLOCK_M; grouped 256-row tiles, one half's 128 rows (kHalfTiles).
        if self.kind is GemmKind.DENSE:
            tail_rows = m % cfg.block_m if m > cfg.block_m else 0
        else:
            tail_rows = 128 if cfg.block_m == 256 and m >= 256 else 0
        map_a_tail = tm.get(a.dtype, a.data_ptr(), (k, rows), (row_stride(a2) * a.element_size(),),
                            (BLOCK_K, tail_rows), jit.Swizzle.B128) if tail_rows else map_a
        map_b = tm.get(b.dtype, b.data_ptr(), (k, b_rows), (k * b.element_size(),),
                       (BLOCK_K, cfg.block_n), jit.Swizzle.B128)
        mp = align(m, 4)  # the A-scale column stride (layout.get_col_major_tma_aligned_tensor)
        if masked:
            map_sa = tm.get(torch.float32, sa.data_ptr(), (m, kb, self.groups),
                            (mp * 4, kb * mp * 4), (cfg.block_m, 1, 1))
        else:
            map_sa = tm.get(torch.float32, sa.data_ptr(), (m, kb), (mp * 4,),
                            (sa_box(self.kind, cfg.block_m), 1))
        # Output: 64-column chunks with the 128-byte swizzle, then the BLOCK_N % 64 tail plain
        # (the kernel ignores a map it has no columns for).
        d_stride = (n * out.element_size(),)
        tail = cfg.block_n % 64
        map_d = tm.get(out.dtype, out.data_ptr(), (n, rows), d_stride, (64, cfg.block_m),
                       jit.Swizzle.B128) if cfg.block_n >= 64 else None
        map_d_tail = tm.get(out.dtype, out.data_ptr(), (n, rows), d_stride, (tail, cfg.block_m)) \
            if tail else None
        pack = jit.ParamPack([ctypes.c_uint64(sb.data_ptr()), ctypes.c_uint32(m),
                              ctypes.c_uint64(0 if index is None else index.data_ptr()),
                              ctypes.c_uint32(self.groups), ctypes.c_uint64(out.data_ptr()),
                              ctypes.c_uint64(0 if c is None else c.data_ptr()),
                              ctypes.c_uint64(0 if c is None else c.stride(0)),
                              ctypes.c_uint64(0 if split is None else split[0].data_ptr()),
                              ctypes.c_uint64(0 if split is None else split[1].data_ptr()),
                              map_a, map_b, map_sa, map_d or map_d_tail, map_d_tail or map_d,
                              map_a_tail])
        if len(self.packs) >= 1024:
            self.packs.clear()
        self.packs[key] = pack
        return pack

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, index: torch.Tensor | None = None,
            c: torch.Tensor | None = None) -> None:
        """out = (a * sa) @ (b * sb)^T (+ c) per group; tensors as the backend contract hands
        them over (a, b, out, index contiguous; scales float32, any strides; c float32 [M, N]
        with unit column stride, any row stride, dense only)."""
        sa = kernel_a_scales(sa)
        if not sb.is_contiguous():
            sb = sb.contiguous()
        dst = out
        if (a.data_ptr() | b.data_ptr() | out.data_ptr()) % 16:
            # A contiguous view at an odd storage offset: TMA cannot address it (slow path).
            a, b = tma_aligned(a), tma_aligned(b)
            if out.data_ptr() % 16:
                # NOTE: grouped kernels leave rows of no group untouched: start from out's values.
                dst = out.clone(memory_format=torch.contiguous_format)
        # NOTE: with a, b and dst contiguous and the plan fixing the shapes, these pointers and
        # sa's strides are all the descriptors depend on (one-row strides: see row_stride).
        key = (a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), dst.data_ptr(),
               0 if index is None else index.data_ptr(), _c_key(c))
        split = None
        if self.split_tiles:
            # (the stream's workspace is part of the key, here and in _Launcher.run)
            split = split_workspace(self.device_index, self.split_floats, self.split_tiles)
            key += (split[0].data_ptr(), split[1].data_ptr())
        pack = self.packs.get(key)
        if pack is None:
            pack = self.params(a, sa, b, sb, dst, index, key, c, split)
        launch(self.kernel, self.launch, self.device_index, pack)
        if dst is not out:
            out.copy_(dst)


def _c_key(c: torch.Tensor | None) -> tuple | None:
    """C's part of a pack key: its pointer and row stride (both in the kernel's arguments)."""
    return None if c is None else (c.data_ptr(), c.stride(0))


_plans: dict[tuple, Sm90Plan] = {}


def get_plan(problem: GemmProblem, device_index: int, cfg: Sm90Config) -> Sm90Plan:
    """The plan of (problem, device, config), built on first use."""
    # NOTE: supports() fixes B's dtype and the recipes, so (kind, shapes, C, A's dtype, device,
    # config) is the key.
    key = (problem.kind, problem.m, problem.n, problem.k, problem.groups, problem.has_c,
           problem.a_dtype, device_index, cfg)
    fam = DENSE if problem.kind is GemmKind.DENSE else GROUPED
    return cached_plan(_plans, key, lambda: Sm90Plan(problem, device_index, cfg), fam.name,
                       problem, cfg)


# --- families ------------------------------------------------------------------------------------
# NOTE: A may be e5m2 in the dense and grouped families (an output gradient quantised with
# grad_format="e5m2": dX = dY . W, dY e5m2, W^T e4m3): one more wgmma type (`.e5m2.e4m3`), the
# same pipeline. The small-M family (A is wgmma's B there) stays e4m3.
A_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _common_refusal(problem: GemmProblem) -> str | None:
    if problem.a_dtype not in A_DTYPES or problem.b_dtype != torch.float8_e4m3fn:
        return "the sm90 kernel takes A e4m3 or e5m2 and B e4m3 only"
    if problem.a_recipe is not Recipe.GROUP or problem.b_recipe is not Recipe.BLOCK:
        return "the sm90 kernel takes A 1x128 groups with B 128x128 blocks only"
    if problem.out_dtype != torch.bfloat16:
        return "the sm90 kernel writes bfloat16 only"
    if problem.has_c and problem.kind is not GemmKind.DENSE:
        return "the sm90 grouped kernels have no C accumulator input"
    if problem.k % 16:
        return f"TMA needs K % 16 == 0 (16-byte rows of A and B), got K={problem.k}"
    if problem.n % 8:
        return f"TMA needs N % 8 == 0 (16-byte rows of bf16 output), got N={problem.n}"
    if problem.k > MAX_K:
        return f"the sm90 kernel keeps K/128 B scales on chip: K <= {MAX_K}, got K={problem.k}"
    rows = problem.m * (problem.groups if problem.kind is GemmKind.MASKED else 1)
    if rows >= 2 ** 31 or problem.groups * problem.n >= 2 ** 31:
        return "dimensions must fit in int32 TMA coordinates"
    return None


class _Sm90Family(KernelFamily):
    Config = Sm90Config

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[Sm90Config]:
        """The chosen config first, then every other tile that fits, without multicast."""
        best = self.select_config(problem, facts)
        rows, groups, per_group = problem.m, 1, problem.m // max(1, problem.groups)
        if problem.kind is GemmKind.MASKED:
            rows, groups = max(1, problem.expected_m), problem.groups
            per_group = rows
        block_ms = (BLOCK_M_CHOICES if problem.kind is GemmKind.DENSE
                    else _grouped_block_ms(problem.kind, per_group))
        out = [best]
        for c in sorted(candidate_tiles(rows, problem.n, problem.k, facts, groups, block_ms,
                                        problem.kind),
                        key=_rank):
            cfg = _config(c, problem.k, facts)
            if cfg not in out:
                out.append(cfg)
        return out

    def config_for(self, problem: GemmProblem, device: torch.device) -> Sm90Config:
        return self.select_config(problem, DeviceFacts.of(device))

    def run(self, config: Sm90Config, problem: GemmProblem, a: torch.Tensor, sa: torch.Tensor,
            b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, c: torch.Tensor | None = None,
            index: torch.Tensor | None = None) -> None:
        if c is not None and c.stride(-1) != 1:
            raise ValueError(f"{self.name} needs C with unit column stride, got strides "
                             f"{tuple(c.stride())}")
        get_plan(problem, a.device.index, config).run(a, sa, b, sb, out, index, c)


class Sm90Fp8Gemm1d2d(_Sm90Family):
    """Dense: D[M, N] = A . B^T, M a kernel argument; 2-CTA multicast where loads bound the tile."""

    name = "sm90_fp8_gemm_1d2d"

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind is not GemmKind.DENSE:
            return f"takes dense GEMMs, not {problem.kind.value}"
        return _common_refusal(problem)

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> Sm90Config:
        return _select_dense(problem.m, problem.n, problem.k, facts)


_M_GROUPED = (GemmKind.CONTIGUOUS, GemmKind.OFFSETS, GemmKind.MASKED)


class Sm90MGroupedFp8Gemm1d2d(_Sm90Family):
    """MoE grouped along M: contiguous (m_indices), offsets, masked (masked_m read on the device,
    expected_m picks the config). Rows of no group are neither computed nor written; a
    contiguous block of padding only costs no loads, MMA or stores."""

    name = "sm90_m_grouped_fp8_gemm_1d2d"

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind not in _M_GROUPED:
            return f"takes M-grouped GEMMs (contiguous, offsets, masked), not {problem.kind.value}"
        return _common_refusal(problem)

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> Sm90Config:
        rows = max(1, problem.expected_m) if problem.kind is GemmKind.MASKED else problem.m
        return _select_grouped(problem.kind, rows, problem.groups, problem.n, problem.k, facts)


def _split_config(c: Candidate, k: int, facts: DeviceFacts) -> Sm90Config:
    return replace(_config(c, k, facts), two_accum=False, splits=c.splits)


@functools.lru_cache(maxsize=4096)
def _select_split(m: int, n: int, k: int, facts: DeviceFacts) -> tuple[Sm90Config, float]:
    """The cheapest split's config and its modelled time over the dense family's whole tiles'."""
    split = min(split_candidates(m, n, k, facts), key=_rank)
    whole = min(candidate_tiles(m, n, k, facts), key=_rank)
    return _split_config(split, k, facts), split.cost / whole.cost


class Sm90Fp8Gemm1d2dSplitK(Sm90Fp8Gemm1d2d):
    """Dense, K split: the 1D2D kernel with split-K, the parts summed in the kernel. Takes
    M >= SPLIT_MIN_M and declines where its model gains less than 1 / SPLIT_MIN_GAIN over the
    dense family's whole tiles."""

    name = "sm90_fp8_gemm_1d2d_split_k"

    def supports(self, problem: GemmProblem) -> str | None:
        why = super().supports(problem)
        if why is None and problem.m < SPLIT_MIN_M:
            why = (f"splits K from M = {SPLIT_MIN_M} (smaller M: the small-M family), "
                   f"got M={problem.m}")
        if why is None and problem.k <= BLOCK_K:
            why = f"needs two k-blocks to split, got K={problem.k}"
        return why

    def declines(self, problem: GemmProblem, facts: DeviceFacts) -> str | None:
        ratio = _select_split(problem.m, problem.n, problem.k, facts)[1]
        if ratio > SPLIT_MIN_GAIN:
            return f"modelled {ratio:.2f} of the whole tiles' time, above {SPLIT_MIN_GAIN}"
        return None

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> Sm90Config:
        return _select_split(problem.m, problem.n, problem.k, facts)[0]

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[Sm90Config]:
        """Every split config that fits, the chosen one first."""
        return [_split_config(c, problem.k, facts) for c in
                sorted(split_candidates(problem.m, problem.n, problem.k, facts), key=_rank)]


DENSE = Sm90Fp8Gemm1d2d()
GROUPED = Sm90MGroupedFp8Gemm1d2d()
SPLIT_K = Sm90Fp8Gemm1d2dSplitK()


# --- the ops layer's warm-call fast path ---------------------------------------------------------
class _Launcher:
    """Warm calls of one metadata signature of the ops layer's fast path: every call has the
    metadata (shapes, strides, dtypes, device) of the call the launcher was made for, so only
    data pointers vary. A hit in the plan's argument packs launches at once; anything else
    (new pointers, set_num_sms since) takes the family's run, which builds what is missing and
    copies what TMA cannot address."""

    __slots__ = ("family", "problem", "device", "device_index", "plan", "dense")

    def __init__(self, family: _Sm90Family, problem: GemmProblem, device: torch.device) -> None:
        self.family, self.problem, self.device, self.device_index = (family, problem, device,
                                                                     device.index)
        self.plan = get_plan(problem, device.index, family.config_for(problem, device))
        self.dense = problem.kind is GemmKind.DENSE

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, index: torch.Tensor | None) -> None:
        """`index`: the grouped kinds' m_indices, offsets or masked_m; a dense call passes its
        c there (or None)."""
        plan = self.plan
        # NOTE: Sm90Plan.run's pack key (_c_key inlined); a hit needs no alignment check, since
        # packs hold only 16-byte aligned pointers (run copies the others) and sa's strides are
        # fixed.
        if index is None:
            last = (0, None)
        elif self.dense:
            last = (0, (index.data_ptr(), index.stride(0)))
        else:
            last = (index.data_ptr(), None)
        key = (a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), out.data_ptr()) + last
        if plan.split_tiles:
            split = split_workspace(self.device_index, plan.split_floats, plan.split_tiles)
            key += (split[0].data_ptr(), split[1].data_ptr())
        pack = plan.packs.get(key)
        if pack is not None and plan.sm_override == num_sms_override():
            launch(plan.kernel, plan.launch, self.device_index, pack)
        else:
            self.plan = get_plan(self.problem, self.device_index,
                                 self.family.config_for(self.problem, self.device))
            if self.dense:
                self.plan.run(a, sa, b, sb, out, None, index)
            else:
                self.plan.run(a, sa, b, sb, out, index)


def launcher(family: KernelFamily, problem: GemmProblem, sa: torch.Tensor, sb: torch.Tensor):
    """`_Launcher.run` of `family` (DENSE, SPLIT_K or GROUPED, the one the backend chose for `problem`)
    for warm calls with contiguous a, b, out (and index) and scales with the metadata of sa and
    sb; or None when those scales need converting on every call (the general path) or the family
    is not one of this module's."""
    if family is not DENSE and family is not GROUPED and family is not SPLIT_K:
        return None
    if not (is_col_major_tma_aligned(sa) and sb.is_contiguous()):
        return None
    return _Launcher(family, problem, sa.device).run

"""FP8 NT GEMM for sm_90 in Gluon (Triton's tile-level language): A 1x128, B 128x128 scales.

D[m, n] = sum_k A[m, k] * B[g, n, k] * sa[m, k // 128] * sb[g, n // 128, k // 128], FP32
accumulation; dense, grouped contiguous (the first group of each m tile; the persistent
kernel's further-groups launch takes the rest) and grouped masked (masked_m read on the GPU).

Why a second kernel: the fine-grained recipe needs each 128-deep partial sum in registers to
scale it, and `tl.dot` then waits for its wgmma group right after issuing it, so MMA and
promotion serialise within a warpgroup (docs/triton.md). Gluon states the waits itself:

- a loader warp (warp specialisation) streams A and B tiles through a ring of STAGES shared
  memory buffers with TMA, guarded by `ready` / `empty` mbarriers;
- two consumer warpgroups, each its own partition, take the two m64 halves of a 128-row tile
  (A's half is a slice of the shared tile; both read the same B tile and release each stage);
  as separate partitions they wait and arrive on the mbarriers without a barrier across both,
  so one promotes while the other's wgmma runs. Each issues the wgmma of K block kb + 1 before
  it waits for K block kb (`warpgroup_mma_wait(1)`), so the FFMA promotion of kb overlaps the
  tensor cores working on kb + 1 (two accumulators in flight);
- persistent over output tiles in an L2-grouped order; tiles whose rows are all written leave
  through shared memory and a TMA store (clipped to `out`) while the next tile's loads
  proceed, others through register stores under their row mask.

A kernel family (`FAMILY`): the Triton backend prefers it at large M on sm_90 where its wave
model says it is faster (`GluonFamily.declines`); everything else runs the persistent kernel
(`fp8_gemm`). Not available under TRITON_INTERPRET (Gluon has no interpreter);
tests/test_gluon_compile.py compiles it for sm_90a on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...problem import SCALE_BLOCK, GemmKind, GemmProblem, Recipe, ceil_div
from ..family import DeviceFacts, KernelFamily
from . import fp8_gemm

__all__ = ["FAMILY", "GluonConfig", "GluonFamily"]

# NOTE: 2 x 4 consumer warps + 1 loader warp occupy 12 warps' register slots (allocation is per
# warpgroup): maxnreg = 65536 / 384 rounded down to 8; setmaxnreg then gives the loader
# warpgroup _LOADER_REGS, the worker consumer _CONSUMER_REGS and the default one the rest.
_LOADER_REGS = gl.constexpr(40)
_CONSUMER_REGS = gl.constexpr(232)
_MAXNREG = 168


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(m tile, n tile) of a linear tile index: GROUP_M m tiles share each n tile (L2 reuse)."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_size = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_size
    pid_n = (tile % width) // group_size
    return pid_m, pid_n


@gluon.jit
def _row_groups(offs_m, idx_ptr, M_A, G):
    """Contiguous: the group of each row of A (G for padding: values outside [0, G))."""
    gid = gl.load(idx_ptr + offs_m, mask=offs_m < M_A, other=-1)
    return gl.where((gid >= 0) & (gid < G), gid, G)


@gluon.jit
def _rows_ok(offs_m, g, idx_ptr, M_A, G, MMAX, KIND: gl.constexpr):
    """Which of the rows offs_m (within group g) the tile writes. Dense: the rows of A.
    Masked: m < min(masked_m[g], Mmax). Contiguous: rows with m_indices[m] == g."""
    if KIND == 3:
        ok = offs_m < gl.minimum(gl.maximum(gl.load(idx_ptr + g), 0), MMAX)
    elif KIND == 1:
        gid = _row_groups(offs_m, idx_ptr, M_A, G)
        ok = (gid == g) & (gid < G)  # a tile of padding only: g == G, no row
    else:
        ok = offs_m < M_A
    return ok


@gluon.jit
def _tile_info(tile, num_pid_m, num_pid_n, idx_ptr, M_A, G, MMAX, KIND: gl.constexpr,
               GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, rows_layout: gl.constexpr):
    """(group, m tile, n tile, whether the tile writes any row) of a linear tile index; a tile
    that writes no row is skipped. Masked: the tiles of group g follow those of g - 1.
    Contiguous: an m tile computes the first group among its rows' m_indices; the persistent
    kernel's further-groups launch takes any others."""
    if KIND == 3:
        per_group = num_pid_m * num_pid_n
        g = tile // per_group
        pid_m, pid_n = _tile_coords(tile % per_group, num_pid_m, num_pid_n, GROUP_M)
    else:
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_layout)
    if KIND == 1:
        g = gl.min(_row_groups(offs_m, idx_ptr, M_A, G), 0)
    elif KIND != 3:
        g = tile * 0
    m_ok = _rows_ok(offs_m, g, idx_ptr, M_A, G, MMAX, KIND)
    return g, pid_m, pid_n, gl.max(m_ok.to(gl.int32), 0) == 1


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, idx_ptr, shape,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            GROUP_M: gl.constexpr, STAGES: gl.constexpr, KIND: gl.constexpr):
    """Producer: one TMA load of A and one of B per K block into the ring's next stage."""
    M_A, N, K, G, MMAX = shape
    rows_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    num_pid_m = gl.cdiv(MMAX, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = (G if KIND == 3 else 1) * num_pid_m * num_pid_n
    k_blocks = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        g, pid_m, pid_n, active = _tile_info(tile, num_pid_m, num_pid_n, idx_ptr, M_A, G, MMAX,
                                             KIND, GROUP_M, BLOCK_M, rows_layout)
        if active:
            # NOTE: A and B are [rows, K] matrices; a box that runs past its group reads other
            # groups' rows, which only feed output rows / columns never stored.
            a_row = (g * MMAX if KIND == 3 else 0) + pid_m * BLOCK_M
            b_row = g * N + pid_n * BLOCK_N
            for kb in range(k_blocks):
                s = it % STAGES
                # NOTE: a fresh mbarrier counts as having completed the phase before phase 0,
                # so the first pass over the ring does not wait.
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [a_row, kb * BLOCK_K], ready.index(s),
                                                a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [b_row, kb * BLOCK_K], ready.index(s),
                                                b_bufs.index(s))
                it += 1


@gluon.jit
def _issue_mma(a_bufs, b_bufs, ready, it, regs, WG: gl.constexpr, HALF: gl.constexpr,
               STAGES: gl.constexpr):
    """Wait for K step `it`'s tiles and start the wgmma of this warpgroup's rows of A into a
    fresh accumulator held in the registers of `regs` (a finished accumulator: use_acc=False
    ignores its values)."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s).slice(WG * HALF, HALF), b_bufs.index(s).permute((1, 0)),
                         regs, use_acc=False, is_async=True)


@gluon.jit
def _scales(sa_rows, sb_tile, kb, k_blocks, m_ok, stride_sak, stride_sbk):
    """sa[rows, kb] * sb[n block, kb] (zeros past the last K block)."""
    in_k = kb < k_blocks
    sa = gl.load(sa_rows + kb * stride_sak, mask=m_ok & in_k, other=0.0)
    sb = gl.load(sb_tile + kb * stride_sbk, mask=in_k, other=0.0)
    return sa * sb


@gluon.jit
def _promote(total, acc, scale, OUTSTANDING: gl.constexpr, empty, it, STAGES: gl.constexpr):
    """Wait until at most OUTSTANDING wgmma groups are in flight (`acc`'s is done), free its
    stage for the loader and add acc * scale (per row) to the FP32 sum. Returns (acc, sum)."""
    acc = warpgroup_mma_wait(OUTSTANDING, deps=(acc, ))
    mbarrier.arrive(empty.index(it % STAGES), count=1)
    total = total + acc * gl.expand_dims(scale, 1)
    # NOTE: a side-effecting no-op that the sum passes through pins the FFMAs before the next
    # wgmma (also side-effecting); scheduled after it, they keep `acc`'s registers live while
    # the next wgmma wants them, and ptxas copies and serialises (C7514 / C7515).
    total = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [total], dtype=gl.float32,
                                      is_pure=False, pack=1)
    return acc, total


@gluon.jit
def _consumer(WG: gl.constexpr, a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, stride_om,
              sa_ptr, sb_ptr, idx_ptr, shape, sstrides,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, KIND: gl.constexpr):
    """Consumer warpgroup WG (rows [WG * 64, WG * 64 + 64) of each tile): wgmma per K block into
    a fresh accumulator, promoted with its scales into the FP32 sum while the next K block's
    wgmma runs; then the epilogue of its rows."""
    HALF: gl.constexpr = BLOCK_M // 2
    M_A, N, K, G, MMAX = shape
    stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk = sstrides
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    tile_rows_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 128], [32], [4], [0])
    num_pid_m = gl.cdiv(MMAX, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = (G if KIND == 3 else 1) * num_pid_m * num_pid_n
    k_blocks = gl.cdiv(K, BLOCK_K)
    c_smem = c_bufs.index(WG)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        # NOTE: both consumers and the loader skip the same tiles (decided on all 128 rows).
        g, pid_m, pid_n, active = _tile_info(tile, num_pid_m, num_pid_n, idx_ptr, M_A, G, MMAX,
                                             KIND, GROUP_M, BLOCK_M, tile_rows_layout)
        if active:
            base = pid_m * BLOCK_M + WG * HALF
            offs_m = base + gl.arange(0, HALF, layout=row_layout)
            m_ok = _rows_ok(offs_m, g, idx_ptr, M_A, G, MMAX, KIND)
            full = gl.min(m_ok.to(gl.int32), 0) == 1
            row0 = (g * MMAX if KIND == 3 else 0) + base
            it = _tile(a_bufs, b_bufs, ready, empty, c_smem, out_desc, out_ptr, stride_om,
                       sa_ptr, sb_ptr, g, pid_n, base, offs_m, m_ok, full, row0, it, N,
                       k_blocks, stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn,
                       stride_sbk, WG, HALF, BLOCK_N, STAGES, mma_layout, col_layout)
    tma.store_wait(0)


@gluon.jit
def _tile(a_bufs, b_bufs, ready, empty, c_smem, out_desc, out_ptr, stride_om, sa_ptr, sb_ptr,
          g, pid_n, base, offs_m, m_ok, full, row0, it, N, k_blocks,
          stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
          WG: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          mma_layout: gl.constexpr, col_layout: gl.constexpr):
    """This warpgroup's half of one output tile (rows offs_m = base + i): the K loop, then the
    store of the rows m_ok (out rows row0 + i). Returns the K step counter."""
    sa_rows = sa_ptr + g * stride_sag + offs_m * stride_sam
    # NOTE: BLOCK_N divides 128, so the tile lies in one 128-wide scale block of B
    sb_tile = sb_ptr + g * stride_sbg + (pid_n * BLOCK_N // 128) * stride_sbn
    # NOTE: the scales of K blocks kb + 2 and kb + 3 are loaded while kb and kb + 1 are
    # promoted: a load issued just before its use stalls the warpgroup for its L2 latency.
    sc_x = _scales(sa_rows, sb_tile, 0, k_blocks, m_ok, stride_sak, stride_sbk)
    sc_y = _scales(sa_rows, sb_tile, 1, k_blocks, m_ok, stride_sak, stride_sbk)
    total = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
    acc_y = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
    acc_x = _issue_mma(a_bufs, b_bufs, ready, it, acc_y, WG, HALF, STAGES)
    for kb in range(0, k_blocks - 2, 2):
        acc_y = _issue_mma(a_bufs, b_bufs, ready, it + 1, acc_y, WG, HALF, STAGES)
        nx = _scales(sa_rows, sb_tile, kb + 2, k_blocks, m_ok, stride_sak, stride_sbk)
        ny = _scales(sa_rows, sb_tile, kb + 3, k_blocks, m_ok, stride_sak, stride_sbk)
        acc_x, total = _promote(total, acc_x, sc_x, 1, empty, it, STAGES)
        acc_x = _issue_mma(a_bufs, b_bufs, ready, it + 2, acc_x, WG, HALF, STAGES)
        acc_y, total = _promote(total, acc_y, sc_y, 1, empty, it + 1, STAGES)
        sc_x = nx
        sc_y = ny
        it += 2
    if k_blocks % 2 == 0:
        last = _issue_mma(a_bufs, b_bufs, ready, it + 1, acc_y, WG, HALF, STAGES)
        _, total = _promote(total, acc_x, sc_x, 1, empty, it, STAGES)
        _, total = _promote(total, last, sc_y, 0, empty, it + 1, STAGES)
        it += 2
    else:
        _, total = _promote(total, acc_x, sc_x, 0, empty, it, STAGES)
        it += 1
    # epilogue: tiles whose rows are all written go through shared memory and a TMA store
    # (it clips columns past N); others are stored from registers under the row mask, so that
    # rows the call does not own stay untouched.
    if full:
        # the previous tile's TMA store must have read c_smem before it is rewritten
        tma.store_wait(0)
        c_smem.store(total.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row0, pid_n * BLOCK_N], c_smem)
    else:
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        out_rows = (row0 - base + offs_m).to(gl.int64) * stride_om
        ptrs = out_ptr + gl.expand_dims(out_rows, 1) + gl.expand_dims(offs_n, 0)
        mask = gl.expand_dims(m_ok, 1) & gl.expand_dims(offs_n < N, 0)
        gl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
    return it


@gluon.jit
def _gluon_fp8_gemm_kernel(a_desc, b_desc, out_desc, out_ptr, sa_ptr, sb_ptr, idx_ptr,
                           M_A, N, K, G, MMAX, stride_om,
                           stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
                           KIND: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                           num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BLOCK_K == 128, "a K block is one scale block")
    gl.static_assert(128 % BLOCK_N == 0, "an n tile must lie in one 128-wide scale block of B")
    gl.static_assert(BLOCK_M == 128 and num_warps == 4, "two consumer warpgroups of 64 rows")

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    # One epilogue tile per consumer warpgroup (out_desc's block is half a tile's rows).
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape,
                                       out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage

    shape = (M_A, N, K, G, MMAX)
    sstrides = (stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk)
    gl.warp_specialize([
        (_consumer, (0, a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, stride_om, sa_ptr,
                     sb_ptr, idx_ptr, shape, sstrides, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                     KIND)),
        (_consumer, (1, a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, stride_om, sa_ptr,
                     sb_ptr, idx_ptr, shape, sstrides, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                     KIND)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, idx_ptr, shape,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, KIND)),
    ], [4, 1], [_CONSUMER_REGS, _LOADER_REGS])


# ---------------------------------------------------------------------------------------------
# config and heuristic


@dataclass(frozen=True)
class GluonConfig:
    """One launch of the Gluon kernel: tile, ring depth, L2 grouping, grid size. Its warps are
    fixed by the kernel: a default partition of 4 (`num_warps`, the first consumer warpgroup)
    and worker partitions of 4 (the second consumer) and 1 (the TMA loader)."""

    block_m: int
    block_n: int
    num_stages: int
    group_m: int  # m tiles per L2 group of the tile order
    num_programs: int  # persistent grid size (programs loop over tiles)

    num_warps = 4  # the launch's num_warps: the default partition

    def __post_init__(self) -> None:
        # NOTE: two consumer warpgroups of 64 rows; a K block is one scale block and an n tile
        # lies in one 128-wide scale block of B (the kernel's static checks).
        bad = [f"{name}={getattr(self, name)}" for name, ok in (
            ("block_m", self.block_m == 128),
            ("block_n", self.block_n >= 16 and 128 % self.block_n == 0),
            ("num_stages", self.num_stages >= 2), ("group_m", self.group_m >= 1),
            ("num_programs", self.num_programs >= 1)) if not ok]
        if bad:
            raise ValueError(f"invalid GluonConfig ({', '.join(bad)}): BLOCK_M must be 128, "
                             f"BLOCK_N a power of two from 16 to 128, stages >= 2, counts positive")

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} GROUP_M={self.group_m} "
                f"stages={self.num_stages} warps={self.num_warps}+4+1 "
                f"programs={self.num_programs}")


# Measured on an H200 (DeepSeek-V3 shapes, M = 4096, full waves): the Gluon kernel computes a
# 128x128 tile 1.2-1.35x as fast as the persistent kernel's large-M configs.
_SPEEDUP = 1.25


@functools.lru_cache(maxsize=4096)
def select_config(problem: GemmProblem, facts: DeviceFacts) -> GluonConfig:
    """128x128 tiles with two accumulators per consumer warpgroup (3 x 64 FP32 registers a
    thread); the ring as deep as shared memory allows next to the epilogue tile; one program
    per SM, at most one per tile."""
    epilogue = 128 * 128 * problem.out_dtype.itemsize
    stages = max(2, min(6, (facts.smem_per_block - epilogue - 1024) // (2 * 128 * SCALE_BLOCK)))
    tiles = fp8_gemm.output_tiles(problem, 128, 128)
    return GluonConfig(128, 128, stages, 8, max(1, min(tiles, facts.num_sms)))


def _wave_work(problem: GemmProblem, facts: DeviceFacts, block_m: int, block_n: int,
               num_programs: int) -> float:
    """Output elements an SM computes over all waves of a large-M launch (wave quantisation:
    a last wave that fills few SMs costs a whole wave)."""
    tiles = fp8_gemm.output_tiles(problem, block_m, block_n)
    per_sm = max(1, num_programs // facts.num_sms)
    return ceil_div(tiles, per_sm * facts.num_sms) * per_sm * block_m * block_n


@functools.lru_cache(maxsize=4096)
def _declines(problem: GemmProblem, facts: DeviceFacts) -> str | None:
    if facts.interpreter:
        return "Gluon has no interpreter"
    if facts.capability != (9, 0):
        return f"sm_90 only, got sm_{facts.capability[0]}{facts.capability[1]}"
    glu = select_config(problem, facts)
    k_blocks = ceil_div(problem.k, SCALE_BLOCK)
    if glu.num_programs < facts.num_sms:
        # NOTE: one partial wave: time is one tile's latency, lower in the Gluon kernel except
        # for short K, where its fixed cost (warp specialisation, descriptors) shows (H200:
        # 130x576x7168 29 vs 38 us; 130x576x320 8.1 vs 6.6 us)
        if k_blocks <= 4:
            return f"one partial wave with {k_blocks} K blocks: the persistent kernel is faster"
        return None
    alt = fp8_gemm.select_config(problem, facts)
    own = _wave_work(problem, facts, glu.block_m, glu.block_n, glu.num_programs) / _SPEEDUP
    if own > _wave_work(problem, facts, alt.block_m, alt.block_n, alt.num_programs):
        return "the persistent kernel's tiles quantise to fewer waves"
    return None


def candidate_configs(problem: GemmProblem, facts: DeviceFacts) -> list[GluonConfig]:
    """Configs the autotuner times: the heuristic's choice, then one stage fewer."""
    base = select_config(problem, facts)
    out = [base]
    if base.num_stages > 2:
        out.append(GluonConfig(base.block_m, base.block_n, base.num_stages - 1, base.group_m,
                               base.num_programs))
    return out


def further_groups_config(cfg: GluonConfig) -> fp8_gemm.PersistentConfig:
    """The persistent kernel's config for a contiguous GEMM's further-groups launch after the
    Gluon kernel: the same tile and grid, its pipeline depth capped where that kernel's
    epilogue needs shared memory too."""
    return fp8_gemm.PersistentConfig(cfg.block_m, cfg.block_n, cfg.group_m, 1,
                                     min(cfg.num_stages, fp8_gemm.LARGE_TILE.max_stages),
                                     fp8_gemm.LARGE_TILE.num_warps, True, cfg.num_programs)


# ---------------------------------------------------------------------------------------------
# launch


_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
              torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def smem_layouts(a: torch.dtype, b: torch.dtype, out: torch.dtype, block_m: int, block_n: int):
    """Shared-memory layouts of the A and B tiles and of one consumer warpgroup's out box (half
    the tile's rows), 128-byte swizzle where the row allows."""
    g = _GL_DTYPES
    return (gl.NVMMASharedLayout.get_default_for([block_m, SCALE_BLOCK], g[a]),
            gl.NVMMASharedLayout.get_default_for([block_n, SCALE_BLOCK], g[b]),
            gl.NVMMASharedLayout.get_default_for([block_m // 2, block_n], g[out]))


_KIND = {GemmKind.DENSE: 0, GemmKind.CONTIGUOUS: 1, GemmKind.MASKED: 3}


def _launch(cfg: GluonConfig, problem: GemmProblem, a: torch.Tensor, sa: torch.Tensor,
            b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, idx: torch.Tensor | None,
            mmax: int) -> None:
    """a [rows, K], b [G * N, K], out [rows, N]: row-major, 16-byte aligned; masked rows are
    g * mmax + m (mmax: rows of A otherwise)."""
    k, n = problem.k, problem.n
    sag, sam, sak = fp8_gemm.scale_strides(sa, problem.a_recipe, problem.kind is GemmKind.MASKED)
    sbg, sbn, sbk = fp8_gemm.scale_strides(sb, problem.b_recipe,
                                           problem.kind is not GemmKind.DENSE)
    la, lb, lo = smem_layouts(a.dtype, b.dtype, out.dtype, cfg.block_m, cfg.block_n)
    # NOTE: each consumer warpgroup stores its 64 rows: out's box is half a tile.
    a_desc = TensorDescriptor(a, list(a.shape), [k, 1], [cfg.block_m, SCALE_BLOCK], la)
    b_desc = TensorDescriptor(b, list(b.shape), [k, 1], [cfg.block_n, SCALE_BLOCK], lb)
    o_desc = TensorDescriptor(out, list(out.shape), [out.stride(0), 1],
                              [cfg.block_m // 2, cfg.block_n], lo)
    _gluon_fp8_gemm_kernel[(cfg.num_programs,)](
        a_desc, b_desc, o_desc, out, sa, sb, idx if idx is not None else sa,
        a.shape[0], n, k, problem.groups, mmax, out.stride(0), sag, sam, sak, sbg, sbn, sbk,
        **_meta(cfg, problem))


@functools.lru_cache(maxsize=1024)
def _meta(cfg: GluonConfig, problem: GemmProblem) -> dict:
    """The launch's constexprs and options (shared: never modified)."""
    return dict(KIND=_KIND[problem.kind], GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
                num_warps=cfg.num_warps, maxnreg=_MAXNREG)


_TRITON_TYPES = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
                 torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_config(cfg: GluonConfig, problem: GemmProblem, target):
    """The kernel `cfg` launches for `problem`, compiled ahead of time for `target` (a
    triton.backends.compiler.GPUTarget; no GPU needed): what the compile checks inspect."""
    from triton import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    ty = _TRITON_TYPES
    la, lb, lo = smem_layouts(problem.a_dtype, problem.b_dtype, problem.out_dtype, cfg.block_m,
                              cfg.block_n)
    fn = _gluon_fp8_gemm_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(a_desc=f"tensordesc<{ty[problem.a_dtype]}[{cfg.block_m}, {SCALE_BLOCK}],{la!r}>",
               b_desc=f"tensordesc<{ty[problem.b_dtype]}[{cfg.block_n}, {SCALE_BLOCK}],{lb!r}>",
               out_desc=f"tensordesc<{ty[problem.out_dtype]}[{cfg.block_m // 2}, {cfg.block_n}],"
                        f"{lo!r}>",
               out_ptr=f"*{ty[problem.out_dtype]}", sa_ptr="*fp32", sb_ptr="*fp32",
               idx_ptr="*i32")
    meta = dict(_meta(cfg, problem))
    options = {key: meta.pop(key) for key in ("maxnreg",)}
    options["num_warps"] = meta["num_warps"]
    sig.update({name: "constexpr" for name in meta})
    return triton_compile(GluonASTSource(fn, sig, meta), target=target, options=options)


# ---------------------------------------------------------------------------------------------
# the family


class GluonFamily(KernelFamily):
    """The Gluon kernel: sm_90, A 1x128 x B 128x128, dense / contiguous / masked, no C, at
    large M where it beats the persistent kernel."""

    name = "gluon_fp8_gemm_1d2d"
    Config = GluonConfig

    def supports(self, problem: GemmProblem) -> str | None:
        why = fp8_gemm.dtype_refusal(problem)
        if why is not None:
            return why
        if problem.kind not in _KIND:
            return f"{problem.kind.value} GEMMs are not implemented (dense, contiguous, masked)"
        if problem.a_recipe is not Recipe.GROUP or problem.b_recipe is not Recipe.BLOCK:
            return (f"A 1x128 x B 128x128 scales only, got A {problem.a_recipe.value} x "
                    f"B {problem.b_recipe.value}")
        if problem.has_c:
            return "no c (D = C + A.B^T)"
        # NOTE: TMA rows of A, B (FP8) and out must be multiples of 16 bytes.
        if problem.k % 16 or problem.k == 0:
            return f"K must be a positive multiple of 16 for TMA, got {problem.k}"
        if problem.n * problem.out_dtype.itemsize % 16:
            return f"out rows must be multiples of 16 bytes for TMA, got N={problem.n}"
        rows = fp8_gemm.rows_per_group(problem)
        if rows <= 128:
            return f"large M only (rows per group > 128), got {rows}"
        return None

    def declines(self, problem: GemmProblem, facts: DeviceFacts) -> str | None:
        """Why the heuristic leaves a supported problem to the persistent kernel on a device
        with `facts` (not sm_90; or its wave model says the persistent kernel is faster)."""
        return _declines(problem, facts)

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> GluonConfig:
        return select_config(problem, facts)

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[GluonConfig]:
        return candidate_configs(problem, facts)

    def run(self, config: GluonConfig, problem: GemmProblem, a: torch.Tensor, sa: torch.Tensor,
            b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, c: torch.Tensor | None = None,
            index: torch.Tensor | None = None) -> None:
        """Launch `config` on the current stream; a contiguous GEMM then runs the persistent
        kernel's further-groups launch (`further_groups_config`). Tensors as the backend
        contract hands them over; operands at base addresses TMA cannot read from (views at an
        odd offset) are copied to aligned buffers first, and out through one."""
        if not isinstance(config, GluonConfig):
            raise TypeError(f"config must be a GluonConfig, got {type(config).__name__}")
        if c is not None:
            raise ValueError("the Gluon kernel takes no c")
        k, n = problem.k, problem.n
        masked = problem.kind is GemmKind.MASKED
        rows = a.shape[0] * (a.shape[1] if masked else 1)
        if rows == 0 or n == 0:
            return
        a2 = fp8_gemm.tma_aligned(a.view(rows, k))
        b2 = fp8_gemm.tma_aligned(b.view(-1, k))
        out2 = out.view(rows, n)
        # NOTE: a copy of out, not an empty buffer: rows the call does not own stay as they are.
        dst = fp8_gemm.tma_aligned(out2)
        _launch(config, problem, a2, sa, b2, sb, dst, index, a.shape[1] if masked else rows)
        if problem.kind is GemmKind.CONTIGUOUS:
            fp8_gemm.run_further_groups(further_groups_config(config), problem, a2, sa,
                                        b2.view(b.shape), sb, dst, index)
        if dst is not out2:
            out2.copy_(dst)


FAMILY = GluonFamily()

"""The persistent FP8 NT GEMM in Triton: dense, grouped contiguous / offsets / masked, every scale
recipe and FP8 format pair, an optional C, split-K. A kernel family (`FAMILY`).

D[m, n] = sum_k A[m, k] * B[g, n, k] * scale_a * scale_b (+ C[m, n]), FP32 accumulation.

One kernel body serves the four kinds; the kind, the recipes, split-K and the load path are
compile-time constants. Contiguous GEMMs take a second, usually idle launch for tiles that hold
rows of several groups; split-K GEMMs a second kernel that reduces the partial sums in order.
The grid is persistent: each program walks output tiles in an L2-grouped order. For every K
tile of 128 (one scale block) the tensor-core partial sum is promoted to the FP32 accumulator
with its scales applied (two-level accumulation); when no scale varies along K (per-tensor /
per-row recipes) the dot accumulates directly and Triton promotes every 128 of K
(`max_num_imprecise_acc`), and the scales are applied once at the end.

Kernel -> config and heuristic -> launch -> the family.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...layout import TMA_ALIGN_BYTES
from ...problem import (FP8_DTYPES, OUT_DTYPES, SCALE_BLOCK, GemmKind, GemmProblem, Recipe, align,
                        ceil_div)
from ..family import DeviceFacts, KernelFamily

__all__ = ["FAMILY", "PersistentConfig", "PersistentFamily"]

# kind / recipe codes shared by the kernel and the wrapper
KIND_DENSE, KIND_CONTIGUOUS, KIND_OFFSETS, KIND_MASKED = 0, 1, 2, 3
KIND_FURTHER_GROUPS = 4  # contiguous, second launch: the further groups of mixed m tiles
R_TENSOR, R_ROW, R_GROUP, R_BLOCK = 0, 1, 2, 3
_KIND = {GemmKind.DENSE: KIND_DENSE, GemmKind.CONTIGUOUS: KIND_CONTIGUOUS,
         GemmKind.OFFSETS: KIND_OFFSETS, GemmKind.MASKED: KIND_MASKED}
_RECIPE = {Recipe.TENSOR: R_TENSOR, Recipe.ROW: R_ROW, Recipe.GROUP: R_GROUP, Recipe.BLOCK: R_BLOCK}

# NOTE: offsets / masked map tiles to groups with a [G]-wide prefix sum held in registers.
MAX_GROUPS_TABLE = 1024
_A_RECIPES = (Recipe.TENSOR, Recipe.ROW, Recipe.GROUP)
_B_RECIPES = (Recipe.TENSOR, Recipe.ROW, Recipe.BLOCK, Recipe.GROUP)


# ---------------------------------------------------------------------------------------------
# kernel


@triton.jit
def _group_table(idx_ptr, G, M_A, MMAX, KIND: tl.constexpr, BLOCK_M: tl.constexpr,
                 G_POW2: tl.constexpr):
    """Offsets / masked: per group its first row, its number of rows and its m tiles (vectors of
    G_POW2). Values are clamped so that no row outside A is ever addressed."""
    gs = tl.arange(0, G_POW2)
    gmask = gs < G
    if KIND == 2:  # offsets [G + 1]: rows [off[g], off[g + 1])
        lo = tl.load(idx_ptr + gs, mask=gmask, other=0)
        hi = tl.load(idx_ptr + gs + 1, mask=gmask, other=0)
        lo = tl.minimum(tl.maximum(lo, 0), M_A)
        hi = tl.minimum(tl.maximum(hi, lo), M_A)
        rows = hi - lo
    else:  # masked [G]: rows [g * Mmax, g * Mmax + min(masked_m[g], Mmax))
        mm = tl.load(idx_ptr + gs, mask=gmask, other=0)
        rows = tl.minimum(tl.maximum(mm, 0), MMAX)
        lo = gs * MMAX
    rows = tl.where(gmask, rows, 0)
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    return gs, lo, rows, tiles


@triton.jit
def _k_tile(a_desc, b_desc, a_ptrs, b_ptrs, a_row, b_row, k0, offs_k, m_ok, n_ok, K,
            USE_TMA: tl.constexpr):
    """The A and B tiles at K offset k0: TMA loads at rows a_row of A and b_row of B as
    [G * N, K], or pointer loads that read zeros past K and nothing outside m_ok / n_ok."""
    if USE_TMA:
        a = a_desc.load([a_row, k0])
        b = b_desc.load([b_row, k0])
    else:
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return a, b


@triton.jit
def _mma_tile(a_op, b_op, sa_op, sb_op, tile, k_range, N, K, MMAX,
              A_RECIPE: tl.constexpr, B_RECIPE: tl.constexpr, USE_TMA: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FP32 accumulator of one scaled [BLOCK_M, BLOCK_N] output tile.

    a_op = (a_ptr, a_desc, stride_am): A as one [rows, K] matrix and its TMA descriptor;
    b_op = (b_ptr, b_desc, stride_bg, stride_bn): B [G, N, K], the descriptor over [G * N, K];
    sa_op = (sa_ptr, stride_sag, stride_sam, stride_sak), sb_op = (sb_ptr, stride_sbg,
    stride_sbn, stride_sbk): the scales (group, row, K-block strides);
    tile = (row0, row_end, g, n0): rows row0 .. row0 + BLOCK_M - 1 of A against group g's B
    from column n0; rows at or past row_end are not read by the pointer loads (their results
    are not stored);
    k_range = (kb_lo, n_iters, k_blocks): K tiles kb_lo .. kb_lo + n_iters - 1 of the
    k_blocks; K tiles at or past k_blocks (the short last split) load zeros and add nothing.
    NOTE: offsets / masked pass the group's end as row_end, not A's: masked A scales
    [G, Mmax, ...] may have any strides, so a row past Mmax of group g need not lie inside the
    scale tensor."""
    a_ptr, a_desc, stride_am = a_op
    b_ptr, b_desc, stride_bg, stride_bn = b_op
    sa_ptr, stride_sag, stride_sam, stride_sak = sa_op
    sb_ptr, stride_sbg, stride_sbn, stride_sbk = sb_op
    row0, row_end, g, n0 = tile
    kb_lo, n_iters, k_blocks = k_range
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < row_end
    n_ok = offs_n < N
    # scale rows: masked A scales are [G, Mmax(, kb)], others [M(, kb)] (MMAX = 0 there)
    sa_rows = sa_ptr + g * stride_sag + (offs_m - g * MMAX) * stride_sam
    sb_base = sb_ptr + g * stride_sbg
    A_PER_K: tl.constexpr = A_RECIPE == 2
    B_PER_K: tl.constexpr = B_RECIPE >= 2
    # NOTE: with BLOCK_N dividing 128 a tile lies in one 128-wide block of N: one scalar B scale.
    B_SCALAR_BLOCK: tl.constexpr = (B_RECIPE == 3) and (128 % BLOCK_N == 0)
    if B_SCALAR_BLOCK:
        sb_k_ptr = sb_base + (n0 // 128) * stride_sbn
    elif B_RECIPE == 3:
        sb_k_ptr = sb_base + (offs_n // 128) * stride_sbn
    else:
        sb_k_ptr = sb_base + offs_n * stride_sbn
    kb_last = k_blocks - 1

    # NOTE: the per-K scales of the next K tile are loaded one iteration ahead, so their global
    # load latency hides behind the current tile's MMA (Triton does not pipeline these loads).
    if A_PER_K:
        sa_next = tl.load(sa_rows + tl.minimum(kb_lo, kb_last) * stride_sak, mask=m_ok, other=0.0)
    if B_PER_K:
        if B_SCALAR_BLOCK:
            sb_next = tl.load(sb_k_ptr + tl.minimum(kb_lo, kb_last) * stride_sbk)
        else:
            sb_next = tl.load(sb_k_ptr + tl.minimum(kb_lo, kb_last) * stride_sbk, mask=n_ok, other=0.0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # NOTE: the tile's origin in 64-bit scalar arithmetic (rows x K and groups x N x K can pass
    # 2^31 elements), offsets inside the tile in 32-bit (fewer registers)
    a_ptrs = (a_ptr + tl.cast(row0, tl.int64) * stride_am
              + tl.arange(0, BLOCK_M)[:, None] * stride_am + offs_k[None, :])
    b_ptrs = (b_ptr + tl.cast(g, tl.int64) * stride_bg + tl.cast(n0, tl.int64) * stride_bn
              + tl.arange(0, BLOCK_N)[:, None] * stride_bn + offs_k[None, :])
    for i in range(0, n_iters):
        kb = kb_lo + i
        k0 = kb * BLOCK_K
        kb_pre = tl.minimum(kb + 1, kb_last)
        if A_PER_K:
            sa_cur = sa_next
            sa_next = tl.load(sa_rows + kb_pre * stride_sak, mask=m_ok, other=0.0)
        if B_PER_K:
            sb_cur = sb_next
            if B_SCALAR_BLOCK:
                sb_next = tl.load(sb_k_ptr + kb_pre * stride_sbk)
            else:
                sb_next = tl.load(sb_k_ptr + kb_pre * stride_sbk, mask=n_ok, other=0.0)
        a, b = _k_tile(a_desc, b_desc, a_ptrs, b_ptrs, row0, g * N + n0, k0, offs_k, m_ok, n_ok,
                       K, USE_TMA)
        if A_PER_K or B_PER_K:
            part = tl.dot(a, b.T)
            if A_PER_K:
                if B_SCALAR_BLOCK:
                    acc += part * (sa_cur * sb_cur)[:, None]
                elif B_PER_K:
                    acc += part * sa_cur[:, None] * sb_cur[None, :]
                else:
                    acc += part * sa_cur[:, None]
            else:
                if B_SCALAR_BLOCK:
                    acc += part * sb_cur
                else:
                    acc += part * sb_cur[None, :]
        else:
            # NOTE: FP8 wgmma keeps a reduced-precision running sum; max_num_imprecise_acc makes
            # Triton promote it into the FP32 accumulator every BLOCK_K of K.
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)

    # scales that do not vary along K, applied once
    if A_RECIPE == 0:
        acc = acc * tl.load(sa_ptr)
    elif A_RECIPE == 1:
        acc = acc * tl.load(sa_rows, mask=m_ok, other=0.0)[:, None]
    if B_RECIPE == 0:
        acc = acc * tl.load(sb_base)
    elif B_RECIPE == 1:
        acc = acc * tl.load(sb_base + offs_n * stride_sbn, mask=n_ok, other=0.0)[None, :]
    return acc


@triton.jit
def _store_tile(acc, out_ptr, c_ptr, ws_ptr, row0, offs_m, offs_n, row_ok, ks, M, N,
                stride_om, stride_on, stride_cm, stride_cn,
                HAS_C: tl.constexpr, SPLIT_K: tl.constexpr):
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    # NOTE: the tile origin in 64-bit scalar arithmetic (M x N can pass 2^31 elements)
    rows = (offs_m - row0)[:, None]
    r64 = tl.cast(row0, tl.int64)
    if SPLIT_K > 1:
        # partial sums to the workspace [SPLIT_K, M, N]; _splitk_reduce_kernel adds them in order
        ws = ws_ptr + (tl.cast(ks, tl.int64) * M + r64) * N + rows * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        if HAS_C:
            acc += tl.load(c_ptr + r64 * stride_cm + rows * stride_cm + offs_n[None, :] * stride_cn,
                           mask=mask, other=0.0)
        o = out_ptr + r64 * stride_om + rows * stride_om + offs_n[None, :] * stride_on
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_order(tile, num_pid_m, num_pid_n, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr):
    """(split, m tile, n tile) of a linear tile index: split fastest, then GROUP_M m tiles that
    share each n tile (their B tile stays in L2)."""
    ks = tile % SPLIT_K
    t = tile // SPLIT_K
    width = GROUP_M * num_pid_n
    first_m = (t // width) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % width) % group_size
    pid_n = (t % width) // group_size
    return ks, pid_m, pid_n


@triton.jit
def _contiguous_groups(idx_ptr, offs_m, M_A, G):
    """Group of each row of a tile (-1: padding or out of [0, G)), the first and last group."""
    gid = tl.load(idx_ptr + offs_m, mask=offs_m < M_A, other=-1)
    valid = (gid >= 0) & (gid < G)
    gid = tl.where(valid, gid, -1)
    return gid, tl.min(tl.where(valid, gid, G), 0), tl.max(gid, 0)


@triton.jit
def _fp8_gemm_nt_kernel(
        a_ptr, b_ptr, a_desc, b_desc, out_ptr, c_ptr, ws_ptr, sa_ptr, sb_ptr, idx_ptr,
        M_A, N, K, G, MMAX,
        stride_am, stride_bg, stride_bn,
        stride_om, stride_on, stride_cm, stride_cn,
        stride_sag, stride_sam, stride_sak,
        stride_sbg, stride_sbn, stride_sbk,
        KIND: tl.constexpr, A_RECIPE: tl.constexpr, B_RECIPE: tl.constexpr,
        HAS_C: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, G_POW2: tl.constexpr,
        FLATTEN: tl.constexpr):
    """Persistent FP8 GEMM. Tile t of the m-tile x n-tile x split space is handled by program
    t % NUM_PROGRAMS. KIND: 0 dense, 1 contiguous (idx = m_indices; each tile's first group),
    2 offsets (idx = offsets), 3 masked (idx = masked_m), 4 contiguous, the further groups of
    tiles that hold several. Recipes: 0 tensor, 1 row, 2 1x128 group, 3 128x128 block."""
    # the operands as _mma_tile takes them
    a_op = (a_ptr, a_desc, stride_am)
    b_op = (b_ptr, b_desc, stride_bg, stride_bn)
    sa_op = (sa_ptr, stride_sag, stride_sam, stride_sak)
    sb_op = (sb_ptr, stride_sbg, stride_sbn, stride_sbk)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    k_per_split = tl.cdiv(k_blocks, SPLIT_K)

    # ---- m tiles: dense / contiguous tile A's rows; offsets / masked tile each group's rows
    if KIND == 2 or KIND == 3:
        gs, g_lo, g_rows, g_tiles = _group_table(idx_ptr, G, M_A, MMAX, KIND, BLOCK_M, G_POW2)
        g_tiles_end = tl.cumsum(g_tiles, 0)
        num_pid_m = tl.sum(g_tiles, 0)
    else:
        num_pid_m = tl.cdiv(M_A, BLOCK_M)
    num_tiles = num_pid_m * num_pid_n * SPLIT_K

    # NOTE: FLATTEN (dense) lets Triton fuse the tile and K loops into one software pipeline, so
    # the next tile's loads start during this tile's epilogue.
    for tile in tl.range(pid, num_tiles if KIND != 4 else 0, NUM_PROGRAMS, flatten=FLATTEN):
        ks, pid_m, pid_n = _tile_order(tile, num_pid_m, num_pid_n, SPLIT_K, GROUP_M)
        n0 = pid_n * BLOCK_N
        kb_lo = ks * k_per_split
        offs_n = n0 + tl.arange(0, BLOCK_N)

        if KIND == 0:
            row0 = pid_m * BLOCK_M
            offs_m = row0 + tl.arange(0, BLOCK_M)
            acc = _mma_tile(a_op, b_op, sa_op, sb_op, (row0, M_A, 0, n0),
                            (kb_lo, k_per_split, k_blocks), N, K, 0,
                            A_RECIPE, B_RECIPE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            _store_tile(acc, out_ptr, c_ptr, ws_ptr, row0, offs_m, offs_n, offs_m < M_A, ks, M_A, N,
                        stride_om, stride_on, stride_cm, stride_cn, HAS_C, SPLIT_K)
        elif KIND == 1:
            # the tile's first group here; further groups of a tile that holds several (a layout
            # not aligned to BLOCK_M) in the loop after this one, so this hot loop stays simple
            row0 = pid_m * BLOCK_M
            offs_m = row0 + tl.arange(0, BLOCK_M)
            gid, g_first, g_last = _contiguous_groups(idx_ptr, offs_m, M_A, G)
            if g_first < G:
                acc = _mma_tile(a_op, b_op, sa_op, sb_op, (row0, M_A, g_first, n0),
                                (kb_lo, k_per_split, k_blocks), N, K, 0,
                                A_RECIPE, B_RECIPE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
                _store_tile(acc, out_ptr, c_ptr, ws_ptr, row0, offs_m, offs_n, gid == g_first, ks,
                            M_A, N, stride_om, stride_on, stride_cm, stride_cn, HAS_C, SPLIT_K)
        elif KIND == 2 or KIND == 3:
            # group g owns virtual m tiles [g_tiles_end[g] - g_tiles[g], g_tiles_end[g])
            g = tl.sum((g_tiles_end <= pid_m).to(tl.int32), 0)
            sel = gs == g
            tiles_before = tl.sum(tl.where(sel, g_tiles_end - g_tiles, 0), 0)
            start = tl.sum(tl.where(sel, g_lo, 0), 0)
            end = start + tl.sum(tl.where(sel, g_rows, 0), 0)
            row0 = start + (pid_m - tiles_before) * BLOCK_M
            offs_m = row0 + tl.arange(0, BLOCK_M)
            acc = _mma_tile(a_op, b_op, sa_op, sb_op, (row0, end, g, n0),
                            (kb_lo, k_per_split, k_blocks), N, K, MMAX,
                            A_RECIPE, B_RECIPE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            _store_tile(acc, out_ptr, c_ptr, ws_ptr, row0, offs_m, offs_n, offs_m < end, ks, M_A, N,
                        stride_om, stride_on, stride_cm, stride_cn, HAS_C, SPLIT_K)

    if KIND == 4:
        # contiguous, second launch: an m tile may hold rows of several groups (a layout not
        # aligned to BLOCK_M); each group after its first is computed and stored under its own
        # row mask. Programs walk m tiles (one m_indices load each), not output tiles, so the
        # usual case, no such tile, costs about one dependent load per program.
        # NOTE: a launch of its own, so that the first launch's hot loop keeps its registers
        # (in one kernel this loop made ptxas spill; compile check: 224 B stack vs none).
        for pid_m in range(pid, num_pid_m, NUM_PROGRAMS):
            row0 = pid_m * BLOCK_M
            offs_m = row0 + tl.arange(0, BLOCK_M)
            gid, g_first, g_last = _contiguous_groups(idx_ptr, offs_m, M_A, G)
            for g in range(g_first + 1, g_last + 1):
                row_ok = gid == g
                if tl.sum(row_ok.to(tl.int32), 0) > 0:
                    for t in range(0, num_pid_n * SPLIT_K):
                        ks = t % SPLIT_K
                        n0 = (t // SPLIT_K) * BLOCK_N
                        offs_n = n0 + tl.arange(0, BLOCK_N)
                        acc = _mma_tile(a_op, b_op, sa_op, sb_op, (row0, M_A, g, n0),
                                        (ks * k_per_split, k_per_split, k_blocks), N, K, 0,
                                        A_RECIPE, B_RECIPE, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
                        _store_tile(acc, out_ptr, c_ptr, ws_ptr, row0, offs_m, offs_n, row_ok, ks,
                                    M_A, N, stride_om, stride_on, stride_cm, stride_cn, HAS_C,
                                    SPLIT_K)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, out_ptr, c_ptr, M, N, stride_om, stride_on, stride_cm, stride_cn,
                          HAS_C: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = sum_s ws[s] (+ c), summed in the fixed order s = 0, 1, ... (deterministic)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m.to(tl.int64)[:, None]  # 64-bit: M x N can pass 2^31 elements
    ws = ws_ptr + rows * N + offs_n[None, :]
    plane = tl.cast(M, tl.int64) * N
    acc = tl.load(ws, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws + s * plane, mask=mask, other=0.0)
    if HAS_C:
        acc += tl.load(c_ptr + rows * stride_cm + offs_n[None, :] * stride_cn,
                       mask=mask, other=0.0)
    tl.store(out_ptr + rows * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# config and heuristic


def _tile_side_ok(v: int) -> bool:
    return v >= 16 and v & (v - 1) == 0


@dataclass(frozen=True)
class PersistentConfig:
    """One launch of the persistent kernel: tile, pipeline depth, split of K, grid size. The K
    tile is one scale block (SCALE_BLOCK), so K-varying scales are indexed by K tile."""

    block_m: int
    block_n: int
    group_m: int  # m tiles per L2 group of the tile order
    split_k: int  # K ranges per output tile (dense only); partial sums reduced in a fixed order
    num_stages: int
    num_warps: int
    use_tma: bool  # tensor descriptors for the A and B loads (sm_90+, K % 16 == 0)
    num_programs: int  # persistent grid size (programs loop over tiles)
    flatten: bool = False  # dense: one software pipeline across tiles (tl.range(flatten=True))

    def __post_init__(self) -> None:
        # NOTE: tile sides are powers of two of at least 16 (tl.dot, tl.arange).
        bad = [f"{name}={getattr(self, name)}" for name, ok in (
            ("block_m", _tile_side_ok(self.block_m)), ("block_n", _tile_side_ok(self.block_n)),
            ("group_m", self.group_m >= 1), ("split_k", self.split_k >= 1),
            ("num_stages", self.num_stages >= 1),
            ("num_warps", self.num_warps in (1, 2, 4, 8, 16)),
            ("num_programs", self.num_programs >= 1)) if not ok]
        if bad:
            raise ValueError(f"invalid PersistentConfig ({', '.join(bad)}): tiles must be powers "
                             f"of two >= 16, warps a power of two <= 16, counts positive")

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} GROUP_M={self.group_m} "
                f"SPLIT_K={self.split_k} stages={self.num_stages} warps={self.num_warps} "
                f"tma={int(self.use_tma)} programs={self.num_programs}"
                f"{' flat' if self.flatten else ''}")


def rows_per_group(problem: GemmProblem) -> int:
    """Rows of A one group's GEMM has (masked: the caller's expected_m)."""
    if problem.kind is GemmKind.DENSE:
        return problem.m
    if problem.kind is GemmKind.MASKED:
        return max(1, min(problem.expected_m or problem.m, problem.m))
    return max(1, problem.m // max(1, problem.groups))


def output_tiles(problem: GemmProblem, block_m: int, block_n: int) -> int:
    """Output tiles of a launch: masked [G, Mmax] rows tile per group; offsets have at most one
    partly filled m tile per group more than their rows."""
    m_tiles = ceil_div(problem.m, block_m)
    if problem.kind is GemmKind.MASKED:
        m_tiles *= problem.groups
    elif problem.kind is GemmKind.OFFSETS:
        m_tiles += problem.groups
    return m_tiles * ceil_div(problem.n, block_n)


def _stages(block_m: int, block_n: int, facts: DeviceFacts, cap: int) -> int:
    # NOTE: each stage holds one A and one B tile in shared memory (1 byte an element); keep
    # 32 KB for the epilogue's layout conversion and the compiler's own scratch.
    per_stage = (block_m + block_n) * SCALE_BLOCK
    return max(2, min(cap, (facts.smem_per_block - 32 * 1024) // per_stage))


@dataclass(frozen=True)
class _Tile:
    """A tile shape the kernel runs well, with the rate one program streams operands at when
    memory bound (measured on an H200: one warpgroup ~30 GB/s, two ~45 GB/s)."""

    block_m: int
    block_n: int
    num_warps: int
    max_stages: int
    stream_bw: float


# small M (memory bound): one warpgroup 64xN, two warpgroups side by side along N or M
_SMALL_TILES = (_Tile(64, 64, 4, 6, 30e9), _Tile(64, 128, 4, 5, 30e9), _Tile(64, 256, 8, 4, 45e9),
                _Tile(128, 128, 8, 4, 33e9))
# large M (tensor-core bound), measured on an H200 over the DeepSeek-V3 shapes: 128x128 with two
# warpgroups where N and K are large; 128x64 with one warpgroup and two programs per SM (one
# program's scale promotion overlaps the other's MMA) for N <= 2304 or K <= 2048.
LARGE_TILE = _Tile(128, 128, 8, 5, 35e9)
_LARGE_TILE_NARROW = _Tile(128, 64, 4, 4, 30e9)
_TOTAL_BW = 3.4e12  # achievable HBM bandwidth with every SM streaming (H200: copy ~3.6-4.2 TB/s)
_SPLIT_COST_US = 4.0  # second launch (the fixed-order reduction) and its tail


def _programs_per_sm(tile: _Tile, stages: int, facts: DeviceFacts) -> int:
    """2 when two programs fit one SM (registers of one warpgroup, shared memory for both)."""
    if tile.num_warps != 4:
        return 1
    # NOTE: the epilogue's layout conversion reuses the pipeline buffers (measured: 98.8 KB for
    # 128x64 with 4 stages), so two programs need 2 x (stages x stage bytes + ~2 KB).
    smem = stages * (tile.block_m + tile.block_n) * SCALE_BLOCK + 2048
    return 2 if 2 * smem <= facts.smem_per_block + 1024 else 1


def _estimate_us(problem: GemmProblem, facts: DeviceFacts, tile: _Tile, split: int,
                 m_tiles: int, rows: int, groups: int) -> float:
    """Modelled time of a memory-bound launch, only to rank small-M tiles and splits: the slower
    of (waves of programs, each streaming its A and B tiles at its own rate) and (every operand
    byte read once from HBM; re-reads of a B tile by the m tiles sharing it hit L2), plus the
    split-K workspace round trip and the reduction launch."""
    n, k = problem.n, problem.k
    ctas = m_tiles * ceil_div(n, tile.block_n) * split
    waves = ceil_div(ctas, facts.num_sms)
    k_per_cta = ceil_div(ceil_div(k, SCALE_BLOCK), split) * SCALE_BLOCK
    stream = waves * (tile.block_m + tile.block_n) * k_per_cta / tile.stream_bw
    unique = groups * (rows + n) * k / _TOTAL_BW
    t = max(stream, unique) * 1e6
    if split > 1:
        t += _SPLIT_COST_US + 2.0 * split * problem.m * n * 4 / _TOTAL_BW * 1e6
    return t


def _valid_split(k_blocks: int, split: int) -> bool:
    # NOTE: the heuristic splits K evenly (at least 2 K tiles each): a short last split runs
    # zero-filled K steps (measured ~1.5x slower on an H200 for 4 such steps).
    return split == 1 or (k_blocks % split == 0 and k_blocks // split >= 2)


def _make_config(problem: GemmProblem, facts: DeviceFacts, tile: _Tile, split: int, flatten: bool,
                 use_tma: bool) -> PersistentConfig:
    """The config of one tile choice: pipeline depth, programs per SM and the persistent grid."""
    bm, bn = tile.block_m, tile.block_n
    stages = _stages(bm, bn, facts, cap=tile.max_stages)
    per_sm = _programs_per_sm(tile, stages, facts)
    tiles = output_tiles(problem, bm, bn) * split
    programs = max(1, min(tiles, per_sm * facts.num_sms))
    return PersistentConfig(bm, bn, 8, split, stages, tile.num_warps, use_tma, programs,
                            flatten and problem.kind is GemmKind.DENSE)


@functools.lru_cache(maxsize=4096)
def select_config(problem: GemmProblem, facts: DeviceFacts) -> PersistentConfig:
    """The heuristic config. Small M (memory bound): the tile and split-K that minimise the
    modelled streaming time (fill the SMs in one wave, the fewest splits that do). Large M
    (tensor-core bound): 128x128 tiles, or 128x64 with two programs per SM for narrow N / short
    K. Dense GEMMs with few K tiles (<= 16 at small M, <= 4 at large M) run the tile and K loops
    as one flattened pipeline (the next tile's loads overlap this tile's epilogue). Pipelines
    as deep as shared memory allows."""
    rows = rows_per_group(problem)
    k_blocks = ceil_div(problem.k, SCALE_BLOCK)
    use_tma = facts.capability >= (9, 0) and not facts.interpreter and problem.k % 16 == 0
    dense = problem.kind is GemmKind.DENSE
    split = 1
    if rows > 128:
        narrow = problem.n <= 2304 or problem.k <= 2048
        tile = _LARGE_TILE_NARROW if narrow else LARGE_TILE
    else:
        best = None
        for tile_c in _SMALL_TILES:
            if tile_c.block_m > 64 and rows <= 64:
                continue
            m_tiles = ceil_div(rows, tile_c.block_m) * (1 if dense else problem.groups)
            for split_c in (range(1, 17) if dense else (1,)):
                if not _valid_split(k_blocks, split_c):
                    continue
                ctas = m_tiles * ceil_div(problem.n, tile_c.block_n) * split_c
                if split_c > 1 and ctas > facts.num_sms:
                    break
                t = _estimate_us(problem, facts, tile_c, split_c, m_tiles, rows,
                                 1 if dense else problem.groups)
                if best is None or t < best[0] * 0.97:
                    best = (t, tile_c, split_c)
        _, tile, split = best
    # NOTE: not with split-K: the flattened loop plus the workspace epilogue spill registers
    # (compile check: 48-160 B stack)
    flatten = dense and split == 1 and k_blocks <= (16 if rows <= 128 else 4)
    return _make_config(problem, facts, tile, split, flatten, use_tma)


def candidate_configs(problem: GemmProblem, facts: DeviceFacts) -> list[PersistentConfig]:
    """Configs the autotuner times: the heuristic's choice first, then the other tiles, even
    K splits (dense), one stage fewer, the flattened pipeline on and off, and pointer loads."""
    base = select_config(problem, facts)
    out = [base]

    def add(cfg: PersistentConfig) -> None:
        if cfg not in out:
            out.append(cfg)

    dense = problem.kind is GemmKind.DENSE
    k_blocks = ceil_div(problem.k, SCALE_BLOCK)
    splits = [s for s in (1, 2, 3, 4, 6, 7, 8) if _valid_split(k_blocks, s)] if dense else [1]
    for tile in _SMALL_TILES + (LARGE_TILE, _LARGE_TILE_NARROW):
        for split in splits:
            ctas = ceil_div(problem.m, tile.block_m) * ceil_div(problem.n, tile.block_n) * split
            if split > 1 and not facts.num_sms // 2 <= ctas <= 2 * facts.num_sms:
                continue  # splits only to fill the SMs about once
            add(_make_config(problem, facts, tile, split, base.flatten, base.use_tma))
    if base.num_stages > 2:
        add(replace(base, num_stages=base.num_stages - 1))
    if dense and base.split_k == 1:
        add(replace(base, flatten=not base.flatten))
    if base.use_tma:
        add(replace(base, use_tma=False))
    return out


# ---------------------------------------------------------------------------------------------
# launch


def tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy of it when its base address is not 16-byte aligned (TMA reads
    from aligned base addresses only; a view into a buffer may start anywhere)."""
    if t.data_ptr() % TMA_ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def rows_of_16_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous fp8 `t` [..., K], or for K % 16 != 0 a copy with its rows zero-padded to a
    multiple of 16 columns (K's 128-column scale blocks are the same: 128 is a multiple of 16).
    NOTE: with rows of K % 16 bytes no A or B load can be 16-byte aligned, so every element was
    its own one-byte load (the H200 ran a K = 1000 weight gradient at 23 TFLOPS)."""
    k = t.shape[-1]
    if k % TMA_ALIGN_BYTES == 0:
        return t
    buf = torch.zeros(*t.shape[:-1], align(k, TMA_ALIGN_BYTES), dtype=torch.uint8,
                      device=t.device)
    buf[..., :k] = t.view(torch.uint8)
    return buf.view(t.dtype)


def scale_strides(s: torch.Tensor, recipe: Recipe, lead: bool) -> tuple[int, int, int]:
    """(group, row, k) element strides of a normalised scale tensor; `lead` when it has a leading
    [G] (grouped B, masked A). Per-tensor scales of grouped B are [G]: the group stride only
    (per-tensor A scales are [1] even for masked A; the kernel then reads only their first)."""
    st = list(s.stride())
    if recipe is Recipe.TENSOR:
        return (st[0] if lead else 0), 0, 0
    g = st.pop(0) if lead else 0
    if recipe is Recipe.ROW:
        return g, st[0], 0
    return g, st[0], st[1]


def check_config(cfg: PersistentConfig, problem: GemmProblem) -> None:
    """Raise ValueError where `cfg` cannot run `problem` as it says."""
    if not isinstance(cfg, PersistentConfig):
        raise TypeError(f"config must be a PersistentConfig, got {type(cfg).__name__}")
    dense = problem.kind is GemmKind.DENSE
    if not dense and (cfg.split_k > 1 or cfg.flatten):
        raise ValueError(f"split_k > 1 and flatten are for dense GEMMs only, got {cfg} for "
                         f"a {problem.kind.value} GEMM")
    if cfg.use_tma and problem.k % 16:
        raise ValueError(f"use_tma needs K % 16 == 0 (16-byte rows of FP8), got K={problem.k}")
    k_blocks = ceil_div(problem.k, SCALE_BLOCK)
    if cfg.split_k > 1 and ceil_div(k_blocks, ceil_div(k_blocks, cfg.split_k)) != cfg.split_k:
        raise ValueError(f"split_k={cfg.split_k} leaves an empty K range for K={problem.k}, "
                         f"BLOCK_K={SCALE_BLOCK}")


@functools.lru_cache(maxsize=1024)
def _launch_consts(problem: GemmProblem, cfg: PersistentConfig, has_c: bool) -> tuple[dict, dict]:
    """The keyword arguments (constexprs, warps, stages) of the main launch and of the
    contiguous further-groups launch, from (problem, config) alone, computed once."""
    check_config(cfg, problem)
    kind = problem.kind
    # NOTE: the group table of offsets / masked is a [G_POW2] vector (G_POW2 >= G); other kinds
    # do not build it, so they keep one value and do not compile once per group count.
    table = kind in (GemmKind.OFFSETS, GemmKind.MASKED)
    meta = dict(A_RECIPE=_RECIPE[problem.a_recipe], B_RECIPE=_RECIPE[problem.b_recipe],
                USE_TMA=cfg.use_tma, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=SCALE_BLOCK, GROUP_M=cfg.group_m, NUM_PROGRAMS=cfg.num_programs,
                G_POW2=triton.next_power_of_2(max(problem.groups, 2)) if table else 2,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    main = dict(meta, KIND=_KIND[kind], HAS_C=has_c and cfg.split_k == 1, SPLIT_K=cfg.split_k,
                FLATTEN=cfg.flatten)
    further = dict(meta, KIND=KIND_FURTHER_GROUPS, HAS_C=False, SPLIT_K=1, FLATTEN=False)
    return main, further


def _launch(cfg: PersistentConfig, problem: GemmProblem, a, sa, b, sb, out, c, idx,
            main: bool, further: bool) -> None:
    """The main launch (and the split-K reduction) when `main`; the contiguous further-groups
    launch when `further`."""
    kind = problem.kind
    grouped_b = kind is not GemmKind.DENSE
    masked = kind is GemmKind.MASKED
    n, k, groups = problem.n, problem.k, problem.groups
    m_a = a.shape[0] * (a.shape[1] if masked else 1)  # rows of A as one [rows, K] matrix
    mmax = a.shape[1] if masked else 0
    if m_a == 0 or n == 0:
        return
    main_meta, further_meta = _launch_consts(problem, cfg, c is not None)
    if k % TMA_ALIGN_BYTES:
        a, b = rows_of_16_bytes(a), rows_of_16_bytes(b)
        k = a.shape[-1]
    split = cfg.split_k
    sag, sam, sak = scale_strides(sa, problem.a_recipe, masked)
    sbg, sbn, sbk = scale_strides(sb, problem.b_recipe, grouped_b)
    out2 = out.view(m_a, n)
    stride_bg = n * k if grouped_b else 0

    a_desc = b_desc = None
    if cfg.use_tma:
        a, b = tma_aligned(a), tma_aligned(b)
        a_desc = TensorDescriptor(a.view(m_a, k), [m_a, k], [k, 1], [cfg.block_m, SCALE_BLOCK])
        b_rows = b.numel() // k
        b_desc = TensorDescriptor(b.view(b_rows, k), [b_rows, k], [k, 1],
                                  [cfg.block_n, SCALE_BLOCK])

    ws = None
    if main and split > 1:
        ws = torch.empty((split, m_a, n), dtype=torch.float32, device=a.device)
    c_arg = c if c is not None else out
    stride_cm, stride_cn = (c.stride(0), c.stride(1)) if c is not None else (0, 0)
    idx_arg = idx if idx is not None else sa  # unused by dense: any pointer

    args = (a, b, a_desc, b_desc, out2, c_arg, ws if ws is not None else out2, sa, sb, idx_arg,
            m_a, n, k, groups, mmax,
            k, stride_bg, k,
            out2.stride(0), out2.stride(1), stride_cm, stride_cn,
            sag, sam, sak, sbg, sbn, sbk)
    grid = (cfg.num_programs,)
    if main:
        _fp8_gemm_nt_kernel[grid](*args, **main_meta)
    if further and kind is GemmKind.CONTIGUOUS:
        # the further groups of m tiles that hold rows of several groups (see KIND == 4)
        _fp8_gemm_nt_kernel[grid](*args, **further_meta)
    if main and split > 1:
        bm, bn = 32, 128
        _splitk_reduce_kernel[(ceil_div(m_a, bm), ceil_div(n, bn))](
            ws, out2, c_arg, m_a, n, out2.stride(0), out2.stride(1), stride_cm, stride_cn,
            HAS_C=c is not None, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)


def run_further_groups(cfg: PersistentConfig, problem: GemmProblem, a: torch.Tensor,
                       sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor,
                       m_indices: torch.Tensor) -> None:
    """Contiguous GEMMs: only the launch that computes, for m tiles holding rows of several
    groups, every group after the tile's first (a kernel that computes each tile's first group
    runs before it)."""
    _launch(cfg, problem, a, sa, b, sb, out, None, m_indices, main=False, further=True)


_TRITON_TYPES = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
                 torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_config(cfg: PersistentConfig, problem: GemmProblem, target, further: bool = False):
    """The main kernel `cfg` launches for `problem` (or, with `further`, the contiguous
    further-groups kernel), compiled ahead of time for `target` (a
    triton.backends.compiler.GPUTarget; no GPU needed) with the launch's constexprs and
    options; integer arguments carry none of the value specialisations a launch adds."""
    from triton.compiler import ASTSource

    main, further_meta = _launch_consts(problem, cfg, problem.has_c)
    meta = dict(further_meta if further else main)
    options = {key: meta.pop(key) for key in ("num_warps", "num_stages")}
    fp8_a, fp8_b = _TRITON_TYPES[problem.a_dtype], _TRITON_TYPES[problem.b_dtype]
    fn = _fp8_gemm_nt_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(a_ptr=f"*{fp8_a}", b_ptr=f"*{fp8_b}", out_ptr=f"*{_TRITON_TYPES[problem.out_dtype]}",
               c_ptr="*fp32", ws_ptr="*fp32", sa_ptr="*fp32", sb_ptr="*fp32", idx_ptr="*i32")
    if cfg.use_tma:
        sig.update(a_desc=f"tensordesc<{fp8_a}[{cfg.block_m}, {SCALE_BLOCK}]>",
                   b_desc=f"tensordesc<{fp8_b}[{cfg.block_n}, {SCALE_BLOCK}]>")
    else:
        meta.update(a_desc=None, b_desc=None)
    sig.update({name: "constexpr" for name in meta})
    return triton.compile(ASTSource(fn, sig, meta), target=target, options=options)


# ---------------------------------------------------------------------------------------------
# the family


def dtype_refusal(problem: GemmProblem) -> str | None:
    """Why a Triton family cannot take the problem's dtypes (FP8 operands, bf16/fp32 out), or None."""
    if problem.a_dtype not in FP8_DTYPES or problem.b_dtype not in FP8_DTYPES:
        return f"operands must be FP8 (e4m3/e5m2), got {problem.a_dtype} x {problem.b_dtype}"
    if problem.out_dtype not in OUT_DTYPES:
        return f"out dtype must be bf16 or fp32, got {problem.out_dtype}"
    return None


class PersistentFamily(KernelFamily):
    """The persistent Triton kernel: dense and every m-grouped kind, every recipe, FP8 format
    pair, C and split-K, on any GPU with FP8 dots and under the interpreter."""

    name = "fp8_gemm_persistent"
    Config = PersistentConfig

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind not in _KIND:
            return f"takes dense and m-grouped GEMMs, not {problem.kind.value}"
        why = dtype_refusal(problem)
        if why is not None:
            return why
        if problem.a_recipe not in _A_RECIPES:
            return f"A recipe {problem.a_recipe.value} is not one of {[r.value for r in _A_RECIPES]}"
        if problem.b_recipe not in _B_RECIPES:
            return f"B recipe {problem.b_recipe.value} is not one of {[r.value for r in _B_RECIPES]}"
        if problem.has_c and problem.kind is not GemmKind.DENSE:
            return "c (D = C + A.B^T) is implemented for dense GEMMs only"
        if problem.kind in (GemmKind.OFFSETS, GemmKind.MASKED) and problem.groups > MAX_GROUPS_TABLE:
            return (f"{problem.kind.value} GEMMs take at most {MAX_GROUPS_TABLE} groups, "
                    f"got {problem.groups}")
        return None

    def declines(self, problem: GemmProblem, facts: DeviceFacts) -> str | None:
        """Never: the last family of the table takes whatever it supports."""
        return None

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> PersistentConfig:
        return select_config(problem, facts)

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[PersistentConfig]:
        return candidate_configs(problem, facts)

    def run(self, config: PersistentConfig, problem: GemmProblem, a: torch.Tensor,
            sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor,
            c: torch.Tensor | None = None, index: torch.Tensor | None = None) -> None:
        """Launch `config` on the current stream (plus the contiguous further-groups launch and
        the split-K reduction). Tensors as the backend contract hands them over: a, b, out
        contiguous, scales normalised; index = m_indices / offsets / masked_m."""
        _launch(config, problem, a, sa, b, sb, out, c, index, main=True, further=True)


FAMILY = PersistentFamily()

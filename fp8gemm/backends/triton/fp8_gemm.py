"""FP8 NT GEMM in Triton: dense, grouped contiguous / offsets / masked, every scale recipe.

D[m, n] = sum_k A[m, k] * B[g, n, k] * scale_a * scale_b (+ C[m, n]), FP32 accumulation.

One kernel body serves the four kinds; the kind, the recipes, split-K and the load path are
compile-time constants. Contiguous GEMMs take a second, usually idle launch for tiles that hold
rows of several groups; split-K GEMMs a second kernel that reduces the partial sums in order.
The grid is persistent: each program walks output tiles in an L2-grouped order. For every K
tile of 128 (one scale block) the tensor-core partial sum is promoted to the FP32 accumulator
with its scales applied (two-level accumulation); when no scale varies along K (per-tensor /
per-row recipes) the dot accumulates directly and Triton promotes every 128 of K
(`max_num_imprecise_acc`), and the scales are applied once at the end.

Kernel -> launch wrapper; tests in tests/test_triton_*.py, timings in scripts/triton_check.sh.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...problem import GemmKind, GemmProblem, Recipe, ceil_div
from .config import GemmConfig, triton_twin

__all__ = ["launch_gemm"]

# kind / recipe codes shared by the kernel and the wrapper
KIND_DENSE, KIND_CONTIGUOUS, KIND_OFFSETS, KIND_MASKED = 0, 1, 2, 3
R_TENSOR, R_ROW, R_GROUP, R_BLOCK = 0, 1, 2, 3
_KIND = {GemmKind.DENSE: KIND_DENSE, GemmKind.CONTIGUOUS: KIND_CONTIGUOUS,
         GemmKind.OFFSETS: KIND_OFFSETS, GemmKind.MASKED: KIND_MASKED}
_RECIPE = {Recipe.TENSOR: R_TENSOR, Recipe.ROW: R_ROW, Recipe.GROUP: R_GROUP, Recipe.BLOCK: R_BLOCK}


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
def _mma_tile(a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr,
              row0, g, n0, kb_lo, n_iters, k_blocks, row_end, N, K, MMAX,
              stride_am, stride_bg, stride_bn,
              stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
              A_RECIPE: tl.constexpr, B_RECIPE: tl.constexpr, USE_TMA: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FP32 accumulator of one [BLOCK_M, BLOCK_N] tile over K tiles kb_lo .. kb_lo + n_iters - 1,
    scaled. K tiles at or past k_blocks (the short last split) load zeros and add nothing. Rows
    at or past row_end are not read by the pointer loads (their results are not stored).
    NOTE: offsets / masked pass the group's end, not A's: masked A scales [G, Mmax, ...] may have
    any strides, so a row past Mmax of group g need not lie inside the scale tensor."""
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
        if USE_TMA:
            a = a_desc.load([row0, k0])
            b = b_desc.load([g * N + n0, k0])
        else:
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
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
            acc = _mma_tile(a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr,
                            row0, 0, n0, kb_lo, k_per_split, k_blocks, M_A, N, K, 0,
                            stride_am, stride_bg, stride_bn,
                            stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
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
                acc = _mma_tile(a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr,
                                row0, g_first, n0, kb_lo, k_per_split, k_blocks, M_A, N, K, 0,
                                stride_am, stride_bg, stride_bn,
                                stride_sag, stride_sam, stride_sak,
                                stride_sbg, stride_sbn, stride_sbk,
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
            acc = _mma_tile(a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr,
                            row0, g, n0, kb_lo, k_per_split, k_blocks, end, N, K, MMAX,
                            stride_am, stride_bg, stride_bn,
                            stride_sag, stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
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
                        acc = _mma_tile(a_ptr, b_ptr, a_desc, b_desc, sa_ptr, sb_ptr,
                                        row0, g, n0, ks * k_per_split, k_per_split, k_blocks,
                                        M_A, N, K, 0, stride_am, stride_bg, stride_bn,
                                        stride_sag, stride_sam, stride_sak,
                                        stride_sbg, stride_sbn, stride_sbk,
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
# launch wrapper


def _scale_strides(s: torch.Tensor, recipe: Recipe, lead: bool) -> tuple[int, int, int]:
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


def _tma_ok(t: torch.Tensor, k: int) -> bool:
    # NOTE: TMA needs 16-byte aligned base addresses and row strides (FP8: K % 16 == 0).
    return k % 16 == 0 and t.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=1024)
def _launch_consts(problem: GemmProblem, cfg: GemmConfig, use_tma: bool,
                   has_c: bool) -> tuple[int, dict, dict | None]:
    """What the launches take from (problem, config) alone, computed once: the split count and
    the keyword arguments (constexprs, warps, stages) of the main launch and of the contiguous
    second launch (None for other kinds)."""
    kind = problem.kind
    split = cfg.split_k if kind is GemmKind.DENSE else 1
    k_blocks = ceil_div(problem.k, cfg.block_k)
    if split > 1 and ceil_div(k_blocks, ceil_div(k_blocks, split)) != split:
        raise ValueError(f"split_k={split} leaves an empty K range for K={problem.k}, "
                         f"BLOCK_K={cfg.block_k}")
    # NOTE: the group table of offsets / masked is a [G_POW2] vector (G_POW2 >= G); other kinds
    # do not build it, so they keep one value and do not compile once per group count.
    table = kind in (GemmKind.OFFSETS, GemmKind.MASKED)
    meta = dict(A_RECIPE=_RECIPE[problem.a_recipe], B_RECIPE=_RECIPE[problem.b_recipe],
                USE_TMA=use_tma, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, NUM_PROGRAMS=cfg.num_programs,
                G_POW2=triton.next_power_of_2(max(problem.groups, 2)) if table else 2,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    main = dict(meta, KIND=_KIND[kind], HAS_C=has_c and split == 1, SPLIT_K=split,
                FLATTEN=cfg.flatten and kind is GemmKind.DENSE)
    second = (dict(meta, KIND=4, HAS_C=False, SPLIT_K=1, FLATTEN=False)
              if kind is GemmKind.CONTIGUOUS else None)
    return split, main, second


def launch_gemm(problem: GemmProblem, cfg: GemmConfig, a: torch.Tensor, sa: torch.Tensor,
                b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, c: torch.Tensor | None,
                idx: torch.Tensor | None) -> None:
    """Launch one GEMM (plus the split-K reduction when cfg.split_k > 1) on the current stream.
    Tensors are as the backend contract gives them: a, b, out contiguous; scales normalised."""
    kind = problem.kind
    grouped_b = kind is not GemmKind.DENSE
    masked = kind is GemmKind.MASKED
    n, k, groups = problem.n, problem.k, problem.groups
    m_a = a.shape[0] * (a.shape[1] if masked else 1)  # rows of A as one [rows, K] matrix
    mmax = a.shape[1] if masked else 0
    if m_a == 0 or n == 0:
        return
    sag, sam, sak = _scale_strides(sa, problem.a_recipe, masked)
    sbg, sbn, sbk = _scale_strides(sb, problem.b_recipe, grouped_b)
    out2 = out.view(m_a, n)
    # NOTE: the Gluon kernel needs TMA on A, B and out (16-byte aligned bases; a view into a
    # buffer may not be): where it cannot run, its Triton twin (same tile) takes the GEMM; a
    # contiguous GEMM runs the twin's second launch after it either way.
    use_gluon = cfg.gluon and _tma_ok(a, k) and _tma_ok(b, k) and out.data_ptr() % 16 == 0
    if use_gluon:
        from .gluon_fp8_gemm import launch_gluon_gemm

        launch_gluon_gemm(_KIND[kind], a.view(m_a, k), b.view(-1, k), out2, sa, sb,
                          (sag, sam, sak, sbg, sbn, sbk), groups, mmax if masked else m_a, idx,
                          cfg.block_m, cfg.block_n, cfg.num_stages, cfg.group_m, cfg.num_programs)
        if kind is not GemmKind.CONTIGUOUS:
            return
    if cfg.gluon:
        cfg = triton_twin(cfg)
    use_tma = cfg.use_tma and _tma_ok(a, k) and _tma_ok(b, k)
    split, main_meta, second_meta = _launch_consts(problem, cfg, use_tma, c is not None)
    stride_bg = n * k if grouped_b else 0

    a_desc = b_desc = None
    if use_tma:
        a_desc = TensorDescriptor(a.view(m_a, k), [m_a, k], [k, 1], [cfg.block_m, cfg.block_k])
        b_rows = b.numel() // k
        b_desc = TensorDescriptor(b.view(b_rows, k), [b_rows, k], [k, 1],
                                  [cfg.block_n, cfg.block_k])

    ws = None
    if split > 1:
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
    if not use_gluon:
        _fp8_gemm_nt_kernel[grid](*args, **main_meta)
    if second_meta is not None:
        # the further groups of m tiles that hold rows of several groups (see KIND == 4)
        _fp8_gemm_nt_kernel[grid](*args, **second_meta)
    if split > 1:
        bm, bn = 32, 128
        _splitk_reduce_kernel[(ceil_div(m_a, bm), ceil_div(n, bn))](
            ws, out2, c_arg, m_a, n, out2.stride(0), out2.stride(1), stride_cm, stride_cn,
            HAS_C=c is not None, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)

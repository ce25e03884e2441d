"""The k-grouped FP8 NT GEMM in Triton (the MoE weight gradient): a kernel family (`FAMILY`).

out[g, m, n] = c[g, m, n] + sum_k A[m, off_g + k] * B[n, off_g + k] * sa[m, kb_g + k // 128]
               * sb[n, kb_g + k // 128],   0 <= k < ks[g],

with off_g = ks[0] + ... + ks[g - 1] and kb_g = ceil(ks[0] / 128) + ... + ceil(ks[g - 1] / 128):
the groups lie one after another along K, and each group's 1x128 scale blocks start at its first
column. Both operands are scaled per 1x128 group along K; FP32 accumulation.

One launch computes every group: the grid is (output tiles of one group, G); each program reads
ks on the device and finds its group's blocks of 128 columns by a prefix sum over the [G] sizes
held in registers, so nothing is read on the host (graph-safe) and a group with K = 0 writes c
(or 0). The kernel reads each group from a 128-column block (16-byte aligned loads): where some
K_g is not a multiple of 128, A and B are first copied with every group moved to one
(`layout.k_groups_on_blocks`, device ops only).
For every K tile of 128 (one scale block) the tensor-core partial sum is promoted to the FP32
accumulator with both scales applied (two-level accumulation).

Kernel -> config and heuristic -> launch -> the family.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...layout import k_group_columns, k_groups_on_blocks
from ...problem import FP8_DTYPES, SCALE_BLOCK, GemmKind, GemmProblem, Recipe, ceil_div
from ..family import DeviceFacts, KernelFamily

__all__ = ["FAMILY", "KGroupedConfig", "KGroupedFamily", "MAX_GROUPS"]

# NOTE: every program holds the [G] sizes (padded to a power of two) in registers for its prefix
# sum: 1024 int64 values over 128 threads are 16 registers each, the most worth spending.
MAX_GROUPS = 1024


# ---------------------------------------------------------------------------------------------
# kernel


@triton.jit
def _group_blocks(ks_ptr, g, G, NUM_KB, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr):
    """(first block, blocks) of group g along K: groups of ceil(K_g / BLOCK_K) blocks one after
    another, sizes clamped to >= 0 and to the NUM_KB blocks there are, so values that do not add
    up never address outside A, B or their scales."""
    gs = tl.arange(0, G_POW2)
    kc = tl.maximum(tl.load(ks_ptr + gs, mask=gs < G, other=0).to(tl.int64), 0)
    blocks = tl.minimum((kc + BLOCK_K - 1) // BLOCK_K, NUM_KB)
    kb_off = tl.sum(tl.where(gs < g, blocks, 0), 0)
    kb_lo = tl.minimum(kb_off, NUM_KB)
    kb_len = tl.minimum(kb_off + tl.sum(tl.where(gs == g, blocks, 0), 0), NUM_KB) - kb_lo
    return kb_lo, kb_len.to(tl.int32)


@triton.jit
def _k_grouped_fp8_gemm_nt_kernel(
        a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, c_ptr, ks_ptr,
        M, N, NUM_KB, G,
        stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk,
        stride_og, stride_om, stride_on, stride_cg, stride_cm, stride_cn,
        HAS_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, G_POW2: tl.constexpr):
    """Program (t, g): output tile t of group g (GROUP_M m tiles share each n tile, so their B
    tile stays in L2); group after group along the grid's second axis. A and B have every group
    on a block of BLOCK_K columns, zero past its K (the family's run sees to it)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    kb_lo, kb_len = _group_blocks(ks_ptr, g, G, NUM_KB, BLOCK_K, G_POW2)
    # NOTE: the group's first column as a multiple of BLOCK_K the compiler can see: without it,
    # every A and B element was its own one-byte load (no vector loads, no cp.async
    # pipelining), ~25 TFLOPS on the H200.
    lo = tl.multiple_of(kb_lo * BLOCK_K, BLOCK_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # NOTE: the tile origin in 64-bit scalar arithmetic (M x sum K can pass 2^31 elements),
    # offsets inside the tile in 32-bit
    a_ptrs = (a_ptr + tl.cast(pid_m * BLOCK_M, tl.int64) * stride_am + lo
              + tl.arange(0, BLOCK_M)[:, None] * stride_am + offs_k[None, :])
    b_ptrs = (b_ptr + tl.cast(pid_n * BLOCK_N, tl.int64) * stride_bn + lo
              + tl.arange(0, BLOCK_N)[:, None] * stride_bn + offs_k[None, :])
    sa_ptrs = sa_ptr + offs_m * stride_sam + kb_lo * stride_sak
    sb_ptrs = sb_ptr + offs_n * stride_sbn + kb_lo * stride_sbk

    # NOTE: the scales of the next K tile are loaded one iteration ahead, so their global load
    # latency hides behind the current tile's MMA.
    kb_last = tl.maximum(kb_len - 1, 0)
    sa_next = tl.load(sa_ptrs, mask=m_ok & (kb_len > 0), other=0.0)
    sb_next = tl.load(sb_ptrs, mask=n_ok & (kb_len > 0), other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, kb_len):
        sa_cur = sa_next
        sb_cur = sb_next
        kb_pre = tl.minimum(i + 1, kb_last)
        sa_next = tl.load(sa_ptrs + kb_pre * stride_sak, mask=m_ok & (i + 1 < kb_len), other=0.0)
        sb_next = tl.load(sb_ptrs + kb_pre * stride_sbk, mask=n_ok & (i + 1 < kb_len), other=0.0)
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        acc += tl.dot(a, b.T) * sa_cur[:, None] * sb_cur[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    mask = m_ok[:, None] & n_ok[None, :]
    rows = tl.arange(0, BLOCK_M)[:, None]
    r64 = tl.cast(pid_m * BLOCK_M, tl.int64)
    g64 = tl.cast(g, tl.int64)
    if HAS_C:
        acc += tl.load(c_ptr + g64 * stride_cg + r64 * stride_cm + rows * stride_cm
                       + offs_n[None, :] * stride_cn, mask=mask, other=0.0)
    tl.store(out_ptr + g64 * stride_og + r64 * stride_om + rows * stride_om
             + offs_n[None, :] * stride_on, acc, mask=mask)


# ---------------------------------------------------------------------------------------------
# config and heuristic


def _tile_side_ok(v: int) -> bool:
    return v >= 16 and v & (v - 1) == 0


@dataclass(frozen=True)
class KGroupedConfig:
    """One launch of the k-grouped kernel: output tile, L2 grouping, pipeline depth, warps. The
    K tile is one scale block (SCALE_BLOCK)."""

    block_m: int
    block_n: int
    group_m: int  # m tiles per L2 group of the tile order
    num_stages: int
    num_warps: int

    def __post_init__(self) -> None:
        # NOTE: tile sides are powers of two of at least 16 (tl.dot, tl.arange).
        bad = [f"{name}={getattr(self, name)}" for name, ok in (
            ("block_m", _tile_side_ok(self.block_m)), ("block_n", _tile_side_ok(self.block_n)),
            ("group_m", self.group_m >= 1), ("num_stages", self.num_stages >= 1),
            ("num_warps", self.num_warps in (1, 2, 4, 8, 16))) if not ok]
        if bad:
            raise ValueError(f"invalid KGroupedConfig ({', '.join(bad)}): tiles must be powers "
                             f"of two >= 16, warps a power of two <= 16, counts positive")

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} GROUP_M={self.group_m} "
                f"stages={self.num_stages} warps={self.num_warps}")


# (block_m, block_n, num_warps): one warpgroup for 64-wide tiles, two for 128x128 and wider
_TILES = ((128, 128, 8), (128, 256, 8), (64, 128, 4), (128, 64, 4), (64, 64, 4))


def _stages(block_m: int, block_n: int, facts: DeviceFacts) -> int:
    # NOTE: each stage holds one A and one B tile in shared memory (1 byte an element); keep
    # 32 KB for the epilogue's layout conversion and the compiler's own scratch.
    per_stage = (block_m + block_n) * SCALE_BLOCK
    return max(2, min(4, (facts.smem_per_block - 32 * 1024) // per_stage))


def _config(problem: GemmProblem, facts: DeviceFacts, tile: tuple[int, int, int]) -> KGroupedConfig:
    bm, bn, warps = tile
    return KGroupedConfig(bm, bn, 8, _stages(bm, bn, facts), warps)


@functools.lru_cache(maxsize=1024)
def select_config(problem: GemmProblem, facts: DeviceFacts) -> KGroupedConfig:
    """The heuristic config: 128x128 tiles with two warpgroups (the persistent family's large-M
    tile) where a group's output has at least one such tile per SM over all groups, else the
    largest of 128x64 / 64x128 / 64x64 that does, so that every SM gets a tile; 64-wide sides
    for M or N <= 64."""
    m, n, groups = problem.m, problem.n, max(1, problem.groups)
    for bm, bn, warps in _TILES[:1] + _TILES[2:]:
        if (bm > 64 and m <= 64) or (bn > 64 and n <= 64):
            continue
        if ceil_div(m, bm) * ceil_div(n, bn) * groups >= facts.num_sms or (bm, bn) == (64, 64):
            return _config(problem, facts, (bm, bn, warps))
    return _config(problem, facts, _TILES[-1])


def candidate_configs(problem: GemmProblem, facts: DeviceFacts) -> list[KGroupedConfig]:
    """Configs the autotuner times: the heuristic's first, then every other tile."""
    out = [select_config(problem, facts)]
    for tile in _TILES:
        cfg = _config(problem, facts, tile)
        if cfg not in out:
            out.append(cfg)
    return out


# ---------------------------------------------------------------------------------------------
# launch


def _launch(cfg: KGroupedConfig, problem: GemmProblem, a, sa, b, sb, out, c, ks) -> None:
    m, n, groups = problem.m, problem.n, problem.groups
    if m == 0 or n == 0 or groups == 0:
        return
    if not isinstance(cfg, KGroupedConfig):
        raise TypeError(f"config must be a KGroupedConfig, got {type(cfg).__name__}")
    num_kb = sa.shape[1]
    if problem.k != SCALE_BLOCK * num_kb:
        # Some group's K is not a multiple of 128 (sum K = 128 x scale columns holds exactly
        # when all are): a copy of A and B with every group moved to a 128-column block.
        cols = k_group_columns(ks, problem.k, num_kb)
        a, b = k_groups_on_blocks(a, cols, num_kb), k_groups_on_blocks(b, cols, num_kb)
    c_arg = c if c is not None else out
    grid = (ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n), groups)
    _k_grouped_fp8_gemm_nt_kernel[grid](
        a, b, sa, sb, out, c_arg, ks,
        m, n, num_kb, groups,
        a.stride(0), b.stride(0), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        c_arg.stride(0), c_arg.stride(1), c_arg.stride(2),
        HAS_C=c is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=SCALE_BLOCK,
        GROUP_M=cfg.group_m, G_POW2=triton.next_power_of_2(max(groups, 2)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---------------------------------------------------------------------------------------------
# the family


class KGroupedFamily(KernelFamily):
    """The k-grouped Triton kernel: A and B in 1x128 groups along each group's K, any FP8 format
    pair, fp32 out, an optional C (which may be out), up to MAX_GROUPS groups."""

    name = "k_grouped_fp8_gemm"
    Config = KGroupedConfig

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind is not GemmKind.K_GROUPED:
            return f"takes k-grouped GEMMs, not {problem.kind.value}"
        if problem.a_dtype not in FP8_DTYPES or problem.b_dtype not in FP8_DTYPES:
            return f"operands must be FP8 (e4m3/e5m2), got {problem.a_dtype} x {problem.b_dtype}"
        if problem.a_recipe is not Recipe.GROUP or problem.b_recipe is not Recipe.GROUP:
            return (f"A and B in 1x128 groups only, got A {problem.a_recipe.value} x "
                    f"B {problem.b_recipe.value}")
        if problem.out_dtype != torch.float32:
            return f"writes float32 only, got {problem.out_dtype}"
        if problem.groups > MAX_GROUPS:
            return (f"at most {MAX_GROUPS} groups (each program holds the group sizes in "
                    f"registers for its prefix sum), got {problem.groups}")
        return None

    def declines(self, problem: GemmProblem, facts: DeviceFacts) -> str | None:
        """Never: the only family of the table that takes k-grouped GEMMs."""
        return None

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> KGroupedConfig:
        return select_config(problem, facts)

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[KGroupedConfig]:
        return candidate_configs(problem, facts)

    def run(self, config: KGroupedConfig, problem: GemmProblem, a: torch.Tensor,
            sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor,
            c: torch.Tensor | None = None, index: torch.Tensor | None = None) -> None:
        """Launch `config` on the current stream: a [M, sum K] and b [N, sum K] contiguous,
        sa [M, S] and sb [N, S] any strides, out [G, M, N] float32, c None / [G, M, N] / out,
        index = ks int32 [G]."""
        if index is None:
            raise ValueError("the k-grouped kernel needs ks (index): int32 [G] K sizes")
        _launch(config, problem, a, sa, b, sb, out, c, index)


FAMILY = KGroupedFamily()

"""The sm90 1D1D kernel families: A and B both scaled per 1x128 group along K, FP32 out, `c`
accumulated. Two families share the kernel (include/fp8gemm/sm90_fp8_gemm_1d1d.cuh):

- `sm90_fp8_gemm_1d1d`: dense, the weight gradient dW = dY^T . X of a linear layer (K = tokens);
- `sm90_k_grouped_fp8_gemm_1d1d`: k-grouped, the MoE weight gradient of every expert in one
  launch (group g's K = ks[g] tokens, read on the device).

N is a compile-time constant; M and K are kernel arguments, so a new token count costs a plan
(tensor maps), not a compile.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import jit
from ..._settings import settings
from ...layout import (TMA_ALIGN_BYTES, is_col_major_tma_aligned, k_group_columns,
                       k_groups_on_blocks, num_sms_override)
from ...problem import SCALE_BLOCK, GemmKind, GemmProblem, Recipe, align, ceil_div
from ..family import DeviceFacts, KernelFamily
from .launch import cached_plan, kernel_a_scales, launch, row_stride, tma_aligned
from .sm90_fp8_gemm_1d2d import BAND_SIZE, LOAD_WEIGHT, MIN_STAGES, mma_efficiency

__all__ = ["Sm90Config1d1d", "Sm90Fp8Gemm1d1d", "Sm90KGroupedFp8Gemm1d1d", "DENSE", "K_GROUPED",
           "smem_bytes", "max_stages",
           "num_threads", "tile_cost", "candidate_tiles", "kernel_source", "compile_kernel",
           "BLOCK_K", "BLOCK_M_CHOICES", "BLOCK_N_CHOICES", "K_GROUPED_BLOCK_N_CHOICES",
           "TALL_BLOCK_N_CHOICES", "launcher"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
# NOTE: one k-block is one scale block of both operands: partial sums are promoted every 128 of K.
BLOCK_K = SCALE_BLOCK
BLOCK_M_CHOICES = (64, 128)
# NOTE: each math thread holds the wgmma accumulator and the FP32 sums (BLOCK_N/2 floats each) and
# the stage's B scales of its columns (BLOCK_N/4), loaded before the wgmma is issued. With two
# math warpgroups (232 registers each) 176 is the widest tile ptxas compiles without spills,
# for an even or an odd N (single-float stores; 184 spills 72 and 88 bytes); the k-grouped walk
# keeps a few more registers live, and there 176 spills 4 bytes: 168. One warpgroup (256 registers)
# takes 192 (200 spills 56 bytes), 184 k-grouped (192 spills 8). wgmma's 256 would need 256
# registers for the two accumulators alone.
BLOCK_N_CHOICES = {128: tuple(range(16, 177, 8)), 64: tuple(range(16, 193, 8))}
K_GROUPED_BLOCK_N_CHOICES = {128: tuple(range(16, 169, 8)), 64: tuple(range(16, 185, 8))}
# NOTE: BLOCK_M = 256 runs two waves of 128 rows per k-block through the one accumulator (as the
# 1D2D family's 256-row tiles): a k-block's loads feed twice the FLOPs of 128 rows (256x120 reads
# 6.1 bytes of A and B per 1000 FLOPs, 128x128 7.8). Each thread then holds both waves' FP32 sums,
# the accumulator and the B scales: 256x120 is the widest tile ptxas compiles without spills,
# dense and k-grouped (256x128 spills 8 and 40 bytes). The heuristic does not offer them
# (BLOCK_M_CHOICES): on the H200 (scripts/cuda_tiles.py --family sm90_fp8_gemm_1d1d --kind wgrad)
# 256x120 ran the suite's four M = 4096-token weight gradients at 0.851x cuBLAS block-wise
# against 0.884x for the heuristic's tiles, faster only at 32768x512 (3 %): the two waves'
# promotions run one after the other. A config may ask for one.
TALL_BLOCK_N_CHOICES = tuple(range(16, 121, 8))
MAX_STAGES = 8
# NOTE: two accumulators (the next k-block's wgmma issued before the wait for this one, so the
# tensor cores run while a k-block is promoted) add BLOCK_N/2 registers: the widest tiles ptxas
# compiles without spills, dense and k-grouped (two math warpgroups: 144 spills 356 bytes; one:
# 152 spills 76 bytes k-grouped).
TWO_ACCUM_MAX_BLOCK_N = {128: 136, 64: 144}
# NOTE: with one accumulator the promotion runs after each wgmma and before the next one: the
# two math warpgroups wait on the same stage, so the tensor cores idle while they promote.
# Offered two-accumulator tiles (PICK_TWO_ACCUM), the model would charge it 1 / 0.82 of the
# tensor-core time. It does not offer them: on the H200, timed against the one-accumulator
# kernel on the suite's in-place weight gradients (`scripts/cuda_tiles.py --family
# sm90_fp8_gemm_1d1d --kind wgrad --variants base,block_n=128+two_accum=1`), 128x128 with two
# accumulators ran within 1 %, 128x136 with two 1 % faster at 2112x7168 and 3-6 % slower at
# 24576x1536 and 7168x2048. The promotion does cost (a build without its FMAs ran 24 % faster),
# but its issue time does not overlap the wgmma either way (docs/cuda.md, "Where the time
# goes"). A config may still ask for them.
SERIAL_PROMOTION_EFFICIENCY = 0.82
PICK_TWO_ACCUM = False
# NOTE: a k-block costs the math warps a fixed part besides its wgmma (the full barrier's wait,
# the scale loads, the promotion waiting for the last wgmma), which a wider tile spreads over more
# columns. On the H200 a wave of 128-row tiles took a + b * BLOCK_N / 32 for widths 128-160 with
# a / b = 4 (7168x16384x4096, 44-55 waves: 22.3, 22.7, 24.1, 24.3, 25.1 us per wave at 128, 136,
# 144, 152, 160), as a / b = 3.4-4.6 fitted at 24576x1536 and 4096x7168 for widths 128-176. The
# two widest tiles, which fit five stages rather than six, ran 7 % (168) and 9 % (176) above
# that line: SHALLOW_RING_COST. The model takes 128x160 for four of the six DeepSeek-V3 weight
# gradients, 128x152 for 7168x2048 (six waves either way: 2-5 % faster than 128x160 in four runs)
# and 128x176 for 32768x512 (three n-blocks, not four); against 128x128 in one run they took
# 4-14 % less time at 4096 tokens. Tiles up to 128 wide keep the 1D2D model: with the fixed
# part added there the model took fewer, larger tiles for small weight gradients (256x256,
# 300x500, 130x2112, 1000x576 at 4096 tokens), which ran 8-19 % slower.
KBLOCK_FIXED_STEPS = 4
FULL_RING_STAGES = 6
SHALLOW_RING_COST = 1.07
# NOTE: A may be e5m2 (a gradient quantised with grad_format="e5m2": dW = dY^T . X, dY^T e5m2,
# X^T e4m3): one more wgmma type (`.e5m2.e4m3`), the same pipeline.
A_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --- config ---------------------------------------------------------------------------------------
def num_threads(block_m: int) -> int:
    """One producer warpgroup and one (BLOCK_M = 64) or two math warpgroups."""
    return 128 + (128 if block_m == 64 else 256)


def smem_bytes(block_m: int, block_n: int, num_stages: int) -> int:
    """Sm90Fp8Gemm1d1dLayout::kSmemBytes: the kernel traps when launched with less."""
    # NOTE: a stage's scales start on 128 bytes (TMA's shared-memory alignment).
    per_stage = (block_m + block_n) * BLOCK_K + (align(block_m, 32) + align(block_n, 32)) * 4
    return 1024 + num_stages * per_stage + 2 * num_stages * 8


def max_stages(block_m: int, block_n: int, smem_limit: int) -> int:
    """The deepest pipeline of this tile that fits `smem_limit` bytes (0: none fits)."""
    for s in range(MAX_STAGES, MIN_STAGES - 1, -1):
        if smem_bytes(block_m, block_n, s) <= smem_limit:
            return s
    return 0


@dataclass(frozen=True)
class Sm90Config1d1d:
    """One instance of the sm90 1D1D kernel and its launch."""

    block_m: int
    block_n: int
    num_stages: int
    band_size: int
    grid: int  # persistent CTAs
    two_accum: bool = False  # two accumulators: the next k-block's wgmma runs under a promotion

    @property
    def num_threads(self) -> int:
        return num_threads(self.block_m)

    @property
    def smem(self) -> int:
        """Dynamic shared memory of this config, bytes (independent of K: the scales travel with
        their stage)."""
        return smem_bytes(self.block_m, self.block_n, self.num_stages)

    def __str__(self) -> str:
        return (f"BLOCK {self.block_m}x{self.block_n}x{BLOCK_K} stages={self.num_stages} "
                f"grid={self.grid} threads={self.num_threads}"
                + (" two-accum" if self.two_accum else ""))


# --- heuristic -------------------------------------------------------------------------------------
def tile_cost(block_m: int, block_n: int, two_accum: bool = False,
              num_stages: int = FULL_RING_STAGES) -> float:
    """Modelled time of one tile per unit of K: max(MMA, loads), in FLOP units. Up to 128 wide
    the tensor-core rate and the load weight are the 1D2D family's measured model
    (sm90_fp8_gemm_1d2d: one math warpgroup at 0.4 of two, N in steps of 32); a wider tile costs
    the 128-wide one x (BLOCK_N / 32 + KBLOCK_FIXED_STEPS) / (4 + KBLOCK_FIXED_STEPS), as
    measured on these kernels, and SHALLOW_RING_COST more with fewer than FULL_RING_STAGES
    stages. With one accumulator the promotion is not overlapped (SERIAL_PROMOTION_EFFICIENCY,
    charged where PICK_TWO_ACCUM offers the two-accumulator kernel beside it)."""
    narrow = min(block_n, 128)
    mma = 2 * block_m * narrow / mma_efficiency(block_m, narrow)
    if block_n > 128:
        mma *= (block_n / 32 + KBLOCK_FIXED_STEPS) / (128 // 32 + KBLOCK_FIXED_STEPS)
        if num_stages < FULL_RING_STAGES:
            mma *= SHALLOW_RING_COST
    if PICK_TWO_ACCUM and not two_accum:
        mma /= SERIAL_PROMOTION_EFFICIENCY
    return max(mma, LOAD_WEIGHT * (block_m + block_n))


@dataclass(frozen=True)
class Candidate:
    block_m: int
    block_n: int
    num_stages: int
    tiles: int
    waves: int
    last_wave: int  # tiles in the last wave
    cost: float  # waves * tile_cost
    two_accum: bool = False


def candidate_tiles(m: int, n: int, facts: DeviceFacts, groups: int = 1,
                    k_grouped: bool = False) -> list[Candidate]:
    """Every tile shape that fits shared memory, with its modelled cost, for `groups` GEMMs of
    [m, n] (the k-grouped kernel's groups; their K does not change the tile)."""
    choices = K_GROUPED_BLOCK_N_CHOICES if k_grouped else BLOCK_N_CHOICES
    out = []
    for bm in BLOCK_M_CHOICES:
        if bm == 128 and m <= 64:
            continue  # a second math warpgroup would only multiply zeros
        for bn in choices[bm]:
            if bn > align(n, 8) and bn != choices[bm][0]:
                continue  # wider than N: only zero columns
            stages = max_stages(bm, bn, facts.smem_per_block)
            if stages == 0:
                continue
            tiles = groups * ceil_div(m, bm) * ceil_div(n, bn)
            waves = ceil_div(tiles, facts.num_sms)
            last = tiles - (waves - 1) * facts.num_sms
            # The two-accumulator kernel where it fits registers and has three stages.
            two = PICK_TWO_ACCUM and bn <= TWO_ACCUM_MAX_BLOCK_N[bm] and stages >= 3
            # Rounded, so that tiles the model prices alike tie exactly and the tie-breaks decide.
            cost = round(waves * tile_cost(bm, bn, two, stages), 6)
            out.append(Candidate(bm, bn, stages, tiles, waves, last, cost, two))
    return out


def _rank(c: Candidate) -> tuple:
    # Least modelled time; among equals fewer tiles (less per-tile overhead: the epilogue's
    # stores and the pipeline ramp), two math warpgroups, the fullest last wave, the wider tile.
    return (c.cost, c.tiles, -c.block_m, -c.last_wave, -c.block_n)


def _config(best: Candidate, facts: DeviceFacts) -> Sm90Config1d1d:
    return Sm90Config1d1d(block_m=best.block_m, block_n=best.block_n, num_stages=best.num_stages,
                          band_size=BAND_SIZE, grid=max(1, min(facts.num_sms, best.tiles)),
                          two_accum=best.two_accum)


@functools.lru_cache(maxsize=4096)
def _select(m: int, n: int, facts: DeviceFacts, groups: int = 1,
            k_grouped: bool = False) -> Sm90Config1d1d:
    # NOTE: K does not enter: every k-block costs the same, and shared memory does not grow with K.
    cands = candidate_tiles(m, n, facts, groups, k_grouped)
    if not cands:
        raise ValueError(f"no sm90 1D1D tile fits {facts.smem_per_block} bytes of shared memory")
    return _config(min(cands, key=_rank), facts)


# --- kernel source -------------------------------------------------------------------------------
def kernel_source(n: int, cfg: Sm90Config1d1d, k_grouped: bool = False,
                  a_e5m2: bool = False) -> tuple[str, str]:
    """(source, name expression) of the kernel instance for (N, config, dense or k-grouped, A in
    e4m3 or e5m2)."""
    b = {True: "true", False: "false"}
    source = "#include <fp8gemm/sm90_fp8_gemm_1d1d.cuh>\n"
    name = (f"&fp8gemm::sm90_fp8_gemm_1d1d_kernel<{b[k_grouped]}, {n}, "
            f"{cfg.block_m}, {cfg.block_n}, {cfg.num_stages}, {cfg.band_size}, "
            f"{b[cfg.two_accum]}, {b[a_e5m2]}>")
    return source, name


def compile_kernel(n: int, cfg: Sm90Config1d1d, k_grouped: bool = False,
                   compiler: str | None = None, a_e5m2: bool = False,
                   include_dir: Path | None = None):
    """Compile without loading (no GPU needed): (key, CompiledCubin, path, was_cached).
    include_dir: another copy of the kernel headers (to read a variant's SASS); None: the
    module's INCLUDE_DIR, read at the call (scripts/cuda_tiles.py swaps it)."""
    return jit.compile_cached(*kernel_source(n, cfg, k_grouped, a_e5m2),
                              (str(include_dir or INCLUDE_DIR),), compiler=compiler)


# --- launch --------------------------------------------------------------------------------------
def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """A K-major operand TMA can address: its rows a multiple of 16 bytes apart and its base on
    16 bytes. An operand whose K is not a multiple of 16 is copied into rows padded to 16 bytes
    (the padding is never read: the tensor map's K is the true K, and TMA zero-fills past it)."""
    rows, k = t.shape
    if k % TMA_ALIGN_BYTES == 0:
        return tma_aligned(t)
    buf = torch.empty(rows, align(k, TMA_ALIGN_BYTES), dtype=t.dtype, device=t.device)
    view = buf[:, :k]
    view.copy_(t)
    return view


def _row_bytes(t: torch.Tensor) -> int:
    """The row stride of a `_tma_rows` operand for its tensor map, bytes: the padded rows' own
    stride, else launch.row_stride's (one-row views get the packed stride)."""
    stride = t.stride(0) if t.shape[1] % TMA_ALIGN_BYTES else row_stride(t)
    return stride * t.element_size()


def pack_key(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             out: torch.Tensor, c: torch.Tensor | None, ks: torch.Tensor | None) -> tuple:
    """What an argument pack depends on besides the plan's shapes: the pointers, and the scale
    columns (k-grouped: the sum of the groups' k-blocks, which sizes the tensor maps)."""
    return (a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), out.data_ptr(),
            0 if c is None else c.data_ptr(), 0 if ks is None else ks.data_ptr(), sa.shape[1])


class Sm90Plan1d1d:
    """Everything fixed for one (problem, device, config): kernel, launch config, and the
    argument packs of the tensors it has seen (tensor maps encoded once per pointer set)."""

    __slots__ = ("cfg", "kernel", "launch", "device_index", "m", "n", "k", "groups", "k_grouped",
                 "packs", "tmaps", "sm_override")

    def __init__(self, problem: GemmProblem, device_index: int, cfg: Sm90Config1d1d) -> None:
        self.sm_override = num_sms_override()  # the set_num_sms value the config was chosen under
        self.cfg, self.device_index = cfg, device_index
        self.m, self.n, self.k, self.groups = problem.m, problem.n, problem.k, problem.groups
        self.k_grouped = problem.kind is GemmKind.K_GROUPED
        a_e5m2 = problem.a_dtype == torch.float8_e5m2
        self.kernel = jit.build(*kernel_source(problem.n, cfg, self.k_grouped, a_e5m2),
                                (str(INCLUDE_DIR),))
        self.kernel.set_max_dynamic_smem(cfg.smem, device_index)
        self.launch = jit.LaunchConfig((cfg.grid, 1, 1), (cfg.num_threads, 1, 1), cfg.smem,
                                       pdl=settings.pdl)
        self.packs: dict[tuple, jit.ParamPack] = {}
        self.tmaps = jit.TensorMapCache(capacity=512)

    def params(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               out: torch.Tensor, c: torch.Tensor | None, ks: torch.Tensor | None,
               key: tuple) -> jit.ParamPack:
        cfg, m, n, tm = self.cfg, self.m, self.n, self.tmaps
        # K as the tensor maps see it (k-grouped: 128 per k-block of every group) and k-blocks.
        k, kb = a.shape[1], sa.shape[1]
        # NOTE: a box of min(BLOCK_M, M) rows: the kernel expects exactly these bytes per stage.
        map_a = tm.get(a.dtype, a.data_ptr(), (k, m), (_row_bytes(a),),
                       (BLOCK_K, min(cfg.block_m, m)), jit.Swizzle.B128)
        map_b = tm.get(b.dtype, b.data_ptr(), (k, n), (_row_bytes(b),),
                       (BLOCK_K, cfg.block_n), jit.Swizzle.B128)
        # Scales: column-major, columns padded to 4 floats (layout.get_col_major_tma_aligned_tensor);
        # full boxes (TMA zero-fills rows past M and N; the kernel counts BLOCK_M + BLOCK_N floats).
        map_sa = tm.get(torch.float32, sa.data_ptr(), (m, kb), (align(m, 4) * 4,),
                        (cfg.block_m, 1))
        map_sb = tm.get(torch.float32, sb.data_ptr(), (n, kb), (align(n, 4) * 4,),
                        (cfg.block_n, 1))
        pack = jit.ParamPack([ctypes.c_uint32(m), ctypes.c_uint32(self.k),
                              ctypes.c_uint64(0 if ks is None else ks.data_ptr()),
                              ctypes.c_uint32(self.groups),
                              ctypes.c_uint64(0 if c is None else c.data_ptr()),
                              ctypes.c_uint64(out.data_ptr()), map_a, map_b, map_sa, map_sb])
        if len(self.packs) >= 1024:
            self.packs.clear()
        self.packs[key] = pack
        return pack

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, c: torch.Tensor | None = None,
            ks: torch.Tensor | None = None) -> None:
        """out = c + (a * sa) @ (b * sb)^T (k-grouped: per group, ks the groups' K); tensors as
        the backend contract hands them over (a, b, out, c, ks contiguous, c may be out; scales
        float32 [rows, S], any strides)."""
        sa, sb = kernel_a_scales(sa), kernel_a_scales(sb)
        if self.k_grouped and self.k != BLOCK_K * sa.shape[1]:
            # NOTE: some group's K is not a multiple of 128 (sum K = 128 S holds exactly when all
            # are): the kernel needs every group on a k-block (TMA faults on an innermost start
            # that is not 16-byte aligned, and the wgmma descriptors move in 16 bytes), so A and
            # B are copied with their groups moved to k-block boundaries.
            cols = k_group_columns(ks, self.k, sa.shape[1])
            a, b = (k_groups_on_blocks(a, cols, sa.shape[1]),
                    k_groups_on_blocks(b, cols, sa.shape[1]))
        else:
            a, b = _tma_rows(a), _tma_rows(b)
        dst = out
        # NOTE: the epilogue stores two floats at once (8 bytes); a view at an odd float offset
        # goes through a copy (slow but correct, never an error). c is read with 4-byte loads.
        if out.data_ptr() % 8:
            dst = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        key = pack_key(a, sa, b, sb, dst, c, ks)
        pack = self.packs.get(key)
        if pack is None:
            pack = self.params(a, sa, b, sb, dst, c, ks, key)
        launch(self.kernel, self.launch, self.device_index, pack)
        if dst is not out:
            out.copy_(dst)


_plans: dict[tuple, Sm90Plan1d1d] = {}


def get_plan(problem: GemmProblem, device_index: int, cfg: Sm90Config1d1d) -> Sm90Plan1d1d:
    """The plan of (problem, device, config), built on first use."""
    # NOTE: supports() fixes B's dtype, the recipes and the output; has_c only changes a pointer.
    key = (problem.kind, problem.m, problem.n, problem.k, problem.groups, problem.a_dtype,
           device_index, cfg)
    fam = K_GROUPED if problem.kind is GemmKind.K_GROUPED else DENSE
    return cached_plan(_plans, key, lambda: Sm90Plan1d1d(problem, device_index, cfg), fam.name,
                       problem, cfg)


# --- families ------------------------------------------------------------------------------------
def _common_refusal(problem: GemmProblem) -> str | None:
    if problem.a_dtype not in A_DTYPES or problem.b_dtype != torch.float8_e4m3fn:
        return "the sm90 1D1D kernel takes A e4m3 or e5m2 and B e4m3 only"
    if problem.a_recipe is not Recipe.GROUP or problem.b_recipe is not Recipe.GROUP:
        return "the sm90 1D1D kernel takes A and B both in 1x128 groups along K only"
    if problem.out_dtype != torch.float32:
        return "the sm90 1D1D kernel writes float32 only"
    # (k-grouped: the groups padded to k-blocks are at most 128 columns longer each)
    k = problem.k + (BLOCK_K * problem.groups if problem.kind is GemmKind.K_GROUPED else 0)
    if max(problem.m, problem.n, k) >= 2 ** 31:
        return "dimensions must fit in int32 TMA coordinates"
    return None


class _Family1d1d(KernelFamily):
    Config = Sm90Config1d1d
    k_grouped = False

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> Sm90Config1d1d:
        return _select(problem.m, problem.n, facts, problem.groups, self.k_grouped)

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list[Sm90Config1d1d]:
        """The chosen config first, then every other tile that fits."""
        out = [self.select_config(problem, facts)]
        for c in sorted(candidate_tiles(problem.m, problem.n, facts, problem.groups,
                                        self.k_grouped), key=_rank):
            cfg = _config(c, facts)
            if cfg not in out:
                out.append(cfg)
        return out

    def config_for(self, problem: GemmProblem, device: torch.device) -> Sm90Config1d1d:
        return self.select_config(problem, DeviceFacts.of(device))


class Sm90Fp8Gemm1d1d(_Family1d1d):
    """Dense, A and B in 1x128 groups along K, FP32 out: out = c + A . B^T (c None, separate or
    out itself). Any K >= 1 (an operand whose K is not a multiple of 16 is copied into padded
    rows first); M, N any."""

    name = "sm90_fp8_gemm_1d1d"

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind is not GemmKind.DENSE:
            return f"takes dense GEMMs, not {problem.kind.value}"
        return _common_refusal(problem)

    def run(self, config: Sm90Config1d1d, problem: GemmProblem, a: torch.Tensor,
            sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor,
            c: torch.Tensor | None = None, index: torch.Tensor | None = None) -> None:
        if index is not None:
            raise ValueError(f"{self.name} is dense: it takes no index tensor")
        if (c is not None) != problem.has_c:
            raise ValueError(f"c must be given exactly when the problem has C ({problem})")
        get_plan(problem, a.device.index, config).run(a, sa, b, sb, out, c)


class Sm90KGroupedFp8Gemm1d1d(_Family1d1d):
    """K-grouped (the MoE weight gradient): out[g] = c[g] + A_g . B_g^T for every group in one
    launch, `index` = ks [G] int32 on the device (any K_g >= 0; graph-safe). Where every K_g is
    a multiple of 128 (sum K = 128 x the scale columns) A and B are read in place; otherwise
    they are first copied with each group moved to a k-block boundary (device ops, no sync)."""

    name = "sm90_k_grouped_fp8_gemm_1d1d"
    k_grouped = True

    def supports(self, problem: GemmProblem) -> str | None:
        if problem.kind is not GemmKind.K_GROUPED:
            return f"takes k-grouped GEMMs, not {problem.kind.value}"
        return _common_refusal(problem)

    def run(self, config: Sm90Config1d1d, problem: GemmProblem, a: torch.Tensor,
            sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor,
            c: torch.Tensor | None = None, index: torch.Tensor | None = None) -> None:
        if index is None:
            raise ValueError(f"{self.name} needs ks (the groups' K) as its index tensor")
        if (c is not None) != problem.has_c:
            raise ValueError(f"c must be given exactly when the problem has C ({problem})")
        get_plan(problem, a.device.index, config).run(a, sa, b, sb, out, c, index)


DENSE = Sm90Fp8Gemm1d1d()
K_GROUPED = Sm90KGroupedFp8Gemm1d1d()


# --- the ops layer's warm-call fast path ---------------------------------------------------------
class _Launcher:
    """Warm calls of one metadata signature of the ops layer's fast path (as the 1D2D family's
    launcher): a hit in the plan's argument packs launches at once; anything else (new pointers,
    set_num_sms since) takes the plan's run, which builds what is missing."""

    __slots__ = ("problem", "device", "device_index", "plan")

    def __init__(self, problem: GemmProblem, device: torch.device) -> None:
        self.problem, self.device, self.device_index = problem, device, device.index
        self.plan = get_plan(problem, device.index, DENSE.config_for(problem, device))

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, c: torch.Tensor | None) -> None:
        plan = self.plan
        # NOTE: Sm90Plan1d1d.run's pack key; a hit needs no layout check: packs hold only
        # pointers TMA and the epilogue can address (run copies the others), and the scales'
        # strides are fixed by the metadata signature.
        pack = plan.packs.get(pack_key(a, sa, b, sb, out, c, None))
        if pack is not None and plan.sm_override == num_sms_override():
            launch(plan.kernel, plan.launch, self.device_index, pack)
        else:
            self.plan = get_plan(self.problem, self.device_index,
                                 DENSE.config_for(self.problem, self.device))
            self.plan.run(a, sa, b, sb, out, c)


def launcher(problem: GemmProblem, sa: torch.Tensor, sb: torch.Tensor):
    """`_Launcher.run` for warm calls of `problem` with contiguous a, b, out (and c) and scales
    with the metadata of sa and sb; None when the scales need converting on every call (the
    general path) or an operand needs its rows padded (K not a multiple of 16)."""
    if not (is_col_major_tma_aligned(sa) and is_col_major_tma_aligned(sb)):
        return None
    if problem.k % TMA_ALIGN_BYTES:
        return None
    return _Launcher(problem, sa.device).run

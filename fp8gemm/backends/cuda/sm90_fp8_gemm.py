"""Dense FP8 GEMM on sm_90a: config heuristic, kernel source, launch.

Kernel: include/fp8gemm/sm90_fp8_gemm_1d2d.cuh (A scaled per 1x128 group, B per 128x128 block,
bf16 out). N and K are compile-time constants; M is a kernel argument.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import jit
from ..._settings import settings
from ...layout import _SmCount
from ...problem import GemmKind, GemmProblem, Recipe, align, ceil_div

__all__ = ["DeviceFacts", "Sm90GemmConfig", "select_config", "candidate_configs", "smem_bytes",
           "num_threads", "tile_cost", "mma_efficiency", "use_two_accum", "kernel_source",
           "build_kernel", "fp8_gemm_nt", "BLOCK_K", "BLOCK_N_CHOICES"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
BLOCK_K = 128
# NOTE: wgmma N goes up to 256, but each math thread holds two BLOCK_N/2 float accumulators
# (wgmma's and the promoted FP32 one) in 232 registers: 160 is the widest that fits with room for
# addresses. Above 128 only widths that never straddle three 128-wide B scale blocks
# (BLOCK_N <= 128 + largest power of two dividing it): 136, 144, 160.
BLOCK_N_CHOICES = tuple(range(16, 129, 8)) + (136, 144, 160)
BLOCK_M_CHOICES = (64, 128, 256)
# BLOCK_M = 256 keeps two FP32 sums per thread besides the wgmma accumulator: BLOCK_N <= 136 fits
# without spills (144 spills). Narrower tiles gain nothing from the second wave: on the M = 4096
# shapes 256x96 and 256x112 ran 20-28 % slower than 256x128 (more than their wave counts say).
BLOCK_N_CHOICES_256 = (128, 136)
MAX_STAGES = 8
MIN_STAGES = 3
# Tiles per rasterisation band (even: a 2-CTA cluster's two tiles must share a band).
BAND_SIZE = 16
# NOTE: cost model of one tile per unit of K: max(MMA time, load time), in FLOP units.
# - MMA: 2*BM*BN / efficiency. Measured on H200 (scripts/cuda_sweep.py, M = 4096, cold L2): the
#   tensor cores take N in steps of 32 (N = 136 costs about what 160 does), so efficiency is
#   BN / align(BN, 32) (times WIDE_TILE_EFFICIENCY above 128, below); one math warpgroup
#   (BLOCK_M = 64) waits for its own wgmma before each promotion and reaches well under half the
#   rate of two, which alternate (0.4 fits the M = 128 shapes, where both tile heights compete).
#   BLOCK_M = 256 (two 128-row waves per k-block) ran 3-11 % faster per FLOP than 128 at equal wave
#   counts on the six M = 4096 shapes (scripts/cuda_ab.py, H200): 1.06. Tiles wider than 128:
#   0.96 at BLOCK_M <= 128 (128x160 ran 0.89x 128x128's per-FLOP rate with its two accumulators
#   before the uniform descriptors, when the model priced that 0.96 / 1.07 = 0.90; not measured
#   since), 1.02 at 256 (256x136 ran 0.87x 256x128's, 136/160 alone says 0.85).
#   Two wgmma accumulators in flight on 128x128 (use_two_accum), the epilogue under the next
#   tile's first wgmma: timed as the bench CLI times (cuda_ab.py --method bench), 0.97-1.09x
#   256x128 at M = 1024-4096 from K = 1536 while the wgmma descriptors were built per thread.
#   With them warp-uniform (commits 1d6e202, cc1bfea) 256x128 gained more: 1.02-1.05x 128x128
#   with two accumulators on the four M = 4096 shapes where both fill the same waves
#   (benchmarks/experiments/2026-11-30-after-uniform-tiles-multicast-ab-bench.json), so the
#   tile's cost / 1.02 at K >= 1024.
# - Loads: LOAD_WEIGHT * (BM + BN) bytes of A and B per unit of K; LOAD_WEIGHT is the FLOPs an SM
#   does while pulling one byte from L2 (1480 TFLOPS / 132 SMs over ~90 GB/s per SM).
LOAD_WEIGHT = 128
ONE_WARPGROUP_EFFICIENCY = 0.4
TWO_WAVE_EFFICIENCY = 1.06
TWO_ACCUM_EFFICIENCY = 1.02
TWO_ACCUM_MIN_K = 1024
TWO_ACCUM_MAX_K = 49152
WIDE_TILE_EFFICIENCY = {64: 0.96, 128: 0.96, 256: 1.02}
# 2-CTA TMA multicast halves the L2 reads of the shared operand; measured on the suite's
# compute-bound M = 4096 shapes it changed times by -3..+2 % (noise), so it is chosen only where
# the model says loads bound the tile.
MULTICAST_MIN_M = 512
# NOTE: DeepGEMM's SASS post-pass (clear the reuse and no-yield bits of the promotion FFMAs so
# the other math warpgroup can issue its wgmma sooner) was tried on 128x128 and 256x128 tiles
# (first half / all of each FFMA run, commit 9ec09f1): 1-5 % slower on every M = 4096 shape
# (benchmarks/experiments/2026-11-30-ffma-yield-*.json), so it is not applied.
# NOTE: the kernel keeps every k-block's B scales in shared memory (8 bytes per 128 of K) and
# prefetches them into registers (2 * K/128 / math threads per thread): at K = 262144 a 64x160 tile
# spills, and near K = 4M no tile fits shared memory. 131072 is the largest K checked to compile
# without spills for the widest tiles (tests/test_cuda_compile.py); larger K goes to another backend.
MAX_K = 131072
# NOTE: TMA needs 16-byte aligned global base addresses (and row strides).
TMA_ALIGN = 16
# Raw stream handles that are not real streams: NULL (legacy default), CU_STREAM_LEGACY,
# CU_STREAM_PER_THREAD (cuda.h).
_SPECIAL_STREAMS = (0, 1, 2)


def use_two_accum(block_m: int, block_n: int, k: int) -> bool:
    """Two accumulators in flight (and the epilogue under the next tile's first wgmma): on 128x128
    tiles up to K = TWO_ACCUM_MAX_K. The kernel takes any BLOCK_N <= 128 with BLOCK_M = 128, but
    ptxas spills for some (128x120; 128x112 from K = 32768; 128x128 at K = 65536), and against
    one accumulator narrow tiles measured within +-4 % (H200, cuda_ab.py) while 128x128 gained
    3-7 %. tests/test_cuda_compile.py compiles every K step of this range."""
    return (block_m, block_n) == (128, 128) and k <= TWO_ACCUM_MAX_K


def mma_efficiency(block_m: int, block_n: int) -> float:
    eff = block_n / align(block_n, 32)
    if block_n > 128:
        eff *= WIDE_TILE_EFFICIENCY[block_m]
    if block_m == 64:
        eff *= ONE_WARPGROUP_EFFICIENCY
    elif block_m == 256:
        eff *= TWO_WAVE_EFFICIENCY
    return eff


def tile_cost(block_m: int, block_n: int, k: int = 0) -> float:
    cost = max(2 * block_m * block_n / mma_efficiency(block_m, block_n),
               LOAD_WEIGHT * (block_m + block_n))
    # The two accumulators' gain is measured on the whole tile (the model calls 128x128
    # load-bound; it ran faster than that bound with them).
    if use_two_accum(block_m, block_n, k) and k >= TWO_ACCUM_MIN_K:
        cost /= TWO_ACCUM_EFFICIENCY
    return cost


@dataclass(frozen=True)
class DeviceFacts:
    """What the heuristic reads off the device."""

    num_sms: int
    smem_per_block: int  # opt-in dynamic shared memory per block, bytes
    l2_bytes: int

    @staticmethod
    def of(device: torch.device) -> "DeviceFacts":
        from ...layout import get_num_sms

        index = device.index if device.index is not None else torch.cuda.current_device()
        props = _device_props(index)
        return DeviceFacts(get_num_sms(index), props[0], props[1])


@functools.lru_cache(maxsize=None)
def _device_props(index: int) -> tuple[int, int]:
    p = torch.cuda.get_device_properties(index)
    return int(p.shared_memory_per_block_optin), int(p.L2_cache_size)


@dataclass(frozen=True)
class Sm90GemmConfig:
    block_m: int
    block_n: int
    num_stages: int
    num_multicast: int  # CTAs per cluster sharing one TMA load (1 or 2)
    multicast_on_a: bool  # which operand the cluster shares (meaningful when num_multicast == 2)
    band_size: int
    grid: int  # persistent CTAs
    smem: int  # dynamic shared memory, bytes
    num_threads: int
    two_accum: bool = False  # two wgmma accumulators in flight (BLOCK_M 128, BLOCK_N <= 128)

    def __str__(self) -> str:
        mc = "none" if self.num_multicast == 1 else ("A" if self.multicast_on_a else "B")
        return (f"sm90_fp8_gemm_1d2d BLOCK {self.block_m}x{self.block_n}x{BLOCK_K} "
                f"stages={self.num_stages} multicast={mc} grid={self.grid} "
                f"threads={self.num_threads} smem={self.smem // 1024}KB"
                + (" accum=2" if self.two_accum else ""))


def num_threads(block_m: int) -> int:
    """One producer warpgroup and one (BLOCK_M = 64) or two math warpgroups."""
    return 128 + (128 if block_m == 64 else 256)


def smem_bytes(block_m: int, block_n: int, num_stages: int, k: int) -> int:
    """Mirror of Sm90Fp8Gemm1d2dLayout::kSmemBytes (the kernel traps if given less)."""
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + block_m * 4
    sb = align(2 * ceil_div(k, BLOCK_K) * 4, 8)
    return 1024 + block_m * block_n * 2 + num_stages * per_stage + sb + 2 * num_stages * 8


def _stages(block_m: int, block_n: int, k: int, smem_limit: int) -> int:
    for s in range(MAX_STAGES, MIN_STAGES - 1, -1):
        if smem_bytes(block_m, block_n, s, k) <= smem_limit:
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


def candidate_configs(m: int, n: int, k: int, facts: DeviceFacts) -> list[Candidate]:
    """Every tile shape that fits shared memory, with its modelled cost."""
    out = []
    for bm in BLOCK_M_CHOICES:
        if (bm == 128 and m <= 64) or (bm == 256 and m <= 128):
            continue  # a second math warpgroup or wave would only multiply zeros
        for bn in BLOCK_N_CHOICES:
            if bn > align(n, 8) and bn != BLOCK_N_CHOICES[0]:
                continue  # wider than N: only zero columns
            if bm == 256 and bn not in BLOCK_N_CHOICES_256:
                continue
            stages = _stages(bm, bn, k, facts.smem_per_block)
            if stages == 0:
                continue
            tiles = ceil_div(m, bm) * ceil_div(n, bn)
            waves = ceil_div(tiles, facts.num_sms)
            last = tiles - (waves - 1) * facts.num_sms
            # NOTE: rounded, so that tiles the model prices alike tie exactly and the tie-breaks
            # decide (7168 / 0.35 came out 1 ulp under 8192 / 0.4, and 64x56 beat 64x64 on that).
            cost = round(waves * tile_cost(bm, bn, k), 6)
            out.append(Candidate(bm, bn, stages, tiles, waves, last, cost))
    return out


def _rank(c: Candidate) -> tuple:
    # Least modelled time (waves x tile cost: fewest waves for what a tile costs); among equals,
    # fewer tiles (less per-tile overhead: epilogue, pipeline ramp), two math warpgroups, the
    # fullest last wave, then the wider tile.
    return (c.cost, c.tiles, -c.block_m, -c.last_wave, -c.block_n)


@functools.lru_cache(maxsize=4096)
def _select(m: int, n: int, k: int, facts: DeviceFacts) -> Sm90GemmConfig:
    cands = candidate_configs(m, n, k, facts)
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
    grid = min(facts.num_sms, best.tiles)
    grid -= grid % multicast
    return Sm90GemmConfig(block_m=best.block_m, block_n=best.block_n, num_stages=best.num_stages,
                          num_multicast=multicast, multicast_on_a=on_a, band_size=BAND_SIZE,
                          grid=max(grid, multicast),
                          smem=smem_bytes(best.block_m, best.block_n, best.num_stages, k),
                          num_threads=num_threads(best.block_m),
                          two_accum=use_two_accum(best.block_m, best.block_n, k))


def select_config(problem: GemmProblem, facts: DeviceFacts) -> Sm90GemmConfig:
    """The config for a dense problem on a device: pure and cached."""
    return _select(problem.m, problem.n, problem.k, facts)


# --- kernel source ------------------------------------------------------------------------------------
def kernel_source(n: int, k: int, cfg: Sm90GemmConfig) -> tuple[str, str]:
    """(source, name expression) of the kernel instance for (N, K, config)."""
    source = "#include <fp8gemm/sm90_fp8_gemm_1d2d.cuh>\n"
    name = (f"&fp8gemm::sm90_fp8_gemm_1d2d_kernel<{n}, {k}, {cfg.block_m}, {cfg.block_n}, "
            f"{cfg.num_stages}, {cfg.num_multicast}, {'true' if cfg.multicast_on_a else 'false'}, "
            f"{cfg.band_size}, {'true' if cfg.two_accum else 'false'}>")
    return source, name


def compile_kernel(n: int, k: int, cfg: Sm90GemmConfig, compiler: str | None = None):
    """Compile without loading (no GPU needed): (key, CompiledCubin, path, was_cached)."""
    source, name = kernel_source(n, k, cfg)
    return jit.compile_cached(source, name, (str(INCLUDE_DIR),), compiler=compiler)


def build_kernel(n: int, k: int, cfg: Sm90GemmConfig) -> jit.Kernel:
    source, name = kernel_source(n, k, cfg)
    return jit.build(source, name, (str(INCLUDE_DIR),))


# --- launch -------------------------------------------------------------------------------------------
class _Plan:
    """Everything fixed for one (problem, device): config, kernel, launch config, arg packs."""

    __slots__ = ("cfg", "kernel", "launch", "device_index", "m", "n", "k", "num_kb", "packs",
                 "tmaps", "sm_override")

    def __init__(self, problem: GemmProblem, device_index: int,
                 cfg: Sm90GemmConfig | None = None) -> None:
        # The set_num_sms value this plan's grid was chosen under (see _get_plan).
        self.sm_override = _SmCount.override
        if cfg is None:
            cfg = select_config(problem, DeviceFacts.of(torch.device("cuda", device_index)))
        self.cfg = cfg
        self.m, self.n, self.k = problem.m, problem.n, problem.k
        self.num_kb = ceil_div(problem.k, BLOCK_K)
        self.device_index = device_index
        if cfg.num_multicast == 2:
            blocks = (ceil_div(self.n, cfg.block_n) if cfg.multicast_on_a
                      else ceil_div(self.m, cfg.block_m))
            if blocks % 2:
                raise RuntimeError(f"internal: multicast config {cfg} needs an even block count")
        self.kernel = build_kernel(problem.n, problem.k, cfg)
        self.kernel.set_max_dynamic_smem(cfg.smem, device_index)
        self.launch = jit.LaunchConfig((cfg.grid, 1, 1), (cfg.num_threads, 1, 1), cfg.smem,
                                       (cfg.num_multicast, 1, 1))
        self.packs: dict[tuple, jit.ParamPack] = {}
        self.tmaps = jit.TensorMapCache(capacity=512)
        if settings.print_configs:
            print(f"[fp8gemm] cuda: {problem} -> {cfg}", flush=True)

    def params(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               out: torch.Tensor, key: tuple) -> jit.ParamPack:
        cfg, m, n, k = self.cfg, self.m, self.n, self.k
        tm = self.tmaps
        sa_stride = align(m, 4) if self.num_kb == 1 else sa.stride(1)
        # NOTE: a box of min(BLOCK_M, M) rows: the kernel expects exactly these bytes per stage.
        map_a = tm.get(a.dtype, a.data_ptr(), (k, m), (_row_stride(a) * a.element_size(),),
                       (BLOCK_K, min(cfg.block_m, m)), jit.Swizzle.B128)
        map_b = tm.get(b.dtype, b.data_ptr(), (k, n), (_row_stride(b) * b.element_size(),),
                       (BLOCK_K, cfg.block_n), jit.Swizzle.B128)
        map_sa = tm.get(torch.float32, sa.data_ptr(), (m, self.num_kb), (sa_stride * 4,),
                        (cfg.block_m, 1))
        # Output: 64-column chunks with the 128-byte swizzle, then the BLOCK_N % 64 tail plain
        # (the kernel ignores a map it has no columns for).
        d_stride = (_row_stride(out) * out.element_size(),)
        tail = cfg.block_n % 64
        map_d = tm.get(out.dtype, out.data_ptr(), (n, m), d_stride, (64, cfg.block_m),
                       jit.Swizzle.B128) if cfg.block_n >= 64 else None
        map_d_tail = tm.get(out.dtype, out.data_ptr(), (n, m), d_stride, (tail, cfg.block_m)) \
            if tail else None
        pack = jit.ParamPack([ctypes.c_uint64(sb.data_ptr()), ctypes.c_uint32(m),
                              map_a, map_b, map_sa, map_d or map_d_tail, map_d_tail or map_d])
        if len(self.packs) >= 1024:
            self.packs.clear()
        self.packs[key] = pack
        return pack


_plans: dict[tuple, _Plan] = {}


def _row_stride(t: torch.Tensor) -> int:
    """Row stride (elements) of a contiguous 2-D tensor for its tensor map.
    NOTE: torch calls a tensor with one row contiguous whatever its row stride (a [1, K] view of
    a wider buffer, an expanded row: stride 0); TMA reads one row then, so the packed stride is
    used and the descriptor is the same for every such view."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy when its base address is not 16-byte aligned (a contiguous view
    at an odd storage offset): TMA cannot address it, and `supports` sees only the problem, not
    the pointers, so the backend copies (slow but correct, never an error)."""
    return t if t.data_ptr() % TMA_ALIGN == 0 else t.clone(memory_format=torch.contiguous_format)


def _get_plan(problem: GemmProblem, device_index: int) -> _Plan:
    # NOTE: keyed by ints, not the problem: hashing the frozen dataclass costs ~0.5 us per call,
    # and supports() has already fixed every other field (dtypes, recipes: widen the key when
    # supports() takes more than one).
    pkey = (problem.m, problem.n, problem.k, device_index)
    plan = _plans.get(pkey)
    # A plan's grid depends on set_num_sms: rebuild it when the override changed since.
    if plan is None or plan.sm_override != _SmCount.override:
        plan = _plans[pkey] = _Plan(problem, device_index)
    return plan


def _launch(plan: _Plan, device_index: int, pack: jit.ParamPack) -> None:
    """Launch on the current torch stream of the tensors' device."""
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    # NOTE: a CUkernel launched on a special stream (torch's default stream is NULL) runs in the
    # thread's *current* context (cuda.h, cuLaunchKernelEx), not the one of the tensors' device:
    # make that device current when it is not (tensors on cuda:1, current device cuda:0).
    if stream in _SPECIAL_STREAMS and torch._C._cuda_getDevice() != device_index:
        with torch.cuda.device(device_index):
            plan.kernel.launch(plan.launch, stream, pack)
    else:
        plan.kernel.launch(plan.launch, stream, pack)


def _a_scales_strides_ok(sa: torch.Tensor, m: int) -> bool:
    """Whether A scales [M, kb] have the kernel's strides: column-major, column stride a multiple
    of 4 floats (TMA's 16-byte rule)."""
    s0, s1 = sa.stride()
    return (s0 == 1 or m == 1) and (s1 % 4 == 0 and s1 >= m or sa.shape[1] == 1)


def _kernel_a_scales(sa: torch.Tensor, m: int) -> torch.Tensor:
    """A scales [M, kb] in the kernel's layout: its strides (see _a_scales_strides_ok), 16-byte
    aligned base. Returns sa itself when it already is (what quantize_per_token emits), else a
    converted copy."""
    if _a_scales_strides_ok(sa, m) and sa.data_ptr() % TMA_ALIGN == 0:
        return sa
    kb = sa.shape[1]
    buf = torch.empty((kb, align(m, 4)), dtype=torch.float32, device=sa.device)
    out = buf[:, :m].t()
    out.copy_(sa)
    return out


def fp8_gemm_nt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                out: torch.Tensor, problem: GemmProblem) -> None:
    """out[M, N] = (a * sa) @ (b * sb)^T for a problem `supports` accepted; inputs as the backend
    contract hands them over (a, b, out contiguous; scales float32, any strides)."""
    device_index = a.device.index
    plan = _get_plan(problem, device_index)
    sa = _kernel_a_scales(sa, problem.m)
    if not sb.is_contiguous():
        sb = sb.contiguous()
    a_ptr, b_ptr, out_ptr, dst = a.data_ptr(), b.data_ptr(), out.data_ptr(), out
    if (a_ptr | b_ptr | out_ptr) % TMA_ALIGN:
        # A contiguous view at an odd storage offset: TMA cannot address it (slow path, copies).
        a, b = _tma_aligned(a), _tma_aligned(b)
        if out_ptr % TMA_ALIGN:
            dst = torch.empty_like(out, memory_format=torch.contiguous_format)
        a_ptr, b_ptr, out_ptr = a.data_ptr(), b.data_ptr(), dst.data_ptr()
    # NOTE: with a, b and dst contiguous and the plan fixing (M, N, K), these pointers and sa's
    # column stride are all the descriptors depend on (one-row strides: see _row_stride).
    key = (a_ptr, sa.data_ptr(), sa.stride(1), b_ptr, sb.data_ptr(), out_ptr)
    pack = plan.packs.get(key)
    if pack is None:
        pack = plan.params(a, sa, b, sb, dst, key)
    _launch(plan, device_index, pack)
    if dst is not out:
        out.copy_(dst)


class _Launcher:
    """Warm calls of one metadata signature of the ops layer's fast path: every call has the
    metadata (shapes, strides, dtypes, device) of the call the launcher was made for, so only
    data pointers vary. A hit in the plan's argument packs launches at once; anything else
    (new pointers, set_num_sms since) takes `fp8_gemm_nt`, which builds what is missing and
    copies what TMA cannot address."""

    __slots__ = ("problem", "device_index", "sa_stride", "plan")

    def __init__(self, problem: GemmProblem, device_index: int, sa_stride: int) -> None:
        self.problem, self.device_index, self.sa_stride = problem, device_index, sa_stride
        self.plan = _get_plan(problem, device_index)

    def run(self, a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
            out: torch.Tensor, c: None) -> None:
        """c is None: supports() refuses has_c."""
        plan = self.plan
        # NOTE: fp8_gemm_nt's pack key; a hit needs no alignment check, since packs hold only
        # 16-byte aligned pointers (fp8_gemm_nt copies the others) and sa's strides are fixed.
        pack = plan.packs.get((a.data_ptr(), sa.data_ptr(), self.sa_stride, b.data_ptr(),
                               sb.data_ptr(), out.data_ptr()))
        if pack is not None and plan.sm_override == _SmCount.override:
            _launch(plan, self.device_index, pack)
        else:
            fp8_gemm_nt(a, sa, b, sb, out, self.problem)
            self.plan = _get_plan(self.problem, self.device_index)


def launcher(problem: GemmProblem, sa: torch.Tensor, sb: torch.Tensor):
    """`_Launcher.run` for warm calls with contiguous a, b, out and scales with the metadata of
    sa and sb, or None when those scales need converting on every call (the general path)."""
    if not (_a_scales_strides_ok(sa, problem.m) and sb.is_contiguous()):
        return None
    return _Launcher(problem, sa.device.index, sa.stride(1)).run


def supports(problem: GemmProblem) -> str | None:
    """None when this kernel runs the problem, else why not."""
    if problem.kind is not GemmKind.DENSE:
        return f"{problem.kind.value} GEMMs are not implemented in the CUDA backend yet"
    if problem.a_dtype != torch.float8_e4m3fn or problem.b_dtype != torch.float8_e4m3fn:
        return "the sm90 kernel takes e4m3 x e4m3 only"
    if problem.a_recipe is not Recipe.GROUP or problem.b_recipe is not Recipe.BLOCK:
        return "the sm90 kernel takes A 1x128 groups with B 128x128 blocks only"
    if problem.out_dtype != torch.bfloat16:
        return "the sm90 kernel writes bfloat16 only"
    if problem.has_c:
        return "the sm90 kernel has no C accumulator input"
    if problem.k % 16:
        return f"TMA needs K % 16 == 0 (16-byte rows of A and B), got K={problem.k}"
    if problem.n % 8:
        return f"TMA needs N % 8 == 0 (16-byte rows of bf16 output), got N={problem.n}"
    if problem.m == 0 or problem.n == 0 or problem.k == 0:
        return f"nothing to launch for M={problem.m} N={problem.n} K={problem.k}"
    if problem.k > MAX_K:
        return f"the sm90 kernel keeps K/128 B scales on chip: K <= {MAX_K}, got K={problem.k}"
    if problem.m >= 2 ** 31 or problem.n >= 2 ** 31:
        return "dimensions must fit in int32 TMA coordinates"
    return None

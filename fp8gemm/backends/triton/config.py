"""Launch configs for the Triton FP8 GEMM: device facts, a pure heuristic, optional autotuning.

The heuristic is a pure function of (problem, device facts) and is cached; its tests run on the CPU.
Autotuning (FP8GEMM_AUTOTUNE=1) times the heuristic's candidates on the real inputs once per problem
and stores the winner as JSON in FP8GEMM_CACHE_DIR.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import torch
import triton

try:
    import fcntl
except ImportError:  # not POSIX: the autotune file is written without a cross-process lock
    fcntl = None

from ..._files import write_atomic
from ..._settings import settings
from ...layout import _SmCount
from ...problem import GemmKind, GemmProblem, Recipe, ceil_div

__all__ = ["DeviceFacts", "GemmConfig", "device_facts", "candidate_configs", "choose_config",
           "gluon_eligible", "triton_twin", "load_tuned", "store_tuned"]

# Scales are given per 128 of K (1x128 groups, 128x128 blocks); the K tile is one scale block, so
# the partial sum of every tile is promoted to FP32 (and scaled) every 128 of K.
SCALE_BLOCK = 128


@dataclass(frozen=True)
class DeviceFacts:
    """What the heuristic needs to know about the device."""

    name: str
    capability: tuple[int, int]
    num_sms: int
    smem_per_block: int  # bytes a block may use after opting in
    l2_bytes: int
    interpreter: bool = False

    @property
    def has_tma(self) -> bool:
        return self.capability >= (9, 0)


def _tile_side_ok(v: int) -> bool:
    return v >= 16 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemmConfig:
    """One launch of the GEMM kernel: tile, pipeline depth, split of K, grid size."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # m tiles per L2 group of the tile order
    split_k: int  # K ranges per output tile (dense only); partial sums reduced in a fixed order
    num_stages: int
    num_warps: int
    use_tma: bool  # tensor descriptors for the A and B loads (sm_90+, 16-byte aligned rows)
    num_programs: int  # persistent grid size cap (programs loop over tiles)
    flatten: bool = False  # dense: one software pipeline across tiles (tl.range(flatten=True))
    gluon: bool = False  # dense A 1x128 x B 128x128 on sm_90: the Gluon kernel (gluon_fp8_gemm)

    def __post_init__(self) -> None:
        # NOTE: the kernel indexes K-varying scales by K tile, so a K tile must be one scale
        # block; tile sides are powers of two of at least 16 (tl.dot, tl.arange).
        bad = [f"{name}={getattr(self, name)}" for name, ok in (
            ("block_m", _tile_side_ok(self.block_m)), ("block_n", _tile_side_ok(self.block_n)),
            ("block_k", self.block_k == SCALE_BLOCK), ("group_m", self.group_m >= 1),
            ("split_k", self.split_k >= 1), ("num_stages", self.num_stages >= 1),
            ("num_warps", self.num_warps in (1, 2, 4, 8, 16)),
            ("num_programs", self.num_programs >= 1),
            ("gluon", not self.gluon or (self.block_m, self.block_n, self.num_warps,
                                         self.split_k) == (128, 128, 8, 1))) if not ok]
        if bad:
            raise ValueError(f"invalid GemmConfig ({', '.join(bad)}): tiles must be powers of two "
                             f">= 16 with BLOCK_K = {SCALE_BLOCK}, counts positive")

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
                f"GROUP_M={self.group_m} SPLIT_K={self.split_k} stages={self.num_stages} "
                f"warps={self.num_warps} tma={int(self.use_tma)} programs={self.num_programs}"
                f"{' flat' if self.flatten else ''}{' gluon' if self.gluon else ''}")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "GemmConfig":
        names = {f.name for f in fields(GemmConfig)}
        required = {f.name for f in fields(GemmConfig) if f.default is MISSING}
        if not required <= set(d) <= names:
            raise ValueError(f"config fields must be {sorted(names)}, got {sorted(d)}")
        return GemmConfig(**{k: (bool(v) if k in ("use_tma", "flatten", "gluon") else int(v))
                            for k, v in d.items()})


_INTERPRETER_FACTS = DeviceFacts("triton-interpreter", (9, 0), 4, 227 * 1024, 32 << 20, True)


def device_facts(device: torch.device) -> DeviceFacts:
    """Facts of a CUDA device read from the driver; fixed small facts for the CPU interpreter."""
    if device.type != "cuda":
        return _INTERPRETER_FACTS
    facts = _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())
    cap = _SmCount.override  # set_num_sms(n): persistent kernels use at most n SMs
    if cap is not None and cap < facts.num_sms:
        facts = _capped(facts, cap)
    return facts


@functools.lru_cache(maxsize=64)
def _capped(facts: DeviceFacts, num_sms: int) -> DeviceFacts:
    return replace(facts, num_sms=num_sms)  # once per cap, not per call


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or 99 * 1024
    return DeviceFacts(p.name, (p.major, p.minor), p.multi_processor_count, int(smem),
                       int(getattr(p, "L2_cache_size", 0) or 0))


def _rows_per_group(problem: GemmProblem) -> int:
    if problem.kind is GemmKind.DENSE:
        return problem.m
    if problem.kind is GemmKind.MASKED:
        return max(1, min(problem.expected_m or problem.m, problem.m))
    return max(1, problem.m // max(1, problem.groups))


def _stages(block_m: int, block_n: int, block_k: int, facts: DeviceFacts, cap: int) -> int:
    # NOTE: each stage holds one A and one B tile in shared memory (1 byte an element); keep
    # 32 KB for the epilogue's layout conversion and the compiler's own scratch.
    per_stage = (block_m + block_n) * block_k
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
_LARGE_TILE = _Tile(128, 128, 8, 5, 35e9)
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


@functools.lru_cache(maxsize=None)
def _has_gluon() -> bool:
    try:
        from . import gluon_fp8_gemm  # noqa: F401
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    return True


def gluon_eligible(problem: GemmProblem, facts: DeviceFacts) -> bool:
    """Whether the Gluon kernel takes `problem`: sm_90, dense, contiguous or masked, A 1x128 x
    B 128x128, no C, rows of A, B (K % 16 == 0) and out (16-byte multiples) fit TMA."""
    out_bytes = problem.out_dtype.itemsize
    return (facts.capability == (9, 0) and not facts.interpreter
            and problem.kind is not GemmKind.OFFSETS and not problem.has_c
            and problem.a_recipe is Recipe.GROUP and problem.b_recipe is Recipe.BLOCK
            and problem.k % 16 == 0 and problem.n * out_bytes % 16 == 0 and _has_gluon())


def _gluon_config(problem: GemmProblem, facts: DeviceFacts) -> GemmConfig:
    # NOTE: 128x128 tiles with two accumulators per consumer warpgroup (3 x 64 FP32 registers a
    # thread); stages as deep as shared memory allows next to the epilogue tile.
    epilogue = 128 * 128 * problem.out_dtype.itemsize
    stages = max(2, min(6, (facts.smem_per_block - epilogue - 1024) // (2 * 128 * SCALE_BLOCK)))
    tiles = _output_tiles(problem, 128, 128)
    return GemmConfig(128, 128, SCALE_BLOCK, 8, 1, stages, 8, True,
                      max(1, min(tiles, facts.num_sms)), False, True)


def triton_twin(cfg: GemmConfig) -> GemmConfig:
    """The Triton kernel's config with a Gluon config's tile and grid (its pipeline depth capped
    where the Triton kernel's epilogue needs shared memory too)."""
    return replace(cfg, gluon=False, num_stages=min(cfg.num_stages, _LARGE_TILE.max_stages))


@functools.lru_cache(maxsize=4096)
def choose_config(problem: GemmProblem, facts: DeviceFacts) -> GemmConfig:
    """The heuristic config. Small M (memory bound): the tile and split-K that minimise the
    modelled streaming time (fill the SMs in one wave, the fewest splits that do). Large M
    (tensor-core bound): 128x128 tiles, or 128x64 with two programs per SM for narrow N / short
    K. Dense GEMMs with few K tiles (<= 16 at small M, <= 4 at large M) run the tile and K loops
    as one flattened pipeline (the next tile's loads overlap this tile's epilogue). Pipelines
    as deep as shared memory allows. Large-M dense, contiguous and masked GEMMs of the
    fine-grained recipe on sm_90 take the Gluon kernel (MMA and promotion overlap within a
    warpgroup)."""
    rows = _rows_per_group(problem)
    gluon = rows > 128 and gluon_eligible(problem, facts)
    k_blocks = ceil_div(problem.k, SCALE_BLOCK)
    use_tma = facts.has_tma and not facts.interpreter and problem.k % 16 == 0
    dense = problem.kind is GemmKind.DENSE
    split = 1
    if rows > 128:
        narrow = problem.n <= 2304 or problem.k <= 2048
        tile = _LARGE_TILE_NARROW if narrow else _LARGE_TILE
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
    cfg = _make_config(problem, facts, tile, split, flatten, use_tma)
    if gluon:
        glu = _gluon_config(problem, facts)
        if glu.num_programs < facts.num_sms:
            # NOTE: one partial wave: time is one tile's latency, lower in the Gluon kernel
            # except for short K, where its fixed cost (warp specialisation, descriptors)
            # shows (H200: 130x576x7168 29 vs 38 us; 130x576x320 8.1 vs 6.6 us)
            use = k_blocks > 4
        else:
            use = (_wave_work(problem, facts, glu) / _GLUON_SPEEDUP
                   <= _wave_work(problem, facts, cfg))
        if use:
            return glu
    return cfg


# Measured on an H200 (DeepSeek-V3 shapes, M = 4096, full waves): the Gluon kernel computes a
# 128x128 tile 1.2-1.35x as fast as the Triton kernel's large-M configs.
_GLUON_SPEEDUP = 1.25


def _wave_work(problem: GemmProblem, facts: DeviceFacts, cfg: GemmConfig) -> float:
    """Output elements an SM computes over all waves of a large-M launch (wave quantisation:
    a last wave that fills few SMs costs a whole wave)."""
    tiles = _output_tiles(problem, cfg.block_m, cfg.block_n)
    per_sm = max(1, cfg.num_programs // facts.num_sms)
    return ceil_div(tiles, per_sm * facts.num_sms) * per_sm * cfg.block_m * cfg.block_n


def _output_tiles(problem: GemmProblem, block_m: int, block_n: int) -> int:
    """Output tiles of a launch: masked [G, Mmax] rows tile per group; offsets have at most one
    partly filled m tile per group more than their rows."""
    m_tiles = ceil_div(problem.m, block_m)
    if problem.kind is GemmKind.MASKED:
        m_tiles *= problem.groups
    elif problem.kind is GemmKind.OFFSETS:
        m_tiles += problem.groups
    return m_tiles * ceil_div(problem.n, block_n)


def _make_config(problem: GemmProblem, facts: DeviceFacts, tile: _Tile, split: int, flatten: bool,
                 use_tma: bool, stages: int | None = None) -> GemmConfig:
    """The config of one tile choice: pipeline depth, programs per SM and the persistent grid."""
    bm, bn = tile.block_m, tile.block_n
    if stages is None:
        stages = _stages(bm, bn, SCALE_BLOCK, facts, cap=tile.max_stages)
    per_sm = _programs_per_sm(tile, stages, facts)
    tiles = _output_tiles(problem, bm, bn) * split
    programs = max(1, min(tiles, per_sm * facts.num_sms))
    return GemmConfig(bm, bn, SCALE_BLOCK, 8, split, stages, tile.num_warps, use_tma, programs,
                      flatten and problem.kind is GemmKind.DENSE)


def candidate_configs(problem: GemmProblem, facts: DeviceFacts) -> list[GemmConfig]:
    """Configs the autotuner times: the heuristic's choice first, then the other tiles, even
    K splits (dense), one stage fewer, the Triton kernel in place of the Gluon one, the
    flattened pipeline on and off, and pointer loads."""
    base = choose_config(problem, facts)
    out = [base]

    def add(cfg: GemmConfig) -> None:
        if cfg not in out:
            out.append(cfg)

    dense = problem.kind is GemmKind.DENSE
    k_blocks = ceil_div(problem.k, SCALE_BLOCK)
    splits = [s for s in (1, 2, 3, 4, 6, 7, 8) if _valid_split(k_blocks, s)] if dense else [1]
    for tile in _SMALL_TILES + (_LARGE_TILE, _LARGE_TILE_NARROW):
        for split in splits:
            ctas = ceil_div(problem.m, tile.block_m) * ceil_div(problem.n, tile.block_n) * split
            if split > 1 and not facts.num_sms // 2 <= ctas <= 2 * facts.num_sms:
                continue  # splits only to fill the SMs about once
            add(_make_config(problem, facts, tile, split, base.flatten, base.use_tma))
    if base.num_stages > 2:
        add(replace(base, num_stages=base.num_stages - 1))
    base = triton_twin(base) if base.gluon else base  # the variants below: Triton kernel
    add(base)
    if dense and base.split_k == 1:
        add(replace(base, flatten=not base.flatten))
    if base.use_tma:
        add(replace(base, use_tma=False))
    return out


# --------------------------------------------------------------------------------------------
# Autotune cache: {"<device>|sm<cc>|<SMs> SMs|triton <version>|<problem>": {config fields}} in
# one JSON file per cache directory.

_tuned_lock = threading.Lock()
_tuned: dict[str, dict[str, dict]] | None = None  # cache file path -> its entries, as last read


def _cache_file() -> Path:
    return settings.cache_dir / "triton_autotune.json"


def _key(problem: GemmProblem, facts: DeviceFacts) -> str:
    # NOTE: the SM count is part of the key: set_num_sms caps it, and a config's persistent grid
    # (num_programs) is sized for it.
    return (f"{facts.name}|sm{facts.capability[0]}{facts.capability[1]}|{facts.num_sms} SMs|"
            f"triton {triton.__version__}|{problem}")


def _read_file(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tuned(problem: GemmProblem, facts: DeviceFacts) -> GemmConfig | None:
    """The stored config of `problem` on this device, or None. A miss re-reads the file (another
    process may have tuned the problem since); invalid entries count as misses."""
    global _tuned
    key, path = _key(problem, facts), _cache_file()
    with _tuned_lock:
        if _tuned is None:
            _tuned = {}
        entries = _tuned.get(str(path))
        if entries is None or key not in entries:
            entries = _tuned[str(path)] = _read_file(path)
        d = entries.get(key)
    if d is None:
        return None
    try:
        return GemmConfig.from_json(d)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on `path` + ".lock" across processes (POSIX; elsewhere none)."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def store_tuned(problem: GemmProblem, facts: DeviceFacts, cfg: GemmConfig) -> None:
    """Merge one entry into the JSON file: read, merge and write (atomically: temp file + rename)
    under a lock file, so concurrent processes keep each other's entries."""
    global _tuned
    path = _cache_file()
    with _tuned_lock, _file_lock(path):
        current = _read_file(path)
        current[_key(problem, facts)] = cfg.to_json()
        write_atomic(path, json.dumps(current, indent=1, sort_keys=True).encode())
        if _tuned is None:
            _tuned = {}
        _tuned[str(path)] = current

"""Launch configs for the Triton FP8 GEMM: device facts, a pure heuristic, optional autotuning.

The heuristic is a pure function of (problem, device facts) and is cached; its tests run on the CPU.
Autotuning (FP8GEMM_AUTOTUNE=1) times the heuristic's candidates on the real inputs once per problem
and stores the winner as JSON in FP8GEMM_CACHE_DIR.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass, fields

import torch

from ..._settings import settings
from ...problem import GemmKind, GemmProblem, Recipe, ceil_div

__all__ = ["DeviceFacts", "GemmConfig", "device_facts", "candidate_configs", "choose_config",
           "load_tuned", "store_tuned"]

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

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
                f"GROUP_M={self.group_m} SPLIT_K={self.split_k} stages={self.num_stages} "
                f"warps={self.num_warps} tma={int(self.use_tma)} programs={self.num_programs}")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "GemmConfig":
        names = {f.name for f in fields(GemmConfig)}
        if set(d) != names:
            raise ValueError(f"config fields must be {sorted(names)}, got {sorted(d)}")
        return GemmConfig(**{k: (bool(v) if k == "use_tma" else int(v)) for k, v in d.items()})


_INTERPRETER_FACTS = DeviceFacts("triton-interpreter", (9, 0), 4, 227 * 1024, 32 << 20, True)


def device_facts(device: torch.device) -> DeviceFacts:
    """Facts of a CUDA device read from the driver; fixed small facts for the CPU interpreter."""
    if device.type != "cuda":
        return _INTERPRETER_FACTS
    return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or 99 * 1024
    return DeviceFacts(p.name, (p.major, p.minor), p.multi_processor_count, int(smem),
                       int(getattr(p, "L2_cache_size", 0) or 0))


def _is_fine(problem: GemmProblem) -> bool:
    return problem.a_recipe is Recipe.GROUP or problem.b_recipe in (Recipe.BLOCK, Recipe.GROUP)


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


def _estimate_us(problem: GemmProblem, facts: DeviceFacts, bm: int, bn: int, split: int) -> float:
    """A rough time model used only to rank tile shapes and splits: waves of tiles, each tile as
    slow as the slower of its tensor-core work and its share of memory bandwidth, plus the split-K
    workspace round trip and a second launch."""
    m, n, k = problem.m, problem.n, problem.k
    tiles = ceil_div(m, bm) * ceil_div(n, bn) * split
    active = min(tiles, facts.num_sms)
    waves = ceil_div(tiles, facts.num_sms)
    k_per_tile = ceil_div(ceil_div(k, SCALE_BLOCK), split) * SCALE_BLOCK
    # per SM: ~6 dense FP8 TFLOP/s with promotion; bandwidth shared by the active SMs, at most
    # ~60 GB/s for one SM.
    flop_us = 2.0 * bm * bn * k_per_tile / 6.0e12 * 1e6
    bw_per_sm = min(3.6e12 / active, 60e9)
    byte_us = (bm + bn) * k_per_tile / bw_per_sm * 1e6
    t = waves * (max(flop_us, byte_us) + 0.6)  # 0.6 us: prologue/epilogue of one tile
    if split > 1:
        t += 2.0 * split * m * n * 4 / 3.0e12 * 1e6 + 2.5
    return t


@functools.lru_cache(maxsize=4096)
def choose_config(problem: GemmProblem, facts: DeviceFacts) -> GemmConfig:
    """The heuristic config. Optimises, for the tile shapes the kernel runs well (128x128 with
    two warpgroups, 64xN with one), the modelled time: full waves over the SMs, split-K only when
    the output tiles alone leave most SMs idle (small M), and the deepest pipeline that fits."""
    rows = _rows_per_group(problem)
    bk = SCALE_BLOCK
    use_tma = facts.has_tma and not facts.interpreter and problem.k % 16 == 0
    if rows <= 64:
        bm, warps = 64, 4
    else:
        bm, warps = 128, 8
    bn = 128
    split = 1
    if problem.kind is GemmKind.DENSE:
        k_blocks = ceil_div(problem.k, bk)
        best = None
        for cand_bn in (64, 128):
            for cand_split in range(1, min(16, k_blocks) + 1):
                if cand_split > 1 and ceil_div(k_blocks, cand_split) < 2:
                    break
                # no empty K ranges
                if cand_split > 1 and ceil_div(k_blocks, ceil_div(k_blocks, cand_split)) != cand_split:
                    continue
                t = _estimate_us(problem, facts, bm, cand_bn, cand_split)
                if best is None or t < best[0] * 0.97:
                    best = (t, cand_bn, cand_split)
        _, bn, split = best
    stages = _stages(bm, bn, bk, facts, cap=6 if bm == 64 else 4)
    group_m = 8
    if problem.kind is GemmKind.DENSE:
        tiles = ceil_div(problem.m, bm) * ceil_div(problem.n, bn) * split
    else:
        # offsets and masked: at most one partly filled m tile per group
        m_tiles = ceil_div(problem.m, bm) + (problem.groups if problem.kind is GemmKind.OFFSETS else 0)
        if problem.kind is GemmKind.MASKED:
            m_tiles = problem.groups * ceil_div(problem.m, bm)
        tiles = m_tiles * ceil_div(problem.n, bn)
    programs = max(1, min(tiles, facts.num_sms))
    return GemmConfig(bm, bn, bk, group_m, split, stages, warps, use_tma, programs)


def candidate_configs(problem: GemmProblem, facts: DeviceFacts) -> list[GemmConfig]:
    """Configs the autotuner times: the heuristic's choice first, then tile, split and depth
    variations around it."""
    base = choose_config(problem, facts)
    out = [base]

    def add(**kw):
        cfg = GemmConfig(**{**asdict(base), **kw})
        if cfg not in out:
            out.append(cfg)

    for bm, warps in ((64, 4), (128, 8)):
        for bn in (64, 128):
            if bm == base.block_m and bn == base.block_n:
                continue
            add(block_m=bm, block_n=bn, num_warps=warps,
                num_stages=_stages(bm, bn, base.block_k, facts, cap=6 if bm == 64 else 4))
    if problem.kind is GemmKind.DENSE:
        k_blocks = ceil_div(problem.k, base.block_k)
        for split in (1, 2, 4, 8):
            if split != base.split_k and ceil_div(k_blocks, split) >= 2:
                add(split_k=split)
    for stages in (3, base.num_stages + 1):
        if stages != base.num_stages and stages >= 2:
            cap = _stages(base.block_m, base.block_n, base.block_k, facts, cap=8)
            if stages <= cap:
                add(num_stages=stages)
    if base.use_tma:
        add(use_tma=False)
    return out


# --------------------------------------------------------------------------------------------
# Autotune cache: {"<device name>|triton <version>|<problem>": {config fields}} in one JSON file.

_tuned_lock = threading.Lock()
_tuned: dict[str, dict] | None = None


def _cache_file():
    return settings.cache_dir / "triton_autotune.json"


def _key(problem: GemmProblem, facts: DeviceFacts) -> str:
    import triton

    return f"{facts.name}|sm{facts.capability[0]}{facts.capability[1]}|triton {triton.__version__}|{problem}"


def _read_all() -> dict[str, dict]:
    global _tuned
    if _tuned is None:
        try:
            data = json.loads(_cache_file().read_text())
            _tuned = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _tuned = {}
    return _tuned


def load_tuned(problem: GemmProblem, facts: DeviceFacts) -> GemmConfig | None:
    with _tuned_lock:
        d = _read_all().get(_key(problem, facts))
    if d is None:
        return None
    try:
        return GemmConfig.from_json(d)
    except (TypeError, ValueError):
        return None


def store_tuned(problem: GemmProblem, facts: DeviceFacts, cfg: GemmConfig) -> None:
    """Merge one entry into the JSON file; written atomically (temp file + rename), re-reading the
    file first so concurrent processes lose at most their own last entry."""
    global _tuned
    with _tuned_lock:
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            current = json.loads(path.read_text())
            if not isinstance(current, dict):
                current = {}
        except (OSError, ValueError):
            current = {}
        current[_key(problem, facts)] = cfg.to_json()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".triton_autotune.", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(current, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _tuned = current

"""The CUDA kernels' tile schedulers (sm90_scheduler.cuh), run on the CPU.

The header itself is compiled with g++ beside host stand-ins for the few device functions it
calls (tests/scheduler_sim: a warp is 32 threads, warp collectives meet at a barrier, every global
read is bounds-checked), and every CTA's walk is compared, tile by tile, with the order and the
fields that the schedulers document, built here from the layouts independently: dense and split-K
bands, the contiguous layout's padding skip, several groups in a block and 2-CTA pairs, offsets and
masked groups with out-of-range values clamped, and the k-grouped weight gradient's k-block
offsets. No GPU needed; the same header is what the kernels compile.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "fp8gemm" / "backends" / "cuda" / "include" / "fp8gemm" / "sm90_scheduler.cuh"
SIM = Path(__file__).resolve().parent / "scheduler_sim"

DENSE, CONTIGUOUS, OFFSETS, MASKED = 0, 1, 2, 3
_KIND_NAMES = {DENSE: "kKindDense", CONTIGUOUS: "kKindContiguous", OFFSETS: "kKindOffsets",
               MASKED: "kKindMasked"}


@dataclass(frozen=True)
class Sched:
    kind: int
    block_m: int
    n_blocks: int
    band: int
    along_m: bool = False
    splits: int = 1
    pairs: bool = False


@dataclass(frozen=True)
class Walk1d1d:
    k_grouped: bool
    block_m: int
    n_blocks: int
    band: int


CONFIGS = [
    Sched(DENSE, 128, 5, 3),
    Sched(DENSE, 64, 7, 4, along_m=True),
    Sched(DENSE, 256, 4, 16),
    Sched(DENSE, 128, 3, 2, splits=3),
    Sched(DENSE, 64, 38, 16, splits=2),
    Sched(CONTIGUOUS, 128, 5, 4, along_m=True),
    Sched(CONTIGUOUS, 256, 3, 16),
    Sched(CONTIGUOUS, 64, 6, 3),
    Sched(CONTIGUOUS, 128, 38, 16),
    Sched(CONTIGUOUS, 128, 5, 4, along_m=True, pairs=True),
    Sched(CONTIGUOUS, 64, 3, 6, along_m=True, pairs=True),
    Sched(OFFSETS, 128, 5, 4, along_m=True),
    Sched(OFFSETS, 256, 3, 16),
    Sched(OFFSETS, 64, 7, 3),
    Sched(MASKED, 128, 4, 16),
    Sched(MASKED, 64, 7, 3, along_m=True),
    Walk1d1d(False, 128, 5, 4),
    Walk1d1d(True, 128, 5, 4),
    Walk1d1d(True, 64, 3, 16),
]


def _config_line(i: int, c) -> str:
    b = {True: "true", False: "false"}
    if isinstance(c, Walk1d1d):
        return f"WALK1D1D({i}, {b[c.k_grouped]}, {c.block_m}, {c.n_blocks}, {c.band})"
    return (f"SCHED({i}, {_KIND_NAMES[c.kind]}, {c.block_m}, {c.n_blocks}, {c.band}, "
            f"{b[c.along_m]}, {c.splits}, {b[c.pairs]})")


@pytest.fixture(scope="module")
def walker(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (C++20) to build the scheduler simulation")
    d = tmp_path_factory.mktemp("scheduler_sim")
    for f in SIM.iterdir():
        shutil.copy(f, d / f.name)
    shutil.copy(HEADER, d / HEADER.name)  # beside the stand-in sm90_utils.cuh it includes
    (d / "configs.inc").write_text("\n".join(_config_line(i, c) for i, c in enumerate(CONFIGS))
                                   + "\n")
    exe = d / "walk"
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-Wall",
                            "-Wno-unknown-pragmas", "-o", str(exe), str(d / "walk.cpp")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]

    def run(cfg, grid: int, shape_m: int, array=(), num_groups: int = 0, shape_k: int = 0):
        stdin = " ".join(str(v) for v in (CONFIGS.index(cfg), grid, shape_m, shape_k, num_groups,
                                          len(array), *array))
        p = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
        tiles: list[list[tuple]] = [[] for _ in range(grid)]
        for line in p.stdout.splitlines():
            v = tuple(int(x) for x in line.split())
            tiles[v[0]].append(v[1:])
        return tiles

    return run


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def band_order(num_banded: int, num_other: int, band: int) -> list[tuple[int, int]]:
    """(banded, other) of tile t, t = 0, 1, ...: bands of `band` blocks of the banded side, that
    side fastest inside a band, every block of the other side in each band."""
    order = []
    for first in range(0, num_banded, band):
        for other in range(num_other):
            for banded in range(first, min(first + band, num_banded)):
                order.append((banded, other))
    return order


def mn_order(c: Sched | Walk1d1d, num_m: int) -> list[tuple[int, int]]:
    """(m_block, n_block) of tile t of a num_m x n_blocks grid."""
    if getattr(c, "along_m", False):
        return band_order(num_m, c.n_blocks, c.band)
    return [(m, n) for n, m in band_order(c.n_blocks, num_m, c.band)]


def per_cta(seq: list, grid: int) -> list[list]:
    return [seq[b::grid] for b in range(grid)]


# --- dense ---------------------------------------------------------------------------------------
def expected_dense(c: Sched, grid: int, m: int) -> list[list[tuple]]:
    """Split-K: each tile's parts as consecutive items (split = the part, last = the tile's
    index in the walk)."""
    seq = []
    for t in range(ceil_div(m, c.block_m) * c.n_blocks * c.splits):
        mb, nb = mn_order(c, ceil_div(m, c.block_m))[t // c.splits]
        m0 = mb * c.block_m
        split, part_tile = (t % c.splits, t // c.splits) if c.splits > 1 else (0, 0)
        seq.append((m0, m0, nb, 0, c.block_m, 1, int(m <= c.block_m), 3, split, part_tile))
    return per_cta(seq, grid)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if isinstance(c, Sched) and c.kind == DENSE],
                         ids=str)
@pytest.mark.parametrize("m,grid", [(1, 7), (128, 132), (1000, 7), (4096, 132), (5000, 29),
                                    (300, 1000)])
def test_dense_walk(walker, cfg, m, grid):
    assert walker(cfg, grid, m) == expected_dense(cfg, grid, m)


# --- contiguous ----------------------------------------------------------------------------------
def contiguous_layout(rng: random.Random, sizes: list[int], align: int) -> list[int]:
    """m_indices: each group's rows, then -1 padding up to a multiple of `align` (0: a random
    run of 0-300 rows, so that blocks also start in padding)."""
    idx = []
    for g, s in enumerate(sizes):
        idx += [g] * s + [-1] * ((-s) % align if align else rng.randrange(301))
    return idx


def skewed_sizes(rng: random.Random, groups: int, mean: int) -> list[int]:
    """Expert sizes from a heavy-tailed draw, some experts empty."""
    return [0 if rng.random() < 0.15 else int(rng.paretovariate(1.5) * mean / 3)
            for _ in range(groups)]


def valid_group(v: int, groups: int) -> int:
    return v if 0 <= v < groups else -1


def block_groups(layout: list[int], m0: int, block_m: int, groups: int):
    """(sorted groups of the block's rows, each one's halves: bit h for rows in half h, the
    block uniform)."""
    rows = layout[m0:m0 + block_m]
    gs = [valid_group(v, groups) for v in rows]
    present = sorted({g for g in gs if g >= 0})
    if not present:
        return [], [], False
    half = block_m // 2
    halves = [int(g in gs[:half]) | 2 * int(g in gs[half:]) for g in present]
    uniform = all(g == present[0] for g in gs)
    return present, halves, uniform


def tile_fields(layout, m0, c: Sched, groups):
    """The block's groups, each one's halves, and full of the first group's tile: a block whose
    first and last rows are one group is taken whole (the rows of a group are consecutive)."""
    present, halves, uniform = block_groups(layout, m0, c.block_m, groups)
    m = len(layout)
    first = valid_group(layout[m0], groups) if m0 < m else -1
    last = valid_group(layout[min(m0 + c.block_m, m) - 1], groups)
    if first >= 0 and first == last:
        return present, [3], True
    return present, halves, uniform


def expected_contiguous(c: Sched, grid: int, layout: list[int], groups: int):
    m = len(layout)
    order = mn_order(c, ceil_div(m, c.block_m))
    out = []
    for b in range(grid):
        tiles = []
        for mb, nb in order[b::grid]:
            m0 = mb * c.block_m
            present, halves, full = tile_fields(layout, m0, c, groups)
            for i, g in enumerate(present):
                tiles.append((m0, m0, nb, g, c.block_m, int(full and i == 0), 0, halves[i], 0, 0))
        out.append(tiles)
    return out


def expected_pairs(c: Sched, grid: int, layout: list[int], groups: int):
    m = len(layout)
    num_pairs = ceil_div(ceil_div(m, c.block_m), 2)
    order = band_order(num_pairs, c.n_blocks, c.band // 2)
    out = [[] for _ in range(grid)]
    for cluster in range(grid // 2):
        for pair, nb in order[cluster::grid // 2]:
            walks = []
            for rank in range(2):
                m0 = (2 * pair + rank) * c.block_m
                present, halves, full = tile_fields(layout, m0, c, groups)
                walks.append([(g, halves[i], full and i == 0) for i, g in enumerate(present)])
            for step in range(max(len(w) for w in walks)):
                for rank in range(2):
                    own, peer = walks[rank], walks[rank ^ 1]
                    m0 = (2 * pair + rank) * c.block_m
                    if step < len(own):
                        g, halves, full = own[step]
                        multicast = int(step < len(peer) and peer[step][0] == g)
                        tile = (m0, m0, nb, g, c.block_m, int(full), 0, halves, 0, multicast)
                    else:  # an empty tile, on the peer's group
                        tile = (m0, m0, nb, peer[step][0], c.block_m, 0, 0, 0, 0, 0)
                    out[2 * cluster + rank].append(tile)
    return out


CONTIGUOUS_CFGS = [c for c in CONFIGS if isinstance(c, Sched) and c.kind == CONTIGUOUS]


@pytest.mark.parametrize("cfg", CONTIGUOUS_CFGS, ids=str)
@pytest.mark.parametrize("groups,mean,align,grid,seed", [
    (1, 1000, 128, 8, 0), (4, 300, 128, 7, 1), (8, 700, 128, 132, 2), (32, 200, 128, 132, 3),
    (5, 90, 1, 6, 4), (9, 150, 8, 10, 5), (3, 2, 1, 4, 6), (17, 500, 64, 132, 7),
    (12, 100, 0, 9, 8), (30, 40, 0, 132, 9)])
def test_contiguous_walk(walker, cfg, groups, mean, align, grid, seed):
    rng = random.Random(seed)
    layout = contiguous_layout(rng, skewed_sizes(rng, groups, mean), align)
    if not layout:
        layout = [-1]
    if cfg.pairs:
        grid -= grid % 2  # (clusters of two CTAs)
    want = (expected_pairs if cfg.pairs else expected_contiguous)(cfg, grid, layout, groups)
    assert walker(cfg, grid, len(layout), layout, groups) == want


@pytest.mark.parametrize("groups", [8, 32])
def test_contiguous_walk_bench_layout(walker, groups):
    """The moe-skewed suite's expert sizes, padded as the ops pad them, in 128x192 tiles on
    N = 7168 (38 n-blocks, bands of 16) over 132 CTAs: the benchmark's own walk."""
    from fp8gemm.bench.suites import skewed_sizes as suite_sizes
    from fp8gemm.layout import CONTIGUOUS_M_ALIGNMENT
    cfg = Sched(CONTIGUOUS, 128, 38, 16)
    layout = contiguous_layout(random.Random(0), list(suite_sizes(groups * 1024, groups)),
                               CONTIGUOUS_M_ALIGNMENT)
    assert walker(cfg, 132, len(layout), layout, groups) == expected_contiguous(cfg, 132, layout,
                                                                                 groups)


@pytest.mark.parametrize("cfg", CONTIGUOUS_CFGS, ids=str)
def test_contiguous_padding_only(walker, cfg):
    """Blocks of padding are skipped: a layout of padding alone has no tiles."""
    assert walker(cfg, 8, 640, [-1] * 640, 4) == [[] for _ in range(8)]


@pytest.mark.parametrize("cfg", CONTIGUOUS_CFGS, ids=str)
def test_contiguous_bad_ids(walker, cfg):
    """Out-of-range ids (values unchecked on the host) are padding: never a group, never read
    past the layout (the simulation exits on any read outside it)."""
    rng = random.Random(11)
    groups = 6
    layout = contiguous_layout(rng, skewed_sizes(rng, groups, 400), 128)
    for i in rng.sample(range(len(layout)), len(layout) // 5):
        layout[i] = rng.choice([groups, groups + 3, -2, -(2 ** 31), 2 ** 31 - 1])
    tiles = walker(cfg, 10, len(layout), layout, groups)
    for cta in tiles:
        for m0, _, nb, g, _, _, _, halves, _, _ in cta:
            # (pairs: an empty tile may sit past the last block, as the peer's partner)
            assert 0 <= g < groups and 0 <= nb < cfg.n_blocks
            assert 0 <= m0 < len(layout) or halves == 0
    if not cfg.pairs:
        # every valid row still computed in its group's tile of every n-block
        got = {(m0, nb, g) for cta in tiles for m0, _, nb, g, *_ in cta}
        for row, v in enumerate(layout):
            if 0 <= v < groups:
                m0 = row // cfg.block_m * cfg.block_m
                assert all((m0, nb, v) in got for nb in range(cfg.n_blocks))


# --- offsets and masked --------------------------------------------------------------------------
def expected_grouped(c: Sched, grid: int, bounds: list[tuple[int, int]], shape_m: int):
    """bounds: each group's (first row in the 2-D view, rows), clamped."""
    seq = []
    for g, (row0, rows) in enumerate(bounds):
        num_m = ceil_div(rows, c.block_m)
        for mb, nb in mn_order(c, num_m):
            r = mb * c.block_m
            n = min(rows - r, c.block_m)
            sa_m = r if c.kind == MASKED else row0 + r
            seq.append((row0 + r, sa_m, nb, g, n, int(n == c.block_m), int(rows <= c.block_m),
                        3 if n > c.block_m // 2 else 1, 0, 0))
    return per_cta(seq, grid)


def clamp_offsets(offsets: list[int], m: int) -> list[tuple[int, int]]:
    """Group g's rows [lo, hi): offsets[g] clamped to [0, M], offsets[g + 1] to [lo, M]."""
    out = []
    for g in range(len(offsets) - 1):
        lo = min(max(offsets[g], 0), m)
        hi = min(max(offsets[g + 1], lo), m)
        out.append((lo, hi - lo))
    return out


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if isinstance(c, Sched) and c.kind == OFFSETS],
                         ids=str)
@pytest.mark.parametrize("groups,mean,grid,seed", [(1, 1000, 8, 0), (4, 300, 7, 1),
                                                   (8, 700, 132, 2), (32, 200, 132, 3),
                                                   (40, 3, 5, 4)])
def test_offsets_walk(walker, cfg, groups, mean, grid, seed):
    rng = random.Random(seed)
    sizes = skewed_sizes(rng, groups, mean)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    m = max(offsets[-1], 1)
    got = walker(cfg, grid, m, offsets, groups)
    assert got == expected_grouped(cfg, grid, clamp_offsets(offsets, m), m)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if isinstance(c, Sched) and c.kind == OFFSETS],
                         ids=str)
def test_offsets_bad_values(walker, cfg):
    """Decreasing, negative and past-M offsets are clamped: no row outside [0, M)."""
    m = 900
    offsets = [-50, 100, 40, 400, 400, 2000, 700, -3, 899, 10 ** 9]
    got = walker(cfg, 9, m, offsets, len(offsets) - 1)
    assert got == expected_grouped(cfg, 9, clamp_offsets(offsets, m), m)
    for cta in got:
        for m0, _, _, _, rows, *_ in cta:
            assert 0 <= m0 and m0 + rows <= m


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if isinstance(c, Sched) and c.kind == MASKED],
                         ids=str)
@pytest.mark.parametrize("groups,mmax,grid,seed", [(1, 1024, 132, 0), (8, 128, 132, 1),
                                                   (32, 64, 132, 2), (7, 300, 5, 3)])
def test_masked_walk(walker, cfg, groups, mmax, grid, seed):
    rng = random.Random(seed)
    masked_m = [rng.choice([0, rng.randrange(mmax + 1), mmax, mmax + 7, -4, 2 ** 31 - 1])
                for _ in range(groups)]
    bounds = [(g * mmax, min(max(v, 0), mmax)) for g, v in enumerate(masked_m)]
    got = walker(cfg, grid, mmax, masked_m, groups)
    assert got == expected_grouped(cfg, grid, bounds, mmax)


# --- the 1D1D kernels' walk ----------------------------------------------------------------------
def expected_1d1d(c: Walk1d1d, grid: int, m: int, k: int, ks: list[int]):
    order = mn_order(c, ceil_div(m, c.block_m))
    if not c.k_grouped:
        return per_cta([(mb * c.block_m, nb, 0, 0, ceil_div(k, 128)) for mb, nb in order], grid)
    seq, k_off, kb_off = [], 0, 0
    for g, v in enumerate(ks):
        kg = min(max(v, 0), k - k_off)  # clamped to the columns that remain
        seq += [(mb * c.block_m, nb, g, kb_off, ceil_div(kg, 128)) for mb, nb in order]
        k_off, kb_off = k_off + kg, kb_off + ceil_div(kg, 128)
    return per_cta(seq, grid)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if isinstance(c, Walk1d1d) and not c.k_grouped],
                         ids=str)
@pytest.mark.parametrize("m,k,grid", [(2112, 4096, 132), (100, 1000, 3), (7168, 1, 50)])
def test_1d1d_dense_walk(walker, cfg, m, k, grid):
    assert walker(cfg, grid, m, shape_k=k) == expected_1d1d(cfg, grid, m, k, [])


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if isinstance(c, Walk1d1d) and c.k_grouped],
                         ids=str)
@pytest.mark.parametrize("m,k,ks,grid", [
    (576, 4096 * 8, [4096] * 8, 132),
    (1000, 3000, [0, 1, 127, 128, 129, 0, 500, 1115], 17),
    (300, 1000, [-5, 600, 0, 700, 300], 6),  # negative is 0, no group past the columns left
    (128, 0, [0, 0, 0], 4),
])
def test_k_grouped_walk(walker, cfg, m, k, ks, grid):
    got = walker(cfg, grid, m, ks, len(ks), shape_k=k)
    assert got == expected_1d1d(cfg, grid, m, k, ks)

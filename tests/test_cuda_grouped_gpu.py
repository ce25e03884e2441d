"""GPU tests of the CUDA backend's grouped sm90 family (skipped without a Hopper GPU): contiguous,
offsets and masked GEMMs through the public ops with backend="cuda".

Outputs are poisoned with NaN first: every row of a group must be written, and every row of no
group (m_indices -1, rows at or past masked_m[g]) must still be NaN afterwards. The reference is
float64 on the dequantised inputs, row by row with each row's own group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fp8gemm
from fp8gemm.problem import Recipe, ceil_div
from helpers import TOL, calc_diff, rand_scales, ref_grouped_rows

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
TOL_BF16 = TOL[torch.bfloat16]
NAN = float("nan")
scales = rand_scales


def grouped_b(g: int, n: int, k: int, device):
    b = torch.randn(g, n, k, device=device).to(E4M3)
    sb = scales((g, ceil_div(n, 128), ceil_div(k, 128)), device)
    return b, sb


def reference_rows(a, sa, b, sb, groups: torch.Tensor) -> torch.Tensor:
    """float64 out[i] = A[i] . B[groups[i]]^T for rows with a group (others NaN)."""
    return ref_grouped_rows(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK, groups)


def contiguous_layout(sizes, align: int, device) -> torch.Tensor:
    """m_indices for groups of `sizes` rows, each padded to `align` rows with -1."""
    parts = []
    for g, s in enumerate(sizes):
        parts += [g] * s + [-1] * ((-s) % align)
    return torch.tensor(parts, dtype=torch.int32, device=device)


def unaligned_layout(sizes, device) -> torch.Tensor:
    """m_indices for groups of `sizes` rows not aligned to any block, g % 3 rows of -1 after
    group g, then 7 rows of an out-of-range index (a bad value must address nothing)."""
    parts = []
    for g, s in enumerate(sizes):
        parts += [g] * s + [-1] * (g % 3)
    return torch.tensor(parts + [len(sizes) + 5] * 7, dtype=torch.int32, device=device)


def check_rows(out, ref, groups):
    """Rows with a group match the reference; rows without one are untouched (NaN)."""
    valid = groups >= 0
    assert not torch.isnan(out[valid]).any(), "rows of a group left unwritten"
    assert torch.isnan(out[~valid]).all(), "rows of no group were written"
    diff = calc_diff(out[valid], ref[valid])
    assert diff < TOL_BF16, f"calc_diff {diff:.3g}"


CONTIGUOUS = [  # (group sizes, N, K)
    ([8192] * 4, 4096, 7168),
    ([4096] * 8, 7168, 2048),
    ([300, 0, 1, 129, 1000], 576, 320),        # padding blocks, an empty group, tails
    ([37, 200, 64], 200, 336),                  # N and K tails
]


def check_contiguous_padded(sizes, n, k, device, a_dtype=E4M3):
    """Groups of `sizes` rows padded to the contiguous alignment, A in `a_dtype`, through the
    CUDA backend against float64."""
    idx = contiguous_layout(sizes, fp8gemm.get_m_alignment_for_contiguous_layout(), device)
    m = idx.numel()
    a = torch.randn(m, k, device=device).to(a_dtype)
    sa = fp8gemm.get_col_major_tma_aligned_tensor(scales((m, ceil_div(k, 128)), device))
    b, sb = grouped_b(len(sizes), n, k, device)
    out = torch.full((m, n), NAN, dtype=torch.bfloat16, device=device)
    fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), out, idx, backend="cuda")
    torch.cuda.synchronize()
    check_rows(out, reference_rows(a, sa, b, sb, idx), idx)


@pytest.mark.parametrize("sizes,n,k", CONTIGUOUS, ids=lambda v: str(v)[:40])
def test_contiguous_padded(sizes, n, k, gpu_device):
    check_contiguous_padded(sizes, n, k, gpu_device)


def test_contiguous_unaligned_layout(gpu_device):
    """Groups not aligned to 128 rows, -1 rows inside blocks and an out-of-range index: blocks
    holding several groups run once per group, each under its row mask."""
    sizes = [50, 3, 200, 77, 130]
    idx = unaligned_layout(sizes, gpu_device)
    m, n, k = idx.numel(), 576, 640
    a = torch.randn(m, k, device=gpu_device).to(E4M3)
    sa = scales((m, ceil_div(k, 128)), gpu_device)
    b, sb = grouped_b(len(sizes), n, k, gpu_device)
    out = torch.full((m, n), NAN, dtype=torch.bfloat16, device=gpu_device)
    fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), out, idx, backend="cuda")
    torch.cuda.synchronize()
    groups = torch.where(idx < len(sizes), idx, -1)
    check_rows(out, reference_rows(a, sa, b, sb, groups), groups)


def contiguous_config_case(layout: str, sizes, n: int, k: int, device, **fields):
    """A contiguous GEMM of `layout` ("padded-128", "padded-512": whole blocks of padding,
    "unaligned": bad indices too) run through a config built directly from the heuristic's with
    `fields` changed (stages re-derived, grid one CTA per tile up to the SM count, rounded down
    to the cluster). Returns (out, the float64 reference, each row's group or -1)."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as sm90
    from fp8gemm.backends.family import DeviceFacts
    from fp8gemm.problem import GemmKind, GemmProblem

    idx = (unaligned_layout(sizes, device) if layout == "unaligned" else
           contiguous_layout(sizes, int(layout.split("-")[1]), device))
    num_groups = len(sizes)
    groups = torch.where(idx < num_groups, idx, -1)
    m = idx.numel()
    problem = GemmProblem(GemmKind.CONTIGUOUS, m, n, k, num_groups, E4M3, E4M3, Recipe.GROUP,
                          Recipe.BLOCK, torch.bfloat16)
    facts = DeviceFacts.of(device)
    cfg = replace(sm90.GROUPED.select_config(problem, facts), **fields)
    cluster = cfg.num_multicast
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    grid = fields.get("grid", min(facts.num_sms, tiles))
    cfg = replace(cfg, num_stages=sm90.max_stages(cfg.block_m, cfg.block_n, k,
                                                  facts.smem_per_block, GemmKind.CONTIGUOUS),
                  grid=max(cluster, grid - grid % cluster))
    a = torch.randn(m, k, device=device).to(E4M3)
    sa = fp8gemm.get_col_major_tma_aligned_tensor(scales((m, ceil_div(k, 128)), device))
    b, sb = grouped_b(num_groups, n, k, device)
    out = torch.full((m, n), NAN, dtype=torch.bfloat16, device=device)
    sm90.GROUPED.run(cfg, problem, a, sa, b, sb, out, None, idx)
    torch.cuda.synchronize()
    return out, reference_rows(a, sa, b, sb, groups), groups, (cfg, problem, a, sa, b, sb, idx)


@pytest.mark.parametrize("layout", ["padded-128", "unaligned", "padded-512"])
def test_contiguous_256_row_tiles(layout, gpu_device):
    """256-row tiles (the heuristic's pick for long groups) on layouts whose 256-row blocks hold
    two groups, -1 rows inside blocks, an out-of-range index and whole blocks of padding: each
    group of a block runs under its own row mask."""
    sizes = {"padded-128": [300, 129, 1000, 0, 700], "unaligned": [50, 3, 200, 77, 530, 301],
             "padded-512": [100, 600, 5]}[layout]
    out, ref, groups, _ = contiguous_config_case(layout, sizes, 1088, 640, gpu_device,  # N tail 64
                                                 block_m=256, block_n=128, two_accum=False)
    check_rows(out, ref, groups)


@pytest.mark.parametrize("tile", ["128x128-two-accum", "128x128", "128x160", "256x128"])
@pytest.mark.parametrize("layout,sizes", [
    ("padded-128", [300, 129, 1000, 0, 700, 77]),   # 19 blocks: the last pair has one
    ("unaligned", [50, 3, 200, 77, 530, 301]),      # blocks of several groups, bad indices
    ("padded-512", [100, 600, 5, 1300]),            # whole blocks of padding
    ("padded-128", [128] * 3),                      # 3 blocks, pairs of different groups
], ids=["odd-blocks", "unaligned", "padding-blocks", "one-block-groups"])
def test_contiguous_multicast_b(layout, sizes, tile, gpu_device):
    """2-CTA clusters sharing B between the pair's 128- or 256-row tiles where both are of one
    group, and each loading its own otherwise; a CTA whose block has fewer groups than its peer's
    runs empty tiles in step. Rows match float64 and rows of no group stay NaN; the sums are the
    same bits whatever the grid (a tile's k-blocks are summed in one order)."""
    bm, bn = (int(v) for v in tile.split("-")[0].split("x"))
    fields = dict(block_m=bm, block_n=bn, two_accum=tile.endswith("two-accum"), num_multicast=2,
                  multicast_on_a=False)
    torch.manual_seed(0)
    out, ref, groups, _ = contiguous_config_case(layout, sizes, 1088, 896, gpu_device, **fields)
    check_rows(out, ref, groups)
    valid = groups >= 0
    for grid in (2, 6):
        torch.manual_seed(0)
        again, _, _, _ = contiguous_config_case(layout, sizes, 1088, 896, gpu_device, grid=grid,
                                                **fields)
        assert torch.equal(again[valid], out[valid]), f"grid {grid}: other bits"
        assert torch.isnan(again[~valid]).all()


@pytest.mark.parametrize("sizes,n,k", [([4096] * 8, 4096, 7168), ([1000, 0, 3, 555, 128, 1], 576, 320),
                                       ([7, 300, 129], 7168, 2048)], ids=lambda v: str(v)[:40])
def test_offsets(sizes, n, k, gpu_device):
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32,
                           device=gpu_device)
    m = sum(sizes)
    a = torch.randn(m, k, device=gpu_device).to(E4M3)
    sa = fp8gemm.get_col_major_tma_aligned_tensor(scales((m, ceil_div(k, 128)), gpu_device))
    b, sb = grouped_b(len(sizes), n, k, gpu_device)
    out = torch.full((m, n), NAN, dtype=torch.bfloat16, device=gpu_device)
    fp8gemm.m_grouped_fp8_gemm_nt_offsets((a, sa), (b, sb), out, offsets, backend="cuda")
    torch.cuda.synchronize()
    groups = torch.repeat_interleave(torch.arange(len(sizes), device=gpu_device),
                                     torch.tensor(sizes, device=gpu_device)).int()
    check_rows(out, reference_rows(a, sa, b, sb, groups), groups)


def masked_case(g, mmax, n, k, device):
    a = torch.randn(g, mmax, k, device=device).to(E4M3)
    sa = fp8gemm.get_col_major_tma_aligned_tensor(scales((g, mmax, ceil_div(k, 128)), device))
    b, sb = grouped_b(g, n, k, device)
    return a, sa, b, sb


def check_masked(out, a, sa, b, sb, masked_m):
    g, mmax, _ = a.shape
    rows = torch.arange(mmax, device=a.device)[None, :].expand(g, mmax)
    groups = torch.where(rows < masked_m[:, None].clamp(max=mmax),
                         torch.arange(g, device=a.device)[:, None], -1).int()
    ref = reference_rows(a.flatten(0, 1), sa.flatten(0, 1), b, sb, groups.flatten())
    check_rows(out.flatten(0, 1), ref, groups.flatten())


@pytest.mark.parametrize("g,mmax,n,k,expected", [(4, 256, 4096, 7168, 256), (32, 64, 7168, 2048, 8),
                                                 (3, 200, 576, 336, 100), (1, 1024, 4096, 7168, 1024),
                                                 (2, 5, 72, 320, 3)])  # fewer rows than BLOCK_M
def test_masked(g, mmax, n, k, expected, gpu_device):
    a, sa, b, sb = masked_case(g, mmax, n, k, gpu_device)
    masked_m = torch.randint(0, mmax + 1, (g,), dtype=torch.int32, device=gpu_device)
    masked_m[0] = mmax
    if g > 1:
        masked_m[1] = 0
    out = torch.full((g, mmax, n), NAN, dtype=torch.bfloat16, device=gpu_device)
    fp8gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), out, masked_m, expected,
                                         backend="cuda")
    torch.cuda.synchronize()
    check_masked(out, a, sa, b, sb, masked_m)


def test_masked_cuda_graph_with_changing_masked_m(gpu_device):
    """One capture, replays with new masked_m values in the same buffer: each replay computes
    exactly the rows the current values say."""
    g, mmax, n, k = 8, 128, 7168, 2048
    a, sa, b, sb = masked_case(g, mmax, n, k, gpu_device)
    masked_m = torch.full((g,), mmax, dtype=torch.int32, device=gpu_device)
    out = torch.full((g, mmax, n), NAN, dtype=torch.bfloat16, device=gpu_device)
    run = lambda: fp8gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), out, masked_m, 16,
                                                       backend="cuda")  # noqa: E731
    run()  # compile, load and encode outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for values in ([1, 0, 17, 128, 64, 65, 3, 127], [0] * 8, [128] * 8):
        masked_m.copy_(torch.tensor(values, dtype=torch.int32))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_masked(out, a, sa, b, sb, masked_m)


def run_forced_grouped(kind: str, sizes, expected_m: int, device, config):
    """A grouped GEMM of `kind` over groups of `sizes` rows (N = 576, K = 1408; masked: Mmax =
    320) with the config `config(default, facts, problem)` returns, checked against float64
    (rows of no group untouched). Returns (the config, run(config) -> out) for more configs."""
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as sm90
    from fp8gemm.backends.family import DeviceFacts
    from fp8gemm.problem import GemmKind, GemmProblem

    n, k, g = 576, 1408, len(sizes)
    b, sb = grouped_b(g, n, k, device)
    if kind == "masked":
        mmax = 320
        a, sa, _, _ = masked_case(g, mmax, n, k, device)
        layout = torch.tensor(sizes, dtype=torch.int32, device=device)
        m, out_shape = mmax, (g, mmax, n)
    else:
        if kind == "contiguous":
            layout = groups = contiguous_layout(sizes, 128, device)
        else:
            layout = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32,
                                  device=device)
            groups = torch.repeat_interleave(torch.arange(g, device=device),
                                             torch.tensor(sizes, device=device)).int()
        m = layout.numel() if kind == "contiguous" else sum(sizes)
        a = torch.randn(m, k, device=device).to(E4M3)
        sa = fp8gemm.get_col_major_tma_aligned_tensor(scales((m, ceil_div(k, 128)), device))
        out_shape = (m, n)
    problem = GemmProblem(GemmKind[kind.upper()], m, n, k, g, E4M3, E4M3, Recipe.GROUP,
                          Recipe.BLOCK, torch.bfloat16,
                          expected_m=expected_m if kind == "masked" else 0)
    facts = DeviceFacts.of(device)
    cfg = config(sm90.GROUPED.select_config(problem, facts), facts, problem)

    def run(c):
        out = torch.full(out_shape, NAN, dtype=torch.bfloat16, device=device)
        sm90.GROUPED.run(c, problem, a, sa, b, sb, out, None, layout)
        return out

    out = run(cfg)
    torch.cuda.synchronize()
    if kind == "masked":
        check_masked(out, a, sa, b, sb, layout)
    else:
        check_rows(out, reference_rows(a, sa, b, sb, groups), groups)
    return cfg, run


@pytest.mark.parametrize("tile", ["128x128-two-accum", "128x128", "128x96", "128x192"])
@pytest.mark.parametrize("kind", ["contiguous", "offsets", "masked"])
def test_idle_half_warpgroup(kind, tile, gpu_device):
    """128-row tiles whose second math warpgroup has no rows of the tile (a group's last block
    with at most 64 rows, masked_m % 128 in 1..64) run that warpgroup's k-loop without wgmma;
    blocks with 65..127 rows and whole ones compute on both. The config is built directly, with
    one and with two accumulators, and one-accumulator tiles whose B-scale split is a per-tile
    constant (96 wide: the four splits of N = 576; 192: splits 0 and 64)."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as sm90

    bn, two_accum = (128, True) if tile == "128x128-two-accum" else (int(tile[4:]), False)
    run_forced_grouped(
        kind, [1, 64, 65, 128, 129, 192, 193, 300, 0, 63], 128, gpu_device,
        lambda base, facts, p: replace(
            base, block_m=128, block_n=bn, two_accum=two_accum, num_multicast=1, splits=1,
            num_stages=sm90.max_stages(128, bn, p.k, facts.smem_per_block, p.kind),
            grid=min(facts.num_sms, 2 * p.groups * ceil_div(p.n, bn))))


@pytest.mark.parametrize("kind", ["contiguous", "offsets", "masked"])
def test_half_256_row_tiles(kind, gpu_device):
    """256-row tiles whose group has rows in one 128-row half only (a block the 128-padded
    contiguous layout shares between two groups, a group's last 1..128 rows) run that half's
    wave alone from its own 128 A rows: against float64, and the same bits as 128x128 tiles
    (each row's sums come from the same wgmma and promotions either way)."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as sm90
    from fp8gemm.backends.family import DeviceFacts

    def tile(cfg, p, block_m):
        smem = DeviceFacts.of(gpu_device).smem_per_block
        return replace(cfg, block_m=block_m, block_n=128, two_accum=False, num_multicast=1,
                       splits=1, num_stages=sm90.max_stages(block_m, 128, p.k, smem, p.kind))

    problems = []

    def tall(base, facts, p):
        problems.append(p)
        return replace(tile(base, p, 256), grid=min(facts.num_sms, 2 * p.groups * 5))

    sizes = [1, 64, 65, 128, 129, 200, 256, 257, 300, 0, 63, 320]
    cfg, run = run_forced_grouped(kind, sizes, 128, gpu_device, tall)
    half, whole = run(cfg), run(tile(cfg, problems[0], 128))
    torch.cuda.synchronize()
    assert torch.equal(half.isnan(), whole.isnan())
    assert torch.equal(half.nan_to_num(), whole.nan_to_num()), "256-row halves differ from 128x128"


@pytest.mark.parametrize("tile", ["64x128-two-accum", "64x128", "64x64-two-accum"])
@pytest.mark.parametrize("kind", ["contiguous", "offsets", "masked"])
def test_two_ctas_per_sm(kind, tile, gpu_device):
    """ctas_per_sm = 2 (built directly: the heuristic does not offer it): 64-row tiles, two CTAs
    resident on each SM with half the shared memory each, over groups of 0-300 rows; only the
    groups' rows written, against float64. The plan refuses two CTAs of 128-row tiles."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as sm90

    bn, two_accum = int(tile[3:6].rstrip("-")), tile.endswith("two-accum")
    cfg, run = run_forced_grouped(
        kind, [1, 64, 65, 128, 129, 300, 0, 63], 64, gpu_device,
        lambda base, facts, p: replace(
            base, block_m=64, block_n=bn, two_accum=two_accum, num_multicast=1, splits=1,
            ctas_per_sm=2, grid=2 * facts.num_sms,
            num_stages=sm90.max_stages(64, bn, p.k, sm90.smem_limit(facts, 2), p.kind)))
    with pytest.raises(ValueError, match="two CTAs an SM"):
        run(replace(cfg, block_m=128))


def test_bit_identical_repeats(gpu_device):
    idx = contiguous_layout([700, 129, 2000], 128, gpu_device)
    m, n, k = idx.numel(), 4096, 7168
    a = torch.randn(m, k, device=gpu_device).to(E4M3)
    sa = scales((m, ceil_div(k, 128)), gpu_device)
    b, sb = grouped_b(3, n, k, gpu_device)
    first = fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), None, idx, backend="cuda")
    for _ in range(3):
        again = fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), None, idx,
                                                         backend="cuda")
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))


def test_writes_only_out(gpu_device):
    """out a view into a larger buffer: nothing around it is written."""
    sizes, n, k = [100, 250], 576, 320
    offsets = torch.tensor([0, 100, 350], dtype=torch.int32, device=gpu_device)
    m = sum(sizes)
    a = torch.randn(m, k, device=gpu_device).to(E4M3)
    sa = scales((m, ceil_div(k, 128)), gpu_device)
    b, sb = grouped_b(2, n, k, gpu_device)
    big = torch.full((m + 2, n), 7.0, dtype=torch.bfloat16, device=gpu_device)
    fp8gemm.m_grouped_fp8_gemm_nt_offsets((a, sa), (b, sb), big[1:m + 1], offsets, backend="cuda")
    torch.cuda.synchronize()
    assert bool((big[0] == 7.0).all()) and bool((big[m + 1] == 7.0).all())
    groups = torch.tensor([0] * 100 + [1] * 250, dtype=torch.int32, device=gpu_device)
    assert calc_diff(big[1:m + 1], reference_rows(a, sa, b, sb, groups)) < TOL_BF16


_BAD_VALUES_SCRIPT = textwrap.dedent("""
    import torch, fp8gemm
    e4m3, dev = torch.float8_e4m3fn, "cuda"
    g, n, k = 3, 576, 320
    b = torch.randn(g, n, k, device=dev).to(e4m3)
    sb = torch.ones(g, 5, 3, device=dev)
    # m_indices out of range both ways, offsets past the end and decreasing, masked_m > Mmax.
    a = torch.randn(300, k, device=dev).to(e4m3)
    sa = torch.ones(300, 3, device=dev)
    idx = torch.randint(-50, 50, (300,), dtype=torch.int32, device=dev)
    out = torch.zeros(300, n, dtype=torch.bfloat16, device=dev)
    fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), out, idx, backend="cuda")
    # the same through 2-CTA pairs sharing B (a config the heuristic does not pick)
    from dataclasses import replace
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as sm90
    from fp8gemm.backends.family import DeviceFacts
    from fp8gemm.problem import GemmKind, GemmProblem, Recipe
    p = GemmProblem(GemmKind.CONTIGUOUS, 300, n, k, g, e4m3, e4m3, Recipe.GROUP, Recipe.BLOCK,
                    torch.bfloat16)
    facts = DeviceFacts.of(torch.device(dev))
    stages = sm90.max_stages(128, 128, k, facts.smem_per_block, GemmKind.CONTIGUOUS)
    cfg = replace(sm90.GROUPED.select_config(p, facts), block_m=128, block_n=128, grid=4,
                  num_stages=stages, two_accum=False, num_multicast=2, multicast_on_a=False)
    sm90.GROUPED.run(cfg, p, a, fp8gemm.get_col_major_tma_aligned_tensor(sa), b, sb, out, None,
                     idx)
    offsets = torch.tensor([0, 900, 5, -7], dtype=torch.int32, device=dev)
    fp8gemm.m_grouped_fp8_gemm_nt_offsets((a, sa), (b, sb), out, offsets, backend="cuda")
    a3 = torch.randn(g, 64, k, device=dev).to(e4m3)
    sa3 = torch.ones(g, 64, 3, device=dev)
    out3 = torch.zeros(g, 64, n, dtype=torch.bfloat16, device=dev)
    masked_m = torch.tensor([1000, -5, 64], dtype=torch.int32, device=dev)
    fp8gemm.m_grouped_fp8_gemm_nt_masked((a3, sa3), (b, sb), out3, masked_m, 64, backend="cuda")
    # the same through the masked small-M family with a config its heuristic does not pick: one
    # slot of 8-token tiles split in 3, so that a cluster walks up to 8 token tiles
    from fp8gemm.backends.cuda import sm90_fp8_gemm_small_m as small
    p3 = GemmProblem(GemmKind.MASKED, 64, n, k, g, e4m3, e4m3, Recipe.GROUP, Recipe.BLOCK,
                     torch.bfloat16, expected_m=8)
    cfg3 = small.SmallMConfig(8, 3, 2, g * 9 * 3, 1)
    small.MASKED_SMALL_M.run(cfg3, p3, a3, fp8gemm.get_col_major_tma_aligned_tensor(sa3), b, sb,
                             out3, None, masked_m)
    torch.cuda.synchronize()
    print("done")
""")


def test_bad_index_values_stay_in_bounds(gpu_device, tmp_path):
    """Unchecked bad values (group ids out of range, offsets past the end, masked_m > Mmax) never
    read or write out of bounds, contiguous also in 2-CTA pairs sharing B, masked also through
    the masked small-M family: run under compute-sanitizer's memcheck where it is installed,
    else plainly (a fault would still fail the run)."""
    script = tmp_path / "bad_values.py"
    script.write_text(_BAD_VALUES_SCRIPT)
    cmd = [sys.executable, str(script)]
    sanitizer = "compute-sanitizer"
    from shutil import which

    if which(sanitizer):
        # NOTE: API errors (torch probes driver entry points) are not memory errors.
        cmd = [sanitizer, "--tool", "memcheck", "--report-api-errors", "no",
               "--error-exitcode", "9"] + cmd
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "done" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("kind", ["contiguous", "masked"])
def test_e5m2_a(kind, gpu_device):
    """A in e5m2 (an MoE layer's output gradient dY) through the grouped kernels once taken."""
    e5m2, n, k = torch.float8_e5m2, 576, 320
    if kind == "contiguous":
        check_contiguous_padded([300, 0, 129, 1000], n, k, gpu_device, e5m2)
    else:
        a, sa, b, sb = masked_case(4, 256, n, k, gpu_device)
        a = torch.randn(4, 256, k, device=gpu_device).to(e5m2)
        masked_m = torch.tensor([256, 0, 100, 17], dtype=torch.int32, device=gpu_device)
        out = torch.full((4, 256, n), NAN, dtype=torch.bfloat16, device=gpu_device)
        fp8gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), out, masked_m, 100,
                                             backend="cuda")
        torch.cuda.synchronize()
        check_masked(out, a, sa, b, sb, masked_m)

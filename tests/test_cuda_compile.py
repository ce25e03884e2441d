"""CUDA backend without a GPU: the config heuristics' choices, and every kernel they pick for the
DeepSeek-V3 dense and grouped suites compiled for sm_90a (NVRTC, else nvcc), with no spills, no
local memory and QGMMA (FP8 wgmma) in the SASS."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataclasses import replace

from fp8gemm.backends.cuda import launch as cuda_launch
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g
from fp8gemm.backends.cuda import supports as cuda_supports
from fp8gemm.backends.family import DeviceFacts
from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div
from helpers import (FORCED_CONFIGS, SPLIT_K_CONFIGS, TMA_LOAD_WITH_POLICY,
                     assert_waits_before_global_access, compiler_or_skip)

E4M3 = torch.float8_e4m3fn
H200 = DeviceFacts("NVIDIA H200", (9, 0), num_sms=132, smem_per_block=232448)
H100_PCIE = DeviceFacts("NVIDIA H100 PCIe", (9, 0), num_sms=114, smem_per_block=232448)
DSV3_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
DSV3 = [(m, n, k) for m in (64, 128, 4096) for (n, k) in DSV3_NK]
AWKWARD = [(1, 576, 320), (37, 576, 320), (130, 576, 320), (37, 200, 336), (257, 1000, 4096)]


def problem(m, n, k, **kw) -> GemmProblem:
    base = dict(kind=GemmKind.DENSE, m=m, n=n, k=k, groups=1, a_dtype=E4M3, b_dtype=E4M3,
                a_recipe=Recipe.GROUP, b_recipe=Recipe.BLOCK, out_dtype=torch.bfloat16)
    base.update(kw)
    return GemmProblem(**base)


# --- supports ------------------------------------------------------------------------------------
def test_supports_accepts_the_suite():
    for m, n, k in DSV3 + AWKWARD:
        assert cuda_supports(problem(m, n, k)) is None
        assert cuda_supports(problem(m, n, k, has_c=True)) is None  # dense C (a bias)


@pytest.mark.parametrize("kw,needle", [
    (dict(kind=GemmKind.MASKED, groups=2, b_dtype=torch.float8_e5m2), "e4m3"),
    (dict(b_dtype=torch.float8_e5m2), "e4m3"),
    (dict(a_recipe=Recipe.ROW), "1x128"),
    (dict(b_recipe=Recipe.TENSOR), "128x128"),
    (dict(out_dtype=torch.float32), "bfloat16"),
    (dict(kind=GemmKind.CONTIGUOUS, groups=2, has_c=True), "C"),
    (dict(k=328), "K % 16"),
    (dict(n=580), "N % 8"),
])
def test_supports_refuses_with_reason(kw, needle):
    shape = dict(m=64, n=576, k=512)
    shape.update({key: kw.pop(key) for key in ("n", "k") if key in kw})
    why = cuda_supports(problem(**shape, **kw))
    assert isinstance(why, str) and needle in why


def test_e5m2_a_taken():
    """A in e5m2 (an output gradient dY) runs in the dense and grouped families; the small-M
    family keeps e4m3, so the dense family takes small M."""
    from fp8gemm.backends.cuda import family_for

    e5m2 = torch.float8_e5m2
    for m in (4096, 64):
        p = problem(m, 7168, 2048, a_dtype=e5m2)
        assert cuda_supports(p) is None and family_for(p, H200) is g.DENSE, m
    assert g.GROUPED.supports(grouped_problem(GemmKind.CONTIGUOUS, 8192, 4, 0, 4096, 7168)) is None
    assert "B e4m3" in cuda_supports(problem(4096, 7168, 2048, b_dtype=e5m2))


def test_e5m2_a_kernels_compile_clean(tmp_path, monkeypatch):
    """The e5m2-A kernels of the suite's dgrad-like shapes, a two-accumulator tile and the
    grouped kinds compile as clean as their e4m3 twins, with the e5m2 x e4m3 QGMMA."""
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    cases = [(GemmKind.DENSE, n, k, g.DENSE.select_config(problem(4096, n, k), H200))
             for n, k in ((7168, 2112), (1536, 24576), (2048, 7168))]
    cases.append((GemmKind.DENSE, 4096, 7168,
                  g.Sm90Config(128, 128, g.max_stages(128, 128, 7168, H200.smem_per_block), 1,
                               True, g.BAND_SIZE, 132, True)))
    for kind in (GemmKind.CONTIGUOUS, GemmKind.MASKED):
        p = grouped_problem(kind, 8192, 4, 2048 if kind is GemmKind.MASKED else 0, 4096, 7168)
        cases.append((kind, 4096, 7168, g.GROUPED.select_config(p, H200)))
    for kind, n, k, cfg in cases:
        compiled = g.compile_kernel(kind, n, k, cfg, a_e5m2=True)[1]
        what = f"e5m2 A {kind.value} N={n} K={k} {cfg}"
        assert_clean_cubin(compiled, cfg, tool, tmp_path, what)
        path = tmp_path / "e5m2.cubin"
        path.write_bytes(compiled.cubin)
        sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
        assert f"QGMMA.64x{cfg.block_n}x32.F32.E5M2.E4M3" in sass and ".E4M3.E4M3" not in sass, what


# --- heuristic -------------------------------------------------------------------------------------
def test_deep_ring_for_thin_tiles_with_rows():
    """64x32 dense tiles stream a long K through DEEP_RING_STAGES stages once A has
    DEEP_RING_MIN_ROWS rows (4096x7168 at M = 64 picks them); fewer rows keep MAX_STAGES."""
    cfg = g.DENSE.select_config(problem(64, 4096, 7168), H200)
    assert (cfg.block_m, cfg.block_n) == g.DEEP_RING_TILE and cfg.num_stages == g.DEEP_RING_STAGES
    thin = g.candidate_tiles(g.DEEP_RING_MIN_ROWS - 8, 4096, 7168, H200)
    assert [c.num_stages for c in thin if (c.block_m, c.block_n) == g.DEEP_RING_TILE] == [g.MAX_STAGES]


@pytest.mark.parametrize("k", [2048, 7168, 16384])
def test_deep_ring_for_one_masked_expert(k, tmp_path, monkeypatch):
    """One masked expert of 64 expected rows at N = 4096 runs 64x32 tiles (128 of them) through
    the dense ring depth, and that kernel compiles without spills; 8 expected rows keep the
    grouped kinds' cap."""
    def masked(expected):
        return problem(256, 4096, k, kind=GemmKind.MASKED, groups=1, expected_m=expected)

    cfg = g.GROUPED.select_config(masked(64), H200)
    assert (cfg.block_m, cfg.block_n) == g.DEEP_RING_TILE and cfg.num_stages == g.DEEP_RING_STAGES
    few = g.GROUPED.select_config(masked(8), H200)
    assert few.num_stages == g.GROUPED_MAX_STAGES
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    log = g.compile_kernel(GemmKind.MASKED, 4096, k, cfg)[1].log
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes spill", log)), log


@pytest.mark.parametrize("facts", [H200, H100_PCIE], ids=["h200", "h100pcie"])
@pytest.mark.parametrize("m,n,k", DSV3 + AWKWARD)
def test_config_properties(m, n, k, facts):
    cfg = g.DENSE.select_config(problem(m, n, k), facts)
    # Fits shared memory, with the stages the layout needs.
    assert cfg.smem(k) == g.smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages, k)
    # 64x32 tiles of at least DEEP_RING_MIN_ROWS rows take the deeper ring.
    deep = (cfg.block_m, cfg.block_n) == g.DEEP_RING_TILE and m >= g.DEEP_RING_MIN_ROWS
    cap = g.DEEP_RING_STAGES if deep else g.MAX_STAGES
    assert cfg.smem(k) <= facts.smem_per_block and g.MIN_STAGES <= cfg.num_stages <= cap
    # One more stage would not fit (stages are as deep as memory allows), unless at the cap.
    assert (cfg.num_stages == cap
            or g.smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages + 1, k) > facts.smem_per_block)
    # Tile shape the kernel accepts: wgmma N step 8, at most two B scale blocks per tile.
    assert cfg.block_n % 8 == 0 and cfg.block_n in g.BLOCK_N_CHOICES and cfg.block_m in (64, 128, 256)
    # BLOCK_M 256 only with the widths that keep two FP32 sums in registers and pay off.
    assert cfg.block_m != 256 or (cfg.block_n in g.BLOCK_N_CHOICES_256 and m > 128)
    low_bit = cfg.block_n & -cfg.block_n
    assert cfg.block_n <= 128 + min(low_bit, 128)
    assert cfg.num_threads == (256 if cfg.block_m == 64 else 384)
    assert cfg.two_accum == g.use_two_accum(cfg.block_m, cfg.block_n, k) and cfg.splits == 1
    # Multicast legal: pairs of tiles share the multicast operand, grid and tiles even.
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    assert 1 <= cfg.grid <= min(facts.num_sms, tiles)
    if cfg.num_multicast == 2:
        shared = ceil_div(n, cfg.block_n) if cfg.multicast_on_a else ceil_div(m, cfg.block_m)
        assert shared % 2 == 0 and tiles % 2 == 0 and cfg.grid % 2 == 0
        assert cfg.band_size % 2 == 0
    else:
        assert cfg.num_multicast == 1


@pytest.mark.parametrize("m,n,k", DSV3 + AWKWARD)
def test_config_is_the_cheapest_with_fullest_last_wave(m, n, k):
    """The documented objective: least modelled time (waves x per-tile cost); among equals fewer
    tiles, two math warpgroups, then the fullest last wave."""
    cfg = g.DENSE.select_config(problem(m, n, k), H200)
    cands = g.candidate_tiles(m, n, k, H200)
    chosen = next(c for c in cands if (c.block_m, c.block_n) == (cfg.block_m, cfg.block_n))
    assert chosen.waves == ceil_div(chosen.tiles, H200.num_sms)
    for c in cands:
        assert (c.cost, c.tiles) >= (chosen.cost, chosen.tiles), (c, chosen)
        if (c.cost, c.tiles, c.block_m) == (chosen.cost, chosen.tiles, chosen.block_m):
            assert c.last_wave <= chosen.last_wave, (c, chosen)
    # Waves are minimal for what a tile costs: any candidate with fewer waves has dearer tiles.
    per_tile = chosen.cost / chosen.waves
    assert all(c.cost / c.waves > per_tile for c in cands if c.waves < chosen.waves)


def test_cost_model_matches_h200_measurements():
    """Choices the H200 measured best or within 5 % in tile sweeps timed as the bench times."""
    expect = {(4096, 7168, 16384): (256, 128), (4096, 4096, 7168): (256, 128),
              (4096, 7168, 2048): (256, 128), (4096, 2112, 7168): (128, 192),
              (4096, 32768, 512): (256, 128), (4096, 24576, 1536): (256, 128),
              (2048, 4096, 7168): (256, 128), (2048, 7168, 16384): (128, 128),
              (512, 24576, 1536): (256, 128), (512, 7168, 16384): (256, 128),
              (1024, 7168, 2048): (256, 128), (64, 2112, 7168): (64, 16),
              (64, 7168, 16384): (64, 64), (64, 7168, 2048): (64, 64),
              (128, 4096, 7168): (128, 32), (128, 24576, 1536): (128, 192)}
    for (m, n, k), tile in expect.items():
        cfg = g.DENSE.select_config(problem(m, n, k), H200)
        assert (cfg.block_m, cfg.block_n) == tile, ((m, n, k), cfg)
    # One math warpgroup is the slower tile at equal loads; two waves the fastest per FLOP, then
    # two accumulators (from K = TWO_ACCUM_MIN_K).
    assert g.tile_cost(64, 128) > g.tile_cost(128, 64)
    assert g.tile_cost(256, 128) / 2 < g.tile_cost(128, 128, k=7168) < g.tile_cost(128, 128, k=512)
    # Two accumulators on the one-wave tiles up to 128 wide, where they compile clean (below).
    assert g.use_two_accum(128, 128, 7168) and g.use_two_accum(64, 32, 512)
    assert g.use_two_accum(128, 56, 16384) and g.use_two_accum(64, 128, g.TWO_ACCUM_MAX_K)
    assert not g.use_two_accum(128, 128, g.TWO_ACCUM_MAX_K + 128)
    assert not (g.use_two_accum(256, 128, 7168) or g.use_two_accum(128, 136, 7168))


def test_small_m_uses_every_sm():
    """M <= 128 leaves few tiles: the choice spreads them over (nearly) all SMs."""
    for m, n, k in [(64, 2112, 7168), (128, 2112, 7168), (64, 7168, 16384)]:
        cfg = g.DENSE.select_config(problem(m, n, k), H200)
        tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
        # (64x7168x16384: 112 tiles of 64x64 ran 1.6 % faster than 128 of 64x56, H200.)
        assert tiles >= 0.8 * H200.num_sms, (m, n, k, cfg)


def test_config_is_pure_and_cached():
    p = problem(4096, 7168, 2048)
    assert g.DENSE.select_config(p, H200) is g.DENSE.select_config(p, H200)
    assert g.DENSE.select_config(p, H200) == g.DENSE.select_config(p, replace(H200))
    hash(g.DENSE.select_config(p, H200)) and str(g.DENSE.select_config(p, H200))


def test_fewer_sms_changes_the_grid():
    few = replace(H200, num_sms=100)
    cfg = g.DENSE.select_config(problem(4096, 7168, 2048), few)
    assert cfg.grid <= 100


# --- compile every suite kernel ------------------------------------------------------------------------
def _suite_configs():
    seen = {}
    for m, n, k in DSV3 + AWKWARD:
        cfg = g.DENSE.select_config(problem(m, n, k), H200)
        seen.setdefault((n, k, cfg), (m, n, k))
    return seen


@pytest.fixture(scope="module")
def compiled_suite(tmp_path_factory):
    import os

    compiler_or_skip()
    old = os.environ.get("FP8GEMM_CACHE_DIR")
    os.environ["FP8GEMM_CACHE_DIR"] = str(tmp_path_factory.mktemp("cubins"))
    try:
        out = {}
        for (n, k, cfg), shape in _suite_configs().items():
            for has_c in (False, True):  # a C input (a bias) adds loads to the epilogue
                _, compiled, path, _ = g.compile_kernel(GemmKind.DENSE, n, k, cfg, has_c=has_c)
                out[shape + (("c",) if has_c else ())] = (cfg, compiled)
        yield out
    finally:
        if old is None:
            os.environ.pop("FP8GEMM_CACHE_DIR", None)
        else:
            os.environ["FP8GEMM_CACHE_DIR"] = old


def test_suite_kernels_have_no_spills(compiled_suite, tmp_path):
    """ptxas -v says 0 bytes of stack and spills. Where a compiler build leaves its ptxas report
    out of the log, cuobjdump -res-usage must show STACK:0 and LOCAL:0 instead."""
    for shape, (cfg, compiled) in compiled_suite.items():
        log = compiled.log
        stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        assert not re.search(r"C751[459]", log), \
            f"{shape} {cfg}: ptxas serialised or fenced the wgmma\n{log}"
        if stack and spills:
            assert max(stack) == 0 and max(spills) == 0, f"{shape} {cfg}: spills or stack\n{log}"
            continue
        path = tmp_path / "k.cubin"
        path.write_bytes(compiled.cubin)
        res = subprocess.run([_cuobjdump(), "-res-usage", str(path)], capture_output=True,
                             text=True).stdout
        found = re.findall(r"STACK:(\d+)", res) + re.findall(r"LOCAL:(\d+)", res)
        assert len(found) >= 2 and max(map(int, found)) == 0, f"{shape} {cfg}: {res}"


def _cuobjdump():
    from fp8gemm.jit import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's wheel)")
    return tool


def test_suite_kernels_use_qgmma_and_no_local_memory(compiled_suite, tmp_path):
    tool = _cuobjdump()
    for shape, (cfg, compiled) in compiled_suite.items():
        path = tmp_path / "k.cubin"
        path.write_bytes(compiled.cubin)
        sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
        assert re.search(rf"QGMMA\.64x{cfg.block_n}x32", sass), \
            f"{shape} {cfg}: no QGMMA.64x{cfg.block_n}x32 in SASS"
        assert not re.search(r"\b(LDL|STL)\b", sass), f"{shape} {cfg}: local memory in SASS"
        assert_waits_before_global_access(sass, f"{shape} {cfg}")
        # B of one m-block is loaded with an L2 cache policy (the desc[] operand), unless each
        # B load is multicast to a pair of m-blocks.
        b_shared = cfg.num_multicast > 1 and not cfg.multicast_on_a
        assert bool(re.search(TMA_LOAD_WITH_POLICY, sass)) == (not b_shared), \
            f"{shape} {cfg}: B's evict_first load missing or misplaced"
        res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True).stdout
        local = re.findall(r"LOCAL:(\d+)", res)
        assert local and max(map(int, local)) == 0, res


@pytest.mark.parametrize("bm,bn,ks", [
    (128, 128, (512, 7168, 16384, 32768)),  # (TWO_ACCUM_MAX_K: every tile below)
    (128, 96, (7168,)), (128, 120, (32768,)), (128, 8, (7168,)),
    (64, 128, (512,)), (64, 96, (7168,)), (64, 8, (16384,))])
def test_two_accum_compiles_clean_over_its_k_range(bm, bn, ks, tmp_path, monkeypatch):
    """use_two_accum admits one-wave tiles up to 128 wide and K = TWO_ACCUM_MAX_K: no spills, no
    serialised wgmma at K steps across that range (128x128 spilled at K = 65536; 96 wide spilled
    2-3 KB when the promotion took a constant split in each k-block)."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    for k in ks + (g.TWO_ACCUM_MAX_K,):
        assert g.use_two_accum(bm, bn, k)
        stages = g.max_stages(bm, bn, k, H200.smem_per_block)
        cfg = g.Sm90Config(bm, bn, stages, 1, True, g.BAND_SIZE, 132, True)
        log = g.compile_kernel(GemmKind.DENSE, 7168, k, cfg)[1].log
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        if not spills:
            pytest.skip("this compiler's log has no ptxas report")
        assert max(spills) == 0 and not re.search(r"C751[459]", log), f"{cfg}\n{log}"


# (kind, N, K, BLOCK_N, two accumulators): 64-row tiles two CTAs an SM take, K short and long.
# (Contiguous tiles with two accumulators wider than 64 spill 4-8 bytes in 216 registers: the
# contiguous scheduler keeps more state live.)
TWO_CTA_TILES = [
    (GemmKind.DENSE, 2112, 7168, 32, True), (GemmKind.DENSE, 7168, 2048, 64, True),
    (GemmKind.DENSE, 4096, 7168, 160, False), (GemmKind.DENSE, 4096, 32768, 128, True),
    (GemmKind.MASKED, 4096, 7168, 128, True), (GemmKind.MASKED, 7168, 2048, 128, False),
    (GemmKind.CONTIGUOUS, 4096, 7168, 64, True), (GemmKind.CONTIGUOUS, 7168, 2048, 128, False),
    (GemmKind.OFFSETS, 7168, 2048, 128, True)]


@pytest.mark.parametrize("kind,n,k,bn,two_accum", TWO_CTA_TILES)
def test_two_ctas_per_sm_compile_clean(kind, n, k, bn, two_accum, tmp_path, monkeypatch):
    """ctas_per_sm = 2: the kernel launches in 128 registers a thread (half the register file
    for each of two CTAs), the math warpgroup grows to 216, and no 64-row tile spills; its
    stages fit half the SM's shared memory."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    limit = g.smem_limit(H200, 2)
    assert limit == (H200.smem_per_block + 1024) // 2 - 2048
    stages = g.max_stages(64, bn, k, limit, kind)
    assert stages >= g.MIN_STAGES
    cfg = g.Sm90Config(64, bn, stages, 1, True, g.BAND_SIZE, 264, two_accum, ctas_per_sm=2)
    assert cfg.smem(k, kind) <= cfg.smem_limit(H200) == limit
    log = g.compile_kernel(kind, n, k, cfg)[1].log
    assert not re.search(r"C75\d\d", log), f"{cfg}\n{log}"
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    if not spills or not regs:
        pytest.skip("this compiler's log has no ptxas report")
    assert max(spills) == 0 and max(regs) <= 128, f"{cfg}\n{log}"


def test_generated_wgmma_header_is_current():
    script = Path(__file__).resolve().parent.parent / "scripts" / "cuda_gen_wgmma.py"
    rc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr


# --- limits, odd pointers and strides, plans, launch context -------------------------------------
def test_supports_refuses_k_past_the_checked_limit():
    assert cuda_supports(problem(64, 576, g.MAX_K)) is None
    why = cuda_supports(problem(64, 576, g.MAX_K + 16))
    assert isinstance(why, str) and str(g.MAX_K) in why


@pytest.mark.parametrize("bm", [64, 128, 256])
def test_widest_tiles_at_max_k_do_not_spill(bm, tmp_path, monkeypatch):
    """MAX_K is a checked limit: the widest tile at K = MAX_K still compiles without spills
    (its B scales live in shared memory and in registers, both growing with K)."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    k = g.MAX_K
    # The widest tile of this height that fits shared memory at K = MAX_K.
    bn = max(n for n in (g.BLOCK_N_CHOICES_256 if bm == 256 else g.BLOCK_N_CHOICES)
             if g.max_stages(bm, n, k, H200.smem_per_block))
    stages = g.max_stages(bm, bn, k, H200.smem_per_block)
    assert stages >= g.MIN_STAGES
    cfg = g.Sm90Config(bm, bn, stages, 1, True, g.BAND_SIZE, 132)
    _, compiled, _, _ = g.compile_kernel(GemmKind.DENSE, 4096, k, cfg)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", compiled.log)]
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", compiled.log)]
    if not spills:
        pytest.skip("this compiler's log has no ptxas report")
    assert max(spills) == 0 and max(stack) == 0, compiled.log


def test_one_row_tensors_get_the_packed_row_stride():
    """torch calls a [1, K] view of a wider buffer (or an expanded row, stride 0) contiguous;
    its tensor map must not use that stride (TMA needs a multiple of 16 bytes)."""
    wide = torch.zeros(4, 1000, dtype=torch.uint8)
    one = wide[:1, :320]
    assert one.is_contiguous() and one.stride(0) == 1000
    assert cuda_launch.row_stride(one) == 320
    assert cuda_launch.row_stride(torch.zeros(320, dtype=torch.uint8).expand(1, 320)) == 320
    assert cuda_launch.row_stride(torch.zeros(3, 320, dtype=torch.uint8)) == 320


def test_misaligned_base_is_copied_to_an_aligned_tensor():
    base = torch.zeros(64 * 32 + 8, dtype=torch.uint8)
    start = (-base.data_ptr()) % 16 + 1  # one byte past a 16-byte boundary
    view = base[start:start + 64 * 32].view(64, 32)
    assert view.is_contiguous() and view.data_ptr() % 16
    fixed = cuda_launch.tma_aligned(view)
    assert fixed.data_ptr() % 16 == 0 and fixed.is_contiguous() and torch.equal(fixed, view)
    aligned = torch.zeros(64, 32, dtype=torch.uint8)
    assert cuda_launch.tma_aligned(aligned) is aligned


def test_plans_are_per_config(monkeypatch):
    """A plan belongs to (problem, device, config): a config chosen under another SM count
    (set_num_sms) gets a plan of its own, the same config the same plan."""
    built = []

    class FakePlan:
        def __init__(self, prob, device_index, cfg):
            built.append(cfg)

    monkeypatch.setattr(g, "Sm90Plan", FakePlan)
    monkeypatch.setattr(g, "_plans", {})
    p = problem(4096, 7168, 2048)
    cfg, few = g.DENSE.select_config(p, H200), g.DENSE.select_config(p, replace(H200, num_sms=66))
    assert cfg != few and few.grid <= 66
    first = g.get_plan(p, 0, cfg)
    assert g.get_plan(p, 0, cfg) is first and built == [cfg]
    second = g.get_plan(p, 0, few)
    assert second is not first and built == [cfg, few]


@pytest.mark.parametrize("stream,current,guarded", [
    (0, 0, False),           # default stream, tensors on the current device
    (0, 1, True),            # default stream, tensors on cuda:0 while cuda:1 is current
    (0xBEEF0000, 1, False),  # a real stream carries its own context
])
def test_launch_makes_the_tensor_device_current_for_the_null_stream(stream, current, guarded,
                                                                    monkeypatch):
    import contextlib

    events = []

    @contextlib.contextmanager
    def fake_device(index):
        events.append(("enter", index))
        yield
        events.append(("exit", index))

    class FakeKernel:
        def launch(self, config, s, pack):
            events.append(("launch", s))

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current, raising=False)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    cuda_launch.launch(FakeKernel(), "cfg", 0, "pack")
    if guarded:
        assert events == [("enter", 0), ("launch", stream), ("exit", 0)]
    else:
        assert events == [("launch", stream)]


# The heuristic picks no multicast kernel for the suite; CI still compiles the ones the GPU test
# `test_forced_configs` runs (helpers.FORCED_CONFIGS).
@pytest.mark.parametrize("m,n,k,bm,bn,multicast,on_a,two_accum", FORCED_CONFIGS)
def test_forced_configs_compile_clean(m, n, k, bm, bn, multicast, on_a, two_accum, tmp_path,
                                      monkeypatch):
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    stages = g.max_stages(bm, bn, k, H200.smem_per_block)
    cfg = g.Sm90Config(bm, bn, stages, multicast, on_a, g.BAND_SIZE, 132, two_accum)
    _, compiled, _, _ = g.compile_kernel(GemmKind.DENSE, n, k, cfg)
    assert_clean_cubin(compiled, cfg, tool, tmp_path, str(cfg))


@pytest.mark.parametrize("bn", [64, 96, 136, 144, 160, 192])
def test_split_per_tile_matches_the_kernel(bn, tmp_path, monkeypatch):
    """The cost model's SPLIT_PER_TILE_GAIN goes to the tiles whose one-accumulator k-loop the
    kernel instantiates once per B-scale split (n0 % 128): 4 k-steps of QGMMA per instance."""
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    stages = g.max_stages(128, bn, 2048, H200.smem_per_block)
    cfg = g.Sm90Config(128, bn, stages, 1, False, g.BAND_SIZE, 132, False)
    _, compiled, _, _ = g.compile_kernel(GemmKind.DENSE, 4096, 2048, cfg)
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.cubin)
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    instances = 128 // (bn & -bn) if g.split_per_tile(bn) else 1
    assert len(re.findall(rf"QGMMA\.64x{bn}x32", sass)) == 4 * instances, cfg
    assert g.split_per_tile(bn) == (bn in (96, 160, 192))


# Split-K: the configs the GPU test `test_split_k_configs` runs, with their in-kernel sum of the
# parts in the SASS: float4 part stores, the tile's counter, and the bf16 TMA store.
@pytest.mark.parametrize("m,n,k,bm,bn,splits", SPLIT_K_CONFIGS + [
    (1000, 512, 131072, 128, 192, 8),  # the widest split tile at MAX_K
    (1000, 1536, 24576, 128, 144, 5)])
def test_split_k_configs_compile_clean(m, n, k, bm, bn, splits, tmp_path, monkeypatch):
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    stages = g.max_stages(bm, bn, k, H200.smem_per_block)
    cfg = g.Sm90Config(bm, bn, stages, 1, False, g.BAND_SIZE, 132, False, splits)
    _, compiled, _, _ = g.compile_kernel(GemmKind.DENSE, n, k, cfg, has_c=True)
    assert_clean_cubin(compiled, cfg, tool, tmp_path, str(cfg))
    path = tmp_path / "split.cubin"
    path.write_bytes(compiled.cubin)
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    for op in ("STG.E.128", "ATOMG.E.ADD", "UTMASTG"):
        assert op in sass, f"{cfg}: no {op}"


@pytest.mark.parametrize("m,n,k", DSV3 + AWKWARD + [(1000, 512, 32768), (1000, 1536, 24576),
                                                    (1000, 2112, 7168), (4096, 512, 32768)])
def test_split_k_family_takes_what_the_model_halves(m, n, k):
    """The split-K family takes dense M >= SPLIT_MIN_M and declines unless its cheapest split's
    modelled time is at most SPLIT_MIN_GAIN of the cheapest whole tiles'; its config is then that
    split. Of these shapes only 1000x512x32768 (4 parts of 128x128, which the H200 ran 1.16x
    faster than 128x32 whole tiles with the parts summed by the host)."""
    p = problem(m, n, k)
    why = g.SPLIT_K.supports(p)
    assert (why is None) == (m >= g.SPLIT_MIN_M and g.DENSE.supports(p) is None and k > g.BLOCK_K)
    if why is not None:
        return
    split = min(g.split_candidates(m, n, k, H200), key=g._rank)
    whole = min(g.candidate_tiles(m, n, k, H200), key=g._rank)
    taken = g.SPLIT_K.declines(p, H200) is None
    assert taken == (split.cost <= g.SPLIT_MIN_GAIN * whole.cost)
    assert taken == ((m, n, k) == (1000, 512, 32768))
    cfg = g.SPLIT_K.select_config(p, H200)
    assert (cfg.block_m, cfg.block_n, cfg.splits, cfg.grid) == (
        split.block_m, split.block_n, split.splits, min(H200.num_sms, split.tiles))
    assert not cfg.two_accum and cfg.num_stages == split.num_stages and cfg.num_multicast == 1
    assert cfg.block_m <= g.SPLIT_MAX_BLOCK_M and 2 <= cfg.splits <= ceil_div(k, g.BLOCK_K)
    assert g.SPLIT_K.candidate_configs(p, H200)[0] == cfg
    if taken:
        assert (cfg.block_m, cfg.block_n, cfg.splits) == (128, 128, 4)


def test_split_k_family_is_offered_before_the_dense_one():
    """The backend runs 1000x512x32768 through the split-K family, and every dense problem it
    declines through the dense family."""
    from fp8gemm.backends import cuda

    assert cuda.FAMILIES.index(g.SPLIT_K) == cuda.FAMILIES.index(g.DENSE) - 1
    assert cuda.family_for(problem(1000, 512, 32768), H200) is g.SPLIT_K
    assert cuda.family_for(problem(4096, 2112, 7168), H200) is g.DENSE


def test_split_k_refusals():
    """A split plan needs a dense problem, tiles of at most 128 rows, no multicast, one
    accumulator, a k-block a part."""
    ok = g.Sm90Config(128, 128, 4, 1, False, g.BAND_SIZE, 132, False, 2)
    assert "splits=2" in str(ok)
    for cfg, prob in [(ok, problem(256, 512, 128)),  # one k-block for two parts
                      (g.Sm90Config(128, 128, 4, 2, False, 2, 132, False, 2), problem(512, 512, 1024)),
                      (g.Sm90Config(128, 128, 4, 1, False, 2, 132, True, 2), problem(512, 512, 1024)),
                      (g.Sm90Config(256, 128, 3, 1, False, 2, 132, False, 2), problem(512, 512, 1024))]:
        with pytest.raises(ValueError, match="split-K needs"):
            g.Sm90Plan(prob, 0, cfg)


def assert_clean_cubin(compiled, cfg, tool, tmp_path, what: str) -> None:
    """QGMMA of the tile's width in the SASS, no local memory, no stack, no serialised wgmma."""
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.cubin)
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    assert re.search(rf"QGMMA\.64x{cfg.block_n}x32", sass), f"{what}: no QGMMA.64x{cfg.block_n}x32"
    assert not re.search(r"\b(LDL|STL)\b", sass), f"{what}: local memory in SASS"
    assert_waits_before_global_access(sass, what)
    # ptxas serialises every wgmma where it cannot track the groups in flight (C7514 / C7515),
    # or injects a warpgroup.arrive and a dummy wgmma wait where a run-time branch picks between
    # wgmma sequences (C7519).
    assert not re.search(r"C751[459]", compiled.log), compiled.log
    res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True).stdout
    found = re.findall(r"STACK:(\d+)", res) + re.findall(r"LOCAL:(\d+)", res)
    assert len(found) >= 2 and max(map(int, found)) == 0, res


def test_pdl_check_catches_a_global_access_before_the_wait():
    """assert_waits_before_global_access (every kernel's compile test) fails where a load, a
    TMA load, a store, an L1 prefetch or more than kPrefetchKBlocks L2 box prefetches precede
    griddepcontrol.wait, and lets those L2 and descriptor prefetches through."""
    def sass(*ops):
        return "\n".join(f"        /*{16 * i:04x}*/        {op} ;" for i, op in enumerate(ops))

    assert_waits_before_global_access(sass("UTMAPF.L2.2D [UR4], [UR6]", "UTMACCTL.PF [UR6]",
                                           "ACQBULK", "PREEXIT", "CCTL.E.PF1 [R6]",
                                           "LDG.E R2, desc[UR4][R2.64]"), "ok")
    for early in ("LDG.E R2, desc[UR4][R2.64]", "UTMALDG.2D [UR8], [UR4]",
                  "STG.E desc[UR4][R4.64], R7", "REDG.E.ADD.F32.FTZ.RN desc[UR4][R2.64], R5",
                  "@!P0 CCTL.E.PF1 [R6]"):
        with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
            assert_waits_before_global_access(sass(early, "ACQBULK", "PREEXIT"), "bad")
    with pytest.raises(AssertionError, match="no griddepcontrol.wait"):
        assert_waits_before_global_access(sass("LDG.E R2, desc[UR4][R2.64]", "PREEXIT"), "bad")
    with pytest.raises(AssertionError, match="no launch_dependents"):
        assert_waits_before_global_access(sass("ACQBULK"), "bad")
    with pytest.raises(AssertionError, match="L2 box prefetches"):
        assert_waits_before_global_access(
            sass(*["UTMAPF.L2.2D [UR4], [UR6]"] * 3, "ACQBULK", "PREEXIT"), "bad")


# --- the grouped family ----------------------------------------------------------------------------
GROUPED_SUITE = [  # (kind, rows as stored, groups, expected_m, N, K)
    (GemmKind.CONTIGUOUS, 4 * 8192, 4, 0, 4096, 7168), (GemmKind.CONTIGUOUS, 4 * 8192, 4, 0, 7168, 2048),
    (GemmKind.CONTIGUOUS, 8 * 4096, 8, 0, 4096, 7168), (GemmKind.CONTIGUOUS, 8 * 4096, 8, 0, 7168, 2048),
    (GemmKind.OFFSETS, 8 * 4096, 8, 0, 4096, 7168), (GemmKind.OFFSETS, 8 * 4096, 8, 0, 7168, 2048),
    (GemmKind.MASKED, 1024, 1, 1024, 4096, 7168), (GemmKind.MASKED, 512, 2, 512, 7168, 2048),
    (GemmKind.MASKED, 256, 4, 256, 4096, 7168), (GemmKind.MASKED, 256, 32, 8, 7168, 2048),
    (GemmKind.MASKED, 128, 8, 3, 4096, 7168), (GemmKind.CONTIGUOUS, 384, 3, 0, 200, 336),
    (GemmKind.OFFSETS, 300, 5, 0, 576, 320),
    # the bench's skewed MoE cases: decode batches of 32..128 rows per expert, 32 experts
    (GemmKind.MASKED, 1024, 8, 128, 4096, 7168), (GemmKind.MASKED, 1024, 16, 64, 7168, 2048),
    (GemmKind.MASKED, 1024, 32, 32, 4096, 7168), (GemmKind.MASKED, 1024, 32, 32, 7168, 2048),
    (GemmKind.OFFSETS, 32768, 32, 0, 4096, 7168),
]


def grouped_problem(kind, rows, groups, expected_m, n, k) -> GemmProblem:
    return problem(rows, n, k, kind=kind, groups=groups, expected_m=expected_m)


@pytest.mark.parametrize("case", GROUPED_SUITE, ids=lambda c: f"{c[0].value}-{c[1:]}")
def test_grouped_configs(case):
    """The grouped family takes every grouped kind; contiguous tiles of 256 rows only from
    CONTIGUOUS_TALL_MIN_ROWS padded rows per group on average (a 256-row block of a layout
    padded to 128 may hold two groups and run once for each), no clusters, shared memory fits."""
    from fp8gemm.backends.cuda import family_for

    p = grouped_problem(*case)
    fam = family_for(p, H200)
    assert fam is g.GROUPED and cuda_supports(p) is None
    cfg = fam.select_config(p, H200)
    assert cfg.block_m in g.GROUPED_BLOCK_M_CHOICES and cfg.num_multicast == 1
    if p.kind is GemmKind.CONTIGUOUS:
        assert cfg.block_m <= 128 or p.m // p.groups >= g.CONTIGUOUS_TALL_MIN_ROWS
        if p.m // p.groups >= g.CONTIGUOUS_TALL_MIN_ROWS and p.n >= 2048:
            assert cfg.block_m == 256  # the MoE prefill shapes: 4-8 experts of 4096-8192 rows
    assert cfg.smem(p.k, p.kind) <= H200.smem_per_block and 1 <= cfg.grid <= H200.num_sms
    assert cfg == fam.candidate_configs(p, H200)[0]


def test_dense_family_refuses_grouped_and_back():
    p = grouped_problem(*GROUPED_SUITE[0])
    assert "grouped" not in (g.GROUPED.supports(p) or "")
    assert "dense" in g.DENSE.supports(p)
    assert "M-grouped" in g.GROUPED.supports(problem(64, 576, 512))


def test_masked_config_follows_expected_m():
    """expected_m, not Mmax, sizes the masked tiles: a decode batch of 8 rows per expert gets
    64-row tiles whatever Mmax is, MASKED_TALL_MIN_ROWS expected rows 256-row tiles."""
    def block_m(expected_m):
        p = grouped_problem(GemmKind.MASKED, 1024, 32, expected_m, 7168, 2048)
        return g.GROUPED.select_config(p, H200).block_m

    assert block_m(8) == 64 and block_m(g.MASKED_TALL_MIN_ROWS - 8) == 128
    assert block_m(g.MASKED_TALL_MIN_ROWS) == block_m(1024) == 256


def test_skewed_grouped_tiles_as_measured():
    """The moe-skewed suite's picks that a GPU timed against the alternatives in one run:
    contiguous over 8 and 16 experts and offsets over 8-32 in 256x128 tiles (an H100: 16
    contiguous experts 1.05-1.09x and 32 offsets ones 1.02-1.12x 128x192), 32 contiguous experts
    in 128x192 (256x128 0.92-0.94x there; on the H200 1.01-1.03x 128x128 with two accumulators,
    128x160 0.96x), 8 masked experts of 128 expected rows at 7168x2048 in 128x128 with two
    accumulators (1.04x 128x160 on the H200)."""
    from fp8gemm.bench.impls import case_problem
    from fp8gemm.bench.suites import suite_cases

    for case in suite_cases("moe-skewed"):
        p = case_problem(case)
        cfg = g.GROUPED.select_config(p, H200)
        tile = (cfg.block_m, cfg.block_n, cfg.two_accum)
        if case.op == "contiguous":
            assert tile == ((128, 192, False) if case.groups == 32 else (256, 128, False)), case
        if case.op == "offsets":
            assert tile == (256, 128, False), (case, cfg)
        if case.op == "masked" and case.groups == 8 and (case.n, case.k) == (7168, 2048):
            assert tile == (128, 128, True), (case, cfg)
    # At equal waves a 160-wide 128-row tile is priced above a 192-wide one per FLOP.
    assert g.tile_cost(128, 160, 7168) / 160 > g.tile_cost(128, 192, 7168) / 192


def test_grouped_suite_kernels_compile_clean(tmp_path, monkeypatch):
    """Every grouped kernel above and every pick of the bench's moe-skewed suite (wider tiles:
    128x192 over 32 contiguous experts) and moe-decode suite (64x32 tiles in the deep ring)
    compiles clean."""
    from fp8gemm.bench.impls import case_problem
    from fp8gemm.bench.suites import suite_cases

    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    skewed = [case_problem(c) for s in ("moe-skewed", "moe-decode") for c in suite_cases(s)]
    seen = set()
    for case, p in [(c, grouped_problem(*c)) for c in GROUPED_SUITE] + [(p, p) for p in skewed]:
        cfg = g.GROUPED.select_config(p, H200)
        if (p.kind, p.n, p.k, cfg) in seen:
            continue
        seen.add((p.kind, p.n, p.k, cfg))
        _, compiled, _, _ = g.compile_kernel(p.kind, p.n, p.k, cfg)
        assert_clean_cubin(compiled, cfg, tool, tmp_path, f"{case} {cfg}")
        # the scheduler's layout reads are prefetched into L1 (sm90_scheduler.cuh)
        sass = subprocess.run([tool, "-sass", str(tmp_path / "k.cubin")], capture_output=True,
                              text=True).stdout
        assert "CCTL.E.PF1" in sass, f"{case} {cfg}: no L1 prefetch of the grouped layout"


# Contiguous 128- and 256-row tiles in 2-CTA clusters sharing B (not offered by the heuristic):
# the configs the GPU test `test_contiguous_multicast_b` runs compile clean, with multicast loads.
@pytest.mark.parametrize("bm,bn,two_accum", [(128, 128, True), (128, 128, False), (128, 160, False),
                                             (256, 128, False)])
@pytest.mark.parametrize("n,k", [(1088, 896), (7168, 2048), (4096, 7168)])
def test_contiguous_multicast_b_compiles_clean(n, k, bm, bn, two_accum, tmp_path, monkeypatch):
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    stages = g.max_stages(bm, bn, k, H200.smem_per_block, GemmKind.CONTIGUOUS)
    cfg = g.Sm90Config(bm, bn, stages, 2, False, g.BAND_SIZE, 132, two_accum)
    _, compiled, _, _ = g.compile_kernel(GemmKind.CONTIGUOUS, n, k, cfg)
    assert_clean_cubin(compiled, cfg, tool, tmp_path, str(cfg))
    path = tmp_path / "k.cubin"
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    assert ".MULTICAST" in sass, f"{cfg}: no multicast load"


def test_multicast_refusals():
    """Clusters need an even band and grid; a contiguous GEMM shares only B, of 128- or 256-row
    tiles; offsets and masked GEMMs run without clusters."""
    contiguous = grouped_problem(GemmKind.CONTIGUOUS, 1024, 4, 0, 1088, 896)
    ok = g.Sm90Config(128, 128, 4, 2, False, g.BAND_SIZE, 132, False)
    for cfg, prob, why in [
            (replace(ok, grid=131), contiguous, "even grid"),
            (replace(ok, band_size=7), contiguous, "even band"),
            (replace(ok, multicast_on_a=True), contiguous, "256-row tiles only"),
            (replace(ok, block_m=64), contiguous, "256-row tiles only"),
            (ok, grouped_problem(GemmKind.OFFSETS, 1024, 4, 0, 1088, 896), "dense or contiguous"),
            (ok, grouped_problem(GemmKind.MASKED, 256, 4, 256, 1088, 896), "dense or contiguous"),
            (ok, problem(384, 1088, 896), "even block count")]:
        with pytest.raises(ValueError, match=why):
            g.Sm90Plan(prob, 0, cfg)

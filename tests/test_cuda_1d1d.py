"""The sm90 1D1D family (A and B in 1x128 groups along K, FP32 out, c accumulated): on the CPU its
routing, heuristic and every kernel it picks for the weight-gradient suite compiled for sm_90a
without spills; on the H200 (`gpu`) against float64 on the dequantised inputs.

GPU operands are random fp8 values with independent random scales (log-uniform in [1/4, 4]) on
both operands, so a wrong scale row or column, or a scale of the wrong k-block, is a large error.
The bound is helpers.TOLERANCES["gemm tensor cores", float32] (FP32 out on the GPU), with its basis.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace

import pytest
import torch

from fp8gemm.backends.cuda import family_for
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d1d as g
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g2
from fp8gemm.backends.cuda import supports as cuda_supports
from fp8gemm.backends.family import DeviceFacts
from fp8gemm.problem import SCALE_BLOCK, GemmKind, GemmProblem, Recipe, ceil_div
from helpers import (TENSOR_CORE_FP32_DIFF, a_scales, assert_close_diff,
                     assert_waits_before_global_access, b_scales, compiler_or_skip, poisoned,
                     rand_fp8, ref_gemm)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
H200 = DeviceFacts("NVIDIA H200", (9, 0), num_sms=132, smem_per_block=232448)
H100_PCIE = DeviceFacts("NVIDIA H100 PCIe", (9, 0), num_sms=114, smem_per_block=232448)
# The weight gradients of the DeepSeek-V3 dense layers (M, N) = (out, in features), K = tokens.
DSV3_MN = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
WGRAD = [(m, n, k) for (m, n) in DSV3_MN for k in (4096, 1000)]
AWKWARD = [(1, 576, 320), (37, 200, 1000), (64, 131, 128), (130, 576, 7), (257, 1000, 4096)]
# Tiles the GPU test `test_other_tiles` forces (N = 1000), with one accumulator or two: one math
# warpgroup, the widest of each height, the narrowest wgmma, a width that is not a multiple of 32.
FORCED_TILES = [(64, 16, False), (64, 192, False), (128, 8, False), (128, 176, False),
                (128, 136, False), (128, 128, True), (64, 128, True), (128, 8, True),
                (256, 120, False), (256, 64, False)]  # two waves of rows per k-block
FORCED_N = 1000


def problem(m, n, k, **kw) -> GemmProblem:
    base = dict(kind=GemmKind.DENSE, m=m, n=n, k=k, groups=1, a_dtype=E4M3, b_dtype=E4M3,
                a_recipe=Recipe.GROUP, b_recipe=Recipe.GROUP, out_dtype=torch.float32,
                has_c=True)
    base.update(kw)
    return GemmProblem(**base)


# --- routing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k", WGRAD + AWKWARD)
def test_cuda_backend_routes_1d1d_here(m, n, k):
    for has_c in (False, True):
        p = problem(m, n, k, has_c=has_c)
        assert cuda_supports(p) is None and family_for(p) is g.DENSE


def test_1d2d_problems_stay_with_the_1d2d_family():
    p = problem(4096, 7168, 2048, b_recipe=Recipe.BLOCK, out_dtype=torch.bfloat16, has_c=False)
    assert family_for(p, H200) is g2.DENSE
    assert "1x128 groups" in g.DENSE.supports(p)


@pytest.mark.parametrize("kw,needle", [
    (dict(b_dtype=torch.float8_e5m2), "B e4m3"),
    (dict(b_recipe=Recipe.BLOCK), "1x128"),
    (dict(a_recipe=Recipe.ROW), "1x128"),
    (dict(out_dtype=torch.bfloat16), "float32"),
    (dict(kind=GemmKind.MASKED, groups=2), "dense"),
    (dict(m=2 ** 31), "int32"),
])
def test_supports_refuses_with_reason(kw, needle):
    shape = dict(m=64, n=576, k=512)
    shape.update({key: kw.pop(key) for key in ("m", "n", "k") if key in kw})
    why = g.DENSE.supports(problem(**shape, **kw))
    assert isinstance(why, str) and needle in why


def test_e5m2_a_taken():
    """A in e5m2 (an output gradient) runs here; B stays e4m3."""
    p = problem(2112, 7168, 4096, a_dtype=E5M2)
    assert g.DENSE.supports(p) is None and family_for(p) is g.DENSE
    assert g.K_GROUPED.supports(replace(p, kind=GemmKind.K_GROUPED, groups=4)) is None
    assert "B e4m3" in g.DENSE.supports(problem(2112, 7168, 4096, b_dtype=E5M2))
    assert "B e4m3" in g.DENSE.supports(problem(2112, 7168, 4096, a_dtype=E5M2, b_dtype=E5M2))


# --- heuristic -------------------------------------------------------------------------------------
@pytest.mark.parametrize("facts", [H200, H100_PCIE], ids=["h200", "h100pcie"])
@pytest.mark.parametrize("m,n,k", WGRAD + AWKWARD)
def test_config_properties(m, n, k, facts):
    cfg = g.DENSE.select_config(problem(m, n, k), facts)
    assert cfg.block_m in g.BLOCK_M_CHOICES and cfg.block_n in g.BLOCK_N_CHOICES[cfg.block_m]
    assert cfg.block_m == 64 or m > 64
    assert cfg.smem == g.smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages) <= facts.smem_per_block
    # As deep as shared memory allows, up to the cap.
    assert g.MIN_STAGES <= cfg.num_stages <= g.MAX_STAGES
    assert (cfg.num_stages == g.MAX_STAGES
            or g.smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages + 1) > facts.smem_per_block)
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    assert 1 <= cfg.grid <= min(facts.num_sms, tiles)
    assert cfg.num_threads == (256 if cfg.block_m == 64 else 384)


@pytest.mark.parametrize("m,n,k", WGRAD + AWKWARD)
def test_config_is_the_cheapest(m, n, k):
    """The documented objective: least modelled time; among equals fewer tiles, two math
    warpgroups, the fullest last wave, the wider tile."""
    cfg = g.DENSE.select_config(problem(m, n, k), H200)
    cands = g.candidate_tiles(m, n, H200)
    chosen = next(c for c in cands if (c.block_m, c.block_n) == (cfg.block_m, cfg.block_n))
    key = lambda c: (c.cost, c.tiles, -c.block_m, -c.last_wave, -c.block_n)  # noqa: E731
    assert all(key(c) >= key(chosen) for c in cands)
    assert cfg == g.DENSE.candidate_configs(problem(m, n, k), H200)[0]


def test_wgrad_table(monkeypatch):
    """The tiles chosen for the suite's weight gradients on the H200. One accumulator: 128x160,
    whose k-blocks spread their fixed part over 160 columns (KBLOCK_FIXED_STEPS); 128x152 at
    7168x2048 (six waves either way, less work per tile); 128x176 at N = 512 (three n-blocks
    instead of four, though its ring is shallower: SHALLOW_RING_COST). Offered two accumulators
    (at most 136 wide), the model takes 128x136 with two where that saves a wave (2112x7168:
    seven against eight; 7168x16384, 4096x7168) and 128x128 with two elsewhere."""
    expect = {(2112, 7168): (128, 160), (24576, 1536): (128, 160), (32768, 512): (128, 176),
              (7168, 16384): (128, 160), (4096, 7168): (128, 160), (7168, 2048): (128, 152)}
    for pick in (False, True):
        monkeypatch.setattr(g, "PICK_TWO_ACCUM", pick)
        g._select.cache_clear()
        for (m, n), tile in expect.items():
            for k in (4096, 1000):
                cfg = g.DENSE.select_config(problem(m, n, k), H200)
                if pick:
                    wide = (m, n) in ((2112, 7168), (7168, 16384), (4096, 7168))
                    want = (128, 136 if wide else 128, True)
                else:
                    want = tile + (False,)
                assert (cfg.block_m, cfg.block_n, cfg.two_accum) == want, (pick, m, n, k, cfg)
                assert cfg.num_stages == (5 if cfg.block_n == 176 else 6), (m, n, k, cfg)
    g._select.cache_clear()


def test_config_is_pure_cached_and_k_independent():
    p = problem(4096, 7168, 4096)
    assert g.DENSE.select_config(p, H200) is g.DENSE.select_config(p, replace(H200))
    assert g.DENSE.select_config(p, H200) == g.DENSE.select_config(replace(p, k=1000), H200)
    few = g.DENSE.select_config(p, replace(H200, num_sms=100))
    assert few.grid <= 100
    hash(few) and str(few)


def test_print_configs_names_the_family(monkeypatch, capsys):
    class FakePlan:
        def __init__(self, prob, device_index, cfg):
            pass

    monkeypatch.setattr(g, "Sm90Plan1d1d", FakePlan)
    monkeypatch.setattr(g, "_plans", {})
    monkeypatch.setenv("FP8GEMM_PRINT_CONFIGS", "1")
    p = problem(4096, 7168, 4096)
    cfg = g.DENSE.select_config(p, H200)
    g.get_plan(p, 0, cfg)
    g.get_plan(p, 0, cfg)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"[fp8gemm] cuda: {p} -> sm90_fp8_gemm_1d1d {cfg}"]


# --- host pieces --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,k", [(3, 1000), (1, 7), (2, 4096)])
def test_operand_rows_padded_to_16_bytes(rows, k):
    t = torch.randint(0, 255, (rows, k), dtype=torch.uint8)
    r = g._tma_rows(t)
    assert torch.equal(r, t) and r.data_ptr() % 16 == 0
    assert g._row_bytes(r) % 16 == 0 and g._row_bytes(r) >= k
    if k % 16 == 0:
        assert r is t


def test_launcher_only_for_kernel_layouts():
    sa = a_scales(Recipe.GROUP, 256, 4096, col_major=True)
    sb = a_scales(Recipe.GROUP, 384, 4096, col_major=True)
    row_major = b_scales(Recipe.GROUP, 384, 4096)
    assert g.launcher(problem(256, 384, 4096), sa, row_major) is None
    assert g.launcher(problem(256, 384, 1000), sa[:, :8], sb[:, :8]) is None  # K % 16: copies


def test_launcher_hits_the_packs_the_plan_builds(monkeypatch):
    """A warm call finds the argument pack Sm90Plan1d1d.run stored (one key function for both)
    and launches it without the plan's run; a new pointer goes through the plan's run."""
    launched, ran = [], []

    class FakePlan:
        sm_override = None
        kernel, launch = "kernel", "launch config"

        def __init__(self):
            self.packs = {}

        def run(self, *args):
            ran.append(args)

    t = lambda *shape: torch.zeros(*shape)  # noqa: E731
    a, b, out, c = t(4, 128), t(8, 128), t(4, 8), t(4, 8)
    sa = a_scales(Recipe.GROUP, 4, 128, col_major=True)
    sb = a_scales(Recipe.GROUP, 8, 128, col_major=True)
    plan = FakePlan()
    plan.packs[g.pack_key(a, sa, b, sb, out, c, None)] = "pack"
    monkeypatch.setattr(g, "launch", lambda *args: launched.append(args))
    monkeypatch.setattr(g, "get_plan", lambda *args: plan)
    monkeypatch.setattr(g.DENSE, "config_for", lambda *args: None)
    run = object.__new__(g._Launcher)
    run.problem, run.device, run.device_index, run.plan = problem(4, 8, 128), None, 0, plan
    run.run(a, sa, b, sb, out, c)
    assert launched == [("kernel", "launch config", 0, "pack")] and not ran
    run.run(a, sa, b, sb, t(4, 8), c)
    assert len(launched) == 1 and len(ran) == 1


# --- compile every kernel the heuristic picks --------------------------------------------------------
def _cuobjdump():
    from fp8gemm.jit import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's wheel)")
    return tool


def _assert_clean(compiled, cfg, tool, tmp_path, what):
    """No spills or stack in ptxas' report; QGMMA of the tile's width and no local memory in
    the SASS; the wgmma not serialised (C7514 / C7515) nor fenced by injected waits (C7519)."""
    log = compiled.log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    assert not re.search(r"C751[459]", log), f"{what}: ptxas serialised or fenced the wgmma\n{log}"
    if spills:
        assert max(spills) == 0 and max(stack) == 0, f"{what}: spills\n{log}"
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.cubin)
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    assert re.search(rf"QGMMA\.64x{cfg.block_n}x32", sass), f"{what}: no QGMMA.64x{cfg.block_n}x32"
    assert not re.search(r"\b(LDL|STL)\b", sass), f"{what}: local memory in SASS"
    assert_waits_before_global_access(sass, what)
    # c == out: the sums go to global memory as L2 reductions, two floats at a time for even N.
    assert re.search(r"REDG\.E\.ADD\.F32", sass), f"{what}: no in-place reduction"
    # Two accumulators: in a chunk of 8 k-blocks, 7 waits leave the next k-block's wgmma in
    # flight (the overlap the variant exists for); one accumulator waits for all of them.
    overlapped = len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass))
    assert overlapped == (7 if cfg.two_accum else 0), f"{what}: {overlapped} overlapped waits"
    res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True).stdout
    found = re.findall(r"STACK:(\d+)", res) + re.findall(r"LOCAL:(\d+)", res)
    assert len(found) >= 2 and max(map(int, found)) == 0, res


def test_every_picked_kernel_compiles_clean(tmp_path, monkeypatch):
    """Every (N, config) the heuristic picks for the suite (H200 and H100 PCIe), the widest tile
    of each height (128x176: two math warpgroups at 232 registers; 64x192: one at 256) and the
    tiles the GPU tests force."""
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    seen = {}
    for facts in (H200, H100_PCIE):
        for m, n, k in WGRAD + AWKWARD:
            seen.setdefault((n, g.DENSE.select_config(problem(m, n, k), facts)), (m, n, k))
    # the widest with vector stores, and with the odd-N scalar ones
    forced = [(bm, bn, False, n) for bm in g.BLOCK_M_CHOICES
              for bn, n in ((g.BLOCK_N_CHOICES[bm][-1], 7168), (g.BLOCK_N_CHOICES[bm][-1], 131))]
    forced += [(bm, g.TWO_ACCUM_MAX_BLOCK_N[bm], True, 7168) for bm in g.BLOCK_M_CHOICES]
    for bm, bn, two, n in forced + [(bm, bn, two, FORCED_N) for bm, bn, two in FORCED_TILES]:
        cfg = g.Sm90Config1d1d(bm, bn, g.max_stages(bm, bn, H200.smem_per_block), g.BAND_SIZE, 132,
                               two)
        seen.setdefault((n, cfg), (None, n, None))
    for (n, cfg), shape in seen.items():
        _, compiled, _, _ = g.compile_kernel(n, cfg)
        _assert_clean(compiled, cfg, tool, tmp_path, f"{shape} {cfg}")


def test_e5m2_a_kernels_compile_clean(tmp_path, monkeypatch):
    """A in e5m2: the widest tiles of each height, one and two accumulators, dense and
    k-grouped, compile as clean as the e4m3 ones, with the e5m2 x e4m3 QGMMA."""
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    for k_grouped, choices in ((False, g.BLOCK_N_CHOICES), (True, g.K_GROUPED_BLOCK_N_CHOICES)):
        for bm in g.BLOCK_M_CHOICES:
            for bn, two in ((choices[bm][-1], False), (g.TWO_ACCUM_MAX_BLOCK_N[bm], True)):
                cfg = g.Sm90Config1d1d(bm, bn, g.max_stages(bm, bn, H200.smem_per_block),
                                       g.BAND_SIZE, 132, two)
                compiled = g.compile_kernel(7168, cfg, k_grouped, a_e5m2=True)[1]
                what = f"e5m2 A, k-grouped={k_grouped} {cfg}"
                _assert_clean(compiled, cfg, tool, tmp_path, what)
                path = tmp_path / "e5m2.cubin"
                path.write_bytes(compiled.cubin)
                sass = subprocess.run([tool, "-sass", str(path)], capture_output=True,
                                      text=True).stdout
                assert f"QGMMA.64x{bn}x32.F32.E5M2.E4M3" in sass, what
                assert ".E4M3.E4M3" not in sass, what


def test_one_past_the_widest_tile_spills(tmp_path, monkeypatch):
    """BLOCK_N_CHOICES (for an even and an odd N) and K_GROUPED_BLOCK_N_CHOICES stop where ptxas
    starts spilling (the stated register budget)."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    for bm in g.BLOCK_M_CHOICES:
        for what, widest, n, k_grouped in (
                ("BLOCK_N_CHOICES", g.BLOCK_N_CHOICES[bm][-1], 7168, False),
                ("K_GROUPED_BLOCK_N_CHOICES", g.K_GROUPED_BLOCK_N_CHOICES[bm][-1], 7168, True),
                ("BLOCK_N_CHOICES (odd N)", g.BLOCK_N_CHOICES[bm][-1], 131, False)):
            bn = widest + 8
            cfg = g.Sm90Config1d1d(bm, bn, g.max_stages(bm, bn, H200.smem_per_block),
                                   g.BAND_SIZE, 132)
            log = g.compile_kernel(n, cfg, k_grouped)[1].log
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
            if not spills:
                pytest.skip("this compiler's log has no ptxas report")
            assert max(spills) > 0, f"{cfg} N={n} compiles clean: widen {what}"


def test_tall_tiles_compile_clean_up_to_the_stated_width(tmp_path, monkeypatch):
    """BLOCK_M = 256 (two waves of rows per k-block): the widest of TALL_BLOCK_N_CHOICES compiles
    clean dense and k-grouped, e4m3 and e5m2; one step wider spills (the stated register
    budget)."""
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    bn = g.TALL_BLOCK_N_CHOICES[-1]
    cfg = g.Sm90Config1d1d(256, bn, g.max_stages(256, bn, H200.smem_per_block), g.BAND_SIZE, 132)
    for k_grouped in (False, True):
        for e5m2 in (False, True):
            compiled = g.compile_kernel(7168, cfg, k_grouped, a_e5m2=e5m2)[1]
            _assert_clean(compiled, cfg, tool, tmp_path, f"k-grouped={k_grouped} e5m2={e5m2} {cfg}")
    wider = g.Sm90Config1d1d(256, bn + 8, g.max_stages(256, bn + 8, H200.smem_per_block),
                             g.BAND_SIZE, 132)
    log = g.compile_kernel(7168, wider)[1].log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if not spills:
        pytest.skip("this compiler's log has no ptxas report")
    assert max(spills) > 0, f"{wider} compiles clean: widen TALL_BLOCK_N_CHOICES"


def test_one_past_the_widest_two_accum_tile_spills(tmp_path, monkeypatch):
    """TWO_ACCUM_MAX_BLOCK_N stops where ptxas starts spilling at both heights (the k-grouped walk,
    which keeps a few more registers live than the dense one)."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    for bm in g.BLOCK_M_CHOICES:
        bn = g.TWO_ACCUM_MAX_BLOCK_N[bm] + 8
        cfg = g.Sm90Config1d1d(bm, bn, g.max_stages(bm, bn, H200.smem_per_block), g.BAND_SIZE, 132,
                               True)
        log = g.compile_kernel(7168, cfg, k_grouped=True)[1].log
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        if not spills:
            pytest.skip("this compiler's log has no ptxas report")
        assert max(spills) > 0, f"{cfg} compiles clean: raise TWO_ACCUM_MAX_BLOCK_N"


# --- GPU ------------------------------------------------------------------------------------------
def _operands(m, n, k, device, gen=None, a_dtype=E4M3):
    """A, B and both scales 1x128 along K, the scales in the kernel's column-major layout (what
    quantize_per_token_transposed writes)."""
    a, b = rand_fp8((m, k), a_dtype, device, gen), rand_fp8((n, k), E4M3, device, gen)
    sa = a_scales(Recipe.GROUP, m, k, device, col_major=True, gen=gen)
    sb = a_scales(Recipe.GROUP, n, k, device, col_major=True, gen=gen)
    return a, sa, b, sb


def _reference(a, sa, b, sb, c=None):
    return ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.GROUP, c)


def _run(a, sa, b, sb, out, c=None, cfg=None):
    p = problem(a.shape[0], b.shape[0], a.shape[1], has_c=c is not None, a_dtype=a.dtype)
    assert family_for(p) is g.DENSE
    cfg = cfg or g.DENSE.config_for(p, a.device)
    g.DENSE.run(cfg, p, a, sa, b, sb, out, c)
    return out


GPU_SHAPES = [(256, 384, 128), (300, 200, 1000), (129, 520, 4096), (1024, 2112, 7168),
              (1, 576, 320), (37, 131, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("c_mode", ["none", "separate", "alias"])
def test_matches_float64(m, n, k, c_mode, gpu_device):
    a, sa, b, sb = _operands(m, n, k, gpu_device)
    c = torch.randn(m, n, device=gpu_device) * 64  # about the products' size
    if c_mode == "alias":
        out = c.clone()
        _run(a, sa, b, sb, out, out)
    else:
        out = poisoned((m, n), torch.float32, gpu_device)
        _run(a, sa, b, sb, out, c if c_mode == "separate" else None)
    ref = _reference(a, sa, b, sb, None if c_mode == "none" else c)
    assert_close_diff(out, ref, TENSOR_CORE_FP32_DIFF, f"{m}x{n}x{k} c={c_mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("bm,bn,two", FORCED_TILES)
def test_other_tiles(bm, bn, two, gpu_device):
    """Configs the suite may not pick: one math warpgroup, the widest tiles, an N tail inside a
    tile, M and K tails (9 k-blocks: with two accumulators one chunk of 8 and one alone)."""
    m, n, k = 300, FORCED_N, 1100
    a, sa, b, sb = _operands(m, n, k, gpu_device)
    cfg = g.Sm90Config1d1d(bm, bn, g.max_stages(bm, bn, H200.smem_per_block), g.BAND_SIZE, 132,
                           two)
    c = torch.randn(m, n, device=gpu_device)
    out = poisoned((m, n), torch.float32, gpu_device)
    _run(a, sa, b, sb, out, c, cfg)
    assert_close_diff(out, _reference(a, sa, b, sb, c), TENSOR_CORE_FP32_DIFF, str(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(300, 200, 1000), (1024, 2112, 4096), (37, 131, 7)])
@pytest.mark.parametrize("c_mode", ["none", "alias"])
def test_e5m2_a_matches_float64(m, n, k, c_mode, gpu_device):
    """A in e5m2 (dY^T of a gradient quantised in e5m2) against float64, through the family's
    own config; e5m2 codes read as e4m3 would be a large error."""
    a, sa, b, sb = _operands(m, n, k, gpu_device, a_dtype=E5M2)
    c = torch.randn(m, n, device=gpu_device) * 64
    out = c.clone() if c_mode == "alias" else poisoned((m, n), torch.float32, gpu_device)
    _run(a, sa, b, sb, out, out if c_mode == "alias" else None)
    ref = _reference(a, sa, b, sb, c if c_mode == "alias" else None)
    assert_close_diff(out, ref, TENSOR_CORE_FP32_DIFF, f"e5m2 A {m}x{n}x{k} c={c_mode}")


@pytest.mark.gpu
def test_bit_identical_repeats_and_row_major_scales(gpu_device):
    m, n, k = 1024, 1536, 4096
    a, sa, b, sb = _operands(m, n, k, gpu_device)
    first = _run(a, sa, b, sb, poisoned((m, n), torch.float32, gpu_device))
    for _ in range(2):
        assert torch.equal(_run(a, sa, b, sb, poisoned((m, n), torch.float32, gpu_device)), first)
    # Row-major scales (converted on the host) give the same bits.
    again = _run(a, sa.contiguous(), b, sb.contiguous(), poisoned((m, n), torch.float32, gpu_device))
    assert torch.equal(again, first)


@pytest.mark.gpu
def test_through_the_op_and_its_warm_path(gpu_device):
    """fp8gemm.fp8_gemm_nt with 1x128 scales on both operands, fp32 out and c = out (the
    weight-gradient call): the CUDA backend runs it, warm calls (the launcher) accumulate."""
    import fp8gemm

    m, n, k = 512, 768, 1024
    a, sa, b, sb = _operands(m, n, k, gpu_device)
    out = torch.zeros(m, n, device=gpu_device)
    for _ in range(3):
        fp8gemm.fp8_gemm_nt((a, sa), (b, sb), out, c=out, backend="cuda")
    assert_close_diff(out, 3 * _reference(a, sa, b, sb), TENSOR_CORE_FP32_DIFF, "3 x accumulate")
    y = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), out_dtype=torch.float32, backend="cuda")
    assert_close_diff(y, _reference(a, sa, b, sb), TENSOR_CORE_FP32_DIFF, "no c")


@pytest.mark.gpu
def test_cuda_graph_capture(gpu_device):
    m, n, k = 384, 640, 1000  # K % 16 != 0: the padded copies are captured too
    a, sa, b, sb = _operands(m, n, k, gpu_device)
    out = torch.zeros(m, n, device=gpu_device)
    _run(a, sa, b, sb, out, out)  # warm: compile, load, plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(a, sa, b, sb, out, out)
    a2, sa2, b2, sb2 = _operands(m, n, k, gpu_device)
    for src, dst in ((a2, a), (sa2, sa), (b2, b), (sb2, sb)):
        dst.copy_(src)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert_close_diff(out, 2 * _reference(a, sa, b, sb), TENSOR_CORE_FP32_DIFF, "graph replay")


@pytest.mark.gpu
def test_misaligned_out_and_operands(gpu_device):
    """Views at odd offsets: the host copies what TMA or the 8-byte stores cannot address."""
    m, n, k = 200, 264, 512
    a, sa, b, sb = _operands(m, n, k, gpu_device)
    a_buf = torch.empty(m * k + 16, dtype=torch.uint8, device=gpu_device)
    a_odd = a_buf[1:1 + m * k].view(E4M3).view(m, k)
    a_odd.copy_(a)
    out_buf = poisoned((m * n + 1,), torch.float32, gpu_device)
    out = out_buf[1:].view(m, n)
    c = torch.randn(m, n, device=gpu_device)
    _run(a_odd, sa, b, sb, out, c)
    assert_close_diff(out, _reference(a, sa, b, sb, c), TENSOR_CORE_FP32_DIFF, "odd offsets")
    assert torch.isnan(out_buf[0])


# --- the k-grouped family ----------------------------------------------------------------------------
# (M, N, ks): the suite's MoE weight gradients (8 experts x 4096 tokens, and skewed counts that
# are multiples of 128), then awkward splits (empty groups, K not a multiple of 128 or 16).
K_GROUPED_CPU = [(4096, 7168, (4096,) * 8), (7168, 2048, (4096,) * 8),
                 (4096, 7168, (1024, 7680, 256, 4096, 2048, 9216, 512, 8192)),
                 (200, 376, (16384, 3, 0)), (64, 131, (1000, 0, 37))]


def k_problem(m, n, ks, has_c=False, **kw) -> GemmProblem:
    return problem(m, n, sum(ks), kind=GemmKind.K_GROUPED, groups=len(ks), has_c=has_c, **kw)


@pytest.mark.parametrize("m,n,ks", K_GROUPED_CPU)
def test_k_grouped_routing_and_config(m, n, ks):
    p = k_problem(m, n, ks, has_c=True)
    assert cuda_supports(p) is None and family_for(p) is g.K_GROUPED
    assert "k_grouped" in g.DENSE.supports(p) and "dense" in g.K_GROUPED.supports(problem(m, n, 128))
    cfg = g.K_GROUPED.select_config(p, H200)
    assert cfg.block_n in g.K_GROUPED_BLOCK_N_CHOICES[cfg.block_m]
    assert cfg.smem <= H200.smem_per_block
    tiles = len(ks) * ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    assert cfg.grid == min(H200.num_sms, tiles)
    assert cfg == g.K_GROUPED.candidate_configs(p, H200)[0]


def test_k_grouped_picked_kernels_compile_clean(tmp_path, monkeypatch):
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    seen = {(n, g.K_GROUPED.select_config(k_problem(m, n, ks), f))
            for f in (H200, H100_PCIE) for m, n, ks in K_GROUPED_CPU}
    for bm in g.BLOCK_M_CHOICES:  # the widest of each height, with one and two accumulators
        for bn, two in ((g.K_GROUPED_BLOCK_N_CHOICES[bm][-1], False),
                        (g.TWO_ACCUM_MAX_BLOCK_N[bm], True)):
            seen.add((7168, g.Sm90Config1d1d(bm, bn, g.max_stages(bm, bn, H200.smem_per_block),
                                             g.BAND_SIZE, 132, two)))
    for n, cfg in sorted(seen, key=str):
        _, compiled, _, _ = g.compile_kernel(n, cfg, k_grouped=True)
        _assert_clean(compiled, cfg, tool, tmp_path, f"k-grouped N={n} {cfg}")
        sass = subprocess.run([tool, "-sass", str(tmp_path / "k.cubin")], capture_output=True,
                              text=True).stdout
        assert "CCTL.E.PF1" in sass, f"k-grouped N={n} {cfg}: ks not prefetched into L1"


def _k_operands(m, n, ks, device, a_dtype=E4M3):
    """A [M, sum K], B [N, sum K] and their scales [rows, sum ceil(K_g/128)] (column-major),
    each group with its own 1x128 blocks."""
    s = sum(ceil_div(k, SCALE_BLOCK) for k in ks)
    a, b = rand_fp8((m, sum(ks)), a_dtype, device), rand_fp8((n, sum(ks)), E4M3, device)
    sa = a_scales(Recipe.GROUP, m, SCALE_BLOCK * s, device, col_major=True)
    sb = a_scales(Recipe.GROUP, n, SCALE_BLOCK * s, device, col_major=True)
    return a, sa, b, sb


def _k_reference(a, sa, b, sb, ks, c=None):
    out = torch.zeros(len(ks), a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    off = kb = 0
    for i, k in enumerate(ks):
        nkb = ceil_div(k, SCALE_BLOCK)
        if k:
            out[i] = ref_gemm(a[:, off:off + k], sa[:, kb:kb + nkb], Recipe.GROUP,
                              b[:, off:off + k], sb[:, kb:kb + nkb], Recipe.GROUP)
        off, kb = off + k, kb + nkb
    return out if c is None else out + c.double()


def _k_run(a, sa, b, sb, ks_t, out, c=None):
    p = k_problem(a.shape[0], b.shape[0], [0] * ks_t.shape[0], has_c=c is not None)
    p = replace(p, k=a.shape[1], a_dtype=a.dtype)
    assert family_for(p) is g.K_GROUPED
    g.K_GROUPED.run(g.K_GROUPED.config_for(p, a.device), p, a, sa, b, sb, out, c, ks_t)
    return out


K_GROUPED_GPU = [(256, 384, (512, 1024, 0, 256)),        # multiples of 128: read in place
                 (300, 200, (1000, 37, 0, 129, 17)),      # moved to k-blocks first
                 (129, 136, (3, 0, 0))]                   # sum K odd, groups of nothing


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,ks", K_GROUPED_GPU)
@pytest.mark.parametrize("c_mode", ["none", "separate", "alias"])
def test_k_grouped_matches_float64(m, n, ks, c_mode, gpu_device):
    a, sa, b, sb = _k_operands(m, n, ks, gpu_device)
    ks_t = torch.tensor(ks, dtype=torch.int32, device=gpu_device)
    c = torch.randn(len(ks), m, n, device=gpu_device) * 64
    if c_mode == "alias":
        out = c.clone()
        _k_run(a, sa, b, sb, ks_t, out, out)
    else:
        out = poisoned((len(ks), m, n), torch.float32, gpu_device)
        _k_run(a, sa, b, sb, ks_t, out, c if c_mode == "separate" else None)
    ref = _k_reference(a, sa, b, sb, ks, None if c_mode == "none" else c)
    assert_close_diff(out, ref, TENSOR_CORE_FP32_DIFF, f"{m}x{n} ks={ks} c={c_mode}")
    if c_mode == "none":
        assert all((out[i] == 0).all() for i, k in enumerate(ks) if k == 0)
    if c_mode == "alias":  # a group of nothing leaves its slice of out untouched, bit for bit
        assert all(torch.equal(out[i], c[i]) for i, k in enumerate(ks) if k == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("c_mode", ["none", "separate", "alias"])
def test_tall_tiles(c_mode, gpu_device):
    """BLOCK_M = 256 (two waves of rows per k-block), forced: dense with M tails in either wave
    (300 rows: the second block's second wave has none; 1000: 232 rows) and the k-grouped kernel
    accumulating in place."""
    cfg = g.Sm90Config1d1d(256, 120, g.max_stages(256, 120, H200.smem_per_block), g.BAND_SIZE,
                           132)
    for m, n, k in ((300, 1000, 1100), (1000, 360, 4096)):
        a, sa, b, sb = _operands(m, n, k, gpu_device)
        c = torch.randn(m, n, device=gpu_device) * 64
        if c_mode == "alias":
            out = c.clone()
            _run(a, sa, b, sb, out, out, cfg)
        else:
            out = poisoned((m, n), torch.float32, gpu_device)
            _run(a, sa, b, sb, out, c if c_mode == "separate" else None, cfg)
        ref = _reference(a, sa, b, sb, None if c_mode == "none" else c)
        assert_close_diff(out, ref, TENSOR_CORE_FP32_DIFF, f"{m}x{n}x{k} c={c_mode} {cfg}")
    if c_mode != "alias":
        return
    m, n, ks = 300, 200, (1000, 37, 0, 129, 17)
    a, sa, b, sb = _k_operands(m, n, ks, gpu_device)
    ks_t = torch.tensor(ks, dtype=torch.int32, device=gpu_device)
    c = torch.randn(len(ks), m, n, device=gpu_device) * 64
    out = c.clone()
    p = replace(k_problem(m, n, [0] * len(ks), has_c=True), k=a.shape[1])
    g.K_GROUPED.run(cfg, p, a, sa, b, sb, out, out, ks_t)
    assert_close_diff(out, _k_reference(a, sa, b, sb, ks, c), TENSOR_CORE_FP32_DIFF,
                      f"k-grouped {m}x{n} ks={ks} {cfg}")


@pytest.mark.gpu
def test_k_grouped_e5m2_a_matches_float64(gpu_device):
    """The MoE weight gradient with each expert's dY^T in e5m2, accumulated in place."""
    m, n, ks = 300, 200, (1000, 37, 0, 129, 17)
    a, sa, b, sb = _k_operands(m, n, ks, gpu_device, a_dtype=E5M2)
    ks_t = torch.tensor(ks, dtype=torch.int32, device=gpu_device)
    c = torch.randn(len(ks), m, n, device=gpu_device) * 64
    out = c.clone()
    _k_run(a, sa, b, sb, ks_t, out, out)
    assert_close_diff(out, _k_reference(a, sa, b, sb, ks, c), TENSOR_CORE_FP32_DIFF,
                      f"e5m2 A {m}x{n} ks={ks}")


@pytest.mark.gpu
def test_k_grouped_cuda_graph_reads_ks_on_the_device(gpu_device):
    """Captured once, replayed after ks changes in place (the padded copies are captured too)."""
    m, n = 256, 384
    ks_a, ks_b = (512, 0, 300, 212), (0, 1000, 24, 0)
    s = max(sum(ceil_div(k, SCALE_BLOCK) for k in ks) for ks in (ks_a, ks_b))
    a, b = rand_fp8((m, sum(ks_a)), E4M3, gpu_device), rand_fp8((n, sum(ks_a)), E4M3, gpu_device)
    sa = a_scales(Recipe.GROUP, m, SCALE_BLOCK * s, gpu_device, col_major=True)
    sb = a_scales(Recipe.GROUP, n, SCALE_BLOCK * s, gpu_device, col_major=True)
    ks_t = torch.tensor(ks_a, dtype=torch.int32, device=gpu_device)
    out = torch.empty(4, m, n, device=gpu_device)
    _k_run(a, sa, b, sb, ks_t, out)  # compile, load, plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _k_run(a, sa, b, sb, ks_t, out)
    for ks in (ks_b, ks_a):
        ks_t.copy_(torch.tensor(ks, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_diff(out, _k_reference(a, sa, b, sb, ks), TENSOR_CORE_FP32_DIFF,
                          f"replay ks={ks}")

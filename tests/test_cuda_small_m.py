"""The CUDA small-M family (sm90_fp8_gemm_1d2d_small_m: swap-AB, split-K over a cluster).

CPU: what it supports and declines, the heuristic's choices and their validity over a table of
decode shapes, the shared-memory layout against the kernel's, and every kernel the heuristic
picks (plus the extremes it may pick) compiled for sm_90a with no spills, no local memory, no
serialised or fenced wgmma and QGMMA of the token tile's width in the SASS.

GPU (marked gpu): against float64 on the dequantised inputs (independent random scales, so a
scale read from the wrong token or k-block shows as a large error), poisoned outputs, a strided
output view, bit-identical repeats of split configs, CUDA-graph capture, the ops layer's warm path,
and the model's cluster capacity against the driver's.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import replace

import pytest
import torch

from fp8gemm.backends import cuda as cuda_backend
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as dense
from fp8gemm.backends.cuda import sm90_fp8_gemm_small_m as sm
from fp8gemm.backends.family import DeviceFacts
from fp8gemm.problem import GemmKind, GemmProblem, Recipe, align, ceil_div
from helpers import (TMA_LOAD_WITH_POLICY, TOL, assert_waits_before_global_access, calc_diff,
                     col_major_tma, compiler_or_skip, poisoned, rand_fp8, rand_scales, ref_gemm,
                     ref_masked)

E4M3 = torch.float8_e4m3fn
H200 = DeviceFacts("NVIDIA H200", (9, 0), num_sms=132, smem_per_block=232448)
H100_PCIE = DeviceFacts("NVIDIA H100 PCIe", (9, 0), num_sms=114, smem_per_block=232448)
MS = (1, 2, 7, 37, 64, 100, 129, 200, 256)
# The suite's N x K, then thin, wide and awkward ones (N < 64, K not a multiple of 128).
NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048),
      (576, 7168), (200, 336), (576, 320), (56, 1040), (1024, 4096)]
TABLE = [(m, n, k) for m in MS for (n, k) in NK]


def problem(m, n, k, **kw) -> GemmProblem:
    base = dict(kind=GemmKind.DENSE, m=m, n=n, k=k, groups=1, a_dtype=E4M3, b_dtype=E4M3,
                a_recipe=Recipe.GROUP, b_recipe=Recipe.BLOCK, out_dtype=torch.bfloat16)
    base.update(kw)
    return GemmProblem(**base)


def chosen(m, n, k, facts=H200):
    return cuda_backend.family_for(problem(m, n, k), facts)


# --- supports and declines ---------------------------------------------------------------------------
def test_supports_decode_sizes_only():
    assert sm.SMALL_M.supports(problem(256, 2112, 7168)) is None
    why = sm.SMALL_M.supports(problem(257, 2112, 7168))
    assert isinstance(why, str) and "M <= 256" in why
    assert "dense" in sm.SMALL_M.supports(problem(64, 576, 512, kind=GemmKind.MASKED, groups=2))
    for kw, needle in [(dict(b_dtype=torch.float8_e5m2), "e4m3"), (dict(has_c=True), "C"),
                       (dict(a_recipe=Recipe.ROW), "1x128"), (dict(out_dtype=torch.float32),
                                                             "bfloat16")]:
        assert needle in sm.SMALL_M.supports(problem(64, 576, 512, **kw))


def test_backend_supports_is_unchanged():
    """The family supports a subset of the dense family's problems: the backend's answer is the
    dense family's."""
    for m, n, k in TABLE + [(4096, 7168, 2048)]:
        p = problem(m, n, k)
        assert (cuda_backend.supports(p) is None) == (dense.DENSE.supports(p) is None)
    assert cuda_backend.FAMILIES.index(sm.SMALL_M) < cuda_backend.FAMILIES.index(dense.DENSE)


def test_thin_n_long_k_goes_to_the_small_m_family_split():
    """The weak dense shapes (few tiles of B for 132 SMs, K = 7168) run split along K."""
    for m in (1, 2, 7, 37, 64, 100, 129, 200):
        assert chosen(m, 2112, 7168) is sm.SMALL_M, m
        cfg = sm.SMALL_M.select_config(problem(m, 2112, 7168), H200)
        assert cfg.num_splits >= 2 and cfg.grid >= 0.5 * H200.num_sms, (m, cfg)
    cfg = sm.SMALL_M.select_config(problem(64, 2112, 7168), H200)
    assert (cfg.block_m, cfg.num_splits) == (64, 3)  # 33 tiles x 3: the largest one-wave split


def test_large_problems_stay_with_the_dense_family():
    for m, n, k in [(4096, 7168, 2048), (257, 2112, 7168), (256, 7168, 2048), (64, 24576, 1536),
                    (1, 32768, 512), (161, 7168, 16384)]:
        assert chosen(m, n, k) is dense.DENSE, (m, n, k)
    why = sm.SMALL_M.declines(problem(256, 7168, 2048), H200)
    assert isinstance(why, str) and "one wave" in why


def test_wide_n_up_to_160_tokens_reads_b_once():
    """M = 129..160 at N = 7168: 112 tiles of one token tile each (B read once) fit one wave,
    where two token tiles would need 224 CTAs."""
    for m in (129, 144, 160):
        for k in (2048, 16384):
            cfg = sm.SMALL_M.select_config(problem(m, 7168, k), H200)
            assert chosen(m, 7168, k) is sm.SMALL_M, (m, k)
            assert cfg.block_m == align(m, 8) and cfg.grid == 112, (m, k, cfg)


def test_declines_where_the_dense_model_is_as_fast():
    """Tiny GEMMs cost the launch either way: the model leaves them to the dense family."""
    why = sm.SMALL_M.declines(problem(64, 576, 320), H200)
    assert isinstance(why, str) and "modelled" in why
    assert chosen(64, 576, 320) is dense.DENSE


# --- heuristic ---------------------------------------------------------------------------------------------
def _taken(facts):
    out = []
    for m, n, k in TABLE:
        p = problem(m, n, k)
        if sm.SMALL_M.supports(p) is None and sm.SMALL_M.declines(p, facts) is None:
            out.append((p, sm.SMALL_M.select_config(p, facts)))
    return out


def assert_valid(cfg: sm.SmallMConfig, m: int, n: int, k: int, facts: DeviceFacts) -> None:
    num_kb = ceil_div(k, sm.BLOCK_K)
    assert cfg.block_m % 8 == 0 and 8 <= cfg.block_m <= sm.MAX_BLOCK_M
    assert cfg.block_m <= align(m, 8), "a token tile wider than M only computes zeros"
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, sm.BLOCK_N)
    assert cfg.grid == tiles * cfg.num_splits
    assert 1 <= cfg.num_splits <= min(sm.MAX_SPLITS, num_kb)
    # One wave: every cluster resident at once, at most one CTA per SM.
    assert tiles <= sm.cluster_slots(cfg.num_splits, facts.num_sms)
    assert cfg.grid <= facts.num_sms
    # Shared memory fits; an even ring as deep as it allows, capped at one stage per k-block of
    # a split.
    assert cfg.smem(k) <= facts.smem_per_block
    top = max(sm.MIN_STAGES, min(sm.stage_target(cfg.block_m), ceil_div(num_kb, cfg.num_splits)))
    assert cfg.num_stages % 2 == 0 and sm.MIN_STAGES <= cfg.num_stages <= top
    assert cfg.num_stages + 2 > top or sm.smem_bytes(cfg.block_m, cfg.num_splits,
                                                     cfg.num_stages + 2, k) > facts.smem_per_block
    assert cfg.num_threads == 384 and cfg.block_n == 64


@pytest.mark.parametrize("facts", [H200, H100_PCIE], ids=["h200", "h100pcie"])
def test_configs_are_valid(facts):
    taken = _taken(facts)
    assert len(taken) >= 20
    for p, cfg in taken:
        assert_valid(cfg, p.m, p.n, p.k, facts)
        assert sm.SMALL_M.candidate_configs(p, facts)[0] == cfg
        assert all(c.grid <= facts.num_sms for c in sm.SMALL_M.candidate_configs(p, facts))


def test_config_is_the_cheapest_candidate():
    """The documented objective: least modelled time; among equals fewer splits, fewer tiles."""
    for p, cfg in _taken(H200):
        cands = sm.candidates(p.m, p.n, p.k, H200)
        best = cands[0]
        assert best.config == cfg
        for c in cands:
            assert (c.us, c.config.num_splits, c.tiles) >= (best.us, cfg.num_splits, best.tiles)
        # It wins over the dense family's config by the model's margin.
        assert best.us < sm.WIN_FACTOR * sm.dense_estimate_us(p, H200)


def test_model_shape():
    # Splitting a thin-N, long-K GEMM shortens the slowest CTA's stream.
    assert sm.estimate_us(64, 2112, 7168, 64, 3) < sm.estimate_us(64, 2112, 7168, 64, 1)
    # The DRAM floor bounds the time from below whatever the split.
    assert sm.estimate_us(1, 2112, 7168, 8, 8) >= sm.FIXED_US + sm.dram_us(1, 2112, 7168)
    # Cluster packing on 132 SMs: 6-CTA clusters 17 (the H200 driver's count), 5-CTA 20 (the
    # driver allows 22), 8-CTA 12; pairs fill all.
    assert sm.cluster_slots(6, 132) == 17 and sm.cluster_slots(5, 132) == 20
    assert sm.cluster_slots(8, 132) == 12
    assert sm.cluster_slots(2, 132) == 66
    assert sm.cluster_slots(1, 132) == 132
    assert sm.token_tiles(37) == (40, 24) and sm.token_tiles(256) == (128, 88)
    assert sm.token_tiles(1) == (8,)


def test_config_is_pure_and_cached():
    p = problem(37, 2112, 7168)
    assert sm.SMALL_M.select_config(p, H200) is sm.SMALL_M.select_config(p, H200)
    assert sm.SMALL_M.select_config(p, H200) == sm.SMALL_M.select_config(p, replace(H200))
    assert hash(sm.SMALL_M.select_config(p, H200))
    assert "split-K=" in str(sm.SMALL_M.select_config(p, H200))


def test_fewer_sms_shrink_the_grid():
    few = replace(H200, num_sms=66)
    for m, n, k in [(64, 2112, 7168), (1, 4096, 7168)]:
        p = problem(m, n, k)
        if sm.SMALL_M.declines(p, few) is None:
            assert sm.SMALL_M.select_config(p, few).grid <= 66


def test_select_config_raises_without_a_one_wave_config():
    with pytest.raises(ValueError, match="one-wave"):
        sm.SMALL_M.select_config(problem(256, 7168, 2048), H200)


def test_plan_rejects_an_inconsistent_grid():
    with pytest.raises(ValueError, match="tiles x splits"):
        sm.SmallMPlan(problem(64, 2112, 7168), 0, sm.SmallMConfig(64, 3, 8, 100))


def test_plan_rejects_an_odd_ring():
    with pytest.raises(ValueError, match="even number of stages"):
        sm.SmallMPlan(problem(1, 4096, 7168), 0, sm.SmallMConfig(8, 4, 5, 64 * 4))


def test_plans_are_per_config_and_printed(monkeypatch, capsys):
    built = []

    class FakePlan:
        def __init__(self, prob, device_index, cfg):
            built.append(cfg)

    monkeypatch.setattr(sm, "SmallMPlan", FakePlan)
    monkeypatch.setattr(sm, "_plans", {})
    monkeypatch.setenv("FP8GEMM_PRINT_CONFIGS", "1")
    p = problem(64, 2112, 7168)
    cfg = sm.SMALL_M.select_config(p, H200)
    first = sm.get_plan(p, 0, cfg)
    assert sm.get_plan(p, 0, cfg) is first and built == [cfg]
    printed = capsys.readouterr().out
    assert "sm90_fp8_gemm_1d2d_small_m" in printed and "split-K=3" in printed


def test_no_launcher_for_scales_converted_per_call():
    sa = torch.zeros(64, 56)  # row-major: converted on every call
    assert sm.launcher(sm.SMALL_M, problem(64, 2112, 7168), sa, torch.zeros(17, 56), None) is None


# --- compile ---------------------------------------------------------------------------------------------
def _cuobjdump():
    from fp8gemm.jit import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's wheel)")
    return tool


def _variants():
    """(N, K, config) of every kernel the heuristic picks on the table (H200, H100 PCIe), and the
    extremes it may pick elsewhere: the widest token tile with the largest split, the narrowest
    with the largest split, two stages, N < 64 with a K tail."""
    seen = {}
    for facts in (H200, H100_PCIE):
        for p, cfg in _taken(facts):
            seen.setdefault((p.n, p.k, cfg), None)
    for n, k, bm, splits in [(2112, 7168, 128, 8), (2112, 7168, 8, 8), (56, 1040, 8, 4),
                             (576, 320, 40, 3)]:
        stages = sm.max_stages(bm, splits, k, H200.smem_per_block)
        seen.setdefault((n, k, sm.SmallMConfig(bm, splits, stages, 1)), None)
    seen.setdefault((576, 7168, sm.SmallMConfig(64, 2, 2, 1)), None)
    return list(seen)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    compiler_or_skip()
    old = os.environ.get("FP8GEMM_CACHE_DIR")
    os.environ["FP8GEMM_CACHE_DIR"] = str(tmp_path_factory.mktemp("cubins"))
    try:
        yield [(n, k, cfg, sm.compile_kernel(n, k, cfg)[1]) for n, k, cfg in _variants()]
    finally:
        if old is None:
            os.environ.pop("FP8GEMM_CACHE_DIR", None)
        else:
            os.environ["FP8GEMM_CACHE_DIR"] = old


def test_every_variant_compiles_clean(compiled, tmp_path):
    """No spills or stack, no local memory, QGMMA.64x{block_m}x32, no serialised wgmma
    (C7514/C7515) nor compiler-injected accumulator fences (C7519); registers within the
    384-thread launch's 168 (setmaxnreg then gives the math warpgroups 232)."""
    tool = _cuobjdump()
    assert len(compiled) >= 15
    for n, k, cfg, c in compiled:
        what = f"N={n} K={k} {cfg}"
        assert not re.search(r"C751[459]", c.log), f"{what}\n{c.log}"
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", c.log)]
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", c.log)]
        if spills:
            assert max(spills) == 0, f"{what}\n{c.log}"
        if regs:
            assert max(regs) <= 168, f"{what}\n{c.log}"
        path = tmp_path / "k.cubin"
        path.write_bytes(c.cubin)
        sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
        assert re.search(rf"QGMMA\.64x{cfg.block_m}x32", sass), f"{what}: no QGMMA.64x{cfg.block_m}x32"
        assert not re.search(r"\b(LDL|STL)\b", sass), f"{what}: local memory"
        assert_waits_before_global_access(sass, what)
        assert re.search(TMA_LOAD_WITH_POLICY, sass), f"{what}: no evict_first load of B"
        # A split reduces through the cluster: its barrier and DSMEM loads are in the SASS.
        assert (cfg.num_splits > 1) == bool(re.search(r"UCGABAR_ARV", sass)), what
        res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True).stdout
        found = re.findall(r"STACK:(\d+)", res) + re.findall(r"LOCAL:(\d+)", res)
        assert len(found) >= 2 and max(map(int, found)) == 0, f"{what}: {res}"


def test_host_layout_matches_the_kernel(tmp_path, monkeypatch):
    """smem_bytes is Sm90Fp8GemmSmallMLayout::kSmemBytes (the kernel traps on less)."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    cases = [(2112, 7168, 64, 3, 8), (56, 1040, 8, 4, 2), (4096, 7168, 128, 1, 6),
             (576, 320, 40, 3, 2)]
    checks = "".join(
        f"static_assert(fp8gemm::Sm90Fp8GemmSmallMLayout<{n}, {k}, {bm}, {s}, {st}, "
        f"{str(masked).lower()}>::kSmemBytes == {sm.smem_bytes(bm, s, st, k, masked)}, "
        f"\"smem_bytes({bm}, {s}, {st}, {k}, {masked})\");\n"
        for n, k, bm, s, st in cases for masked in (False, True))
    source, name = sm.kernel_source(576, 320, sm.SmallMConfig(40, 3, 2, 1))
    from fp8gemm import jit

    jit.compile_cached(source + checks, name, (str(dense.INCLUDE_DIR),))


# --- GPU -----------------------------------------------------------------------------------------------
TOL_BF16 = TOL[torch.bfloat16]
GPU_NK = [(2112, 7168), (4096, 7168), (200, 336), (56, 1040)]


def operands(m, n, k, device):
    a = rand_fp8((m, k), E4M3, device)
    b = rand_fp8((n, k), E4M3, device)
    sa = col_major_tma(rand_scales((m, ceil_div(k, 128)), device))
    sb = rand_scales((ceil_div(n, 128), ceil_div(k, 128)), device)
    return a, sa, b, sb


def run_config(cfg, a, sa, b, sb, out=None):
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    if out is None:
        out = poisoned((m, n), torch.bfloat16, a.device)
    sm.SMALL_M.run(cfg, problem(m, n, k), a, sa, b, sb, out)
    return out


def heuristic_or_first(m, n, k, device):
    """The heuristic's config on this device, also where the family would decline (to test the
    kernel at every M), else None."""
    cands = sm.candidates(m, n, k, DeviceFacts.of(device))
    return cands[0].config if cands else None


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_NK, ids=lambda v: str(v))
def test_matches_float64(n, k, gpu_device):
    for m in MS:
        cfg = heuristic_or_first(m, n, k, gpu_device)
        if cfg is None:
            continue
        a, sa, b, sb = operands(m, n, k, gpu_device)
        out = run_config(cfg, a, sa, b, sb)  # poisoned: an element never written stays NaN
        torch.cuda.synchronize()
        what = f"{m}x{n}x{k} {cfg}"
        assert not torch.isnan(out).any(), f"{what}: elements never written"
        diff = calc_diff(out, ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK))
        assert diff < TOL_BF16, f"{what}: calc_diff {diff:.3g}"


# Configs the heuristic may not pick on these shapes: the largest split, a split whose CTAs own one
# k-block (the second math warpgroup idle), minimal and other stage counts (the two warpgroups'
# stage/phase walk), more clusters than one wave, N below one tile of B with a K tail, and M < 8
# in an 8-token tile (where odd rings failed).
FORCED = [(64, 2112, 7168, 64, 8, 8), (37, 576, 320, 40, 3, 2), (64, 2112, 7168, 64, 2, 4),
          (200, 2112, 7168, 104, 2, 2), (1, 4096, 7168, 8, 4, 6), (129, 56, 1040, 72, 8, 2),
          (256, 1024, 4096, 128, 5, 6), (1, 4096, 7168, 8, 1, 4), (7, 2112, 7168, 8, 8, 2)]


@pytest.mark.gpu
def test_m1_repeats_are_bit_identical(gpu_device):
    """M = 1 in an 8-token tile, run 200 times on one input: every run correct and the same
    bits (the odd rings this family no longer builds failed such runs within a few hundred)."""
    m, n, k = 1, 4096, 7168
    cfg = sm.SmallMConfig(8, 4, 6, 64 * 4)
    a, sa, b, sb = operands(m, n, k, gpu_device)
    first = run_config(cfg, a, sa, b, sb)
    torch.cuda.synchronize()
    assert calc_diff(first, ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK)) < TOL_BF16
    for _ in range(200):
        again = run_config(cfg, a, sa, b, sb)
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,bm,splits,stages", FORCED, ids=lambda v: str(v))
def test_forced_configs(m, n, k, bm, splits, stages, gpu_device):
    tiles = ceil_div(m, bm) * ceil_div(n, sm.BLOCK_N)
    cfg = sm.SmallMConfig(bm, splits, stages, tiles * splits)
    a, sa, b, sb = operands(m, n, k, gpu_device)
    out = run_config(cfg, a, sa, b, sb)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert calc_diff(out, ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK)) < TOL_BF16


@pytest.mark.gpu
def test_bit_identical_repeats_and_strided_output(gpu_device):
    """A split's sum order is fixed: the same bits every run. A view with a row stride wider
    than N gets exactly its elements written."""
    m, n, k = 64, 2112, 7168
    cfg = sm.SmallMConfig(64, 3, 8, 33 * 3)
    a, sa, b, sb = operands(m, n, k, gpu_device)
    first = run_config(cfg, a, sa, b, sb)
    for _ in range(3):
        again = run_config(cfg, a, sa, b, sb)
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    big = torch.full((m + 2, n + 64), 7.0, dtype=torch.bfloat16, device=gpu_device)
    view = big[1:m + 1, 8:n + 8]
    run_config(cfg, a, sa, b, sb, out=view)
    torch.cuda.synchronize()
    assert torch.equal(view.view(torch.int16), first.view(torch.int16))
    view.fill_(7.0)
    assert bool((big == 7.0).all()), "elements outside the view were written"


@pytest.mark.gpu
def test_cuda_graph_capture(gpu_device):
    m, n, k = 37, 2112, 7168
    p = problem(m, n, k)
    assert cuda_backend.family_for(p, DeviceFacts.of(gpu_device)) is sm.SMALL_M
    a, sa, b, sb = operands(m, n, k, gpu_device)
    out = poisoned((m, n), torch.bfloat16, gpu_device)
    cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, None, p)  # warm: compile, load, encode maps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, None, p)
    a2, sa2, b2, sb2 = operands(m, n, k, gpu_device)
    a.copy_(a2), sa.copy_(sa2), b.copy_(b2), sb.copy_(sb2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert calc_diff(out, ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK)) < TOL_BF16


@pytest.mark.gpu
def test_through_the_ops_layer_warm_path(gpu_device):
    """fp8_gemm_nt(..., backend="cuda") reaches the family; the second call takes the launcher."""
    import fp8gemm

    m, n, k = 64, 2112, 7168
    a, sa, b, sb = operands(m, n, k, gpu_device)
    ref = ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK)
    first = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")
    second = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(first.view(torch.int16), second.view(torch.int16))
    assert calc_diff(first, ref) < TOL_BF16


@pytest.mark.gpu
def test_model_cluster_slots_fit_the_device(gpu_device):
    """The model's one-wave capacity (cluster_slots) is at most what the driver says can be
    resident, for every split the heuristic may choose, with the largest token tile's shared
    memory."""
    from cuda.bindings import driver as cu

    facts = DeviceFacts.of(gpu_device)
    m, n, k = 64, 2112, 7168
    for splits in range(1, sm.MAX_SPLITS + 1):
        stages = sm.max_stages(sm.MAX_BLOCK_M, splits, k, facts.smem_per_block)
        cfg = sm.SmallMConfig(sm.MAX_BLOCK_M, splits, stages, 33 * splits)
        plan = sm.get_plan(problem(m, n, k), gpu_device.index or 0, cfg)
        err, func = cu.cuKernelGetFunction(plan.kernel._kernel)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        lc = cu.CUlaunchConfig()
        lc.gridDimX, lc.gridDimY, lc.gridDimZ = cfg.grid, 1, 1
        lc.blockDimX, lc.blockDimY, lc.blockDimZ = sm.NUM_THREADS, 1, 1
        lc.sharedMemBytes = cfg.smem(k)
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = splits, 1, 1
        lc.attrs, lc.numAttrs = [attr], 1
        err, count = cu.cuOccupancyMaxActiveClusters(func, lc)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        assert sm.cluster_slots(splits, facts.num_sms) <= count, (splits, count)


# --- the masked family (sm90_m_grouped_fp8_gemm_1d2d_small_m) -------------------------------------
def masked_problem(g, mmax, n, k, expected):
    return problem(mmax, n, k, kind=GemmKind.MASKED, groups=g, expected_m=expected)


def masked_config(g, mmax, n, k, expected, bm, splits, stages=None, slots=None):
    """A masked config of bm-token tiles: `slots` token tiles per group in the grid (default:
    those of the expected rows), `stages` the most that fit (default)."""
    slots = ceil_div(expected, bm) if slots is None else slots
    stages = sm.max_stages(bm, splits, k, H200.smem_per_block, masked=True) \
        if stages is None else stages
    return sm.SmallMConfig(bm, splits, stages, g * slots * ceil_div(n, sm.BLOCK_N) * splits, slots)


def test_masked_family_supports_masked_decode_sizes_only():
    fam = sm.MASKED_SMALL_M
    assert fam.supports(masked_problem(2, 512, 4096, 7168, 256)) is None
    assert "expected_m=257" in fam.supports(masked_problem(2, 512, 4096, 7168, 257))
    assert "masked" in fam.supports(problem(64, 4096, 7168))
    assert "masked" in fam.supports(problem(64, 4096, 7168, kind=GemmKind.CONTIGUOUS, groups=2))
    for kw, needle in [(dict(a_dtype=torch.float8_e5m2), "e4m3"), (dict(b_recipe=Recipe.GROUP),
                                                                   "128x128")]:
        assert needle in fam.supports(problem(64, 576, 512, kind=GemmKind.MASKED, groups=2,
                                              expected_m=8, **kw))


def test_masked_family_sits_before_the_grouped_family():
    """The backend runs a masked problem with the small-M family where its model takes it, else
    with the grouped family."""
    fams = cuda_backend.FAMILIES
    assert fams.index(sm.MASKED_SMALL_M) < fams.index(dense.GROUPED)
    p = masked_problem(1, 256, 4096, 7168, 128)
    assert cuda_backend.family_for(p, H200) is sm.MASKED_SMALL_M
    assert cuda_backend.family_for(masked_problem(4, 256, 4096, 7168, 64), H200) is dense.GROUPED


def test_masked_family_supports_a_subset_of_the_grouped_family():
    """Wherever the masked family takes a problem the grouped family does too, so the backend's
    `supports` answers alike with the family in its table or out of it."""
    for g, mmax, expected, n, k in [(1, 256, 128, 4096, 7168), (2, 64, 8, 7168, 2048),
                                    (3, 300, 257, 576, 320), (2, 5, 3, 56, 1040),
                                    (2, 64, 8, 7168, 2050), (2, 64, 8, 7170, 2048)]:
        p = masked_problem(g, mmax, n, k, expected)
        if sm.MASKED_SMALL_M.supports(p) is None:
            assert dense.GROUPED.supports(p) is None, p
        assert (cuda_backend.supports(p) is None) == (dense.GROUPED.supports(p) is None), p


def test_masked_model_takes_one_or_two_experts_where_grouped_tiles_idle():
    """One expert of 128 expected rows at N = 4096, K = 7168: the grouped family's 128-row tiles
    are 32 wide to fill 128 SMs, and the small-M tiles split K in two instead; two experts of 32
    and 128 rows, and one at 7168x2048, are taken by MASKED_WIN_FACTOR (measured faster there);
    with four experts the small-M tiles no longer fit one wave, and two experts of 64 rows at
    N = 2112 price more than the margin above the grouped family's."""
    p = masked_problem(1, 256, 4096, 7168, 128)
    cfg = sm.MASKED_SMALL_M.select_config(p, H200)
    assert (cfg.block_m, cfg.num_splits, cfg.num_slots, cfg.grid) == (128, 2, 1, 128)
    for g, expected, n, k in [(1, 32, 4096, 7168), (2, 32, 4096, 7168), (2, 128, 4096, 7168),
                              (1, 32, 7168, 2048), (1, 128, 7168, 2048)]:
        assert sm.MASKED_SMALL_M.declines(masked_problem(g, 256, n, k, expected), H200) is None
    why = sm.MASKED_SMALL_M.declines(masked_problem(4, 256, 4096, 7168, 64), H200)
    assert "one wave" in why
    why = sm.MASKED_SMALL_M.declines(masked_problem(2, 256, 2112, 7168, 64), H200)
    assert "grouped family" in why


@pytest.mark.parametrize("g,mmax,expected,n,k", [(1, 256, 128, 4096, 7168), (1, 64, 8, 7168, 2048),
                                                 (2, 300, 200, 576, 7168), (1, 5, 3, 2112, 7168),
                                                 (2, 1024, 40, 576, 1040)])
def test_masked_configs_are_valid(g, mmax, expected, n, k):
    """Every candidate covers the expected rows of every group in one wave; slots are the token
    tiles of the expected rows (never past Mmax)."""
    p = masked_problem(g, mmax, n, k, expected)
    cands = sm.problem_candidates(p, H200)
    assert cands
    rows = min(expected, mmax)
    for c in cands:
        cfg = c.config
        assert cfg.num_slots == ceil_div(rows, cfg.block_m)
        assert cfg.block_m <= align(rows, 8)
        tiles = g * cfg.num_slots * ceil_div(n, sm.BLOCK_N)
        assert c.tiles == tiles and cfg.grid == tiles * cfg.num_splits
        assert tiles <= sm.cluster_slots(cfg.num_splits, H200.num_sms)
        assert cfg.smem(k, masked=True) <= H200.smem_per_block and cfg.num_stages % 2 == 0
    assert sm.MASKED_SMALL_M.select_config(p, H200) == cands[0].config
    assert sm.MASKED_SMALL_M.candidate_configs(p, H200)[0] == cands[0].config


def test_masked_model_prices_every_group():
    """g groups move g times the bytes of one: where DRAM bounds (8 tokens, B 4096x7168 split in
    four), the modelled time past the fixed and split costs doubles with two groups."""
    fixed = sm.FIXED_US + sm.SPLIT_US
    one = sm.estimate_us(8, 4096, 7168, 8, 4) - fixed
    two = sm.estimate_us(8, 4096, 7168, 8, 4, groups=2) - fixed
    assert one == pytest.approx(sm.dram_us(8, 4096, 7168), abs=1e-3)
    assert two == pytest.approx(2 * one, abs=2e-3)


def test_masked_plan_rejects_an_inconsistent_grid():
    p = masked_problem(2, 256, 4096, 7168, 128)
    with pytest.raises(ValueError, match="tiles x splits"):
        sm.SmallMPlan(p, 0, sm.SmallMConfig(128, 1, 6, 64, 1))  # 2 x 64 tiles, grid 64
    with pytest.raises(ValueError, match="at least one slot"):
        sm.SmallMPlan(p, 0, sm.SmallMConfig(128, 1, 6, 0, 0))


def _masked_variants():
    """(N, K, config) masked kernels: the model's choices, the widest token tile with the
    largest split, an 8-token tile split in 4 over a K tail, N below one tile of B."""
    seen = {}
    for g, mmax, expected, n, k in [(1, 256, 128, 4096, 7168), (1, 64, 8, 4096, 7168),
                                    (1, 64, 8, 7168, 2048)]:
        seen.setdefault((n, k, sm.MASKED_SMALL_M.select_config(
            masked_problem(g, mmax, n, k, expected), H200)), None)
    for n, k, bm, splits in [(4096, 7168, 160, 8), (56, 1040, 8, 4), (576, 320, 40, 3)]:
        seen.setdefault((n, k, masked_config(1, 256, n, k, bm, bm, splits)), None)
    return list(seen)


def test_masked_variants_compile_clean(tmp_path, monkeypatch):
    """As test_every_variant_compiles_clean, and the A scales come through the 3-D map (a box
    never reads another group's), the group's rows are read after the dependency wait, and a
    split's cluster meets on barrier.cluster only at the start (every thread of a CTA runs it,
    the producer included, which then issues every tile's loads and exits): the reductions of
    its tiles meet on mbarriers, one arrival on each CTA's two per tile, behind one fence."""
    compiler_or_skip()
    tool = _cuobjdump()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    variants = _masked_variants()
    assert len(variants) >= 5
    for n, k, cfg in variants:
        what = f"masked N={n} K={k} {cfg}"
        c = sm.compile_kernel(n, k, cfg, masked=True)[1]
        assert not re.search(r"C751[459]", c.log), f"{what}\n{c.log}"
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", c.log)]
        assert not spills or max(spills) == 0, f"{what}\n{c.log}"
        path = tmp_path / "k.cubin"
        path.write_bytes(c.cubin)
        sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
        assert re.search(rf"QGMMA\.64x{cfg.block_m}x32", sass), what
        assert not re.search(r"\b(LDL|STL)\b", sass), f"{what}: local memory"
        assert re.search(r"UTMALDG\.3D", sass), f"{what}: no 3-D load of the A scales"
        assert_waits_before_global_access(sass, what)
        split = cfg.num_splits > 1
        arrives = len(re.findall(r"UCGABAR_ARV", sass))
        assert arrives == (1 if split else 0), f"{what}: {arrives} cluster arrives"
        remote = len(re.findall(r"SYNCS\.ARRIVE\.TRANS64\.RED\b", sass))
        assert remote == (2 * cfg.num_splits if split else 0), f"{what}: {remote} remote arrives"
        fences = len(re.findall(r"MEMBAR\.ALL\.GPU", sass))
        assert fences == (1 if split else 0), f"{what}: {fences} GPU fences"


def test_masked_host_layout_matches_the_kernel(tmp_path, monkeypatch):
    """The masked kernel's shared memory is smem_bytes(masked=True): the dense layout and, with a
    split, the two reduction barriers."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    cfg = masked_config(1, 256, 576, 320, 40, 40, 3)
    source, name = sm.kernel_source(576, 320, cfg, masked=True)
    assert name.endswith(", true>")
    check = (f"static_assert(fp8gemm::Sm90Fp8GemmSmallMLayout<576, 320, 40, 3, {cfg.num_stages}, "
             f"true>::kSmemBytes == {cfg.smem(320, masked=True)}, \"smem\");\n")
    assert cfg.smem(320, masked=True) == cfg.smem(320) + 16
    from fp8gemm import jit

    jit.compile_cached(source + check, name, (str(dense.INCLUDE_DIR),))


# --- the masked family on the GPU -----------------------------------------------------------------
def masked_operands(g, mmax, n, k, device):
    a = rand_fp8((g, mmax, k), E4M3, device)
    b = rand_fp8((g, n, k), E4M3, device)
    sa = col_major_tma(rand_scales((g, mmax, ceil_div(k, 128)), device))
    sb = rand_scales((g, ceil_div(n, 128), ceil_div(k, 128)), device)
    return a, sa, b, sb


def run_masked(cfg, a, sa, b, sb, masked_m, expected, out=None):
    g, mmax, k = a.shape
    n = b.shape[1]
    if out is None:
        out = poisoned((g, mmax, n), torch.bfloat16, a.device)
    sm.MASKED_SMALL_M.run(cfg, masked_problem(g, mmax, n, k, expected), a, sa, b, sb, out, None,
                          masked_m)
    return out


def check_masked_out(out, a, sa, b, sb, masked_m, what=""):
    """Rows below masked_m[g] (clamped to 0..Mmax) against float64, every other row still NaN."""
    g, mmax, _ = a.shape
    rows = masked_m.clamp(0, mmax)
    ref = ref_masked(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK, rows)
    past = torch.arange(mmax, device=a.device)[None, :] >= rows[:, None]
    assert bool(torch.isnan(out[past]).all()), f"{what}: rows at or past masked_m written"
    done = ~past
    if bool(done.any()):
        assert not bool(torch.isnan(out[done]).any()), f"{what}: rows below masked_m not written"
        diff = calc_diff(out[done], ref[done])
        assert diff < TOL_BF16, f"{what}: calc_diff {diff:.3g}"


# (G, Mmax, N, K, expected, bm, splits, stages, slots, masked_m): the model's choice at one expert;
# a cluster walking three token tiles of one slot (K = 7168 in 3 splits: 18 and 19 k-blocks a
# CTA, so the ring's parity moves between tiles) and an 8-token tile over two; groups with no
# rows, one row, rows past the expected and the full Mmax; N below one tile of B with a K tail;
# Mmax smaller than the token tile.
MASKED_FORCED = [
    (1, 256, 4096, 7168, 128, 128, 2, 6, 1, [128]),
    (2, 384, 2112, 7168, 128, 128, 3, 6, 1, [384, 300]),
    (3, 100, 576, 7168, 8, 8, 4, 8, 2, [0, 1, 100]),
    (2, 200, 56, 1040, 64, 64, 8, 2, 1, [200, 65]),
    (2, 5, 2112, 7168, 3, 8, 2, 16, 1, [5, 2]),
    (4, 160, 576, 320, 40, 40, 3, 2, 2, [40, 0, 160, 81]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("g,mmax,n,k,expected,bm,splits,stages,slots,counts", MASKED_FORCED,
                         ids=lambda v: str(v))
def test_masked_forced_configs(g, mmax, n, k, expected, bm, splits, stages, slots, counts,
                               gpu_device):
    cfg = sm.SmallMConfig(bm, splits, stages, g * slots * ceil_div(n, sm.BLOCK_N) * splits, slots)
    a, sa, b, sb = masked_operands(g, mmax, n, k, gpu_device)
    masked_m = torch.tensor(counts, dtype=torch.int32, device=gpu_device)
    out = run_masked(cfg, a, sa, b, sb, masked_m, expected)
    torch.cuda.synchronize()
    check_masked_out(out, a, sa, b, sb, masked_m, f"{cfg} masked_m={counts}")


@pytest.mark.gpu
def test_masked_model_choice_and_bad_values(gpu_device):
    """The model's config over random masked_m, then values past Mmax and negative (clamped:
    Mmax rows and none), repeated: the same bits every run."""
    g, mmax, n, k, expected = 2, 256, 4096, 7168, 128
    p = masked_problem(g, mmax, n, k, expected)
    cfg = sm.MASKED_SMALL_M.select_config(p, DeviceFacts.of(gpu_device))
    a, sa, b, sb = masked_operands(g, mmax, n, k, gpu_device)
    for counts in ([int(v) for v in torch.randint(0, mmax + 1, (g,))], [1000, -5]):
        masked_m = torch.tensor(counts, dtype=torch.int32, device=gpu_device)
        out = run_masked(cfg, a, sa, b, sb, masked_m, expected)
        again = run_masked(cfg, a, sa, b, sb, masked_m, expected)
        torch.cuda.synchronize()
        check_masked_out(out, a, sa, b, sb, masked_m, f"{cfg} masked_m={counts}")
        assert torch.equal(out.view(torch.int16), again.view(torch.int16))


@pytest.mark.gpu
def test_masked_cuda_graph_with_changing_masked_m(gpu_device):
    """One capture, replays with new masked_m values in the same buffer, fewer and more rows
    than expected (a slot's cluster walking two token tiles): each replay computes exactly the
    rows the current values say."""
    g, mmax, n, k, expected = 2, 128, 2112, 7168, 32
    cfg = masked_config(g, mmax, n, k, expected, 32, 2)
    a, sa, b, sb = masked_operands(g, mmax, n, k, gpu_device)
    masked_m = torch.full((g,), expected, dtype=torch.int32, device=gpu_device)
    out = poisoned((g, mmax, n), torch.bfloat16, gpu_device)
    run_masked(cfg, a, sa, b, sb, masked_m, expected, out)  # compile, load, encode outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_masked(cfg, a, sa, b, sb, masked_m, expected, out)
    for values in ([1, 0], [0, 0], [128, 33], [64, 127]):
        masked_m.copy_(torch.tensor(values, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_masked_out(out, a, sa, b, sb, masked_m, f"replay masked_m={values}")


@pytest.mark.gpu
def test_masked_launcher_warm_path(gpu_device):
    """The ops layer's warm path for the masked family (what it takes once the family is in
    the backend's table): the first call goes to `slow`, which builds the pack; later calls
    with the same pointers launch from the pack, new pointers go to `slow` again."""
    g, mmax, n, k, expected = 2, 128, 2112, 7168, 32
    p = masked_problem(g, mmax, n, k, expected)
    cfg = sm.MASKED_SMALL_M.select_config(p, DeviceFacts.of(gpu_device))
    a, sa, b, sb = masked_operands(g, mmax, n, k, gpu_device)
    masked_m = torch.tensor([32, 77], dtype=torch.int32, device=gpu_device)
    slow_calls = []

    def slow(a_, sa_, b_, sb_, out_, masked_m_):
        slow_calls.append(out_.data_ptr())
        sm.MASKED_SMALL_M.run(cfg, p, a_, sa_, b_, sb_, out_, None, masked_m_)

    run = sm.launcher(sm.MASKED_SMALL_M, p, sa, sb, slow)
    assert run is not None
    out = poisoned((g, mmax, n), torch.bfloat16, gpu_device)
    run(a, sa, b, sb, out, masked_m)
    out.fill_(float("nan"))
    run(a, sa, b, sb, out, masked_m)  # from the pack
    torch.cuda.synchronize()
    assert slow_calls == [out.data_ptr()]
    check_masked_out(out, a, sa, b, sb, masked_m, "warm launch")
    other = poisoned((g, mmax, n), torch.bfloat16, gpu_device)
    run(a, sa, b, sb, other, masked_m)
    torch.cuda.synchronize()
    assert slow_calls == [out.data_ptr(), other.data_ptr()]
    check_masked_out(other, a, sa, b, sb, masked_m, "new out")

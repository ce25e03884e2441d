"""scripts/cuda_tiles.py on the CPU: a variant of every CUDA family's config derives the fields
that follow from it (stages that fit, the grid), so the GPU run times what it says."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8gemm.backends.cuda import sm90_fp8_gemm_1d1d as g1
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g2
from fp8gemm.backends.cuda import sm90_fp8_gemm_small_m as sm
from fp8gemm.backends.family import DeviceFacts
from fp8gemm.problem import GemmKind, ceil_div
from helpers import load_script

ct = load_script("scripts/cuda_tiles.py")

H200 = DeviceFacts("NVIDIA H200", (9, 0), num_sms=132, smem_per_block=232448)


def _derive(family, problem, spec):
    base = family.select_config(problem, H200)
    stages = max(c.num_stages for c in family.candidate_configs(problem, H200) + [base])
    return base, ct.derive(base, ct.parse_variant(spec, family.Config), problem, H200, stages)


def test_dense_tile_change_rederives_stages_and_grid():
    p = ct.dense_problem(4096, 4096, 7168)
    base, cfg = _derive(g2.DENSE, p, "block_m=128+block_n=192")
    assert (cfg.block_m, cfg.block_n, cfg.two_accum) == (128, 192, False)
    # The most stages that fit: one more does not.
    assert cfg.smem(p.k, p.kind) <= H200.smem_per_block
    deeper = replace(cfg, num_stages=cfg.num_stages + 1)
    assert deeper.smem(p.k, p.kind) > H200.smem_per_block
    assert cfg.grid == min(132, ceil_div(4096, 128) * ceil_div(4096, 192))


def test_dense_split_k_variant_rederives_grid_and_drops_two_accum():
    p = ct.dense_problem(192, 7168, 16384)
    base, cfg = _derive(g2.DENSE, p, "block_m=128+block_n=128+splits=2")
    assert (cfg.block_m, cfg.block_n, cfg.splits, cfg.two_accum) == (128, 128, 2, False)
    assert cfg.grid == min(132, ceil_div(192, 128) * ceil_div(7168, 128) * 2)
    _, wide = _derive(g2.DENSE, ct.dense_problem(1000, 512, 32768), "splits=4")
    assert wide.splits == 4 and not wide.two_accum and wide.grid <= 132


def test_two_ctas_per_sm_variant_takes_half_the_shared_memory_and_twice_the_grid():
    """ctas_per_sm=2 on a 64-row masked tile: the most stages that fit half the SM's shared
    memory (fewer than the base's), a CTA per tile up to two per SM."""
    data = type("Data", (), {"a": torch.empty(16, 64, 7168)})()
    p = ct.grouped_problem(GemmKind.MASKED, data, 16, 64, 4096, 7168)
    base, cfg = _derive(g2.GROUPED, p, "ctas_per_sm=2")
    assert (base.block_m, base.ctas_per_sm, cfg.ctas_per_sm) == (64, 1, 2)
    limit = g2.smem_limit(H200, 2)
    assert cfg.smem(p.k, p.kind) <= limit < replace(cfg, num_stages=cfg.num_stages + 1).smem(
        p.k, p.kind)
    assert cfg.num_stages < base.num_stages
    assert cfg.grid == min(2 * 132, 16 * ceil_div(4096, cfg.block_n))
    assert "ctas/SM=2" in str(cfg)


def test_wgrad_two_accum_variant():
    p = ct.wgrad_problem(2112, 7168, 4096)
    assert g1.DENSE.supports(p) is None
    base, cfg = _derive(g1.DENSE, p, "block_n=128+two_accum=1")
    assert (cfg.block_n, cfg.two_accum) == (128, True) and cfg.smem <= H200.smem_per_block
    assert cfg.num_stages == g1.max_stages(128, 128, H200.smem_per_block)
    assert cfg.grid == min(132, ceil_div(2112, 128) * ceil_div(7168, 128))


def test_wgrad_tall_variant():
    """block_m=256 (two waves of 128 rows, not offered by the heuristic): 384 threads, the most
    stages that fit, a CTA per tile up to the SM count (2112 rows: 9 blocks)."""
    p = ct.wgrad_problem(2112, 7168, 4096)
    base, cfg = _derive(g1.DENSE, p, "block_m=256+block_n=96")
    assert (cfg.block_m, cfg.block_n, cfg.num_threads) == (256, 96, 384)
    assert cfg.smem <= H200.smem_per_block and cfg.num_stages >= 2
    assert cfg.grid == min(132, 9 * ceil_div(7168, 96))


def test_k_grouped_variant_counts_every_expert_s_tiles():
    """--kind k_grouped_wgrad: the problem the bench's op builds (K = every expert's tokens);
    a changed tile re-derives the grid over the G experts' tiles."""
    from fp8gemm.bench.impls import case_problem
    from fp8gemm.bench.suites import Case, backward_skewed_sizes

    sizes = backward_skewed_sizes(8, 4096)
    assert len(sizes) == 8 and sum(sizes) == 8 * 4096 and all(x % 128 == 0 for x in sizes)
    assert 0 in sizes  # the suite's experts with no tokens
    p = case_problem(Case("tiles", "k_grouped_wgrad", 256, 576, 4096, groups=8, sizes=sizes))
    assert p.kind is GemmKind.K_GROUPED and p.k == 8 * 4096 and p.groups == 8
    assert g1.K_GROUPED.supports(p) is None
    _, cfg = _derive(g1.K_GROUPED, p, "block_m=64+block_n=96")
    assert cfg.grid == min(132, 8 * ceil_div(256, 64) * ceil_div(576, 96))


@pytest.mark.parametrize("spec", ["num_splits=3", "block_m=16", "block_m=24+num_splits=5"])
def test_small_m_variants_keep_one_cta_per_tile_and_split_and_even_rings(spec):
    p = ct.dense_problem(20, 2112, 7168)
    assert sm.SMALL_M.supports(p) is None
    base, cfg = _derive(sm.SMALL_M, p, spec)
    tiles = ceil_div(20, cfg.block_m) * ceil_div(2112, sm.BLOCK_N)
    assert cfg.grid == tiles * cfg.num_splits
    if "block_m" in spec:
        assert cfg.num_stages % 2 == 0 and cfg.smem(p.k) <= H200.smem_per_block


def test_masked_small_m_variant_rederives_slots_and_grid():
    """A narrower token tile on the masked small-M family:
    the expected rows' token tiles per group, a CTA per group, slot, tile of B and split."""
    data = type("Data", (), {"a": torch.empty(2, 256, 7168)})()
    p = ct.grouped_problem(GemmKind.MASKED, data, 2, 128, 4096, 7168)
    base, cfg = _derive(sm.MASKED_SMALL_M, p, "block_m=64+num_splits=1")
    assert (base.block_m, base.num_slots) == (128, 1)
    assert (cfg.block_m, cfg.num_slots, cfg.num_splits) == (64, 2, 1)
    assert cfg.grid == 2 * 2 * ceil_div(4096, sm.BLOCK_N)
    assert cfg.num_stages % 2 == 0 and cfg.smem(p.k) <= H200.smem_per_block


def test_parse_variant_names_the_fields():
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        ct.parse_variant("blockm=64", g2.Sm90Config)
    with pytest.raises(ValueError, match="0 or 1"):
        ct.parse_variant("two_accum=2", g1.Sm90Config1d1d)
    assert ct.parse_variant("block_n=128+two_accum=1", g1.Sm90Config1d1d) == {
        "block_n": 128, "two_accum": True}
    assert torch.float32 == ct.wgrad_problem(8, 8, 8).out_dtype
    assert ct.wgrad_problem(8, 8, 8).has_c and not ct.wgrad_problem(8, 8, 8, False).has_c


def _copy_headers(root):
    import shutil
    inc = root / "fp8gemm" / "backends" / "cuda" / "include"
    shutil.copytree(Path(g2.__file__).parent / "include", inc)
    return inc


def test_headers_option_takes_checkouts_and_include_folders(tmp_path):
    inc = _copy_headers(tmp_path / "old")
    assert ct.parse_headers(f"a={tmp_path / 'old'},b={inc}") == {"a": inc, "b": inc}
    assert ct.parse_headers("") == {}
    for bad, why in [(f"a={inc},a={inc}", "distinct"), ("a", "NAME=DIR"),
                     (f"a@b={inc}", "NAME=DIR"), (f"a={tmp_path}", "no fp8gemm/sm90_utils.cuh")]:
        with pytest.raises(ValueError, match=why):
            ct.parse_headers(bad)


def test_kernel_headers_build_from_the_other_copy_in_caches_of_their_own(tmp_path, monkeypatch):
    """Inside, every family compiles from the other headers and keeps its plans apart; after,
    this tree's headers and plan caches are back. A copy whose header fails to compile shows
    that the copy is what was compiled."""
    from helpers import compiler_or_skip

    from fp8gemm.jit import CompileError
    from fp8gemm.problem import GemmKind

    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    inc = _copy_headers(tmp_path / "old")
    (inc / "fp8gemm" / "sm90_utils.cuh").write_text("#error the old copy\n")
    state = lambda: ([m.INCLUDE_DIR for m in ct._INCLUDE_MODULES],  # noqa: E731
                     [m._plans for m in ct._PLAN_MODULES])
    before = state()
    caches: dict = {}
    cfg = g2.Sm90Config(128, 128, 4, 1, False, g2.BAND_SIZE, 132, False)
    with ct.kernel_headers(inc, caches):
        assert all(m.INCLUDE_DIR == inc for m in ct._INCLUDE_MODULES)
        assert all(m._plans is caches[m.__name__] for m in ct._PLAN_MODULES)
        with pytest.raises(CompileError, match="the old copy"):
            g2.compile_kernel(GemmKind.DENSE, 512, 256, cfg)
    after = state()
    assert after[0] == before[0] and all(a is b for a, b in zip(after[1], before[1]))
    g2.compile_kernel(GemmKind.DENSE, 512, 256, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("op,shape,spec", [("dense", (1, 256, 576, 640), "block_n=64"),
                                           ("contiguous", (3, 200, 576, 640), "block_n=160"),
                                           ("wgrad", (1, 256, 576, 1000), "block_n=128")])
def test_ncu_call_runs_the_variant(op, shape, spec, gpu_device):
    """scripts/ncu_call.py's `fp8gemm-cuda:VARIANT`: the family's config with the change, right."""
    from fp8gemm import calc_diff
    from fp8gemm.bench.impls import make_data, reference_output
    from fp8gemm.bench.suites import Case

    nc = load_script("scripts/ncu_call.py")
    g, m, n, k = shape
    data = make_data(Case("ncu", op, m, n, k, groups=g), gpu_device)
    fn, out = nc.variant_call(spec, op, data, g, m, n, k)
    fn()
    torch.cuda.synchronize()
    assert calc_diff(data.data_rows(out), reference_output(data)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("args", [
    ["--family", "sm90_fp8_gemm_1d1d", "--kind", "wgrad", "--shapes", "384x576x1000",
     "--variants", "base,block_m=256+block_n=96"],
    ["--family", "sm90_k_grouped_fp8_gemm_1d1d", "--kind", "k_grouped_wgrad",
     "--shapes", "3x256x576x640,s4x200x576x384", "--variants", "base,block_n=96"],
    ["--family", "sm90_m_grouped_fp8_gemm_1d2d_small_m", "--kind", "masked",
     "--shapes", "2x64x576x1024", "--also", "sm90_m_grouped_fp8_gemm_1d2d"],
], ids=["wgrad", "k_grouped", "masked_small_m"])
def test_main_times_every_variant_right(args, gpu_device, tmp_path, capsys, monkeypatch):
    """The script end to end on small shapes: every variant and peer runs, none is WRONG or
    refused, and each lands in the JSON (the 1D1D tiles, dense in two waves and k-grouped with
    skewed token counts, and the masked small-M family beside the grouped one). DeepGEMM
    is left out (its JIT compiles would dominate the test)."""
    import json

    from fp8gemm.bench.impls import Skip

    make_impl = ct.make_impl

    def no_deepgemm(impl, *a, **kw):
        if impl == "deepgemm":
            raise Skip("left out of this test")
        return make_impl(impl, *a, **kw)

    monkeypatch.setattr(ct, "make_impl", no_deepgemm)
    out = tmp_path / "rows.json"
    assert ct.main(args + ["--runs", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "WRONG" not in printed and "refused" not in printed, printed
    rows = json.loads(out.read_text())
    shapes = args[args.index("--shapes") + 1].split(",")
    for shape in shapes:
        variants = {r["variant"] for r in rows if r["shape"] == shape}
        assert len(variants) >= 2, (shape, variants, printed)


def test_l2_read_bytes_counts_each_tile_s_rows_and_a_shared_operand_once_a_pair():
    """Dense: every tile reads its BLOCK_M rows of A and BLOCK_N of B over all of K (fewer where
    M or N is smaller than the tile); a 2-CTA cluster loads the shared operand once for both."""
    p = ct.dense_problem(4096, 512, 32768)
    cfg = g2.Sm90Config(block_m=128, block_n=128, num_stages=5, num_multicast=1,
                        multicast_on_a=True, band_size=16, grid=128)
    assert ct.l2_read_bytes(p, cfg) == 128 * (128 + 128) * 32768
    on_a = replace(cfg, num_multicast=2, multicast_on_a=True)
    on_b = replace(cfg, num_multicast=2, multicast_on_a=False)
    assert ct.l2_read_bytes(p, on_a) == ct.l2_read_bytes(p, on_b) == 128 * (64 + 128) * 32768
    # M below the tile: only M rows of A a tile
    assert ct.l2_read_bytes(ct.dense_problem(37, 512, 1024), cfg) == 4 * (37 + 128) * 1024
    # masked: the expected rows of each group
    masked = replace(p, kind=GemmKind.MASKED, m=256, groups=4, expected_m=200)
    assert ct.l2_read_bytes(masked, cfg) == 4 * 2 * 4 * (128 + 128) * 32768

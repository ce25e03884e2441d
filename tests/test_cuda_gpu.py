"""GPU tests of the CUDA backend's dense sm90 kernel (skipped without a Hopper GPU).

Operands are random fp8 values with independent random scales (log-uniform in [1/4, 4]), so a
kernel that read a wrong scale (transposed blocks, the wrong 128-column block of a tile that
straddles two) shows a large error. The reference is float64 on the dequantised inputs
(helpers.ref_gemm); the tolerance is the bf16 GEMM bound of helpers.TOLERANCES, with its basis.
"""

from __future__ import annotations

import pytest
import torch

from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div
from helpers import (FORCED_CONFIGS, SPLIT_K_CONFIGS, TOL, calc_diff, col_major_tma, rand_scales,
                     ref_gemm)

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
TOL_BF16 = TOL[torch.bfloat16]

# DeepSeek-V3 dense shapes (the bench suite's), then awkward ones.
DSV3_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
DSV3_SHAPES = [(m, n, k) for m in (64, 128, 4096) for (n, k) in DSV3_NK]
AWKWARD_SHAPES = [(1, 576, 320), (37, 576, 320), (130, 576, 320), (37, 200, 336), (1, 2112, 7168),
                  (257, 1000, 4096), (4000, 7168, 2048), (600, 576, 16384),
                  # partial last k-blocks (zero-filled past K) of 32, 64, 96 and 80 columns,
                  # and a single partial block
                  (300, 576, 160), (1000, 7168, 2112), (129, 1000, 1248), (300, 576, 848),
                  (64, 576, 96)]


def make_operands(m: int, n: int, k: int, device, sa_layout: str = "col"):
    a = torch.randn(m, k, device=device).to(E4M3)
    b = torch.randn(n, k, device=device).to(E4M3)
    sa = rand_scales((m, ceil_div(k, 128)), device)
    sb = rand_scales((ceil_div(n, 128), ceil_div(k, 128)), device)
    if sa_layout == "col":
        sa = col_major_tma(sa)
    return a, sa, b, sb


def reference(a, sa, b, sb) -> torch.Tensor:
    """float64 (A * sa) @ (B * sb)^T on the dequantised inputs."""
    return ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK)


def dense_problem(m: int, n: int, k: int) -> GemmProblem:
    return GemmProblem(GemmKind.DENSE, m, n, k, 1, E4M3, E4M3, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16)


def run_cuda(a, sa, b, sb, out=None):
    from fp8gemm.backends import cuda as cuda_backend

    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    problem = dense_problem(m, n, k)
    if cuda_backend.supports(problem) is not None:
        raise RuntimeError(f"cuda backend refuses {problem}: {cuda_backend.supports(problem)}")
    if out is None:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=a.device)
    cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, None, problem)
    return out


# --- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k", [(4096, 7168, 2112), (1000, 2048, 7168), (37, 576, 320),
                                   (64, 2112, 7168)])
def test_e5m2_a_matches_float64(m, n, k, gpu_device):
    """A in e5m2 (dY of an e5m2 gradient, the input gradient dY . W) against float64, through the
    backend's own choice of family and config."""
    from fp8gemm.backends import cuda as cuda_backend

    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    a = torch.randn(m, k, device=gpu_device).to(torch.float8_e5m2)
    problem = GemmProblem(GemmKind.DENSE, m, n, k, 1, torch.float8_e5m2, E4M3, Recipe.GROUP,
                          Recipe.BLOCK, torch.bfloat16)
    assert cuda_backend.supports(problem) is None
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=gpu_device)
    cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, None, problem)
    diff = calc_diff(out, reference(a, sa, b, sb))
    assert diff < TOL_BF16, f"e5m2 A {m}x{n}x{k}: calc_diff {diff:.3g} >= {TOL_BF16}"


@pytest.mark.parametrize("m,n,k", DSV3_SHAPES + AWKWARD_SHAPES,
                         ids=lambda v: str(v))
def test_dense_matches_float64(m, n, k, gpu_device):
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    out = run_cuda(a, sa, b, sb)  # poisoned with NaN first
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "some output elements were never written"
    diff = calc_diff(out, reference(a, sa, b, sb))
    assert diff < TOL_BF16, f"calc_diff {diff:.3g} >= {TOL_BF16}"


def test_any_scale_strides(gpu_device):
    """Row-major A scales (not the kernel layout) are converted, with the same result."""
    m, n, k = 100, 576, 1024
    a, sa, b, sb = make_operands(m, n, k, gpu_device, sa_layout="row")
    assert sa.stride(1) == 1
    out_row = run_cuda(a, sa, b, sb)
    out_col = run_cuda(a, col_major_tma(sa), b, sb.t().contiguous().t())  # sb column-major too
    torch.cuda.synchronize()
    assert torch.equal(out_row, out_col)
    assert calc_diff(out_row, reference(a, sa, b, sb)) < TOL_BF16


def test_writes_only_out(gpu_device):
    """A view into a larger buffer: the kernel writes the view and nothing around it."""
    m, n, k = 130, 576, 320
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    big = torch.full((m + 2, n), 7.0, dtype=torch.bfloat16, device=gpu_device)
    run_cuda(a, sa, b, sb, out=big[1:m + 1])
    torch.cuda.synchronize()
    assert bool((big[0] == 7.0).all()) and bool((big[m + 1] == 7.0).all())
    assert calc_diff(big[1:m + 1], reference(a, sa, b, sb)) < TOL_BF16


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (4096, 7168, 2048), (37, 576, 320)])
def test_bit_identical_repeats(m, n, k, gpu_device):
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    first = run_cuda(a, sa, b, sb)
    for _ in range(3):
        again = run_cuda(a, sa, b, sb)
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))


def test_second_stream(gpu_device):
    m, n, k = 4096, 4096, 7168
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    expected = run_cuda(a, sa, b, sb)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=gpu_device)
        run_cuda(a, sa, b, sb, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_cuda_graph_capture(gpu_device):
    m, n, k = 128, 7168, 2048
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=gpu_device)
    run_cuda(a, sa, b, sb, out=out)  # warm: compile, load, encode descriptors outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_cuda(a, sa, b, sb, out=out)
    # New values in the same buffers; the replay must compute with them.
    a2, sa2, b2, sb2 = make_operands(m, n, k, gpu_device)
    a.copy_(a2), sa.copy_(sa2), b.copy_(b2), sb.copy_(sb2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert calc_diff(out, reference(a, sa, b, sb)) < TOL_BF16


def test_through_ops_layer(gpu_device):
    """fp8_gemm_nt(..., backend="cuda") reaches this kernel with the public calling convention."""
    import fp8gemm

    m, n, k = 37, 576, 320
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    out = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")
    torch.cuda.synchronize()
    assert calc_diff(out, reference(a, sa, b, sb)) < TOL_BF16


def test_multiple_kernels_and_devices_state(gpu_device):
    """Different (N, K) in one process each get their own kernel; interleaved calls stay right."""
    shapes = [(64, 2112, 7168), (37, 576, 320), (64, 2112, 7168), (130, 576, 320)]
    for m, n, k in shapes:
        a, sa, b, sb = make_operands(m, n, k, gpu_device)
        out = run_cuda(a, sa, b, sb)
        torch.cuda.synchronize()
        assert calc_diff(out, reference(a, sa, b, sb)) < TOL_BF16


@pytest.mark.parametrize("m,n,k,bm,bn,multicast,on_a,two_accum", FORCED_CONFIGS)
def test_forced_configs(m, n, k, bm, bn, multicast, on_a, two_accum, gpu_device):
    """Configs the heuristic may not pick today (2-CTA multicast of A or B, wide odd tiles,
    BLOCK_M 256, two accumulators on any width) stay correct: built directly, bypassing the
    heuristic."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import FAMILIES, sm90_fp8_gemm_1d2d
    from fp8gemm.backends.family import DeviceFacts

    fam = {f.name: f for f in FAMILIES}["sm90_fp8_gemm_1d2d"]
    problem = dense_problem(m, n, k)
    facts = DeviceFacts.of(gpu_device)
    stages = sm90_fp8_gemm_1d2d.max_stages(bm, bn, k, facts.smem_per_block)
    tiles = ceil_div(m, bm) * ceil_div(n, bn)
    grid = min(facts.num_sms, tiles) // multicast * multicast
    cfg = replace(fam.select_config(problem, facts), block_m=bm, block_n=bn, num_stages=stages,
                  num_multicast=multicast, multicast_on_a=on_a, grid=grid, two_accum=two_accum)
    run_forced_dense(fam, cfg, problem, gpu_device)


def run_forced_dense(fam, cfg, problem, device):
    """fam.run of `cfg` on fresh operands into a poisoned out, checked against float64; returns
    (out, run) with run(out) for another call on the same operands."""
    a, sa, b, sb = make_operands(problem.m, problem.n, problem.k, device)

    def run(out):
        fam.run(cfg, problem, a, sa, b, sb, out)
        torch.cuda.synchronize()
        return out

    out = run(torch.full((problem.m, problem.n), float("nan"), dtype=torch.bfloat16,
                         device=device))
    assert not torch.isnan(out).any()
    assert calc_diff(out, reference(a, sa, b, sb)) < TOL_BF16
    return out, run


def _split_config(fam, problem, facts, bm, bn, splits):
    from dataclasses import replace

    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d

    stages = sm90_fp8_gemm_1d2d.max_stages(bm, bn, problem.k, facts.smem_per_block)
    units = ceil_div(problem.m, bm) * ceil_div(problem.n, bn) * splits
    return replace(fam.select_config(problem, facts), block_m=bm, block_n=bn, num_stages=stages,
                   num_multicast=1, grid=min(facts.num_sms, units), two_accum=False,
                   splits=splits)


@pytest.mark.parametrize("m,n,k,bm,bn,splits", SPLIT_K_CONFIGS)
def test_split_k_configs(m, n, k, bm, bn, splits, gpu_device):
    """Split-K (built directly: the heuristic does not offer it yet): against float64 with a
    poisoned out, with C and a bias-like C (row stride 0) added before the one rounding, the same
    bits on every run, and inside a CUDA graph."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import FAMILIES
    from fp8gemm.backends.family import DeviceFacts

    fam = {f.name: f for f in FAMILIES}["sm90_fp8_gemm_1d2d"]
    facts = DeviceFacts.of(gpu_device)
    problem = dense_problem(m, n, k)
    cfg = _split_config(fam, problem, facts, bm, bn, splits)
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    want = reference(a, sa, b, sb)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=gpu_device)
    fam.run(cfg, problem, a, sa, b, sb, out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert calc_diff(out, want) < TOL_BF16
    again = torch.empty_like(out)
    fam.run(cfg, problem, a, sa, b, sb, again)
    assert torch.equal(again, out)  # a fixed order of the parts: the same bits
    with_c = replace(problem, has_c=True)
    c = torch.randn(m, n, device=gpu_device)
    bias = torch.randn(n, device=gpu_device).expand(m, n)  # row stride 0
    for cc in (c, bias):
        out_c = torch.full_like(out, float("nan"))
        fam.run(cfg, with_c, a, sa, b, sb, out_c, c=cc)
        assert calc_diff(out_c, want + cc.double()) < TOL_BF16
    graphed = torch.full_like(out, float("nan"))
    fam.run(cfg, problem, a, sa, b, sb, graphed)  # (warm: the kernel and workspace exist)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fam.run(cfg, problem, a, sa, b, sb, graphed)
    graphed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, out)


@pytest.mark.parametrize("m,n,k,bn,two_accum", [(64, 2112, 7168, 32, True),
                                                  (200, 7168, 2048, 64, True),
                                                  (1000, 576, 1408, 160, False)])
def test_two_ctas_per_sm_dense(m, n, k, bn, two_accum, gpu_device):
    """ctas_per_sm = 2 (built directly: the heuristic does not offer it): 64-row dense tiles, two
    CTAs on each SM, against float64 with a poisoned out; the same bits as run again."""
    from dataclasses import replace

    from fp8gemm.backends.cuda import FAMILIES, sm90_fp8_gemm_1d2d
    from fp8gemm.backends.family import DeviceFacts

    fam = {f.name: f for f in FAMILIES}["sm90_fp8_gemm_1d2d"]
    facts = DeviceFacts.of(gpu_device)
    problem = dense_problem(m, n, k)
    stages = sm90_fp8_gemm_1d2d.max_stages(64, bn, k, sm90_fp8_gemm_1d2d.smem_limit(facts, 2))
    tiles = ceil_div(m, 64) * ceil_div(n, bn)
    cfg = replace(fam.select_config(problem, facts), block_m=64, block_n=bn, num_stages=stages,
                  num_multicast=1, grid=min(2 * facts.num_sms, tiles), two_accum=two_accum,
                  splits=1, ctas_per_sm=2)
    out, run = run_forced_dense(fam, cfg, problem, gpu_device)
    assert torch.equal(run(torch.empty_like(out)), out)
    # the two CTAs do fit an SM together (registers, shared memory and its carveout; the plan
    # refuses the config otherwise)
    plan = sm90_fp8_gemm_1d2d.get_plan(problem, gpu_device.index or 0, cfg)
    assert plan.kernel.max_active_blocks(cfg.num_threads, cfg.smem(k)) == 2


# --- addressing corner cases ---------------------------------------------------------------------
def test_misaligned_base_pointers(gpu_device):
    """Contiguous views at odd storage offsets (A one byte, out two bytes past a 16-byte
    boundary): TMA cannot address them; the backend copies and writes only the view."""
    m, n, k = 130, 576, 320
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    a_buf = torch.empty(m * k + 16, dtype=E4M3, device=gpu_device)
    a_odd = a_buf[1:1 + m * k].view(m, k)
    a_odd.copy_(a)
    out_buf = torch.full((m * n + 16,), 7.0, dtype=torch.bfloat16, device=gpu_device)
    out_odd = out_buf[1:1 + m * n].view(m, n)
    assert a_odd.data_ptr() % 16 and out_odd.data_ptr() % 16
    run_cuda(a_odd, sa, b, sb, out=out_odd)
    torch.cuda.synchronize()
    assert bool((out_buf[0] == 7.0).all()) and bool((out_buf[1 + m * n:] == 7.0).all())
    assert calc_diff(out_odd, reference(a, sa, b, sb)) < TOL_BF16


def test_one_row_views_with_odd_row_strides(gpu_device):
    """M = 1 views of wider buffers: torch calls them contiguous whatever their row stride."""
    m, n, k = 1, 576, 320
    _, sa, b, sb = make_operands(m, n, k, gpu_device)
    a_wide = torch.randn(2, k + 8, device=gpu_device).to(E4M3)
    a1 = a_wide[:1, :k]
    big = torch.full((2, n + 4), 7.0, dtype=torch.bfloat16, device=gpu_device)
    out1 = big[:1, :n]
    assert a1.is_contiguous() and out1.is_contiguous() and (out1.stride(0) * 2) % 16
    run_cuda(a1, sa, b, sb, out=out1)
    torch.cuda.synchronize()
    assert bool((big[0, n:] == 7.0).all()) and bool((big[1] == 7.0).all())
    assert calc_diff(out1, reference(a1, sa, b, sb)) < TOL_BF16


def test_set_num_sms_applies_to_a_shape_already_run(gpu_device):
    import fp8gemm
    from fp8gemm.backends.cuda import family_for

    m, n, k = 4096, 4096, 7168  # more tiles than SMs: the grid is the SM count
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    problem = dense_problem(m, n, k)
    run_cuda(a, sa, b, sb)
    assert family_for(problem).config_for(problem, gpu_device).grid > 66
    # The warm path (the ops layer's per-metadata launcher) must see the change too.
    fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")
    try:
        fp8gemm.set_num_sms(66)
        assert family_for(problem).config_for(problem, gpu_device).grid <= 66
        out = run_cuda(a, sa, b, sb)
        out2 = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")
        torch.cuda.synchronize()
        assert torch.equal(out, out2)
    finally:
        fp8gemm.set_num_sms(None)
    assert not torch.isnan(out).any()
    assert calc_diff(out, reference(a, sa, b, sb)) < TOL_BF16


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_device_that_is_not_current(gpu_device):
    """Default stream (NULL) of cuda:1 while cuda:0 is current: the kernel must run on cuda:1."""
    if torch.cuda.get_device_capability(1) != (9, 0):
        pytest.skip("cuda:1 is not a Hopper GPU")
    dev = torch.device("cuda", 1)
    m, n, k = 130, 576, 320
    with torch.cuda.device(0):
        a, sa, b, sb = make_operands(m, n, k, dev)
        out = run_cuda(a, sa, b, sb)
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == 0
    assert not torch.isnan(out).any()
    assert calc_diff(out, reference(a, sa, b, sb)) < TOL_BF16


# --- C (a bias, or any float32 [M, N] with unit column stride) -------------------------------------
def _c_variants(m: int, n: int, device):
    """(name, c): a full row-major C, a bias broadcast over the rows (row stride 0), and a C that
    is a column slice of a wider tensor (row stride > N). Values of the product's magnitude."""
    full = torch.randn(m, n, device=device) * 30
    wide = torch.randn(m, n + 24, device=device)[:, 8:n + 8] * 30
    bias = (torch.randn(n, device=device) * 30).expand(m, n)
    return [("full", full), ("bias", bias), ("wide", wide)]


def _close_to(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error in units of what bf16 rounding allows: half an ulp (at most 2^-8 of
    the value) plus 4e-3 RMS for the product's own error. The tensor cores keep ~13 bits of a
    k-block's sum, relative to the sum of its terms' magnitudes (~11x the block's RMS for 128
    random terms): ~1.3e-3 RMS at the worst of millions of elements, and 1.45e-3 was measured
    (4096x7168x2048, K = 320 alike). A C missing from an element (C ~ 30, values ~ 30-200 RMS)
    moves it by 10 units or more."""
    ref = ref.double()
    rms = ref.square().mean().sqrt()
    return float(((out.double() - ref).abs() / (ref.abs() * 2 ** -8 + 4e-3 * rms)).max())


# Tiles of 64, 128 and 256 rows, partial tiles in M and N, two accumulators, multicast.
C_SHAPES = [(1, 576, 320), (37, 2112, 7168), (130, 576, 320), (257, 1000, 4096),
            (4096, 7168, 2048), (64, 24576, 1536), (128, 4096, 7168)]


@pytest.mark.parametrize("m,n,k", C_SHAPES, ids=lambda v: str(v))
def test_c_is_added(m, n, k, gpu_device):
    from fp8gemm.backends import cuda as cuda_backend

    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    problem = GemmProblem(GemmKind.DENSE, m, n, k, 1, E4M3, E4M3, Recipe.GROUP, Recipe.BLOCK,
                          torch.bfloat16, has_c=True)
    assert cuda_backend.supports(problem) is None
    product = reference(a, sa, b, sb)
    for name, c in _c_variants(m, n, gpu_device):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=gpu_device)
        cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, c, problem)
        torch.cuda.synchronize()
        err = _close_to(out, product + c.double())
        assert err <= 1, f"{name}: max error {err:.3g} of the bf16 bound"
        again = out.clone()
        cuda_backend.fp8_gemm_nt(a, sa, b, sb, again, c, problem)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), again.view(torch.int16)), name


def test_bias_through_ops_layer_and_warm_calls(gpu_device):
    """fp8_gemm_nt(c=bias.expand(M, N)) runs on the CUDA kernel without an [M, N] copy of the
    bias; warm calls with a new bias (same metadata, new pointer) add the new one."""
    import fp8gemm

    m, n, k = 64, 2112, 7168
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    product = reference(a, sa, b, sb)
    for _ in range(3):
        bias = torch.randn(n, device=gpu_device) * 30
        out = fp8gemm.fp8_gemm_nt((a, sa), (b, sb), c=bias.expand(m, n), backend="cuda")
        torch.cuda.synchronize()
        assert _close_to(out, product + bias.double()) <= 1


def test_c_with_cuda_graph(gpu_device):
    from fp8gemm.backends import cuda as cuda_backend

    m, n, k = 128, 7168, 2048
    a, sa, b, sb = make_operands(m, n, k, gpu_device)
    problem = GemmProblem(GemmKind.DENSE, m, n, k, 1, E4M3, E4M3, Recipe.GROUP, Recipe.BLOCK,
                          torch.bfloat16, has_c=True)
    bias = torch.randn(n, device=gpu_device)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=gpu_device)
    cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, bias.expand(m, n), problem)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_backend.fp8_gemm_nt(a, sa, b, sb, out, bias.expand(m, n), problem)
    bias.copy_(torch.randn(n, device=gpu_device) * 30)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _close_to(out, reference(a, sa, b, sb) + bias.double()) <= 1


def test_split_k_pick_through_ops_layer(gpu_device, monkeypatch):
    """The split-K family's pick (1000x512x32768: 4 parts of 128x128) through the public op:
    cold and warm calls (the fast path's packs name the stream's workspace), a bias, a second
    stream running concurrently with the first, and two CUDA graphs captured on one stream and
    replayed on two streams at once all give the first call's bits."""
    import fp8gemm
    from fp8gemm.backends import cuda
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g
    from fp8gemm.backends.family import DeviceFacts
    from fp8gemm.ops import gemm as gemm_op

    m, n, k = 1000, 512, 32768
    monkeypatch.setattr(gemm_op, "_plans", {})
    cuda._family.cache_clear()
    try:
        problem = dense_problem(m, n, k)
        fam = cuda.family_for(problem, DeviceFacts.of(gpu_device))
        if fam is not g.SPLIT_K:
            pytest.skip(f"this device's model leaves {problem} to {fam.name}")
        a, sa, b, sb = make_operands(m, n, k, gpu_device)
        bias = torch.randn(n, device=gpu_device)

        def call(out=None):
            return fp8gemm.fp8_gemm_nt((a, sa), (b, sb), out=out, c=bias.expand(m, n),
                                       backend="cuda")

        first = call()
        torch.cuda.synchronize()
        assert calc_diff(first, reference(a, sa, b, sb) + bias.double()) < TOL_BF16
        for _ in range(3):  # warm calls
            assert torch.equal(call().view(torch.int16), first.view(torch.int16))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        outs = [torch.full_like(first, float("nan")) for _ in range(4)]
        for i, out in enumerate(outs):  # both streams busy with split launches at once
            with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
                call(out)
        torch.cuda.current_stream().wait_stream(side)
        graphs, graphed = [], [torch.full_like(first, float("nan")) for _ in range(2)]
        for out in graphed:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(out)
            graphs.append(graph)
        side.wait_stream(torch.cuda.current_stream())
        for graph, stream in zip(graphs, (torch.cuda.current_stream(), side)):
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for out in outs + graphed:
            assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    finally:
        cuda._family.cache_clear()

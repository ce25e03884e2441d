"""GPU tests of programmatic dependent launch (FP8GEMM_PDL, on by default; skipped without a Hopper
GPU): decode chains of the CUDA per-token quantiser and a GEMM in one stream, eager and in a CUDA
graph. The quantiser lets its dependents launch as it starts, so each GEMM's CTAs may begin (their
prologue and L2 prefetch of B) while the quantiser still writes the A the GEMM reads: a GEMM that
touched A before its griddepcontrol.wait would read the previous link's values. Every output is
checked against float64 on its own link's quantised A, with fresh inputs on every link.
"""

from __future__ import annotations

import pytest
import torch

import fp8gemm
from fp8gemm.problem import Recipe
from helpers import TOL, calc_diff, rand_fp8, rand_scales, ref_gemm, ref_masked

pytestmark = pytest.mark.gpu

LINKS = 6
# (M, N, K): the small-M family's swap-AB split-K (64x2112x7168), the dense family's 64-row
# tiles (64x4096x7168, 128x7168x2048)
DENSE = [(64, 2112, 7168), (64, 4096, 7168), (128, 7168, 2048)]


@pytest.fixture
def pdl_on(gpu_device):
    if not fp8gemm.settings.pdl:
        pytest.skip("FP8GEMM_PDL=0")
    return gpu_device


def _weights(n, k, device, groups=None):
    shape = (n, k) if groups is None else (groups, n, k)
    b = rand_fp8(shape, torch.float8_e4m3fn, device)
    sb = rand_scales(((groups,) if groups else ()) + (-(-n // 128), -(-k // 128)), device)
    return b, sb


def _check_dense(links, b, sb):
    for i, (a, sa, y) in enumerate(links):
        ref = ref_gemm(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK)
        assert calc_diff(y, ref) < TOL[torch.bfloat16], f"link {i}"


@pytest.mark.parametrize("m,n,k", DENSE)
def test_quantise_then_gemm_eager(m, n, k, pdl_on):
    b, sb = _weights(n, k, pdl_on)
    xs = [torch.randn(m, k, device=pdl_on, dtype=torch.bfloat16) * (i + 1) for i in range(LINKS)]
    links = []
    for x in xs:
        a, sa = fp8gemm.quantize_per_token(x)
        links.append((a, sa, fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")))
    torch.cuda.synchronize()
    _check_dense(links, b, sb)


@pytest.mark.parametrize("m,n,k", DENSE[:2])
def test_quantise_then_gemm_in_a_cuda_graph(m, n, k, pdl_on):
    """Captured links keep their programmatic edges; replays with new inputs stay right."""
    b, sb = _weights(n, k, pdl_on)
    xs = [torch.zeros(m, k, device=pdl_on, dtype=torch.bfloat16) for _ in range(LINKS)]
    for x in xs:  # warm-up outside the capture: compiles, plans, tensor maps
        fp8gemm.fp8_gemm_nt(fp8gemm.quantize_per_token(x), (b, sb), backend="cuda")
    torch.cuda.synchronize()
    graph, links = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for x in xs:
            a, sa = fp8gemm.quantize_per_token(x)
            links.append((a, sa, fp8gemm.fp8_gemm_nt((a, sa), (b, sb), backend="cuda")))
    for replay in range(2):
        for i, x in enumerate(xs):
            x.copy_(torch.randn_like(x) * (i + 1 + replay))
        graph.replay()
        torch.cuda.synchronize()
        _check_dense(links, b, sb)


def test_quantise_then_masked_gemm(pdl_on):
    """The masked kernel reads masked_m and A only after its wait."""
    g, mmax, n, k = 2, 64, 4096, 7168
    b, sb = _weights(n, k, pdl_on, groups=g)
    for i in range(LINKS):
        x = torch.randn(g, mmax, k, device=pdl_on, dtype=torch.bfloat16) * (i + 1)
        masked_m = torch.randint(0, mmax + 1, (g,), device=pdl_on, dtype=torch.int32)
        a, sa = fp8gemm.quantize_per_token(x)
        out = torch.full((g, mmax, n), float("nan"), device=pdl_on, dtype=torch.bfloat16)
        fp8gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), out, masked_m, expected_m=mmax // 2,
                                             backend="cuda")
        ref = ref_masked(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK, masked_m)
        rows = ~torch.isnan(ref[..., 0])
        assert torch.isnan(out[~rows]).all(), f"link {i}: rows past masked_m written"
        if rows.any():
            assert calc_diff(out[rows], ref[rows]) < TOL[torch.bfloat16], f"link {i}"

"""The benchmark on a Hopper GPU: the timer, and the cuBLAS peers called right (small shapes)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8gemm.bench import impls, timing
from fp8gemm.bench.runner import run_cases
from fp8gemm.bench.suites import Case
from helpers import BENCH_PEER_TOL, TOL

pytestmark = pytest.mark.gpu  # conftest skips these without a Hopper GPU


def test_device_timer_measures_a_sleep():
    dev = torch.device("cuda")
    timer = timing.DeviceTimer(dev)
    cycles = int(100 * timer.cycles_per_us)  # about 100 us of GPU time
    us = timing.median(timer.time_us(lambda: torch.cuda._sleep(cycles), host_us=10.0, runs=30))
    assert 80 < us < 130


def test_cublas_block_probe_finds_a_correct_way():
    way, rows = impls.cublas_block_probe(torch.device("cuda"))
    assert way is not None, rows


def test_peers_are_correct_at_small_shapes():
    dev = torch.device("cuda")
    way, _ = impls.cublas_block_probe(dev)
    cases = [Case("t", "dense", 128, 256, 384), Case("t", "dense", 37, 200, 320),
             Case("t", "contiguous", 128, 256, 512, 2), Case("t", "masked", 64, 256, 512, 2)]
    res = run_cases(cases, list(impls.PEER_IMPLS), dev, 30, block_way=way, log=lambda s: None)
    assert res.aborted is None
    # DeepGEMM is an optional peer: absent, it is skipped with that reason and nothing else is.
    absent = importlib.util.find_spec("deep_gemm") is None
    skips = [sk for sk in res.skips if not (absent and sk[1] == "deepgemm")]
    assert not skips, skips
    for r in res.rows:
        # cublas-block computes exactly our recipe; the others quantise differently or in bf16
        limit = (TOL[torch.bfloat16] if r["impl"] == "cublas-block"
                 else BENCH_PEER_TOL.get(r["impl"], BENCH_PEER_TOL["other quantisation"]))
        assert r["diff"] is not None and r["diff"] < limit, r


def _deep_gemm_importable() -> bool:
    try:
        import deep_gemm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def test_busy_time_covers_deepgemm_host_cost():
    timer = timing.DeviceTimer(torch.device("cuda"))
    # (sleep_cycles rounds down to whole cycles)
    assert timer.sleep_cycles(10.0, impls.DEEPGEMM_BUSY_US) >= int(500 * timer.cycles_per_us)
    assert timer.sleep_cycles(400.0) >= int(800 * timer.cycles_per_us)  # twice the host time


def test_new_ops_and_peers_are_correct_at_small_shapes():
    from fp8gemm.bench.suites import skewed_sizes

    dev = torch.device("cuda")
    sizes = skewed_sizes(600, 4)
    cases = [Case("t", "wgrad", 256, 384, 640), Case("t", "wgrad", 256, 384, 1000),
             Case("t", "k_grouped_wgrad", 256, 384, 256, 2, (128, 384)),
             Case("t", "k_grouped_wgrad", 256, 384, 384, 3, (0, 768, 384)),  # an empty expert
             Case("t", "dgrad", 1000, 384, 512),
             Case("t", "contiguous", 150, 256, 512, 4, sizes),
             Case("t", "offsets", 150, 256, 512, 4, sizes),
             Case("t", "masked", 40, 256, 512, 3, skewed_sizes(120, 3)),
             Case("t", "dense", 128, 256, 512)]
    names = ["fp8gemm-cuda", "fp8gemm-triton", "cublas-block", "cublas-block-loop",
             "cublas-rowwise-grouped", "torch-bf16", "deepgemm"]
    res = run_cases(cases, names, dev, 30, log=lambda s: None)
    assert res.aborted is None
    ran = {(r["op"], r["shape"]["k"], r["impl"]) for r in res.rows}
    assert ("wgrad", 640, "cublas-block") in ran, res.skips
    assert ("k_grouped_wgrad", 256, "cublas-block-loop") in ran, res.skips
    assert ("k_grouped_wgrad", 384, "cublas-block-loop") in ran, res.skips
    assert ("dgrad", 512, "cublas-block") in ran, res.skips
    assert ("wgrad", 1000, "cublas-block") not in ran  # cuBLAS takes no K % 16 != 0
    if _deep_gemm_importable():
        for op, k in (("wgrad", 640), ("k_grouped_wgrad", 256), ("k_grouped_wgrad", 384),
                      ("contiguous", 512), ("masked", 512), ("dense", 512), ("dgrad", 512)):
            assert (op, k, "deepgemm") in ran, res.skips
    for r in res.rows:
        exact = r["impl"].startswith("fp8gemm") or r["impl"] in ("cublas-block",
                                                                  "cublas-block-loop", "deepgemm")
        limit = 1e-5 if exact else 2e-3
        assert r["diff"] is not None and r["diff"] < limit, r


def test_moe_layer_prefill_and_decode_in_a_graph():
    dev = torch.device("cuda")
    from fp8gemm.quant import calc_diff

    for tokens in (64, 300):  # decode (CUDA graph, masked) and prefill (eager, contiguous)
        data = impls.make_data(Case("t", "moe_layer", tokens, 512, 256, 4), dev)
        ref = impls.reference_output(data)
        made = {}
        for name in ("fp8gemm-cuda", "fp8gemm-triton", "torch-bf16", "deepgemm"):
            try:
                made[name] = impls.make_impl(name, data)
            except impls.Skip as e:
                assert name != "torch-bf16", e
                assert name != "deepgemm" or not _deep_gemm_importable(), e
        assert "fp8gemm-cuda" in made or "fp8gemm-triton" in made
        for name, m in made.items():
            m.fn()  # a replay (decode) or a call (prefill) gives the layer again
            torch.cuda.synchronize()
            limit = 1e-4 if name == "torch-bf16" else 5e-3
            assert calc_diff(m.output(), ref) < limit, (name, tokens)
            for part in m.parts.values():
                part()
        torch.cuda.synchronize()

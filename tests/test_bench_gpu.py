"""The benchmark on a Hopper GPU: the timer, and the cuBLAS peers called right (small shapes)."""

from __future__ import annotations

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
    assert not res.skips, res.skips
    for r in res.rows:
        # cublas-block computes exactly our recipe; the others quantise differently or in bf16
        limit = (TOL[torch.bfloat16] if r["impl"] == "cublas-block"
                 else BENCH_PEER_TOL.get(r["impl"], BENCH_PEER_TOL["other quantisation"]))
        assert r["diff"] is not None and r["diff"] < limit, r

"""The per-token quantiser as a CUDA kernel (fp8gemm/backends/cuda/quant.py): every instance
compiled for sm_90a without a GPU (no spills, no local memory, the FP8 conversion in the SASS);
what it refuses; on a Hopper GPU with quant.CUDA_QUANT on, the torch code's values (its
specification) on ragged, batched, strided and non-finite input."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

import fp8gemm
from fp8gemm import quant
from helpers import (FP8_STEP_FRACTION, assert_waits_before_global_access, compiler_or_skip,
                     fp8_steps)

cq = pytest.importorskip("fp8gemm.backends.cuda.quant")


def test_every_instance_compiles_clean(tmp_path, monkeypatch):
    compiler_or_skip()
    from fp8gemm.jit import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's wheel)")
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    for dtype, fmt, silu, pow2, rows_first in cq.VARIANTS:
        what = f"{dtype} {fmt} silu={silu} pow2={pow2} rows_first={rows_first}"
        compiled = cq.compile_kernel(dtype, fmt, silu, pow2, rows_first)[1]
        path = tmp_path / "k.cubin"
        path.write_bytes(compiled.cubin)
        sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
        assert f"F2FP.SATFINITE.{fmt.upper()}.F32.PACK_AB" in sass, what
        assert "LDG.E.NA.128" in sass and not re.search(r"\b(LDL|STL)\b", sass), what
        assert_waits_before_global_access(sass, what)
        res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True,
                             text=True).stdout
        found = re.findall(r"STACK:(\d+)", res) + re.findall(r"LOCAL:(\d+)", res)
        assert len(found) >= 2 and max(map(int, found)) == 0, (what, res)


def test_refusals_name_the_constraint():
    x = torch.zeros(4, 320, dtype=torch.bfloat16)
    assert cq.refusal(x, 320, False) is None
    assert cq.refusal(x, 160, True) is None
    assert "K % 8" in cq.refusal(torch.zeros(4, 324, dtype=torch.bfloat16), 324, False)
    assert "K % 8" in cq.refusal(x, 164, True)  # (a SiLU split of 2 x 164 is not 16-byte aligned)
    assert "unit column stride" in cq.refusal(x.t(), 4, False)
    assert "strides % 8" in cq.refusal(torch.zeros(4, 330, dtype=torch.bfloat16)[:, :320], 320,
                                       False)
    assert "16-byte" in cq.refusal(torch.zeros(4 * 320 + 8, dtype=torch.bfloat16)[4:4 + 1280]
                                   .view(4, 320), 320, False)
    assert "bf16, fp16 or fp32" in cq.refusal(torch.zeros(4, 320, dtype=torch.float64), 320,
                                              False)


@pytest.fixture
def cuda_quant(monkeypatch):
    """quant.CUDA_QUANT on, and a count of the CUDA kernel's calls."""
    calls = []
    run = cq.quantize_rows

    def counted(*args):
        calls.append(args[1:])
        return run(*args)

    monkeypatch.setattr(quant, "CUDA_QUANT", True)
    monkeypatch.setattr(cq, "quantize_rows", counted)
    return calls


def _agrees(got, want, what):
    (q, s), (q0, s0) = got, want
    assert q.dtype == q0.dtype and q.shape == q0.shape and s.shape == s0.shape, what
    # (the strides of the dims that have more than one element: those of size 1 are arbitrary)
    assert [st for st, d in zip(s.stride(), s.shape) if d > 1] == \
        [st for st, d in zip(s0.stride(), s0.shape) if d > 1], what
    torch.testing.assert_close(s.cpu(), s0, rtol=1e-6, atol=0, equal_nan=True, msg=what)
    nan = q0.float().isnan()
    assert torch.equal(q.cpu().float().isnan(), nan), f"{what}: NaN elsewhere"
    steps = fp8_steps(q.cpu(), q0)[~nan]
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) <= FP8_STEP_FRACTION, what


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_matches_the_torch_spec(gpu_device, cuda_quant, fmt, pow2):
    cases = [torch.randn(301, 1000) * 4,                                  # ragged last group
             torch.randn(3, 37, 384, dtype=torch.float64).float() * 100,  # a batch
             (torch.randn(64, 7168) * torch.logspace(-3, 3, 7168)).half(),
             torch.randn(40, 1032)[:, :1024].bfloat16(),                  # row-strided
             torch.zeros(5, 256).bfloat16()]                              # amax floored
    nonfinite = torch.randn(9, 512)
    nonfinite[1, 7], nonfinite[2, 300], nonfinite[3, 0] = float("inf"), float("-inf"), float("nan")
    cases.append(nonfinite)
    for x in cases:
        what = f"{list(x.shape)} {x.dtype} {fmt} pow2={pow2}"
        for col_major in (True, False):
            before = len(cuda_quant)
            got = fp8gemm.quantize_per_token(x.to(gpu_device), fmt, pow2_scales=pow2,
                                             col_major_scales=col_major)
            assert len(cuda_quant) == before + 1, f"{what}: the CUDA kernel did not run"
            _agrees(got, quant.per_token_torch(x, fmt, pow2, col_major), what)
        g = x[..., : x.shape[-1] // 16 * 16]
        got = fp8gemm.silu_mul_quantize_per_token(g.to(gpu_device), fmt, pow2_scales=pow2)
        _agrees(got, quant.silu_mul_per_token_torch(g, fmt, pow2, True), "silu " + what)


@pytest.mark.gpu
def test_refused_input_runs_triton_with_the_same_values(gpu_device, cuda_quant):
    x = torch.randn(33, 324) * 3  # K % 8 != 0
    got = fp8gemm.quantize_per_token(x.to(gpu_device))
    assert not cuda_quant
    _agrees(got, quant.per_token_torch(x, "e4m3", False, True), "K = 324")


@pytest.mark.gpu
def test_small_inputs_take_the_cuda_kernel_below_the_size_bound(gpu_device, cuda_quant,
                                                                 monkeypatch):
    """With CUDA_QUANT off, inputs of at most CUDA_QUANT_MAX_ELEMENTS elements run the CUDA
    kernel and larger ones Triton, both with the torch code's values."""
    monkeypatch.setattr(quant, "CUDA_QUANT", False)
    monkeypatch.setattr(quant, "CUDA_QUANT_MAX_ELEMENTS", 128 * 7168)
    for rows, cuda in ((128, True), (129, False)):
        x = torch.randn(rows, 7168) * 3
        before = len(cuda_quant)
        got = fp8gemm.quantize_per_token(x.to(gpu_device))
        assert len(cuda_quant) == before + int(cuda), rows
        _agrees(got, quant.per_token_torch(x, "e4m3", False, True), f"{rows} rows")


@pytest.mark.gpu
def test_repeats_bit_for_bit_and_writes_nothing_else(gpu_device, cuda_quant):
    """The same bits on every run; q and s are fresh tensors, x is left as it was."""
    x = torch.randn(4096, 7168, device=gpu_device, dtype=torch.bfloat16)
    x0 = x.clone()
    q, s = fp8gemm.quantize_per_token(x)
    for _ in range(3):
        q2, s2 = fp8gemm.quantize_per_token(x)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert torch.equal(x, x0) and len(cuda_quant) == 4


@pytest.mark.gpu
def test_silu_mul_masked_m_reads_only_the_tokens_rows(gpu_device, cuda_quant, monkeypatch):
    """With masked_m the CUDA kernel runs whatever the size (it reads the tokens' rows only):
    those rows have the torch code's values and the other rows' scales are an all-zero group's
    (their fp8 values are unspecified). masked_m is clamped to [0, Mmax] and may change between
    the replays of a CUDA graph."""
    monkeypatch.setattr(quant, "CUDA_QUANT", False)
    g, mmax, inter = 8, 160, 2048  # 5.2M elements: Triton without masked_m
    x = torch.randn(g, mmax, 2 * inter, device=gpu_device, dtype=torch.bfloat16) * 3
    zero_scale = quant.silu_mul_per_token_torch(torch.zeros(1, 1, 256), "e4m3", False, True)[1]
    spec_q, spec_s = quant.silu_mul_per_token_torch(x.cpu(), "e4m3", False, True)

    def check(masked_m, got, what):
        q, s = got
        for e, rows in enumerate(masked_m.tolist()):
            rows = min(max(rows, 0), mmax)
            if rows:
                _agrees((q[e, :rows], s[e, :rows]), (spec_q[e, :rows], spec_s[e, :rows]), what)
            assert bool((s[e, rows:] == zero_scale.flatten()[0].to(s.device)).all()), what

    masked_m = torch.tensor([0, 1, 7, 64, 159, 160, 300, -3], dtype=torch.int32,
                            device=gpu_device)
    before = len(cuda_quant)
    check(masked_m, fp8gemm.silu_mul_quantize_per_token(x, masked_m=masked_m), "eager")
    assert len(cuda_quant) == before + 1, "the CUDA kernel did not run"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fp8gemm.silu_mul_quantize_per_token(x, masked_m=masked_m)
    for values in ([5, 0, 160, 3, 2, 1, 100, 77], [160] * 8):
        masked_m.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(masked_m, got, f"graph {values}")

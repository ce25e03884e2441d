"""MoE helpers: router output -> contiguous / masked layout -> grouped GEMM (reference backend)
-> weighted combine equals the dense per-token computation sum_k w[t,k] * x_t @ W_{e[t,k]}^T."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8gemm
from helpers import TOL, assert_close_diff, dequant_a, dequant_b, load_script

FP32 = torch.float32


def routing(t: int, topk: int, groups: int, dropped: bool = False):
    """Distinct experts per token (as a top-k router gives), softmax weights; with `dropped`,
    some slots carry -1 or an id >= G (experts held elsewhere) and one token has none left."""
    ids = torch.stack([torch.randperm(groups)[:topk] for _ in range(t)]).to(torch.int32)
    if dropped:
        ids[0, 0], ids[1, 1], ids[2, 0] = -1, groups, groups + 5
        ids[3, :] = -1
    weights = torch.softmax(torch.randn(t, topk), dim=-1)
    return ids, weights


def experts(groups: int, n: int, k: int):
    w = torch.randn(groups, n, k, dtype=torch.bfloat16)
    wq, ws = fp8gemm.quantize_per_block(w)
    w64 = torch.stack([dequant_b(wq[g], ws[g], "128x128", False) for g in range(groups)])
    return (wq, ws), w64


def dense_moe(x, ids, weights, w64, keep=None) -> torch.Tensor:
    """float64 sum over kept slots of weight * (x_t quantised per token) @ W_e^T."""
    xq, xs = fp8gemm.quantize_per_token(x)
    x64 = dequant_a(xq, xs, "1x128")
    t, topk = ids.shape
    out = torch.zeros(t, w64.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(topk):
            e = int(ids[i, j])
            if 0 <= e < w64.shape[0] and (keep is None or keep[i, j]):
                out[i] += float(weights[i, j]) * (x64[i] @ w64[e].T)
    return out


@pytest.mark.parametrize("dropped", (False, True), ids=("all-kept", "dropped-ids"))
@pytest.mark.parametrize("alignment", (None, 1, 8))
def test_contiguous_roundtrip(alignment, dropped):
    t, topk, g, n, k = 50, 3, 5, 200, 320
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids, weights = routing(t, topk, g, dropped)
    wb, w64 = experts(g, n, k)
    lay = fp8gemm.moe_dispatch_contiguous(x, ids, g, alignment)
    align = alignment or fp8gemm.get_m_alignment_for_contiguous_layout()

    # the layout: groups in order, each padded to the alignment with -1 rows of zeros
    counts = torch.tensor([int(((ids == e)).sum()) for e in range(g)])
    padded = (counts + align - 1) // align * align
    assert lay.offsets.dtype == torch.int32 and lay.m_indices.dtype == torch.int32
    assert lay.offsets.tolist() == [0] + torch.cumsum(padded, 0).tolist()
    for e in range(g):
        run = lay.m_indices[lay.offsets[e]:lay.offsets[e + 1]]
        assert (run[:counts[e]] == e).all() and (run[counts[e]:] == -1).all()
    assert (lay.x[lay.m_indices == -1] == 0).all()
    assert (lay.token_of_row[lay.m_indices == -1] == 0).all()
    # each kept slot's row holds its token; dropped slots have no row
    for i in range(t):
        for j in range(topk):
            r = int(lay.row_of_slot[i, j])
            if 0 <= ids[i, j] < g:
                assert lay.m_indices[r] == ids[i, j] and torch.equal(lay.x[r], x[i])
                assert lay.token_of_row[r] == i
            else:
                assert r == -1

    a = fp8gemm.quantize_per_token(lay.x)
    y = fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, wb, None, lay.m_indices, out_dtype=FP32,
                                                 backend="reference")
    out = fp8gemm.moe_combine_contiguous(y, lay, weights)
    expect = dense_moe(x, ids, weights, w64)
    assert out.shape == (t, n) and out.dtype == FP32
    assert_close_diff(out, expect, TOL[FP32], "contiguous")
    if dropped:
        assert (out[3] == 0).all()  # a token with every slot dropped gets nothing
    if alignment == 1:  # no padding: the offsets op takes the layout as is
        assert (lay.m_indices >= 0).all()
        y2 = fp8gemm.m_grouped_fp8_gemm_nt_offsets(a, wb, None, lay.offsets, out_dtype=FP32,
                                                   backend="reference")
        assert torch.equal(y2, y)


def test_contiguous_dispatch_of_quantised_rows():
    """Dispatching fp8 rows and their (column-major) scales gives the same layout as dispatching
    bf16 and quantising after, and the same GEMM result; bf16 combine returns bf16."""
    t, topk, g, n, k = 40, 2, 4, 200, 320
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids, weights = routing(t, topk, g)
    wb, w64 = experts(g, n, k)
    xq, xs = fp8gemm.quantize_per_token(x)
    lay_q = fp8gemm.moe_dispatch_contiguous(xq, ids, g)
    lay_s = fp8gemm.moe_dispatch_contiguous(xs, ids, g)
    lay = fp8gemm.moe_dispatch_contiguous(x, ids, g)
    real = lay.m_indices >= 0
    aq, asc = fp8gemm.quantize_per_token(lay.x)
    assert lay_q.x.dtype == xq.dtype and torch.equal(lay_q.x.float(), aq.float())
    assert torch.equal(lay_s.x[real], asc[real])
    y = fp8gemm.m_grouped_fp8_gemm_nt_contiguous((lay_q.x, lay_s.x), wb, None, lay.m_indices,
                                                 backend="reference")
    out = fp8gemm.moe_combine_contiguous(y, lay, weights)
    assert out.dtype == torch.bfloat16
    assert_close_diff(out, dense_moe(x, ids, weights, w64), TOL[torch.bfloat16], "fp8 dispatch")


def test_contiguous_deepseek_k():
    """The real K = 7168 with 8 experts (N shrunk to 256)."""
    t, topk, g, n, k = 32, 4, 8, 256, 7168
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids, weights = routing(t, topk, g)
    wb, w64 = experts(g, n, k)
    lay = fp8gemm.moe_dispatch_contiguous(x, ids, g)
    y = fp8gemm.m_grouped_fp8_gemm_nt_contiguous(fp8gemm.quantize_per_token(lay.x), wb, None,
                                                 lay.m_indices, backend="reference")
    assert_close_diff(fp8gemm.moe_combine_contiguous(y, lay, weights),
                      dense_moe(x, ids, weights, w64), TOL[torch.bfloat16], "K=7168")


@pytest.mark.parametrize("dropped", (False, True), ids=("all-kept", "dropped-ids"))
def test_masked_roundtrip(dropped):
    t, topk, g, n, k = 50, 3, 5, 200, 320
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids, weights = routing(t, topk, g, dropped)
    wb, w64 = experts(g, n, k)
    lay = fp8gemm.moe_dispatch_masked(x, ids, g)
    counts = torch.tensor([int((ids == e).sum()) for e in range(g)], dtype=torch.int32)
    assert lay.x.shape == (g, t, k) and torch.equal(lay.masked_m, counts)
    rows = torch.arange(t)[None, :] < counts[:, None]
    assert (lay.x[~rows] == 0).all()
    assert lay.token_of_row.shape == (g, t) and (lay.token_of_row[~rows] == 0).all()
    assert torch.equal(x[lay.token_of_row[rows]], lay.x[rows])  # each row holds its token
    a = fp8gemm.quantize_per_token(lay.x)
    y = fp8gemm.m_grouped_fp8_gemm_nt_masked(a, wb, None, lay.masked_m, expected_m=8,
                                             out_dtype=FP32, backend="reference")
    out = fp8gemm.moe_combine_masked(y, lay, weights)
    assert out.shape == (t, n) and out.dtype == FP32
    assert_close_diff(out, dense_moe(x, ids, weights, w64), TOL[FP32], "masked")
    if dropped:
        assert (lay.row_of_slot[ids < 0] == -1).all() and (lay.row_of_slot[ids >= g] == -1).all()
        assert (out[3] == 0).all()


def test_masked_dispatch_without_the_zero_fill(monkeypatch):
    """zero_rest=False: the rows below masked_m and everything else of the layout as with the
    fill; the rows past masked_m are what the allocation held (NaN here), and the masked GEMM
    over them gives the same result in the rows below masked_m."""
    t, topk, g, n, k = 30, 2, 4, 200, 320
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids, weights = routing(t, topk, g, dropped=True)
    wb, _ = experts(g, n, k)
    xq, sx = fp8gemm.quantize_per_token(x)
    want = fp8gemm.moe_dispatch_masked(xq, ids, g, max_m=12)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.view(torch.uint8).fill_(0x7F).view(out.dtype) if out.element_size() == 1 else out

    monkeypatch.setattr(torch, "empty", poisoned)
    got = fp8gemm.moe_dispatch_masked(xq, ids, g, max_m=12, zero_rest=False)
    monkeypatch.undo()
    rows = torch.arange(12)[None, :] < want.masked_m[:, None]
    assert torch.equal(got.x.view(torch.uint8)[rows], want.x.view(torch.uint8)[rows])
    assert bool((got.x.view(torch.uint8)[~rows] == 0x7F).all()) and bool((~rows).any())
    for name in ("masked_m", "row_of_slot", "token_of_row"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    sa = sx.index_select(0, got.token_of_row.flatten()).view(g, 12, -1)
    ys = [fp8gemm.m_grouped_fp8_gemm_nt_masked((lay.x, sa), wb, None, lay.masked_m,
                                               out_dtype=FP32, backend="reference")
          for lay in (want, got)]
    assert torch.equal(fp8gemm.moe_combine_masked(ys[1], got, weights),
                       fp8gemm.moe_combine_masked(ys[0], want, weights))


def test_masked_capacity_max_m():
    """Slots beyond max_m in an expert are dropped (the first max_m in token order are kept)."""
    t, topk, g, n, k, max_m = 40, 2, 3, 200, 320, 6
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids, weights = routing(t, topk, g)
    wb, w64 = experts(g, n, k)
    lay = fp8gemm.moe_dispatch_masked(x, ids, g, max_m=max_m)
    counts = torch.tensor([int((ids == e).sum()) for e in range(g)])
    assert (counts > max_m).any()  # the test needs an overfull expert
    assert lay.x.shape == (g, max_m, k)
    assert lay.masked_m.tolist() == counts.clamp_max(max_m).tolist()
    # expected kept slots: per expert, the first max_m in (token, slot) order
    keep = torch.zeros(t, topk, dtype=torch.bool)
    seen = [0] * g
    for i in range(t):
        for j in range(topk):
            e = int(ids[i, j])
            keep[i, j] = seen[e] < max_m
            seen[e] += 1
    assert torch.equal(lay.row_of_slot >= 0, keep)
    y = fp8gemm.m_grouped_fp8_gemm_nt_masked(fp8gemm.quantize_per_token(lay.x), wb, None,
                                             lay.masked_m, out_dtype=FP32, backend="reference")
    out = fp8gemm.moe_combine_masked(y, lay, weights)
    assert_close_diff(out, dense_moe(x, ids, weights, w64, keep), TOL[FP32], "capacity")


def test_masked_dispatch_of_fp8_rows():
    """fp8 rows dispatch like the bf16 rows they came from (no fp8 index_copy on the CPU)."""
    x = torch.randn(20, 256, dtype=torch.bfloat16)
    ids, _ = routing(20, 2, 4)
    xq, _ = fp8gemm.quantize_per_token(x)
    lay_q = fp8gemm.moe_dispatch_masked(xq, ids, 4)
    lay = fp8gemm.moe_dispatch_masked(x, ids, 4)
    assert lay_q.x.dtype == xq.dtype
    assert torch.equal(lay_q.x.float(), fp8gemm.quantize_per_token(lay.x)[0].float())


def test_masked_dispatch_needs_no_host_sync():
    """On 'meta' tensors any read-back (item(), bool(), tolist(), data-sized results such as
    bincount) raises: dispatching there shows the masked path is CUDA-graph safe."""
    x = torch.empty(16, 256, device="meta", dtype=torch.bfloat16)
    ids = torch.empty(16, 4, device="meta", dtype=torch.int32)
    lay = fp8gemm.moe_dispatch_masked(x, ids, 8, max_m=16)
    assert lay.x.shape == (8, 16, 256) and lay.masked_m.shape == (8,)
    w = torch.empty(16, 4, device="meta")
    y = torch.empty(8, 16, 512, device="meta", dtype=torch.bfloat16)
    assert fp8gemm.moe_combine_masked(y, lay, w).shape == (16, 512)


@pytest.mark.gpu
def test_contiguous_dispatch_synchronises_once(gpu_device):
    """The contiguous layout reads one small tensor back to size itself, and nothing else."""
    x = torch.randn(64, 256, device=gpu_device, dtype=torch.bfloat16)
    ids, _ = routing(64, 4, 16, dropped=True)
    ids = ids.to(gpu_device)
    fp8gemm.moe_dispatch_contiguous(x, ids, 16)  # (warm: first calls may load kernels)
    torch.cuda.synchronize()
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fp8gemm.moe_dispatch_contiguous(x, ids, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_no_tokens_for_some_experts():
    """Experts that get no token: empty runs (contiguous) and masked_m = 0 (masked)."""
    t, g, n, k = 6, 4, 200, 320
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids = torch.tensor([[0], [0], [2], [0], [2], [2]], dtype=torch.int32)
    w = torch.ones(t, 1)
    wb, w64 = experts(g, n, k)
    expect = dense_moe(x, ids, w, w64)
    lay = fp8gemm.moe_dispatch_contiguous(x, ids, g, alignment=1)
    assert lay.offsets.tolist() == [0, 3, 3, 6, 6]
    y = fp8gemm.m_grouped_fp8_gemm_nt_offsets(fp8gemm.quantize_per_token(lay.x), wb, None,
                                              lay.offsets, out_dtype=FP32, backend="reference")
    assert_close_diff(fp8gemm.moe_combine_contiguous(y, lay, w), expect, TOL[FP32])
    lay = fp8gemm.moe_dispatch_masked(x, ids, g)
    assert lay.masked_m.tolist() == [3, 0, 3, 0]
    y = fp8gemm.m_grouped_fp8_gemm_nt_masked(fp8gemm.quantize_per_token(lay.x), wb, None,
                                             lay.masked_m, out_dtype=FP32, backend="reference")
    assert_close_diff(fp8gemm.moe_combine_masked(y, lay, w), expect, TOL[FP32])


def test_dropped_slots_ignore_unwritten_rows():
    """The grouped GEMMs leave rows of no group untouched, so a caller's out may hold NaN or
    garbage there (e.g. a CUDA-graph buffer from torch.empty); dropped slots must not pick it up.
    Expert 0 gets no token, so row 0 (where a dropped slot's index lands) is never written."""
    t, g, n, k = 8, 3, 200, 320
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids = torch.randint(1, g, (t, 2), dtype=torch.int32)
    ids[:, 1] = torch.where(ids[:, 0] == 1, 2, 1)
    ids[0, 1], ids[5, 0] = -1, g + 1
    w = torch.rand(t, 2)
    wb, w64 = experts(g, n, k)
    expect = dense_moe(x, ids, w, w64)
    nan = float("nan")
    lay = fp8gemm.moe_dispatch_masked(x, ids, g)
    y = fp8gemm.m_grouped_fp8_gemm_nt_masked(fp8gemm.quantize_per_token(lay.x), wb,
                                             torch.full((g, t, n), nan), lay.masked_m,
                                             backend="reference")
    assert_close_diff(fp8gemm.moe_combine_masked(y, lay, w), expect, TOL[FP32], "masked")
    lay = fp8gemm.moe_dispatch_contiguous(x, ids, g, alignment=4)
    y = fp8gemm.m_grouped_fp8_gemm_nt_contiguous(fp8gemm.quantize_per_token(lay.x), wb,
                                                 torch.full((lay.x.shape[0], n), nan),
                                                 lay.m_indices, backend="reference")
    assert_close_diff(fp8gemm.moe_combine_contiguous(y, lay, w), expect, TOL[FP32], "contiguous")


def test_every_slot_dropped():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    ids = torch.full((4, 2), -1, dtype=torch.int32)
    lay = fp8gemm.moe_dispatch_contiguous(x, ids, 3)
    assert lay.x.shape == (0, 128) and lay.m_indices.numel() == 0
    assert lay.offsets.tolist() == [0, 0, 0, 0]
    out = fp8gemm.moe_combine_contiguous(torch.zeros(0, 16), lay, torch.ones(4, 2))
    assert out.shape == (4, 16) and (out == 0).all()
    lay = fp8gemm.moe_dispatch_masked(x, ids, 3)
    assert lay.masked_m.tolist() == [0, 0, 0]
    out = fp8gemm.moe_combine_masked(torch.full((3, 4, 16), float("nan")), lay, torch.ones(4, 2))
    assert (out == 0).all()


# ---------------------------------------------------------------------------------------------
# The Triton combine (CUDA tensors on a GPU; under TRITON_INTERPRET=1 on the CPU)

_COMBINE_CASES = """
import torch
from fp8gemm.moe import _combine_torch
from fp8gemm.backends.triton.moe import BLOCK_N, moe_combine

def case(t, topk, rows, n, dtype, device):
    g = torch.Generator().manual_seed(t * 131 + n)
    y = torch.randn(rows, n, generator=g).to(dtype)
    # every row is at most one slot's (what the dispatch builds); slots past the rows and 30 %
    # more are dropped
    slot = torch.randperm(max(rows, t * topk), generator=g)[:t * topk].reshape(t, topk)
    row = torch.where(slot < rows, slot, -1)
    row[torch.rand(t, topk, generator=g) < 0.3] = -1
    if rows:
        unused = torch.ones(rows, dtype=torch.bool)
        unused[row[row >= 0]] = False
        y[unused] = float("nan")  # rows no slot names: unwritten, never read
    w = torch.rand(t, topk, generator=g)
    w[row < 0] = float("nan")  # a dropped slot's weight is never used
    return y.to(device), row.to(device), w.to(device)

def check(device):
    for t, topk, rows, n, dtype in [(5, 2, 7, 200, torch.float32), (37, 8, 120, BLOCK_N + 72,
                                    torch.bfloat16), (3, 1, 0, 64, torch.bfloat16),
                                    (0, 4, 9, 32, torch.float32), (4, 3, 6, 1, torch.float32)]:
        y, row, w = case(t, topk, rows, n, dtype, device)
        got = moe_combine(y, row, w)
        want = _combine_torch(y.cpu(), row.cpu(), w.cpu())
        assert got.dtype == dtype and got.shape == (t, n), (got.dtype, got.shape)
        assert not got.isnan().any(), (t, topk, rows, n)
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=1e-2 if dtype ==
                                   torch.bfloat16 else 1e-6, atol=1e-5)
        assert torch.equal(moe_combine(y, row, w), got)  # the same bits again

def expected_grads(g, y, row, w):
    # float64: grad_y[row] = w * g[t] on each kept slot's row, grad_w[t, k] = g[t] . y[row]
    g, y, w = g.double().cpu(), y.double().cpu(), w.double().cpu()
    gy, gw = torch.zeros_like(y), torch.zeros_like(w)
    for t, k in (row.cpu() >= 0).nonzero().tolist():
        r = int(row[t, k])
        gy[r] = w[t, k] * g[t]
        gw[t, k] = g[t] @ y[r]
    return gy, gw

def check_grads(device):
    from fp8gemm.moe import _TritonCombine
    for t, topk, rows, n, dtype in [(6, 3, 12, 200, torch.float32), (9, 8, 80, BLOCK_N + 72,
                                    torch.bfloat16), (3, 2, 0, 64, torch.float32)]:
        y, row, w = case(t, topk, rows, n, dtype, device)
        y = torch.nan_to_num(y, nan=0.0).requires_grad_(True)  # (rows no slot names: NaN-free)
        w = torch.where(row >= 0, w, 0.0).requires_grad_(True)
        g = torch.randn(t, n, device=device).to(dtype)
        _TritonCombine.apply(y, row, w).backward(g)
        gy, gw = expected_grads(g, y.detach(), row, w.detach())
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.grad.cpu().double(), gy, **tol)
        torch.testing.assert_close(w.grad.cpu().double(), gw, **tol)
"""


def _run_interpreted(code: str) -> None:
    """Run `code` in a fresh Python under TRITON_INTERPRET=1 (read when Triton is imported), the
    repository first on its path; it must finish without an exception."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code + "print('ok')\n"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_triton_combine_interpreted():
    """The Triton combine against the torch spec under TRITON_INTERPRET=1: dropped slots (NaN
    weights, NaN rows nobody names), several column blocks, no rows, no tokens, N = 1; its
    gradients against float64."""
    _run_interpreted(_COMBINE_CASES + "check('cpu')\ncheck_grads('cpu')\n")


_DISPATCH_CASES = """
import torch
import fp8gemm
from fp8gemm.backends.triton.moe import dispatch_fits, masked_dispatch

CASES = [  # (T, topk, G, max_m or None, ids dtype, x dtype, K)
    (50, 3, 5, None, torch.int64, torch.bfloat16, 320),
    (40, 2, 3, 6, torch.int32, torch.float32, 7),
    (64, 8, 33, 9, torch.int64, torch.float8_e4m3fn, 200),
    (16, 4, 300, None, torch.int64, torch.bfloat16, 16),
    (7, 2, 1, 3, torch.int32, torch.float8_e4m3fn, 130),
    (0, 4, 6, None, torch.int64, torch.bfloat16, 64),
    (9, 2, 4, 0, torch.int64, torch.bfloat16, 8),
    (300, 8, 32, 128, torch.int32, torch.float8_e4m3fn, 256)]

def case(t, topk, g, ids_dtype, x_dtype, k, device):
    gen = torch.Generator().manual_seed(t * 7 + g)
    x = torch.randn(t, k, generator=gen).to(x_dtype)
    ids = torch.randint(-2, g + 2, (t, topk), generator=gen)
    if ids_dtype == torch.int64 and ids.numel():
        ids.view(-1)[::5] = (1 << 40) + 1  # a value that narrowed to int32 would be expert 1
    return x.to(device), ids.to(ids_dtype).to(device)

def check(device):
    for t, topk, g, max_m, ids_dtype, x_dtype, k in CASES:
        x, ids = case(t, topk, g, ids_dtype, x_dtype, k, device)
        m = t if max_m is None else max_m
        assert dispatch_fits(ids.numel(), g)
        want = fp8gemm.moe_dispatch_masked(x.cpu(), ids.cpu(), g, max_m)  # the torch code
        for zero_rest in (True, False):
            xm, masked_m, row_of_slot, token_of_row = masked_dispatch(x, ids, g, m, zero_rest)
            what = (t, topk, g, max_m, zero_rest)
            assert torch.equal(masked_m.cpu(), want.masked_m), what
            assert torch.equal(row_of_slot.cpu().view(t, topk), want.row_of_slot), what
            assert torch.equal(token_of_row.cpu().view(g, m), want.token_of_row), what
            got = xm.cpu().view(g, m, k).view(torch.uint8)
            exp = want.x.view(torch.uint8)
            live = torch.arange(m)[None, :] < want.masked_m[:, None]
            assert torch.equal(got[live], exp[live]), what
            if zero_rest:
                assert torch.equal(got, exp), what
"""


def test_triton_masked_dispatch_interpreted():
    """The Triton masked dispatch under TRITON_INTERPRET=1 gives the torch code's layout bit for
    bit: ids outside [0, G) (an int64 one that int32 would wrap into range), capacity drops,
    one expert, experts not a power of two and more than 256, no tokens, max_m = 0, fp8, bf16
    and fp32 rows of odd byte counts, with and without the zero fill."""
    _run_interpreted(_DISPATCH_CASES + "check('cpu')\n")


@pytest.mark.gpu
def test_triton_masked_dispatch_on_the_gpu(gpu_device, monkeypatch):
    """The Triton dispatch on CUDA tensors against the torch code, and as the public dispatch
    runs it (TRITON_DISPATCH), also inside a CUDA graph replayed with new routing."""
    import fp8gemm.moe as moe_module

    monkeypatch.setattr(moe_module, "TRITON_DISPATCH", True)
    namespace = {}
    exec(_DISPATCH_CASES, namespace)
    namespace["check"](gpu_device)
    x = torch.randn(64, 512, dtype=torch.bfloat16, device=gpu_device)
    ids = torch.randint(0, 8, (64, 4), device=gpu_device)
    fp8gemm.moe_dispatch_masked(x, ids, 8, 64)  # (compiles the kernels before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lay = fp8gemm.moe_dispatch_masked(x, ids, 8, 64)
    for _ in range(2):
        ids.copy_(torch.randint(-1, 9, (64, 4), device=gpu_device))
        graph.replay()
        want = fp8gemm.moe_dispatch_masked(x.cpu(), ids.cpu(), 8, 64)
        for name in ("x", "masked_m", "row_of_slot", "token_of_row"):
            assert torch.equal(getattr(lay, name).cpu(), getattr(want, name)), name


@pytest.mark.gpu
def test_triton_combine_on_the_gpu(gpu_device, monkeypatch):
    """The Triton kernel on CUDA tensors, alone and as the public combine runs it with
    TRITON_COMBINE: it agrees with the torch spec and repeats bit for bit."""
    import fp8gemm.moe as moe_module

    monkeypatch.setattr(moe_module, "TRITON_COMBINE", True)
    namespace = {}
    exec(_COMBINE_CASES, namespace)
    namespace["check"](gpu_device)
    namespace["check_grads"](gpu_device)
    x = torch.randn(16, 256, dtype=torch.bfloat16, device=gpu_device)
    ids, w = routing(16, 2, 4)
    lay = fp8gemm.moe_dispatch_contiguous(x, ids.to(gpu_device), 4)
    y = torch.randn(lay.x.shape[0], 96, dtype=torch.bfloat16, device=gpu_device)
    out = fp8gemm.moe_combine_contiguous(y, lay, w.to(gpu_device))
    from fp8gemm.moe import _combine_torch

    want = _combine_torch(y.cpu(), lay.row_of_slot.cpu(), w)
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=1e-2, atol=1e-5)


def test_triton_combine_compiles_for_sm90():
    """The combine and masked-dispatch kernels as launched compile for sm_90a with no local
    memory."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from fp8gemm.backends.triton import moe as kernels

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton without its ptxas")
    compiled = kernels.compile_kernels(GPUTarget("cuda", 90, 32))
    assert len(compiled) == 4  # the combine forward and backward, the dispatch's two
    for name, k in compiled:
        assert "ld.local" not in k.asm["ptx"] and "st.local" not in k.asm["ptx"], name
        assert "ld.global" in k.asm["ptx"], name


def test_triton_ab_script_toggles_and_restores_the_switches():
    """scripts/moe_triton_ab.py (the H200 A/B of the Triton MoE kernels and the torch code): its
    switch wrapper sets TRITON_COMBINE or TRITON_DISPATCH for one call only, even when the call
    raises; without a GPU it says so."""
    import fp8gemm.moe as moe_module

    ab = load_script("scripts/moe_triton_ab.py")

    def boom():
        raise RuntimeError("x")

    for switch in ("combine", "dispatch"):
        name = f"TRITON_{switch.upper()}"
        before = getattr(moe_module, name)
        assert ab.with_switch(switch, not before, lambda: getattr(moe_module, name))() is (
            not before)
        assert getattr(moe_module, name) is before
        with pytest.raises(RuntimeError):
            ab.with_switch(switch, not before, boom)()
        assert getattr(moe_module, name) is before
    if not torch.cuda.is_available():
        assert ab.main([]) == 2
        assert ab.main(["--switch", "dispatch"]) == 2


def test_layer_profile_script_steps_run_on_the_cpu():
    """scripts/moe_layer_profile.py: every step it times runs (here on a small CPU layer), and
    the steps chained give the layer's output; without a GPU the script says so."""
    from fp8gemm.bench.impls import make_data
    from fp8gemm.bench.suites import Case

    prof = load_script("scripts/moe_layer_profile.py")
    md = make_data(Case("moe-layer", "moe_layer", 200, 256, 128, 2), torch.device("cpu")).moe
    steps = prof.steps_of(md)
    results = {name: fn() for name, fn in steps.items()}
    y = results["combine"]
    assert y.shape == md.x.shape
    assert fp8gemm.calc_diff(y.to(md.x.dtype), results["whole layer"]) < 1e-6
    if not torch.cuda.is_available():
        assert prof.main([]) == 2

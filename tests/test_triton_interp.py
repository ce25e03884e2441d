"""Every Triton kernel of the Triton backend under TRITON_INTERPRET=1 on the CPU.

Triton decides at import whether it interprets, so these tests run in a process that had
TRITON_INTERPRET=1 before Triton was first imported. Run directly as
`TRITON_INTERPRET=1 pytest tests/test_triton_interp.py`; in any other pytest session the one test
`test_interpreter_suite` re-runs this file so, in a subprocess, and the others skip.

Outputs are poisoned with NaN first: every element a kernel owns must be written, every row it
does not own (padding rows, rows past masked_m, rows in no group) must still be NaN after.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (E4M3, E5M2, FP32_DIFF, GemmKind, Recipe, a_scales, b_scales, calc_diff,
                     ceil_div, dequant_a, dequant_b, make_dense, problem, rand_fp8,
                     ref_grouped_rows, ref_quant_groups)
from helpers import INTERPRETED_BF16_DIFF as BF16_DIFF  # the interpreter's bf16 cast truncates

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
CPU = torch.device("cpu")
A_RECIPES = [Recipe.TENSOR, Recipe.ROW, Recipe.GROUP]
B_RECIPES = [Recipe.TENSOR, Recipe.ROW, Recipe.BLOCK, Recipe.GROUP]


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the tests below run here")
def test_interpreter_suite():
    """This file's tests, in a fresh process with the interpreter on."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        str(Path(__file__).resolve())], env=env, cwd=root, capture_output=True,
                       text=True, timeout=1200, check=False)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def tb():
    """The Triton backend package (interpreted)."""
    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 from the start (test_interpreter_suite runs it)")
    pytest.importorskip("triton")
    import fp8gemm.backends.triton as mod
    from fp8gemm.backends.triton import config, fp8_gemm, quant  # noqa: F401

    return mod


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _check(out, ref, out_dtype):
    assert not out.isnan().any(), "unwritten (NaN) output elements"
    diff = calc_diff(out, ref)
    assert diff < (BF16_DIFF if out_dtype is torch.bfloat16 else FP32_DIFF), diff


def _launch(tb, prob, cfg, a, sa, b, sb, out, c=None, idx=None):
    tb.fp8_gemm.launch_gemm(prob, cfg, a, sa, b, sb, out, c, idx)


def _cfg(tb, **kw):
    base = dict(block_m=64, block_n=64, block_k=128, group_m=8, split_k=1, num_stages=2,
                num_warps=4, use_tma=False, num_programs=3)
    base.update(kw)
    return tb.config.GemmConfig(**base)


# ---------------------------------------------------------------------------------------------
# dense


@pytest.mark.parametrize("shape", [(37, 200, 320), (1, 40, 130)])
@pytest.mark.parametrize("rb", B_RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("ra", A_RECIPES, ids=lambda r: r.value)
def test_dense_recipes(tb, ra, rb, shape):
    m, n, k = shape
    a, sa, b, sb, ref = make_dense(m, n, k, ra, rb, CPU, gen=_gen(m * 7 + n))
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, ra, rb, torch.bfloat16)
    assert tb.supports(prob) is None
    out = _poisoned((m, n), torch.bfloat16)
    tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("da,db", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)],
                         ids=["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3", "e5m2xe5m2"])
def test_dense_formats(tb, da, db, out_dtype):
    m, n, k = 70, 130, 384
    a, sa, b, sb, ref = make_dense(m, n, k, Recipe.GROUP, Recipe.BLOCK, CPU, da, db, gen=_gen(3))
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, Recipe.GROUP, Recipe.BLOCK, out_dtype)
    out = _poisoned((m, n), out_dtype)
    tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
    _check(out, ref, out_dtype)


# tile shapes (the BLOCK_N = 256 tile spans two 128-blocks of B scales), split-K with an uneven
# last K range, the tensor-descriptor (TMA) load path, one program looping over every tile.
CONFIGS = [dict(), dict(block_n=128), dict(block_n=256, block_m=128, num_warps=8),
           dict(split_k=3), dict(split_k=2, block_n=128), dict(use_tma=True),
           dict(use_tma=True, split_k=3, block_m=128), dict(num_programs=1, group_m=2),
           dict(flatten=True, split_k=3, use_tma=True), dict(flatten=True, num_programs=2)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "base")
@pytest.mark.parametrize("ra,rb", [(Recipe.GROUP, Recipe.BLOCK), (Recipe.ROW, Recipe.ROW),
                                   (Recipe.GROUP, Recipe.GROUP)], ids=["1x128/128x128", "row/row", "1x128/1x128"])
def test_dense_configs(tb, ra, rb, cfg):
    m, n, k = 75, 200, 640  # K = 5 blocks: split 3 gives ranges 2, 2, 1
    a, sa, b, sb, ref = make_dense(m, n, k, ra, rb, CPU, gen=_gen(11))
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, ra, rb, torch.bfloat16)
    out = _poisoned((m, n), torch.bfloat16)
    _launch(tb, prob, _cfg(tb, **cfg), a, sa, b, sb, out)
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("alias", [False, True], ids=["c", "c-is-out"])
def test_dense_with_c(tb, alias, split):
    m, n, k = 45, 96, 384
    a, sa, b, sb, ref = make_dense(m, n, k, Recipe.GROUP, Recipe.BLOCK, CPU, gen=_gen(5))
    c = torch.randn(m, n, generator=_gen(6)) * 50
    ref = ref + c.double()
    out = c if alias else _poisoned((m, n), torch.float32)
    c_in = out if alias else c
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, Recipe.GROUP, Recipe.BLOCK, torch.float32,
                   has_c=True)
    _launch(tb, prob, _cfg(tb, split_k=split), a, sa, b, sb, out, c_in)
    _check(out, ref, torch.float32)


def test_dense_column_major_a_scales(tb):
    m, n, k = 50, 72, 300
    a, sa, b, sb, ref = make_dense(m, n, k, Recipe.GROUP, Recipe.BLOCK, CPU, col_major=True,
                                   gen=_gen(8))
    assert sa.stride() == (1, 52)
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    out = _poisoned((m, n), torch.bfloat16)
    tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
    _check(out, ref, torch.bfloat16)


def test_long_k_error_does_not_grow(tb):
    """FP32 accumulation with promotion: the error at K = 4096 stays at FP32 rounding."""
    m, n, k = 16, 32, 4096
    a, sa, b, sb, ref = make_dense(m, n, k, Recipe.GROUP, Recipe.BLOCK, CPU, gen=_gen(9))
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, Recipe.GROUP, Recipe.BLOCK, torch.float32)
    out = _poisoned((m, n), torch.float32)
    tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
    _check(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------
# grouped

G, N_G, K_G = 3, 72, 200


def _grouped_operands(m, ra, rb, seed, lead=None, da=E4M3, db=E4M3):
    gen = _gen(seed)
    shape_a = (lead, m, K_G) if lead else (m, K_G)
    a = rand_fp8(shape_a, da, CPU, gen)
    b = rand_fp8((G, N_G, K_G), db, CPU, gen)
    sa = a_scales(ra, m, K_G, CPU, lead=lead, gen=gen)
    sb = b_scales(rb, N_G, K_G, CPU, groups=G, gen=gen)
    return a, sa, b, sb


@pytest.mark.parametrize("rb", B_RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("ra", A_RECIPES, ids=lambda r: r.value)
def test_contiguous(tb, ra, rb):
    # groups not aligned to BLOCK_M, padding rows (-1) and values outside [-1, G) (= padding)
    idx = torch.tensor([0] * 20 + [-1] * 5 + [2] * 50 + [1] * 30 + [7, -5] + [2] * 23 + [-1] * 10,
                       dtype=torch.int32)
    m = idx.numel()
    a, sa, b, sb = _grouped_operands(m, ra, rb, seed=21)
    ref = ref_grouped_rows(a, sa, ra, b, sb, rb, idx)
    prob = problem(GemmKind.CONTIGUOUS, m, N_G, K_G, G, a, b, ra, rb, torch.bfloat16)
    assert tb.supports(prob) is None
    out = _poisoned((m, N_G), torch.bfloat16)
    tb.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, idx, prob)
    own = (idx >= 0) & (idx < G)
    assert out[~own].isnan().all(), "rows of no group were written"
    _check(out[own], ref[own], torch.bfloat16)


def test_contiguous_interleaved_groups(tb):
    """Rows of every group mixed inside one tile (an unsorted layout) are still right."""
    idx = torch.tensor([0, 1, 2, -1] * 20, dtype=torch.int32)
    m = idx.numel()
    a, sa, b, sb = _grouped_operands(m, Recipe.GROUP, Recipe.BLOCK, seed=22)
    ref = ref_grouped_rows(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK, idx)
    prob = problem(GemmKind.CONTIGUOUS, m, N_G, K_G, G, a, b, Recipe.GROUP, Recipe.BLOCK, torch.float32)
    out = _poisoned((m, N_G), torch.float32)
    _launch(tb, prob, _cfg(tb, use_tma=True), a, sa, b, sb, out, idx=idx)
    own = idx >= 0
    assert out[~own].isnan().all()
    _check(out[own], ref[own], torch.float32)


@pytest.mark.parametrize("use_tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("ra,rb", [(Recipe.GROUP, Recipe.BLOCK), (Recipe.TENSOR, Recipe.TENSOR),
                                   (Recipe.ROW, Recipe.GROUP), (Recipe.GROUP, Recipe.ROW)],
                         ids=["1x128/128x128", "tensor/tensor", "row/1x128", "1x128/row"])
def test_offsets(tb, ra, rb, use_tma):
    # unaligned boundaries, an empty group, trailing rows in no group
    offsets = torch.tensor([0, 13, 13, 150], dtype=torch.int32)
    m = 160
    a, sa, b, sb = _grouped_operands(m, ra, rb, seed=31)
    groups = torch.full((m,), -1, dtype=torch.int32)
    for g in range(G):
        groups[offsets[g]:offsets[g + 1]] = g
    ref = ref_grouped_rows(a, sa, ra, b, sb, rb, groups)
    prob = problem(GemmKind.OFFSETS, m, N_G, K_G, G, a, b, ra, rb, torch.bfloat16)
    out = _poisoned((m, N_G), torch.bfloat16)
    _launch(tb, prob, _cfg(tb, use_tma=use_tma), a, sa, b, sb, out, idx=offsets)
    own = groups >= 0
    assert out[~own].isnan().all(), "rows of no group were written"
    _check(out[own], ref[own], torch.bfloat16)
    out2 = _poisoned((m, N_G), torch.bfloat16)
    tb.m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out2, offsets, prob)  # heuristic config
    assert torch.equal(out2[own], out[own]) and out2[~own].isnan().all()


@pytest.mark.parametrize("use_tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("ra,rb", [(Recipe.GROUP, Recipe.BLOCK), (Recipe.ROW, Recipe.ROW),
                                   (Recipe.TENSOR, Recipe.GROUP), (Recipe.GROUP, Recipe.TENSOR)],
                         ids=["1x128/128x128", "row/row", "tensor/1x128", "1x128/tensor"])
def test_masked(tb, ra, rb, use_tma):
    mmax = 70
    masked_m = torch.tensor([0, 33, 500], dtype=torch.int32)  # 500 is clamped to Mmax
    a, sa, b, sb = _grouped_operands(mmax, ra, rb, seed=41, lead=G)
    prob = problem(GemmKind.MASKED, mmax, N_G, K_G, G, a, b, ra, rb, torch.bfloat16, expected_m=40)
    out = _poisoned((G, mmax, N_G), torch.bfloat16)
    _launch(tb, prob, _cfg(tb, use_tma=use_tma), a, sa, b, sb, out, idx=masked_m)
    ad = dequant_a(a, sa, ra)
    bd = dequant_b(b, sb, rb, True)
    for g in range(G):
        rows = min(int(masked_m[g]), mmax)
        assert out[g, rows:].isnan().all(), f"group {g}: rows past masked_m were written"
        if rows:
            _check(out[g, :rows], ad[g, :rows] @ bd[g].T, torch.bfloat16)


def test_grouped_formats(tb):
    idx = torch.tensor([1] * 40 + [0] * 27 + [2] * 9, dtype=torch.int32)
    m = idx.numel()
    for da, db in [(E5M2, E4M3), (E4M3, E5M2)]:
        a, sa, b, sb = _grouped_operands(m, Recipe.GROUP, Recipe.BLOCK, seed=51, da=da, db=db)
        ref = ref_grouped_rows(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK, idx)
        prob = problem(GemmKind.CONTIGUOUS, m, N_G, K_G, G, a, b, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16)
        out = _poisoned((m, N_G), torch.bfloat16)
        tb.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, idx, prob)
        _check(out, ref, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# memory bounds, scale strides, group counts


def _guarded(t: torch.Tensor, at: str) -> torch.Tensor:
    """A copy of `t` (same shape and strides) in memory that touches a page nothing may access:
    right after its last byte (at="end") or right before its first (at="start"). A kernel that
    reads or writes past that edge crashes this process (SIGSEGV) instead of passing by luck."""
    page = mmap.PAGESIZE
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    nbytes = span * t.element_size()
    pages = max(1, ceil_div(nbytes, page))
    buf = mmap.mmap(-1, (pages + 2) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    for guard in (base, base + (pages + 1) * page):
        if libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(page), 0) != 0:
            pytest.skip(f"mprotect failed (errno {ctypes.get_errno()})")
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=pages * page, offset=page)
    lo = pages * page - nbytes if at == "end" else 0
    g = torch.as_strided(raw[lo:lo + nbytes].view(t.dtype), t.shape, t.stride())
    g.copy_(t)
    _GUARDED.append(buf)  # the mapping must outlive the tensor
    return g


_GUARDED: list = []


def _strided_copy(t: torch.Tensor, perm) -> torch.Tensor:
    """t's values in a tensor whose dims are laid out in memory in the order `perm` (outermost
    first), e.g. perm = (1, 0, 2) for [G, M, kb] puts G between M and kb."""
    inv = [perm.index(i) for i in range(t.dim())]
    return t.permute(*perm).contiguous().permute(*inv)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages via mprotect")
@pytest.mark.parametrize("at", ["end", "start"])
@pytest.mark.parametrize("kind", [GemmKind.DENSE, GemmKind.CONTIGUOUS, GemmKind.OFFSETS,
                                  GemmKind.MASKED], ids=lambda k: k.value)
def test_no_access_outside_tensors(tb, kind, at):
    """Every tensor the kernels get ends (or starts) at an inaccessible page. Masked A scales
    have their G stride innermost ([Mmax, G, kb] in memory): a group's last m tile runs past
    Mmax, and those rows' scales lie past the end of the tensor (read before the fix)."""
    gen = _gen(71)
    cfg = _cfg(tb, split_k=2) if kind is GemmKind.DENSE else _cfg(tb)
    ra, rb = Recipe.GROUP, Recipe.BLOCK
    if kind is GemmKind.DENSE:
        m, n, k = 75, 72, 300
        a, sa, b, sb, ref = make_dense(m, n, k, ra, rb, CPU, col_major=True, gen=gen)
        out, idx, own = _poisoned((m, n), torch.bfloat16), None, torch.ones(m, dtype=torch.bool)
    elif kind is GemmKind.MASKED:
        m = 70
        a, sa, b, sb = _grouped_operands(m, ra, rb, seed=72, lead=G)
        sa = _strided_copy(sa, (1, 0, 2))
        idx = torch.tensor([m, 66, 5], dtype=torch.int32)  # groups 0 and 1: a tile past Mmax
        own = torch.arange(m)[None, :] < idx[:, None]
        ref = dequant_a(a, sa, ra) @ dequant_b(b, sb, rb, True).transpose(-1, -2)
        out = _poisoned((G, m, N_G), torch.bfloat16)
    else:
        rows = torch.tensor([0] * 20 + [-1] * 5 + [2] * 30 + [1] * 20, dtype=torch.int32)
        m = rows.numel()
        a, sa, b, sb = _grouped_operands(m, ra, rb, seed=73)
        if kind is GemmKind.CONTIGUOUS:
            idx = rows
        else:
            idx = torch.tensor([0, 20, 20, 70], dtype=torch.int32)
            rows = torch.full((m,), -1, dtype=torch.int32)
            for g in range(G):
                rows[idx[g]:idx[g + 1]] = g
        ref = ref_grouped_rows(a, sa, ra, b, sb, rb, rows)
        own = rows >= 0
        out = _poisoned((m, N_G), torch.bfloat16)
    groups = 1 if kind is GemmKind.DENSE else G
    prob = problem(kind, a.shape[-2], b.shape[-2], a.shape[-1], groups, a, b, ra, rb,
                   torch.bfloat16)
    ga, gsa, gb, gsb, gout = (_guarded(t, at) for t in (a, sa, b, sb, out))
    gidx = None if idx is None else _guarded(idx, at)
    _launch(tb, prob, cfg, ga, gsa, gb, gsb, gout, idx=gidx)
    assert gout[~own].isnan().all(), "rows it does not own were written"
    _check(gout[own], ref[own], torch.bfloat16)


@pytest.mark.parametrize("kind", [GemmKind.CONTIGUOUS, GemmKind.OFFSETS, GemmKind.MASKED],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("ra,rb", [(Recipe.GROUP, Recipe.BLOCK), (Recipe.ROW, Recipe.GROUP),
                                   (Recipe.GROUP, Recipe.TENSOR), (Recipe.ROW, Recipe.ROW)],
                         ids=["1x128/128x128", "row/1x128", "1x128/tensor", "row/row"])
def test_grouped_scales_any_strides(tb, kind, ra, rb):
    """[G]-leading B scales with G innermost in memory, per-tensor [G] scales broadcast from one
    value (stride 0), masked A scales with G innermost, per-row scales every other element."""
    masked = kind is GemmKind.MASKED
    m = 70 if masked else 75
    a, sa, b, sb = _grouped_operands(m, ra, rb, seed=74, lead=G if masked else None)
    if rb is Recipe.TENSOR:
        sb = sb[:1].expand(G)
    elif rb is Recipe.ROW:
        sb = _strided_copy(sb, (1, 0))
    else:
        sb = _strided_copy(sb, (1, 2, 0))
    if ra is Recipe.ROW:
        sa = torch.stack([sa, torch.full_like(sa, float("nan"))], -1)[..., 0]  # stride 2
    elif masked:
        sa = _strided_copy(sa, (2, 1, 0))
    if masked:
        idx = torch.tensor([70, 0, 33], dtype=torch.int32)
        own = torch.arange(m)[None, :] < idx[:, None]
        ref = dequant_a(a, sa, ra) @ dequant_b(b, sb, rb, True).transpose(-1, -2)
        out = _poisoned((G, m, N_G), torch.bfloat16)
    else:
        rows = torch.tensor([1] * 30 + [-1] * 3 + [0] * 2 + [2] * 40, dtype=torch.int32)
        idx = rows if kind is GemmKind.CONTIGUOUS else torch.tensor([0, 2, 30, 75], dtype=torch.int32)
        if kind is GemmKind.OFFSETS:
            rows = torch.repeat_interleave(torch.arange(G, dtype=torch.int32), idx.diff())
        ref = ref_grouped_rows(a, sa, ra, b, sb, rb, rows)
        own = rows >= 0
        out = _poisoned((m, N_G), torch.bfloat16)
    prob = problem(kind, m, N_G, K_G, G, a, b, ra, rb, torch.bfloat16, expected_m=40 if masked else 0)
    _launch(tb, prob, _cfg(tb, block_n=128), a, sa, b, sb, out, idx=idx)
    assert out[~own].isnan().all()
    _check(out[own], ref[own], torch.bfloat16)


def test_dense_scales_any_strides(tb):
    """B 128x128 and 1x128 scales column-major, A per-row scales every other element."""
    m, n, k = 37, 200, 320
    for ra, rb in [(Recipe.ROW, Recipe.BLOCK), (Recipe.GROUP, Recipe.GROUP)]:
        a, sa, b, sb, _ = make_dense(m, n, k, ra, rb, CPU, gen=_gen(75))
        sb = sb.t().contiguous().t()
        if ra is Recipe.ROW:
            sa = torch.stack([sa, torch.full_like(sa, float("nan"))], -1)[..., 0]
        ref = dequant_a(a, sa, ra) @ dequant_b(b, sb, rb, False).T
        prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, ra, rb, torch.bfloat16)
        out = _poisoned((m, n), torch.bfloat16)
        tb.fp8_gemm_nt(a, sa, b, sb, out, None, prob)
        _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("groups", [1, 4])
def test_group_table_sizes(tb, groups):
    """Offsets and masked with G a power of two (the group table is exactly G wide) and G = 1."""
    gen = _gen(76)
    n, k, mmax = 40, 130, 50
    b = rand_fp8((groups, n, k), E4M3, CPU, gen)
    sb = b_scales(Recipe.BLOCK, n, k, CPU, groups=groups, gen=gen)
    bd = dequant_b(b, sb, Recipe.BLOCK, True)
    # masked
    a = rand_fp8((groups, mmax, k), E4M3, CPU, gen)
    sa = a_scales(Recipe.GROUP, mmax, k, CPU, lead=groups, gen=gen)
    masked_m = torch.tensor([50, 1, 0, 37][:groups], dtype=torch.int32)
    prob = problem(GemmKind.MASKED, mmax, n, k, groups, a, b, Recipe.GROUP, Recipe.BLOCK,
                   torch.float32)
    out = _poisoned((groups, mmax, n), torch.float32)
    tb.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, masked_m, prob)
    ad = dequant_a(a, sa, Recipe.GROUP)
    for g in range(groups):
        rows = int(masked_m[g])
        assert out[g, rows:].isnan().all()
        if rows:
            _check(out[g, :rows], ad[g, :rows] @ bd[g].T, torch.float32)
    # offsets
    sizes = [20, 7, 0, 33][:groups]
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    m = int(offsets[-1])
    a = rand_fp8((m, k), E4M3, CPU, gen)
    sa = a_scales(Recipe.GROUP, m, k, CPU, gen=gen)
    rows = torch.repeat_interleave(torch.arange(groups, dtype=torch.int32), torch.tensor(sizes))
    ref = ref_grouped_rows(a, sa, Recipe.GROUP, b, sb, Recipe.BLOCK, rows)
    prob = problem(GemmKind.OFFSETS, m, n, k, groups, a, b, Recipe.GROUP, Recipe.BLOCK,
                   torch.float32)
    out = _poisoned((m, n), torch.float32)
    tb.m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, offsets, prob)
    _check(out, ref, torch.float32)


# ---------------------------------------------------------------------------------------------
# quantisation


def _fp8_ordinal(q: torch.Tensor) -> torch.Tensor:
    bits = q.view(torch.uint8).to(torch.int32)
    mag = bits & 0x7F
    return torch.where(bits >= 0x80, -mag, mag)


def _check_quant(q, s, q_ref, s_ref):
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # NOTE: under the interpreter the kernels round to the FP8 grid in FP32 arithmetic (its own
    # float->fp8 cast mis-rounds); x / scale is IEEE division on both sides, so the values agree
    # exactly but for ties at the rounding boundary: allow one step on 0.1 % of the elements.
    steps = (_fp8_ordinal(q) - _fp8_ordinal(q_ref)).abs()
    assert int(steps.max()) <= 1, int(steps.max())
    assert float((steps > 0).float().mean()) <= 1e-3


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_per_token(tb, fmt, pow2):
    m, k = 70, 300
    x = (torch.randn(m, k, generator=_gen(61)) * torch.rand(m, 1, generator=_gen(62)) * 10)
    x[3] = 0  # an all-zero row: amax floored at 1e-4
    x = x.to(torch.bfloat16)
    q, s = tb.quant.quantize_per_token(x, fmt=fmt, pow2_scales=pow2)
    kb = ceil_div(k, 128)
    assert q.shape == (m, k) and s.shape == (m, kb) and s.stride() == (1, 72)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k)).view(m, kb, 128)
    q_ref, s_ref = ref_quant_groups(xp, fmt, pow2)
    _check_quant(q, s, q_ref.view(m, -1)[:, :k], s_ref)
    q2, s2 = tb.quant.quantize_per_token(x.t().contiguous().t(), fmt=fmt, pow2_scales=pow2,
                                         col_major_scales=False)  # column-major input
    assert s2.is_contiguous() and torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_quantize_batched(tb):
    """Leading dims: [B, M, K] quantises each [M, K] as the 2-D call does."""
    x = (torch.randn(3, 33, 200, generator=_gen(65)) * 4).to(torch.bfloat16)
    q, s = tb.quant.quantize_per_token(x)
    assert q.shape == (3, 33, 200) and s.shape == (3, 33, 2) and s.stride() == (2 * 36, 1, 36)
    qb, sb = tb.quant.quantize_per_block(x, "e5m2", pow2_scales=True)
    assert sb.shape == (3, 1, 2)
    for i in range(3):
        q1, s1 = tb.quant.quantize_per_token(x[i])
        assert torch.equal(s1, s[i]) and torch.equal(q1.view(torch.uint8), q[i].view(torch.uint8))
        q1, s1 = tb.quant.quantize_per_block(x[i], "e5m2", pow2_scales=True)
        assert torch.equal(s1, sb[i]) and torch.equal(q1.view(torch.uint8), qb[i].view(torch.uint8))


def test_quantize_batch_past_grid_limit(tb, monkeypatch):
    """Batches beyond the grid's z limit (65535 on CUDA) launch in slices; here the limit is set
    to 2 so that [5, M, K] takes three launches, with the same results as one."""
    x = (torch.randn(5, 9, 200, generator=_gen(66)) * 4).to(torch.bfloat16)
    want = [tb.quant.quantize_per_token(x), tb.quant.quantize_per_token(x, col_major_scales=False),
            tb.quant.quantize_per_block(x)]
    monkeypatch.setattr(tb.quant, "_MAX_GRID_Z", 2)
    got = [tb.quant.quantize_per_token(x), tb.quant.quantize_per_token(x, col_major_scales=False),
           tb.quant.quantize_per_block(x)]
    for (q0, s0), (q1, s1) in zip(want, got):
        assert s1.stride() == s0.stride() and torch.equal(s1, s0)
        assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8))


def test_quantize_k_offsets_past_2_31(tb):
    """x strided along K by 2^24 + 3 elements (as a transposed view of a tensor of more than
    2^31 elements is): K offsets overflowed 32 bits and the kernels read outside x. The storage
    is an 8.6 GB sparse mapping of which only x's 512 elements are touched."""
    stride, k = (1 << 24) + 3, 256
    n = (k - 1) * stride + 2
    try:
        buf = mmap.mmap(-1, n * 2)
    except (OSError, OverflowError) as e:
        pytest.skip(f"cannot map {n * 2} bytes: {e}")
    _GUARDED.append(buf)
    x = torch.as_strided(torch.frombuffer(buf, dtype=torch.bfloat16, count=n), (2, k), (1, stride))
    x.copy_((torch.randn(2, k, generator=_gen(67)) * 3).to(torch.bfloat16))
    xc = x.contiguous()
    for fn in (tb.quant.quantize_per_token, tb.quant.quantize_per_block,
               tb.quant.silu_mul_quantize_per_token):
        (q, s), (q0, s0) = fn(x), fn(xc)
        assert torch.equal(s, s0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_per_block(tb, fmt, pow2):
    n, k = 200, 300
    w = (torch.randn(n, k, generator=_gen(63)) * 0.05).to(torch.bfloat16)
    q, s = tb.quant.quantize_per_block(w, fmt=fmt, pow2_scales=pow2)
    nb, kb = ceil_div(n, 128), ceil_div(k, 128)
    assert q.shape == (n, k) and s.shape == (nb, kb)
    wp = torch.nn.functional.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n))
    blocks = wp.view(nb, 128, kb, 128).permute(0, 2, 1, 3).reshape(nb, kb, 128 * 128)
    q_ref, s_ref = ref_quant_groups(blocks, fmt, pow2)
    q_ref = q_ref.view(nb, kb, 128, 128).permute(0, 2, 1, 3).reshape(nb * 128, kb * 128)[:n, :k]
    _check_quant(q, s, q_ref, s_ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_silu_mul_quantize_per_token(tb, fmt):
    t, i = 37, 200
    x = (torch.randn(t, 2 * i, generator=_gen(64)) * 3).to(torch.bfloat16)
    q, s = tb.quant.silu_mul_quantize_per_token(x, fmt=fmt)
    kb = ceil_div(i, 128)
    assert q.shape == (t, i) and s.shape == (t, kb) and s.stride() == (1, 40)
    y = torch.nn.functional.silu(x[:, :i].float()) * x[:, i:].float()
    yp = torch.nn.functional.pad(y, (0, kb * 128 - i)).view(t, kb, 128)
    q_ref, s_ref = ref_quant_groups(yp, fmt, False)
    _check_quant(q, s, q_ref.view(t, -1)[:, :i], s_ref)
    with pytest.raises(ValueError, match="odd"):
        tb.quant.silu_mul_quantize_per_token(x[:, :5])


def test_quant_rejects_bad_input(tb):
    with pytest.raises(ValueError, match="fmt"):
        tb.quant.quantize_per_token(torch.zeros(4, 4), fmt="e3m4")
    with pytest.raises(ValueError, match="2-D"):
        tb.quant.quantize_per_block(torch.zeros(4))
    with pytest.raises(TypeError, match="Tensor"):
        tb.quant.quantize_per_block([[1.0]])
    with pytest.raises(TypeError, match="bf16"):
        tb.quant.quantize_per_token(torch.zeros(4, 4, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# availability, configs


def test_available_and_supports(tb):
    assert tb.NAME == "triton"
    assert tb.is_available(CPU)
    a = torch.zeros(1, dtype=E4M3)
    for kind in GemmKind:
        for ra in A_RECIPES:
            for rb in B_RECIPES:
                for da in (E4M3, E5M2):
                    prob = problem(kind, 64, 64, 64, 2, a, a.to(da), ra, rb, torch.float32)
                    assert tb.supports(prob) is None
    bad = problem(GemmKind.DENSE, 4, 4, 4, 1, torch.zeros(1), a, Recipe.ROW, Recipe.ROW, torch.bfloat16)
    assert "FP8" in tb.supports(bad)


H200 = dict(name="H200", capability=(9, 0), num_sms=132, smem_per_block=232448, l2_bytes=60 << 20)


def test_heuristic_small_m_splits_k(tb):
    cfgmod = tb.config
    facts = cfgmod.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    for m, n, k in [(64, 2112, 7168), (128, 4096, 7168), (64, 7168, 16384)]:
        prob = problem(GemmKind.DENSE, m, n, k, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
        cfg = cfgmod.choose_config(prob, facts)
        tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
        assert cfg.split_k > 1, cfg
        assert tiles * cfg.split_k <= 2 * facts.num_sms and cfg.num_programs <= facts.num_sms
        kb = ceil_div(k, 128)
        assert kb % cfg.split_k == 0 and kb // cfg.split_k >= 2  # even K ranges
        assert cfg.use_tma and cfg.block_k == 128
        assert cfgmod.choose_config(prob, facts) is cfg  # cached
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.split_k = 1


def test_heuristic_large_m_gluon(tb):
    """Large-M dense A 1x128 x B 128x128 on sm_90 takes the Gluon kernel when its TMA rows fit;
    with C, an sm_89 part, K % 16 != 0 or out rows not 16-byte multiples, the Triton kernel."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    cfgmod = tb.config
    facts = cfgmod.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    for m, n, k, out in [(4096, 7168, 16384, torch.bfloat16), (129, 2112, 1024, torch.float32)]:
        prob = problem(GemmKind.DENSE, m, n, k, 1, a, a, Recipe.GROUP, Recipe.BLOCK, out)
        cfg = cfgmod.choose_config(prob, facts)
        assert cfg.gluon and (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.split_k) == (128, 128, 8, 1)
        # the stage ring and the epilogue tile fit shared memory
        assert cfg.num_stages * 2 * 128 * 128 + 128 * 128 * out.itemsize <= facts.smem_per_block
        assert cfg.num_programs == min(facts.num_sms, ceil_div(m, 128) * ceil_div(n, 128))
        cands = cfgmod.candidate_configs(prob, facts)
        assert cands[0] is cfg and any(not c.gluon for c in cands)
    ada = cfgmod.DeviceFacts(**{**H200, "capability": (8, 9)})
    grp = Recipe.GROUP
    for m, n, k, ra, has_c, f in [
            (4096, 4096, 7168, grp, True, facts), (4096, 4096, 7168, grp, False, ada),
            (4096, 4096, 7000, grp, False, facts), (4096, 4100, 7168, grp, False, facts),
            (4096, 4096, 7168, Recipe.ROW, False, facts), (128, 4096, 7168, grp, False, facts),
            # one partial wave with short K: the Gluon kernel's fixed cost shows
            (129, 2112, 320, grp, False, facts),
            # 136 tiles of 128x128 take two waves; 128x64 tiles two programs an SM, one
            (1000, 2112, 7168, grp, False, facts)]:
        prob = problem(GemmKind.DENSE, m, n, k, 1, a, a, ra, Recipe.BLOCK, torch.bfloat16,
                       has_c=has_c)
        assert not cfgmod.choose_config(prob, f).gluon, prob
    for kind, m, groups, em in [(GemmKind.CONTIGUOUS, 32768, 4, 0), (GemmKind.MASKED, 512, 2, 512)]:
        prob = problem(kind, m, 7168, 2048, groups, a, a, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16, expected_m=em)
        assert cfgmod.choose_config(prob, facts).gluon, prob


def test_heuristic_large_m(tb):
    """The Triton kernel's large-M choices (recipes the Gluon kernel does not take)."""
    cfgmod = tb.config
    facts = cfgmod.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    for m, n, k in [(4096, 7168, 16384), (4096, 2112, 7168), (4096, 32768, 512)]:
        prob = problem(GemmKind.DENSE, m, n, k, 1, a, a, Recipe.ROW, Recipe.BLOCK, torch.bfloat16)
        cfg = cfgmod.choose_config(prob, facts)
        assert cfg.split_k == 1 and cfg.block_m == 128
        stage_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k
        per_sm = cfg.num_programs // facts.num_sms
        assert cfg.num_programs == per_sm * facts.num_sms and per_sm in (1, 2)
        # the pipelines of all programs on one SM fit its shared memory
        assert per_sm * (cfg.num_stages * stage_bytes + 2048) <= facts.smem_per_block + 1024
        assert per_sm == 1 or cfg.num_warps == 4  # two programs: one warpgroup each (registers)
        assert cfg.flatten == (k <= 4 * 128)
        assert (cfg.block_n == 64) == (n <= 2304 or k <= 2048)
    # unaligned K: no tensor descriptors; an sm_89 part has none either
    prob = problem(GemmKind.DENSE, 4096, 4096, 7000, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    assert not cfgmod.choose_config(prob, facts).use_tma
    ada = cfgmod.DeviceFacts(**{**H200, "capability": (8, 9)})
    prob = problem(GemmKind.DENSE, 4096, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    assert not cfgmod.choose_config(prob, ada).use_tma
    # grouped: no split-K; masked tiles by expected_m
    prob = problem(GemmKind.MASKED, 1024, 4096, 7168, 4, a, a, Recipe.GROUP, Recipe.BLOCK,
                   torch.bfloat16, expected_m=32)
    cfg = cfgmod.choose_config(prob, facts)
    assert cfg.split_k == 1 and cfg.block_m == 64
    cands = cfgmod.candidate_configs(prob, facts)
    assert cands[0] == cfg and len(set(cands)) == len(cands) > 3


def test_autotune_cache_roundtrip(tb, tmp_path, monkeypatch):
    cfgmod = tb.config
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cfgmod, "_tuned", None)
    facts = cfgmod.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    prob = problem(GemmKind.DENSE, 64, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    assert cfgmod.load_tuned(prob, facts) is None
    cfg = cfgmod.candidate_configs(prob, facts)[2]
    cfgmod.store_tuned(prob, facts, cfg)
    monkeypatch.setattr(cfgmod, "_tuned", None)  # as a new process would
    assert cfgmod.load_tuned(prob, facts) == cfg
    assert (tmp_path / "triton_autotune.json").exists()
    with pytest.raises(ValueError):
        cfgmod.GemmConfig.from_json({"block_m": 64})


def test_config_rejects_what_the_kernel_cannot_run(tb, tmp_path, monkeypatch):
    """A K tile other than one scale block (128) would index K-varying scales wrongly: such a
    config cannot be built, and an autotune-cache entry holding one is ignored."""
    cfgmod = tb.config
    for bad in (dict(block_k=64), dict(block_m=48), dict(split_k=0), dict(num_programs=0)):
        with pytest.raises(ValueError, match="invalid GemmConfig"):
            _cfg(tb, **bad)
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cfgmod, "_tuned", None)
    facts = cfgmod.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    prob = problem(GemmKind.DENSE, 64, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    entry = dict(cfgmod.choose_config(prob, facts).to_json(), block_k=64)
    (tmp_path / "triton_autotune.json").write_text(json.dumps({cfgmod._key(prob, facts): entry}))
    assert cfgmod.load_tuned(prob, facts) is None


def test_autotune_key_has_sm_count(tb, tmp_path, monkeypatch):
    """A config tuned for 132 SMs (its persistent grid) is not used under set_num_sms(100)."""
    cfgmod = tb.config
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cfgmod, "_tuned", None)
    facts = cfgmod.DeviceFacts(**H200)
    capped = dataclasses.replace(facts, num_sms=100)
    a = torch.zeros(1, dtype=E4M3)
    prob = problem(GemmKind.DENSE, 64, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    cfgmod.store_tuned(prob, facts, cfgmod.choose_config(prob, facts))
    assert cfgmod.load_tuned(prob, facts) is not None
    assert cfgmod.load_tuned(prob, capped) is None
    assert cfgmod.choose_config(prob, capped).num_programs <= 100


def _store_entries(cache_dir: str, first: int, count: int) -> None:
    os.environ["FP8GEMM_CACHE_DIR"] = cache_dir
    from fp8gemm.backends.triton import config as cfgmod

    cfgmod._tuned = None
    facts = cfgmod.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    for m in range(first, first + count):
        prob = problem(GemmKind.DENSE, m, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16)
        cfgmod.store_tuned(prob, facts, cfgmod.choose_config(prob, facts))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_autotune_store_concurrent_processes(tb, tmp_path):
    """Processes that store entries at the same time keep each other's (read-merge-write under a
    lock file); without the lock, entries written between one process's read and its rename
    were lost."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_store_entries, args=(str(tmp_path), 1 + 25 * i, 25))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    stored = json.loads((tmp_path / "triton_autotune.json").read_text())
    assert len(stored) == 100


def test_config_under_graph_capture_is_not_remembered(tb, monkeypatch):
    """FP8GEMM_AUTOTUNE=1 and the first call of a problem inside a CUDA-graph capture (or one
    without tensors, as a benchmark asking which config runs): the heuristic's config is used but
    not kept, so the next eager call tunes (and keeps that)."""
    facts = tb.config.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    prob = problem(GemmKind.DENSE, 33, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    tuned = tb.config.candidate_configs(prob, facts)[1]
    capturing = [True]
    monkeypatch.setenv("FP8GEMM_AUTOTUNE", "1")
    monkeypatch.setattr(tb, "device_facts", lambda device: facts)
    monkeypatch.setattr(tb, "load_tuned", lambda p, f: None)
    monkeypatch.setattr(tb, "store_tuned", lambda p, f, c: None)
    monkeypatch.setattr(tb, "_autotune", lambda p, f, args: tuned)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    heuristic = tb.config.choose_config(prob, facts)
    assert tb.get_config(prob, cuda, tune_args=()) == heuristic
    assert (prob, facts) not in tb._configs
    capturing[0] = False
    assert tb.get_config(prob, cuda) == heuristic  # no tensors to time: not remembered either
    assert (prob, facts) not in tb._configs
    capturing[0] = False
    assert tb.get_config(prob, cuda, tune_args=()) == tuned
    assert tb._configs[(prob, facts)] == tuned


def test_autotune_store_failure_is_not_fatal(tb, monkeypatch):
    """A cache directory that cannot be written costs a warning (and a re-tune next process),
    not the GEMM call."""
    facts = tb.config.DeviceFacts(**H200)
    a = torch.zeros(1, dtype=E4M3)
    prob = problem(GemmKind.DENSE, 35, 4096, 7168, 1, a, a, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    tuned = tb.config.candidate_configs(prob, facts)[1]

    def read_only(p, f, c):
        raise PermissionError("read-only file system")

    monkeypatch.setenv("FP8GEMM_AUTOTUNE", "1")
    monkeypatch.setattr(tb, "device_facts", lambda device: facts)
    monkeypatch.setattr(tb, "load_tuned", lambda p, f: None)
    monkeypatch.setattr(tb, "store_tuned", read_only)
    monkeypatch.setattr(tb, "_autotune", lambda p, f, args: tuned)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.warns(UserWarning, match="not stored"):
        assert tb.get_config(prob, torch.device("cuda", 0), tune_args=()) == tuned

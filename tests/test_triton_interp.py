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
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (E4M3, E5M2, FP8_STEP_FRACTION, FP32_DIFF, GemmKind, Recipe, a_scales,
                     b_scales, calc_diff, ceil_div, dequant_a, dequant_b, make_dense, problem,
                     rand_fp8, ref_grouped_rows, ref_quant_groups)
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
    from fp8gemm.backends.triton import fp8_gemm, quant  # noqa: F401

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
    """Run one persistent-kernel config through its family (the way autotuning runs one)."""
    tb.fp8_gemm.FAMILY.run(cfg, prob, a, sa, b, sb, out, c, idx)


def _cfg(tb, **kw):
    base = dict(block_m=64, block_n=64, group_m=8, split_k=1, num_stages=2, num_warps=4,
                use_tma=False, num_programs=3)
    base.update(kw)
    return tb.fp8_gemm.PersistentConfig(**base)


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

# K = 128 + 80: a partial last K block, rows of 16-byte multiples (the TMA configs' constraint)
G, N_G, K_G = 3, 72, 208


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
    Mmax, and those rows' scales lie past the end of the tensor (never read)."""
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
    assert float((steps > 0).float().mean()) <= FP8_STEP_FRACTION


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
    calls = (tb.quant.quantize_per_token, lambda x: tb.quant.quantize_per_token(
        x, col_major_scales=False), tb.quant.quantize_per_block,
        tb.quant.quantize_per_token_transposed, tb.quant.quantize_per_block_transposed)
    want = [f(x) for f in calls]
    monkeypatch.setattr(tb.quant, "_MAX_GRID_Z", 2)
    got = [f(x) for f in calls]
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
               tb.quant.silu_mul_quantize_per_token, tb.quant.quantize_per_token_transposed,
               tb.quant.quantize_per_block_transposed):
        (q, s), (q0, s0) = fn(x), fn(xc)
        assert torch.equal(s, s0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_transposing_quantisers_match_the_view(tb, fmt, pow2):
    """The transposing kernels (x read along its rows, the tile transposed) give the quantisers'
    bits on the transposed view: ragged T and C, a batch, fp32 and row-strided input, both
    scale layouts."""
    xs = [(torch.randn(200, 150, generator=_gen(68)) * 3).to(torch.bfloat16),
          (torch.randn(2, 130, 70, generator=_gen(69)) * 5).to(torch.bfloat16),
          torch.randn(129, 300, generator=_gen(70))[:, 20:277]]  # fp32, rows strided
    for x in xs:
        for col_major in (True, False):
            q, s = tb.quant.quantize_per_token_transposed(x, fmt, pow2_scales=pow2,
                                                          col_major_scales=col_major)
            q0, s0 = tb.quant.quantize_per_token(x.transpose(-1, -2), fmt, pow2_scales=pow2,
                                                 col_major_scales=col_major)
            assert q.shape == q0.shape and q.is_contiguous() and s.stride() == s0.stride()
            assert torch.equal(s, s0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
        q, s = tb.quant.quantize_per_block_transposed(x, fmt, pow2_scales=pow2)
        q0, s0 = tb.quant.quantize_per_block(x.transpose(-1, -2), fmt, pow2_scales=pow2)
        assert q.shape == q0.shape and q.is_contiguous() and s.is_contiguous()
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


def test_silu_mul_masked_m_reads_only_the_tokens_rows(tb, monkeypatch):
    """With masked_m the kernel leaves the rows of no token unread (NaN and inf there change
    nothing) and gives them an all-zero group's scale; masked_m is clamped to [0, Mmax], and
    each launch of a batch sliced for the grid reads its own experts' counts."""
    monkeypatch.setattr(tb.quant, "_MAX_GRID_Z", 2)  # 5 experts: launches of 2, 2 and 1
    g, mmax, i = 5, 40, 200
    x = (torch.randn(g, mmax, 2 * i, generator=_gen(71)) * 3).to(torch.bfloat16)
    mm = torch.tensor([3, 0, 40, -2, 77], dtype=torch.int32)
    q0, s0 = tb.quant.silu_mul_quantize_per_token(x)
    for e, rows in enumerate(mm.tolist()):
        x[e, max(rows, 0):, ::2] = float("nan")
        x[e, max(rows, 0):, 1::2] = float("inf")
    q, s = tb.quant.silu_mul_quantize_per_token(x, masked_m=mm)
    zero_scale = tb.quant.silu_mul_quantize_per_token(torch.zeros(1, 1, 2 * i))[1].flatten()[0]
    for e, rows in enumerate(mm.tolist()):
        rows = min(max(rows, 0), mmax)
        assert torch.equal(q[e, :rows].view(torch.uint8), q0[e, :rows].view(torch.uint8)), e
        assert torch.equal(s[e, :rows], s0[e, :rows]), e
        assert bool((s[e, rows:] == zero_scale).all()), e


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
# availability, the family seam


def test_available_and_supports(tb):
    """On the CPU the interpreter runs every problem the backend supports with the persistent
    kernel (Gluon has no interpreter)."""
    assert tb.NAME == "triton"
    assert tb.is_available(CPU)
    assert tb.device_facts(CPU) is tb.INTERPRETER_FACTS and tb.INTERPRETER_FACTS.interpreter
    a = torch.zeros(1, dtype=E4M3)
    for kind in (k for k in GemmKind if k is not GemmKind.K_GROUPED):  # see test_k_grouped.py
        for ra in A_RECIPES:
            for rb in B_RECIPES:
                for da in (E4M3, E5M2):
                    prob = problem(kind, 64, 64, 64, 2, a, a.to(da), ra, rb, torch.float32)
                    assert tb.supports(prob) is None
                    assert tb.launch_config(prob, CPU)[0] is tb.fp8_gemm.FAMILY
    bad = problem(GemmKind.DENSE, 4, 4, 4, 1, torch.zeros(1), a, Recipe.ROW, Recipe.ROW, torch.bfloat16)
    assert "FP8" in tb.supports(bad)



def test_tma_config_on_misaligned_bases(tb):
    """A TMA config runs as it says on operands whose base address TMA cannot read from (views at
    an odd byte offset): they are copied to aligned buffers, the results are the same."""
    m, n, k = 40, 96, 256
    a, sa, b, sb, ref = make_dense(m, n, k, Recipe.GROUP, Recipe.BLOCK, CPU, gen=_gen(91))
    prob = problem(GemmKind.DENSE, m, n, k, 1, a, b, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)
    shifted = []
    for t in (a, b):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 16 != 0
        shifted.append(view)
    out = _poisoned((m, n), torch.bfloat16)
    _launch(tb, prob, _cfg(tb, use_tma=True), shifted[0], sa, shifted[1], sb, out)
    _check(out, ref, torch.bfloat16)

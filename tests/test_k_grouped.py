"""k_grouped_fp8_gemm_nt_contiguous: out[g] = c[g] + A_g . B_g^T with the groups packed along K.

Against float64 on the dequantised inputs of each group, built group by group (helpers.ref_gemm on
the group's own [M, K_g] operands and [M, ceil(K_g/128)] scales), so a mistake in the packing
arithmetic (a group's first column, its first scale column, a short last block) shows as a large
error. Outputs are poisoned with NaN first: every element, of groups with K = 0 too, must be
written.

The Triton kernel runs under TRITON_INTERPRET=1, which Triton reads at import: the tests named
`test_interp_*` run in a subprocess with it set (`test_interpreter_subprocess`), or directly with
`TRITON_INTERPRET=1 pytest tests/test_k_grouped.py -k interp_`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8gemm
from fp8gemm.backends import reference
from fp8gemm.backends.family import choose_family
from fp8gemm.problem import SCALE_BLOCK, GemmKind, GemmProblem, Recipe, ceil_div
from helpers import (E4M3, FP8_COMBOS, FP32_DIFF, TENSOR_CORE_FP32_DIFF, assert_close_diff,
                     col_major_tma,
                     padded_view, poisoned, rand_fp8, rand_scales, ref_gemm)

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
CPU = torch.device("cpu")
GROUP = Recipe.GROUP
from test_triton_families import H200  # noqa: E402  (the one H200 facts of the CPU tests)
OP = fp8gemm.k_grouped_fp8_gemm_nt_contiguous

# The GPU's fp32 outputs meet the tensor-core bound (helpers.TOLERANCES), not FP32_DIFF.
GPU_FP32_DIFF = TENSOR_CORE_FP32_DIFF

# K sizes: not multiples of 128, an empty group, a short last block of 1, long and short groups
KS_CASES = [(1000, 37, 0, 129), (256,), (0, 0, 5), (128, 1, 0, 300, 64, 0, 129, 17)]


def _cat_k(ts: list[torch.Tensor]) -> torch.Tensor:
    """fp8 [rows, K_g] tensors side by side (through uint8: cat of fp8 is not everywhere)."""
    return torch.cat([t.view(torch.uint8) for t in ts], dim=1).view(ts[0].dtype)


def make_k_grouped(m: int, n: int, ks, da=E4M3, db=E4M3, device="cpu", ref=True):
    """(a, b, ks tensor, ref): random groups packed along K with fresh 1x128 scales per group;
    ref float64 [G, M, N] from each group's own operands (zero for K_g = 0), or None."""
    parts = []
    for k in ks:
        kb = ceil_div(k, SCALE_BLOCK)
        parts.append((rand_fp8((m, k), da, device), rand_scales((m, kb), device),
                      rand_fp8((n, k), db, device), rand_scales((n, kb), device)))
    a = (_cat_k([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=1))
    b = (_cat_k([p[2] for p in parts]), torch.cat([p[3] for p in parts], dim=1))
    ks_t = torch.tensor(list(ks), dtype=torch.int32, device=device)
    if not ref:
        return a, b, ks_t, None
    out = torch.zeros(len(ks), m, n, dtype=torch.float64, device=device)
    for g, (ag, sag, bg, sbg) in enumerate(parts):
        if ks[g]:
            out[g] = ref_gemm(ag, sag, GROUP, bg, sbg, GROUP)
    return a, b, ks_t, out


def _k_problem(m=4096, n=7168, k=8 * 4096, groups=8, ra=GROUP, rb=GROUP, out=torch.float32,
               has_c=False, da=E4M3, db=E4M3):
    return GemmProblem(GemmKind.K_GROUPED, m, n, k, groups, da, db, ra, rb, out, has_c)


# ---------------------------------------------------------------------------------------------
# the op on the reference backend (the specification)


@pytest.mark.parametrize("ks", KS_CASES)
@pytest.mark.parametrize("da,db", FP8_COMBOS)
def test_matches_float64(ks, da, db):
    m, n = 70, 37
    a, b, ks_t, ref = make_k_grouped(m, n, ks, da, db)
    out = poisoned((len(ks), m, n), torch.float32)
    got = OP(a, b, out, ks_t, backend="reference")
    assert got is out
    assert_close_diff(out, ref, FP32_DIFF, f"ks={ks}")
    for g, k in enumerate(ks):
        if k == 0:
            assert (out[g] == 0).all()


@pytest.mark.parametrize("ks", [(1000, 37, 0, 129), tuple(range(0, 8 * 97, 97))])
def test_c_given_and_c_is_out(ks):
    m, n = 33, 64
    a, b, ks_t, ref = make_k_grouped(m, n, ks)
    c = torch.randn(len(ks), m, n)
    out = poisoned(c.shape, torch.float32)
    OP(a, b, out, ks_t, c=c, backend="reference")
    assert_close_diff(out, ref + c.double(), FP32_DIFF, "c given")
    acc = c.clone()
    assert OP(a, b, acc, ks_t, c=acc) is acc  # auto on the CPU: the reference
    assert_close_diff(acc, ref + c.double(), FP32_DIFF, "c is out")
    assert torch.equal(acc, out)


def test_allocates_and_takes_any_strides():
    """out=None allocates; a strided A, column-major scales, a padded out view give the same."""
    ks = (1000, 37, 0, 129)
    m, n = 40, 24
    (a_t, sa), (b_t, sb), ks_t, ref = make_k_grouped(m, n, ks)
    y = OP((a_t, sa), (b_t, sb), None, ks_t)
    assert y.shape == (4, m, n) and y.dtype == torch.float32
    assert_close_diff(y, ref, FP32_DIFF, "allocated")
    a_view = padded_view(a_t.view(torch.uint8)).view(a_t.dtype)
    assert not a_view.is_contiguous()
    out = padded_view(poisoned((4, m, n), torch.float32))
    c = torch.randn(4, m, n)
    out.copy_(c)
    OP((a_view, col_major_tma(sa)), (b_t, sb.t().contiguous().t()), out, ks_t, c=out)
    assert_close_diff(out, ref + c.double(), FP32_DIFF, "strided")


def test_empty_shapes():
    """Sum K = 0 writes c (or zeros); G = 0, M = 0, N = 0 return an empty out."""
    a, b, ks_t, _ = make_k_grouped(5, 7, (0, 0, 0))
    assert a[0].shape == (5, 0) and a[1].shape == (5, 0)
    out = poisoned((3, 5, 7), torch.float32)
    assert (OP(a, b, out, ks_t) == 0).all()
    c = torch.randn(3, 5, 7)
    assert torch.equal(OP(a, b, out, ks_t, c=c), c)
    no_k = torch.empty(5, 0, dtype=E4M3), torch.empty(5, 0)
    no_groups = torch.empty(0, dtype=torch.int32)
    assert OP(no_k, (no_k[0][:4], no_k[1][:4]), None, no_groups).shape == (0, 5, 4)
    a, b, ks_t, _ = make_k_grouped(0, 7, (100, 28))
    assert OP(a, b, None, ks_t).shape == (2, 0, 7)


def test_m_1_and_one_group_of_long_k():
    """M = 1, N = 1; a single group (G = 1) of K = 16384 does not grow the error."""
    for m, n, ks in [(1, 1, (300, 0, 129)), (3, 5, (16384,))]:
        a, b, ks_t, ref = make_k_grouped(m, n, ks)
        assert_close_diff(OP(a, b, None, ks_t), ref, FP32_DIFF, f"M={m} N={n} ks={ks}")


def test_reference_clamps_ks_that_do_not_add_up():
    """The backend level (values unchecked, as on a GPU): sizes that do not add up read no
    column outside a and no scale column outside the scales."""
    assert reference.k_grouped_ranges([2000, -5, 300], 1166, 10) == [
        (0, 1166, 0, 10), (1166, 0, 10, 0), (1166, 0, 10, 0)]
    assert reference.k_grouped_ranges([1000, 37, 0, 129], 1166, 11) == [
        (0, 1000, 0, 8), (1000, 37, 8, 1), (1037, 0, 9, 0), (1037, 129, 9, 2)]


# ---------------------------------------------------------------------------------------------
# validation


def _valid(m=6, n=5, ks=(130, 0, 7)):
    a, b, ks_t, _ = make_k_grouped(m, n, ks, ref=False)
    return a, b, ks_t


def test_validation_errors():
    (a_t, sa), (b_t, sb), ks = _valid()
    g, m, n = 3, 6, 5
    out = torch.empty(g, m, n)
    bad = [
        (dict(a=(a_t.float(), sa)), TypeError, "a must be float8"),
        (dict(a=a_t), TypeError, "a must be a (tensor, scale) pair"),
        (dict(b=(b_t[None], sb)), ValueError, "b must be 2-D [N, sum K]"),
        (dict(b=(b_t[:, :-1], sb)), ValueError, "b must be [N, sum K] with sum K = 137"),
        (dict(ks=ks.long()), TypeError, "ks must be torch.int32"),
        (dict(ks=ks[None]), ValueError, "ks must be 1-D [G]"),
        (dict(ks=[130, 0, 7]), TypeError, "ks must be a torch.int32 tensor"),
        (dict(a=(a_t, sa.double())), TypeError, "a scales must be torch.float32"),
        (dict(a=(a_t, sa[:, :1])), ValueError, "a scales must be 1x128 groups along each group"),
        (dict(a=(a_t, sa[:-1])), ValueError, "[6, sum ceil(ks/128)]"),
        (dict(b=(b_t, sb[:, :2]), a=(a_t, sa[:, :2])), ValueError,
         "the scales must have sum ceil(ks/128) = 3 K blocks"),
        (dict(b=(b_t, torch.ones(n, 5))), ValueError, "b scales must be 1x128"),
        (dict(b=(b_t, torch.ones(n, 4))), ValueError, "b scales must have the K blocks of a's"),
        (dict(b=(b_t, torch.ones(n))), ValueError, "b scales must be 1x128"),
        (dict(out=out[:2]), ValueError, "out must have shape [3, 6, 5]"),
        (dict(out=out.to(torch.bfloat16)), TypeError, "out must be torch.float32"),
        (dict(out=out.numpy()), TypeError, "out must be a tensor"),
        (dict(c=out[:, :, :4]), ValueError, "c must have shape [G, M, N] = [3, 6, 5]"),
        (dict(c=out.double()), TypeError, "c must be a torch.float32 tensor"),
        (dict(ks=torch.tensor([128, 9, 0], dtype=torch.int32)), ValueError,
         "the scales must have sum ceil(ks/128) = 2"),
        (dict(ks=torch.tensor([137, -7, 7], dtype=torch.int32)), ValueError,
         "ks must be non-negative K sizes that sum to a's K = 137"),
        (dict(ks=torch.tensor([130, 0, 8], dtype=torch.int32)), ValueError, "(sum 138)"),
        (dict(a=(a_t, sa * float("nan"))), ValueError, "a scales must be finite"),
        (dict(backend="gpu"), ValueError, "backend must be one of"),
    ]
    for change, exc, what in bad:
        kw = dict(a=(a_t, sa), b=(b_t, sb), out=out, ks=ks, c=None, backend="auto")
        kw.update(change)
        with pytest.raises(exc) as e:
            OP(kw["a"], kw["b"], kw["out"], kw["ks"], c=kw["c"], backend=kw["backend"])
        assert what in str(e.value), (change, str(e.value))
    # the scale range, from metadata alone: 3 groups of 137 columns have 2 (137 = 130 + 7) to 4
    # (1 + 1 + 135) scale columns
    with pytest.raises(ValueError, match=r"S in \[2, 4\] for sum K = 137 over G = 3 groups"):
        OP((a_t, torch.ones(m, 5)), (b_t, torch.ones(n, 5)), out, ks)
    with pytest.raises(ValueError, match="G = 0"):
        OP((a_t, sa), (b_t, sb), None, ks[:0])


def test_backends_that_take_the_kind():
    """The CUDA k-grouped family takes A e4m3 or e5m2 with B e4m3 (the other CUDA families refuse
    the kind, and it refuses B in e5m2 with its reason); Gluon and the persistent Triton kernel refuse the kind, and
    the Triton k-grouped family takes it in either format."""
    prob = _k_problem(has_c=True)
    assert reference.supports(prob) is None
    cuda = pytest.importorskip("fp8gemm.backends.cuda")
    fam, why = choose_family(cuda.FAMILIES, prob)
    assert fam is not None and fam.name == "sm90_k_grouped_fp8_gemm_1d1d", why
    fam, why = choose_family(cuda.FAMILIES, _k_problem(db=torch.float8_e5m2))
    assert fam is None and "e4m3" in why, why
    tb = pytest.importorskip("fp8gemm.backends.triton")
    for f in tb.FAMILIES:
        if f is not tb.k_grouped_fp8_gemm.FAMILY:
            assert f.supports(prob) is not None, f
    assert tb.supports(prob) is None and tb.supports(_k_problem(db=torch.float8_e5m2)) is None
    assert tb.family_for(prob, H200) is tb.k_grouped_fp8_gemm.FAMILY
    with pytest.raises(ValueError, match="backend='cuda' cannot run k_grouped"):
        a, b, ks = _valid()
        OP(a, b, None, ks, backend="cuda")  # on the CPU


# ---------------------------------------------------------------------------------------------
# the Triton family's heuristics (pure functions, no GPU)


def test_family_supports_and_configs():
    tb = pytest.importorskip("fp8gemm.backends.triton")
    fam = tb.k_grouped_fp8_gemm.FAMILY
    limit = tb.k_grouped_fp8_gemm.MAX_GROUPS
    for da, db in FP8_COMBOS:
        assert fam.supports(_k_problem(da=da, db=db)) is None
    for prob, why in [(_k_problem(groups=limit + 1), f"at most {limit} groups (each program holds"),
                      (_k_problem(rb=Recipe.BLOCK), "A and B in 1x128 groups only"),
                      (_k_problem(out=torch.bfloat16), "writes float32 only"),
                      (dataclass_replace(_k_problem(), kind=GemmKind.DENSE), "not dense")]:
        assert why in fam.supports(prob), fam.supports(prob)
    assert fam.supports(_k_problem(groups=limit)) is None
    # the wgrad shapes fill the SMs with 128x128 tiles; a narrow output takes 64-wide tiles
    for prob, tile in [(_k_problem(), (128, 128)), (_k_problem(m=7168, n=2048), (128, 128)),
                       (_k_problem(m=64, n=4096), (64, 128)), (_k_problem(m=256, n=256, groups=2),
                                                               (64, 64))]:
        cfg = fam.select_config(prob, H200)
        assert (cfg.block_m, cfg.block_n) == tile, (prob, cfg)
        assert cfg.num_stages * (cfg.block_m + cfg.block_n) * SCALE_BLOCK <= H200.smem_per_block
        cands = fam.candidate_configs(prob, H200)
        assert cands[0] == cfg and len(set(cands)) == len(cands) >= 5
        assert all(isinstance(c, fam.Config) for c in cands)
    with pytest.raises(ValueError, match="invalid KGroupedConfig"):
        fam.Config(96, 128, 8, 3, 8)


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_compile_fullgraph_on_the_cpu():
    """One graph with the custom op; the bits of eager; out given and c = out through copy_."""
    ks = (1000, 37, 0, 129)
    a, b, ks_t, ref = make_k_grouped(40, 24, ks)
    c = torch.randn(4, 40, 24)

    def f(a_t, sa, b_t, sb, ks, c):
        y = OP((a_t, sa), (b_t, sb), None, ks)
        acc = c.clone()
        OP((a_t, sa), (b_t, sb), acc, ks, c=acc)
        return y, acc

    torch._dynamo.reset()
    y, acc = torch.compile(f, fullgraph=True)(*a, *b, ks_t, c)
    ey, eacc = f(*a, *b, ks_t, c)
    assert torch.equal(y, ey) and torch.equal(acc, eacc)
    assert_close_diff(acc, ref + c.double(), FP32_DIFF, "compiled")


def test_custom_op_fake_checks_and_opcheck():
    a, b, ks_t, _ = make_k_grouped(8, 16, (130, 0, 7))
    c = torch.randn(3, 8, 16)
    torch.library.opcheck(torch.ops.fp8gemm.k_grouped_fp8_gemm_nt_contiguous,
                          (*a, *b, ks_t, c, "reference"),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fa = tuple(mode.from_tensor(t) for t in a)
        fb = tuple(mode.from_tensor(t) for t in b)
        fks = mode.from_tensor(ks_t)
        y = torch.ops.fp8gemm.k_grouped_fp8_gemm_nt_contiguous(*fa, *fb, fks)
        assert y.shape == (3, 8, 16) and y.dtype == torch.float32
        with pytest.raises(ValueError, match="b must be .N, sum K. with sum K = 137"):
            torch.ops.fp8gemm.k_grouped_fp8_gemm_nt_contiguous(fa[0], fa[1], fb[0][:, 1:], fb[1],
                                                               fks)


# ---------------------------------------------------------------------------------------------
# the Triton kernel under the interpreter


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: the interp tests run here")
def test_interpreter_subprocess():
    """This file's `test_interp_*` tests, in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-k", "interp_", str(Path(__file__).resolve())], env=env, cwd=root,
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


@pytest.fixture(scope="module")
def tb():
    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 from the start (test_interpreter_subprocess)")
    import fp8gemm.backends.triton as mod

    return mod


@pytest.mark.parametrize("ks", KS_CASES)
def test_interp_triton_matches_float64(tb, ks):
    m, n = 70, 40
    a, b, ks_t, ref = make_k_grouped(m, n, ks)
    out = poisoned((len(ks), m, n), torch.float32)
    OP(a, b, out, ks_t, backend="triton")
    assert_close_diff(out, ref, FP32_DIFF, f"ks={ks}")


@pytest.mark.parametrize("da,db", FP8_COMBOS)
def test_interp_formats_c_and_c_is_out(tb, da, db):
    ks = (1000, 37, 0, 129)
    m, n = 33, 20
    a, b, ks_t, ref = make_k_grouped(m, n, ks, da, db)
    c = torch.randn(len(ks), m, n)
    out = poisoned(c.shape, torch.float32)
    OP(a, b, out, ks_t, c=c, backend="triton")
    assert_close_diff(out, ref + c.double(), FP32_DIFF, "c given")
    acc = c.clone()
    OP(a, b, acc, ks_t, c=acc, backend="triton")
    assert_close_diff(acc, ref + c.double(), FP32_DIFF, "c is out")


def test_interp_eight_groups_every_config(tb):
    """G = 8 with empty groups, through every candidate config of the family (the way
    autotuning runs them), column-major scales."""
    ks = (200, 0, 128, 1, 0, 77, 384, 5)
    m, n = 48, 80
    (a_t, sa), (b_t, sb), ks_t, ref = make_k_grouped(m, n, ks)
    sa = col_major_tma(sa)
    fam = tb.k_grouped_fp8_gemm.FAMILY
    prob = GemmProblem(GemmKind.K_GROUPED, m, n, sum(ks), len(ks), E4M3, E4M3, GROUP, GROUP,
                       torch.float32)
    assert tb.launch_config(prob, CPU)[0] is fam
    cands = fam.candidate_configs(prob, tb.INTERPRETER_FACTS)
    for cfg in cands:
        out = poisoned((len(ks), m, n), torch.float32)
        fam.run(cfg, prob, a_t, sa, b_t, sb, out, None, ks_t)
        assert_close_diff(out, ref, FP32_DIFF, str(cfg))


def test_interp_ks_that_do_not_add_up_match_the_reference(tb):
    """Values the GPU path does not check (negative, too large): the kernel clamps as the
    reference does, writes every element and reads nothing outside the operands."""
    m, n = 20, 24
    (a_t, sa), (b_t, sb), _, _ = make_k_grouped(m, n, (1000, 37, 0, 129), ref=False)
    for bad in ([2000, -5, 300, 7], [100, 100, 100, 100], [0, 0, 0, 0], [-1, 1200, 0, 5]):
        ks_t = torch.tensor(bad, dtype=torch.int32)
        prob = GemmProblem(GemmKind.K_GROUPED, m, n, a_t.shape[1], 4, E4M3, E4M3, GROUP, GROUP,
                           torch.float32)
        want = poisoned((4, m, n), torch.float32)
        reference.k_grouped_fp8_gemm_nt_contiguous(a_t, sa, b_t, sb, want, None, ks_t, prob)
        got = poisoned((4, m, n), torch.float32)
        tb.k_grouped_fp8_gemm_nt_contiguous(a_t, sa, b_t, sb, got, None, ks_t, prob)
        assert_close_diff(got, want.double(), FP32_DIFF, f"ks={bad}")


def test_interp_compile_fullgraph_triton(tb):
    a, b, ks_t, ref = make_k_grouped(24, 40, (300, 0, 29))
    torch._dynamo.reset()
    f = torch.compile(lambda *t: OP((t[0], t[1]), (t[2], t[3]), None, t[4], backend="triton"),
                      fullgraph=True)
    assert_close_diff(f(*a, *b, ks_t), ref, FP32_DIFF, "compiled triton")


# ---------------------------------------------------------------------------------------------
# the H200 (Triton)


def _gpu_check(m, n, ks, device, c_is_out=False, rows=256):
    """Full outputs, float64 reference of the first `rows` rows of every group (what keeps the
    reference affordable: 8 x 256 x 7168 x 4096 products in float64), every element finite."""
    (a_t, sa), (b_t, sb), ks_t, _ = make_k_grouped(m, n, ks, device=device, ref=False)
    sa, sb = col_major_tma(sa), col_major_tma(sb)
    c = torch.randn(len(ks), m, n, device=device) if c_is_out else None
    out = c.clone() if c_is_out else poisoned((len(ks), m, n), torch.float32, device)
    OP((a_t, sa), (b_t, sb), out, ks_t, c=out if c_is_out else None)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref_rows = torch.zeros(len(ks), min(rows, m), n, dtype=torch.float64, device=device)
    off = kb_off = 0
    for g, k in enumerate(ks):
        kb = ceil_div(k, SCALE_BLOCK)
        if k:
            ref_rows[g] = ref_gemm(a_t[:rows, off:off + k], sa[:rows, kb_off:kb_off + kb], GROUP,
                                   b_t[:, off:off + k], sb[:, kb_off:kb_off + kb], GROUP)
        off, kb_off = off + k, kb_off + kb
        if c_is_out:
            ref_rows[g] += c[g, :rows].double()
        elif k == 0:
            assert (out[g] == 0).all()
    assert_close_diff(out[:, :rows], ref_rows, GPU_FP32_DIFF, f"M={m} N={n} ks={ks}")
    return out


@pytest.mark.gpu
def test_gpu_deepseek_wgrad_shapes(gpu_device):
    """8 experts x 4096 tokens: 4096 x 7168 and 7168 x 2048 outputs, through auto (the CUDA
    backend's k-grouped family runs e4m3)."""
    prob = _k_problem()
    assert fp8gemm.backends.select_backend(prob, gpu_device).NAME == "cuda"
    _gpu_check(4096, 7168, (4096,) * 8, gpu_device)
    _gpu_check(7168, 2048, (4096,) * 8, gpu_device, c_is_out=True)


@pytest.mark.gpu
def test_gpu_skewed_and_awkward_ks(gpu_device):
    _gpu_check(4096, 7168, (1000, 37, 0, 129, 8192, 4096, 0, 17), gpu_device, c_is_out=True)
    _gpu_check(200, 376, (16384, 3, 0), gpu_device)  # sum K odd: rows not 16-byte multiples


@pytest.mark.gpu
def test_gpu_cuda_graph_reads_ks_on_the_device(gpu_device):
    """Captured once, replayed after ks changes in place: the replay computes the new split."""
    m, n = 256, 384
    ks_a, ks_b = (512, 0, 300, 212), (0, 1000, 24, 0)
    (a_t, _), (b_t, _), _, _ = make_k_grouped(m, n, ks_a, device=gpu_device, ref=False)
    # one scale tensor that serves both splits: 1x128 blocks of each group of either
    num_kb = max(sum(ceil_div(k, SCALE_BLOCK) for k in ks) for ks in (ks_a, ks_b))
    sa = rand_scales((m, num_kb), gpu_device)
    sb = rand_scales((n, num_kb), gpu_device)
    ks_t = torch.tensor(ks_a, dtype=torch.int32, device=gpu_device)
    out = torch.empty(4, m, n, device=gpu_device)
    prob = GemmProblem(GemmKind.K_GROUPED, m, n, a_t.shape[1], 4, E4M3, E4M3, GROUP, GROUP,
                       torch.float32)
    tb = fp8gemm.backends.get_backend("triton")
    tb.k_grouped_fp8_gemm_nt_contiguous(a_t, sa, b_t, sb, out, None, ks_t, prob)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tb.k_grouped_fp8_gemm_nt_contiguous(a_t, sa, b_t, sb, out, None, ks_t, prob)
    for ks in (ks_b, ks_a):
        ks_t.copy_(torch.tensor(ks, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        want = torch.empty_like(out)
        reference.k_grouped_fp8_gemm_nt_contiguous(a_t, sa, b_t, sb, want, None, ks_t, prob)
        assert_close_diff(out, want.double(), GPU_FP32_DIFF, f"replay ks={ks}")

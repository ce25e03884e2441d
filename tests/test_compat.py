"""fp8gemm.compat.deep_gemm against DeepGEMM's own test file, on the CPU at small shapes.

DeepGEMM's tests/test_core.py builds its inputs with its own casts and layouts; here its
constructors run (with "cuda" read as "cpu") against the drop-in, with its own 1e-3 bound.
The file itself runs on a Hopper GPU (python -c "import fp8gemm.compat.deep_gemm as d;
d.install(); ..."), not here: it benchmarks DeepSeek-V3 shapes.
"""

import random
import sys
import types
from pathlib import Path

import pytest
import torch

import fp8gemm.compat.deep_gemm as dg
from fp8gemm import layout
from helpers import E4M3, calc_diff, make_a, make_b, poisoned, rand_fp8, rand_scales

TEST_CORE = Path(__file__).resolve().parents[2] / "shared" / "peers" / "deepgemm" / "tests" / "test_core.py"
OLD = ("gemm_fp8_fp8_bf16_nt", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
       "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "wgrad_gemm_fp8_fp8_fp32_nt",
       "k_grouped_wgrad_gemm_fp8_fp8_fp32_nt")
NEW = ("fp8_gemm_nt", "fp8_gemm_nn", "fp8_gemm_tn", "fp8_gemm_tt",
       "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nn_contiguous",
       "m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
       "k_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_tn_contiguous")
UTILS = ("get_col_major_tma_aligned_tensor", "get_mn_major_tma_aligned_tensor",
         "get_m_alignment_for_contiguous_layout", "transform_sf_into_required_layout",
         "use_deterministic_algorithms", "set_num_sms", "get_num_sms", "calc_diff",
         "bench_kineto", "ceil_div")


def test_names():
    for name in OLD + NEW + UTILS:
        assert callable(getattr(dg, name)), name


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """DeepGEMM's test_core.py as a module, importing the drop-in as deep_gemm."""
    if not TEST_CORE.exists():
        pytest.skip(f"DeepGEMM's test file is not at {TEST_CORE}")
    saved = {k: sys.modules.get(k) for k in ("deep_gemm", "deep_gemm.jit_kernels",
                                             "deep_gemm.jit_kernels.utils", "cuda.bindings.nvrtc")}
    dg.install()
    try:
        import cuda.bindings.nvrtc  # noqa: F401  (test_core imports it first)
    except ImportError:
        sys.modules["cuda.bindings.nvrtc"] = types.SimpleNamespace(nvrtcVersion=lambda: (0, 0, 0))
    src = TEST_CORE.read_text()
    if not torch.cuda.is_available():
        src = src.replace("'cuda'", "'cpu'")
    mod = types.ModuleType("deepgemm_test_core")
    exec(compile(src, str(TEST_CORE), "exec"), mod.__dict__)
    yield mod
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def test_installed_module_looks_like_the_package(core):
    import deep_gemm

    assert deep_gemm is dg and isinstance(deep_gemm.__path__, list)  # test_core prints it
    from deep_gemm.jit_kernels.utils import get_m_alignment_for_contiguous_layout

    assert get_m_alignment_for_contiguous_layout() == dg.get_m_alignment_for_contiguous_layout()


def test_dense_old_and_new_names(core):
    torch.manual_seed(0)
    x_fp8, y_fp8, out, ref = core.construct(64, 576, 256)
    dg.gemm_fp8_fp8_bf16_nt(x_fp8, y_fp8, out)
    assert core.calc_diff(out, ref) < 0.001
    d = torch.empty_like(out)
    dg.fp8_gemm_nt(x_fp8, y_fp8, d)
    assert torch.equal(d, out)


def test_grouped_contiguous_and_masked(core):
    torch.manual_seed(0)
    random.seed(0)
    m, x_fp8, y_fp8, m_indices, out, ref = core.construct_contiguous_grouped(2, 100, 256, 256)
    dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(x_fp8, y_fp8, out, m_indices)
    out = torch.where((m_indices == -1).unsqueeze(1), torch.zeros_like(out), out)
    assert core.calc_diff(out, ref) < 0.001
    x_fp8, y_fp8, masked_m, out, ref = core.construct_masked_grouped(2, 64, 32, 256, 256)
    dg.m_grouped_fp8_gemm_nt_masked(x_fp8, y_fp8, out, masked_m, 32)
    for j in range(2):
        mj = int(masked_m[j])
        assert core.calc_diff(out[j, :mj], ref[j, :mj]) < 0.001


def test_wgrad_accumulates(core):
    torch.manual_seed(0)
    x_fp8, y_fp8, residual, out, ref = core.construct_wgrad(64, 256, 128)
    dg.wgrad_gemm_fp8_fp8_fp32_nt(x_fp8, y_fp8, out)
    assert core.calc_diff(out, ref) < 0.001


def test_k_grouped_old_and_new_names(core):
    torch.manual_seed(0)
    x_fp8, y_fp8, out, ref, ks = core.construct_k_grouped_wgrad(64, 128, [128, 384, 256])
    dg.k_grouped_wgrad_gemm_fp8_fp8_fp32_nt(x_fp8, y_fp8, out, ks)
    for g in range(len(ks)):
        assert core.calc_diff(out[g], ref[g]) < 0.001
    d = torch.zeros_like(out)
    dg.k_grouped_fp8_gemm_nt_contiguous(x_fp8, y_fp8, d, ks, torch.tensor(ks, dtype=torch.int32))
    assert torch.equal(d, out)


def test_bench_kineto_returns_seconds():
    t = dg.bench_kineto(lambda: torch.ones(8).sum(), "fp8_gemm", num_tests=3,
                        suppress_kineto_output=True)
    assert isinstance(t, float) and 0 < t < 1


@pytest.mark.gpu
def test_bench_kineto_per_kernel_with_multiple_kernels(gpu_device):
    """As DeepGEMM's: per call by default, per launched kernel with with_multiple_kernels (its
    k-grouped test multiplies that by the group count)."""
    x = torch.zeros(1 << 24, device=gpu_device)

    def two_kernels():
        x.add_(1.0)
        x.mul_(0.5)

    per_call = dg.bench_kineto(two_kernels, "k", num_tests=20)
    per_kernel = dg.bench_kineto(two_kernels, "k", num_tests=20, with_multiple_kernels=True)
    assert 0.35 < per_kernel / per_call < 0.65, (per_kernel, per_call)


# ---------------------------------------------------------------------------------------------
# DeepGEMM 2.x's other layouts, on the reference backend


def _stored_t(pair):
    """An operand (tensor, scale) as stored transposed: both transposed, contiguous."""
    t, sc = pair
    return t.transpose(-1, -2).contiguous(), sc.transpose(-1, -2).contiguous()


def test_nn_tn_tt_are_nt_on_the_stored_transposes():
    torch.manual_seed(0)
    m, n, k = 37, 200, 320
    a, b = make_a(m, k, "1x128"), make_b(n, k, "128x128")
    ref = torch.empty(m, n, dtype=torch.bfloat16)
    dg.fp8_gemm_nt(a, b, ref)
    for fn, a_, b_ in ((dg.fp8_gemm_nn, a, _stored_t(b)),
                       (dg.fp8_gemm_tn, _stored_t(a), _stored_t(b)),
                       (dg.fp8_gemm_tt, _stored_t(a), b)):
        d = poisoned((m, n), torch.bfloat16)
        fn(a_, b_, d)
        assert torch.equal(d, ref), fn.__name__
    # a per-channel scale [N] of B stored [K, N] stays as it is
    b_row = (b[0], rand_scales([n]))
    d1, d2 = torch.empty_like(ref), torch.empty_like(ref)
    dg.fp8_gemm_nt(a, b_row, d1)
    dg.fp8_gemm_nn(a, (b_row[0].T.contiguous(), b_row[1]), d2)
    assert torch.equal(d1, d2)


def test_grouped_nn_contiguous_is_nt_on_the_stored_transpose():
    torch.manual_seed(1)
    g, n, k = 3, 136, 256
    m_indices = torch.tensor([0] * 128 + [-1] * 128 + [2] * 128 + [1] * 128, dtype=torch.int32)
    a, b = make_a(m_indices.numel(), k, "1x128"), make_b(n, k, "128x128", groups=g)
    ref, d = poisoned((512, n), torch.bfloat16), poisoned((512, n), torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, ref, m_indices)
    dg.m_grouped_fp8_gemm_nn_contiguous(a, _stored_t(b), d, m_indices)
    assert torch.equal(d.view(torch.int16), ref.view(torch.int16))


def _psum_groups_by_hand(sizes, rows):
    """m_indices of the psum layout of group sizes `sizes`: each group from the 128-aligned end
    of the one before."""
    out, end = [-1] * rows, 0
    for g, size in enumerate(sizes):
        start = (end + 127) // 128 * 128
        for r in range(start, min(start + size, rows)):
            out[r] = g
        end = start + size
    return torch.tensor(out, dtype=torch.int32)


def test_psum_layout_rows():
    sizes = [100, 0, 37, 130, 0]
    psum, end = [], 0
    for size in sizes:
        end = (end + 127) // 128 * 128 + size
        psum.append(end)
    psum = torch.tensor(psum, dtype=torch.int32)
    assert psum.tolist() == [100, 128, 165, 386, 512]
    got = dg._psum_row_groups(psum, 520)
    assert torch.equal(got, _psum_groups_by_hand(sizes, 520))
    assert dg._psum_row_groups(torch.zeros(0, dtype=torch.int32), 4).tolist() == [-1] * 4
    # values a caller got wrong (out of order, negative, past the rows) never name a group
    # outside [0, G)
    bad = dg._psum_row_groups(torch.tensor([300, -5, 2**30, 7], dtype=torch.int32), 400)
    assert int(bad.min()) >= -1 and int(bad.max()) < 4
    with pytest.raises(ValueError, match="psum layout"):
        dg._psum_row_groups(psum.to(torch.int64), 520)


def test_grouped_contiguous_psum_layout():
    """With use_psum_layout the psum array says the groups, and rows between groups (and past
    the last) are left untouched, as with the m_indices that describe the same rows."""
    torch.manual_seed(2)
    sizes, n, k = [100, 0, 37, 130], 64, 256
    psum = torch.tensor([100, 128, 165, 386], dtype=torch.int32)
    rows = 400
    a, b = make_a(rows, k, "1x128"), make_b(n, k, "128x128", groups=len(sizes))
    d, ref = poisoned((rows, n), torch.bfloat16), poisoned((rows, n), torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, psum, use_psum_layout=True)
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, ref, _psum_groups_by_hand(sizes, rows))
    assert torch.equal(d.view(torch.int16), ref.view(torch.int16))
    with pytest.raises(ValueError, match="use_psum_layout"):
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, psum, expected_m_for_psum_layout=128)


def _k_grouped_tn_ref(a, b, ranges):
    """float64 d[g] = A[rows_g]^T . B[rows_g] of operands stored [sum K, M] / [sum K, N] with
    scales [sum K / 128, M] / [.., N]."""
    def deq(t, sc):
        return t.double() * sc.double().repeat_interleave(128, dim=0)[:t.shape[0]]

    da, db = deq(*a), deq(*b)
    return torch.stack([da[lo:hi].T @ db[lo:hi] for lo, hi in ranges])


def test_k_grouped_tn_contiguous():
    torch.manual_seed(3)
    m, n, ks = 72, 40, [128, 0, 256]
    sum_k = sum(ks)
    a = (rand_fp8((sum_k, m), E4M3), rand_scales([sum_k // 128, m]))
    b = (rand_fp8((sum_k, n), E4M3), rand_scales([sum_k // 128, n]))
    ranges = [(0, 128), (128, 128), (128, 384)]
    ref = _k_grouped_tn_ref(a, b, ranges)
    ks_t = torch.tensor(ks, dtype=torch.int32)
    d = poisoned((3, m, n), torch.float32)
    dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d, ks, ks_t)
    assert calc_diff(d, ref) < 1e-5 and torch.equal(d[1], torch.zeros(m, n))
    c = torch.randn(3, m, n)
    d2 = poisoned((3, m, n), torch.float32)
    dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d2, ks, ks_t, c)
    assert calc_diff(d2, ref + c.double()) < 1e-5
    with pytest.raises(ValueError, match="multiples of 128"):
        dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d, [100, 28, 256], ks_t)


def test_k_grouped_tn_psum_layout():
    """psum [100, 128, 328] over 384 rows: groups [0, 100), [128, 128), [128, 328), the rows
    between and after them zeros (as DeepGEMM requires)."""
    torch.manual_seed(4)
    m, n, rows = 64, 48, 384
    a = (rand_fp8((rows, m), E4M3), rand_scales([rows // 128, m]))
    b = (rand_fp8((rows, n), E4M3), rand_scales([rows // 128, n]))
    for t in (a[0], b[0]):
        t[100:128] = 0
        t[328:] = 0
    psum = torch.tensor([100, 128, 328], dtype=torch.int32)
    d = poisoned((3, m, n), torch.float32)
    dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d, None, psum, use_psum_layout=True)
    ref = _k_grouped_tn_ref(a, b, [(0, 100), (128, 128), (128, 328)])
    assert calc_diff(d, ref) < 1e-5


def test_transform_sf_into_required_layout():
    sa = torch.rand(37, 3)
    t = dg.transform_sf_into_required_layout(sa, 37, 300, (1, 128, 128), is_sfa=True)
    assert layout.is_col_major_tma_aligned(t) and torch.equal(t, sa)
    assert torch.equal(dg.transform_sf_into_required_layout(sa, 37, 300, (1, 128)), sa)
    sb = torch.rand(2, 3)
    assert dg.transform_sf_into_required_layout(sb, 200, 300, (1, 128, 128), is_sfa=False) is sb
    grouped = torch.rand(4, 37, 3)
    t = dg.transform_sf_into_required_layout(grouped, 37, 300, (1, 128), num_groups=4)
    assert torch.equal(t, grouped) and layout.is_col_major_tma_aligned(t)
    with pytest.raises(ValueError, match="is_sfa"):
        dg.transform_sf_into_required_layout(sa, 37, 300, (1, 128, 128))
    with pytest.raises(ValueError, match="is_sfa goes with"):
        dg.transform_sf_into_required_layout(sa, 37, 300, (1, 128), is_sfa=True)
    with pytest.raises(ValueError, match="1x128 groups or 128x128 blocks"):
        dg.transform_sf_into_required_layout(sa, 37, 300, (1, 32))
    with pytest.raises(ValueError, match=r"\[37, 3\]"):
        dg.transform_sf_into_required_layout(torch.rand(37, 4), 37, 300, (1, 128))
    with pytest.raises(TypeError, match="float32"):
        dg.transform_sf_into_required_layout(sa.int(), 37, 300, (1, 128))


def test_install_serves_the_layout_module():
    saved = {k: sys.modules.get(k) for k in ("deep_gemm", "deep_gemm.jit_kernels",
                                             "deep_gemm.jit_kernels.utils", "deep_gemm.utils",
                                             "deep_gemm.utils.layout")}
    try:
        dg.install()
        from deep_gemm import fp8_m_grouped_gemm_nt_masked
        from deep_gemm.utils.layout import get_mn_major_tma_aligned_tensor

        assert get_mn_major_tma_aligned_tensor is layout.get_col_major_tma_aligned_tensor
        assert fp8_m_grouped_gemm_nt_masked is dg.m_grouped_fp8_gemm_nt_masked
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v

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

TEST_CORE = Path(__file__).resolve().parents[2] / "shared" / "peers" / "deepgemm" / "tests" / "test_core.py"
OLD = ("gemm_fp8_fp8_bf16_nt", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
       "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "wgrad_gemm_fp8_fp8_fp32_nt",
       "k_grouped_wgrad_gemm_fp8_fp8_fp32_nt")
NEW = ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
       "k_grouped_fp8_gemm_nt_contiguous")
UTILS = ("get_col_major_tma_aligned_tensor", "get_m_alignment_for_contiguous_layout",
         "set_num_sms", "get_num_sms", "calc_diff", "bench_kineto", "ceil_div")


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

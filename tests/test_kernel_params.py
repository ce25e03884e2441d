"""Every CUDA plan's argument pack against the parameters of the kernel it launches, on the CPU.

A plan builds its kernel's arguments by hand (`params`: ctypes scalars and 128-byte tensor maps,
in order), and the driver copies them into the kernel's parameter space by the sizes the cubin
records. A pack with a value too few, too many or of the wrong width launches a kernel that reads
garbage or past the argument array, which only a GPU would show. Here each plan is built with
the JIT's build step stubbed, its `params` run on CPU tensors with stand-in tensor maps, and the
sizes of the values compared with the kernel's parameter list in the compiled cubin (the
EIATTR_KPARAM_INFO records `cuobjdump -elf` prints, ordered by ordinal).
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest
import torch

from fp8gemm import jit
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d1d as g1
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g2
from fp8gemm.backends.cuda import sm90_fp8_gemm_small_m as sm
from fp8gemm.backends.family import DeviceFacts
from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div
from helpers import compiler_or_skip

E4M3 = torch.float8_e4m3fn
H200 = DeviceFacts("NVIDIA H200", (9, 0), num_sms=132, smem_per_block=232448)


class _Kernel:
    """What a plan's __init__ asks of a loaded kernel, without a GPU; keeps what it was built
    from."""

    def __init__(self, source, name, include_dirs, *args, **kwargs):
        self.source, self.name, self.include_dirs = source, name, include_dirs

    def set_max_dynamic_smem(self, *args):
        pass

    def prefer_max_shared(self, *args):
        pass

    def max_active_blocks(self, *args):
        return 2


class _Maps:
    """Stand-in tensor maps: 128 bytes each, as a CUtensorMap."""

    def get(self, *args, **kwargs):
        return (ctypes.c_ubyte * 128)()


@pytest.fixture
def build(monkeypatch, tmp_path):
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "build", _Kernel)


def kernel_param_sizes(kernel: _Kernel, tmp_path) -> list[int]:
    tool = jit.cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's wheel)")
    cubin = jit.compile_cached(kernel.source, kernel.name, kernel.include_dirs)[1].cubin
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    elf = subprocess.run([tool, "-elf", str(path)], capture_output=True, text=True).stdout
    found = re.findall(r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x[0-9a-f]+\s+"
                       r"Size\s*:\s*0x([0-9a-f]+)", elf)
    assert found, elf[:2000]
    return [int(size, 16) for _, size in sorted((int(o, 16), s) for o, s in found)]


def pack_sizes(plan, *args) -> list[int]:
    plan.tmaps = _Maps()
    pack = plan.params(*args)
    return [ctypes.sizeof(v) for v in pack._values]


def problem(kind, m, n, k, groups=1, **kw) -> GemmProblem:
    base = dict(kind=kind, m=m, n=n, k=k, groups=groups, a_dtype=E4M3, b_dtype=E4M3,
                a_recipe=Recipe.GROUP, b_recipe=Recipe.BLOCK, out_dtype=torch.bfloat16)
    base.update(kw)
    return GemmProblem(**base)


def fp8(*shape):
    return torch.zeros(shape, dtype=E4M3)


def f32(*shape):
    return torch.zeros(shape, dtype=torch.float32)


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])
def test_small_m_packs_match_the_kernel(masked, build, tmp_path):
    g, m, n, k = (2, 256, 4096, 7168) if masked else (1, 64, 2112, 7168)
    kind = GemmKind.MASKED if masked else GemmKind.DENSE
    p = problem(kind, m, n, k, g, expected_m=128 if masked else 0)
    fam = sm.MASKED_SMALL_M if masked else sm.SMALL_M
    cfg = fam.select_config(p, H200)
    plan = sm.SmallMPlan(p, 0, cfg)
    kb = ceil_div(k, 128)
    a, b = fp8(g, m, k).squeeze(0), fp8(g, n, k).squeeze(0)
    sa, sb = f32(g, kb, m).squeeze(0), f32(g, ceil_div(n, 128), kb).squeeze(0)
    out = torch.zeros((g, m, n) if masked else (m, n), dtype=torch.bfloat16)
    masked_m = torch.zeros(g, dtype=torch.int32) if masked else None
    sizes = pack_sizes(plan, a, sa, b, sb, out, n, masked_m, ("key",))
    assert sizes == kernel_param_sizes(plan.kernel, tmp_path), (cfg, sizes)


@pytest.mark.parametrize("kind,has_c", [(GemmKind.DENSE, False), (GemmKind.DENSE, True),
                                        (GemmKind.CONTIGUOUS, False), (GemmKind.OFFSETS, False),
                                        (GemmKind.MASKED, False)])
def test_1d2d_packs_match_the_kernel(kind, has_c, build, tmp_path):
    g = 1 if kind is GemmKind.DENSE else 4
    m, n, k = (4096, 4096, 7168) if kind is not GemmKind.MASKED else (256, 4096, 7168)
    p = problem(kind, m, n, k, g, has_c=has_c, expected_m=128 if kind is GemmKind.MASKED else 0)
    fam = g2.DENSE if kind is GemmKind.DENSE else g2.GROUPED
    cfg = fam.select_config(p, H200)
    plan = g2.Sm90Plan(p, 0, cfg)
    kb = ceil_div(k, 128)
    rows = g * m if kind is GemmKind.MASKED else m
    a, sa = fp8(rows, k), f32(kb, rows)
    b, sb = fp8(g, n, k), f32(g, ceil_div(n, 128), kb)
    out = torch.zeros(rows, n, dtype=torch.bfloat16)
    index = None if kind is GemmKind.DENSE else torch.zeros(m, dtype=torch.int32)
    c = f32(m, n) if has_c else None
    sizes = pack_sizes(plan, a, sa, b, sb, out, index, ("key",), c)
    assert sizes == kernel_param_sizes(plan.kernel, tmp_path), (cfg, sizes)


@pytest.mark.parametrize("k_grouped", [False, True], ids=["dense", "k_grouped"])
def test_1d1d_packs_match_the_kernel(k_grouped, build, tmp_path):
    m, n, k, g = 2112, 7168, 4096, (8 if k_grouped else 1)
    kind = GemmKind.K_GROUPED if k_grouped else GemmKind.DENSE
    p = problem(kind, m, n, k, g, b_recipe=Recipe.GROUP, out_dtype=torch.float32, has_c=True)
    fam = g1.K_GROUPED if k_grouped else g1.DENSE
    cfg = fam.select_config(p, H200)
    plan = g1.Sm90Plan1d1d(p, 0, cfg)
    kb = ceil_div(k, 128)
    a, sa, b, sb = fp8(m, k), f32(m, kb), fp8(n, k), f32(n, kb)
    out = torch.zeros((g, m, n) if k_grouped else (m, n), dtype=torch.float32)
    ks = torch.zeros(g, dtype=torch.int32) if k_grouped else None
    sizes = pack_sizes(plan, a, sa, b, sb, out, out, ks, ("key",))
    assert sizes == kernel_param_sizes(plan.kernel, tmp_path), (cfg, sizes)


# --- the backend's warm-call launchers ----------------------------------------------------------
def col_major(kb, rows):
    """Scales as the launchers take them: [kb, rows] storage seen as a column-major [rows, kb]."""
    return f32(kb, rows).t()


@pytest.mark.parametrize("name,trial", [("small_m", False), ("dense_1d2d", False),
                                        ("wgrad_1d1d", False), ("masked_grouped", False),
                                        ("masked_small_m", True), ("split_k", False)])
def test_backend_launchers_build_for_every_family(name, trial, build, monkeypatch):
    """backends.cuda's fp8_gemm_nt_launcher / m_grouped_fp8_gemm_nt_launcher hand each family's
    launcher the arguments it takes, and the family is the one the backend chooses (on the
    CPU: the device facts are the H200's and the plans are built without a GPU). A trial family
    is put at the head of the table for its case."""
    from fp8gemm.backends import cuda

    cases = {
        "small_m": (problem(GemmKind.DENSE, 64, 2112, 7168), sm.SMALL_M),
        "dense_1d2d": (problem(GemmKind.DENSE, 4096, 2112, 7168), g2.DENSE),
        "wgrad_1d1d": (problem(GemmKind.DENSE, 2112, 7168, 4096, b_recipe=Recipe.GROUP,
                               out_dtype=torch.float32), g1.DENSE),
        "masked_grouped": (problem(GemmKind.MASKED, 1024, 4096, 7168, 4, expected_m=1024),
                           g2.GROUPED),
        "masked_small_m": (problem(GemmKind.MASKED, 256, 4096, 7168, 1, expected_m=128),
                           sm.MASKED_SMALL_M),
        "split_k": (problem(GemmKind.DENSE, 1000, 512, 32768), g2.SPLIT_K),
    }
    p, fam = cases[name]
    monkeypatch.setattr(DeviceFacts, "of", staticmethod(lambda device: H200))
    if trial:
        monkeypatch.setattr(cuda, "FAMILIES", cuda.TRIAL_FAMILIES + cuda.FAMILIES)
    cuda._family.cache_clear()
    try:
        assert cuda.family_for(p, H200) is fam
        kb = ceil_div(p.k, 128)
        rows = p.groups * p.m if p.kind is GemmKind.MASKED else p.m
        sa = col_major(kb, rows)
        sb = col_major(kb, p.n) if p.b_recipe is Recipe.GROUP else f32(ceil_div(p.n, 128), kb)
        if p.kind is GemmKind.DENSE:
            run = cuda.fp8_gemm_nt_launcher(p, sa, sb)
        else:
            run = cuda.m_grouped_fp8_gemm_nt_launcher(p, sa, sb)
        assert callable(run), name
    finally:
        cuda._family.cache_clear()

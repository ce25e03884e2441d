"""The JIT layer on the CPU: cache keys, the disk cache (atomic, concurrent, corruption), ELF
reading, compiler choice. Compiling needs NVRTC (pip cuda-bindings + nvidia-cuda-nvrtc) or nvcc;
those tests skip with the reason when neither exists. Nothing here needs a GPU."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from fp8gemm import jit
from fp8gemm.jit import cache, elf
from fp8gemm.jit.compiler import CompilerUnavailable, get_compiler

SOURCE = r"""
namespace demo {
template <int kScale>
__global__ void scale_kernel(float* x, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= kScale;
}
}  // namespace demo
"""
NAME = "&demo::scale_kernel<3>"


def _compiler_or_skip(name: str | None = None):
    try:
        return get_compiler(name)
    except CompilerUnavailable as e:
        pytest.skip(f"no CUDA compiler here: {e}")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- keys --------------------------------------------------------------------------------------------
def test_key_changes_with_every_input(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "a.cuh").write_text("// header v1\n")
    base = dict(source=SOURCE, name_expr=NAME, include_dirs=(str(inc),), flags=("-O3",),
                arch="sm_90a", compiler_ident="nvrtc 13.0")
    k0 = jit.cache_key(**base)
    assert jit.cache_key(**base) == k0, "key must be deterministic"
    variants = [dict(source=SOURCE + " "), dict(name_expr="&demo::scale_kernel<4>"),
                dict(flags=("-O2",)), dict(arch="sm_100a"), dict(compiler_ident="nvrtc 13.1"),
                dict(include_dirs=())]
    keys = {jit.cache_key(**{**base, **v}) for v in variants}
    assert k0 not in keys and len(keys) == len(variants)
    # A header edit (content, not just the name) changes the key.
    os.utime(inc / "a.cuh", ns=(1, 1))
    (inc / "a.cuh").write_text("// header v2\n")
    assert jit.cache_key(**base) != k0
    # A new header file too.
    (inc / "b.cuh").write_text("// new\n")
    assert len({k0, jit.cache_key(**base)}) == 2


# --- disk entries ------------------------------------------------------------------------------------
FAKE_CUBIN = b"\x7fELF\x02\x01" + bytes(200)


def test_entry_roundtrip_and_corruption(tmp_path):
    path = cache.entry_path(tmp_path, "ab" + "0" * 62)
    cache.write_entry(path, FAKE_CUBIN, "kern", {"compiler": "x"})
    entry = cache.read_entry(path)
    assert entry is not None and entry.cubin == FAKE_CUBIN and entry.kernel_name == "kern"
    assert not list(path.parent.glob("*.tmp")), "temporary files must be renamed or removed"

    data = path.read_bytes()
    for bad in (data[:-10], data[:-1] + bytes([data[-1] ^ 1]), b"garbage", data.replace(b"\x7fELF", b"\x7fELG")):
        path.write_bytes(bad)
        assert cache.read_entry(path) is None
        assert not path.exists(), "a corrupt entry is removed so that it is rebuilt"
    assert cache.read_entry(path) is None  # missing


def _compile_in_child(args):
    cache_dir, source, name = args
    os.environ["FP8GEMM_CACHE_DIR"] = cache_dir
    from fp8gemm import jit as j

    key, compiled, path, cached = j.compile_cached(source, name)
    return key, compiled.kernel_name, str(path), len(compiled.cubin)


def test_concurrent_compiles_share_one_valid_entry(cache_dir):
    _compiler_or_skip()
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_compile_in_child, [(str(cache_dir), SOURCE, NAME)] * 4)
    assert len({r[0] for r in results}) == 1 and len({r[2] for r in results}) == 1
    path = Path(results[0][2])
    entry = cache.read_entry(path)
    assert entry is not None and elf.is_elf(entry.cubin)
    assert not list(path.parent.glob("*.tmp"))
    assert len(list(path.parent.glob("*.cubin"))) == 1


# --- compiling ---------------------------------------------------------------------------------------
def test_compile_cache_hit_and_corrupt_rebuild(cache_dir):
    _compiler_or_skip()
    key, first, path, cached = jit.compile_cached(SOURCE, NAME)
    assert not cached and elf.is_elf(first.cubin)
    assert first.kernel_name in elf.kernel_names(first.cubin)
    _, second, _, cached = jit.compile_cached(SOURCE, NAME)
    assert cached and second.cubin == first.cubin and second.kernel_name == first.kernel_name
    path.write_bytes(path.read_bytes()[:100])  # truncate: a crashed writer on a non-atomic fs
    _, third, _, cached = jit.compile_cached(SOURCE, NAME)
    assert not cached and third.kernel_name == first.kernel_name
    assert cache.read_entry(path) is not None


def test_compile_error_carries_log(cache_dir):
    _compiler_or_skip()
    with pytest.raises(jit.CompileError, match="error"):
        jit.compile_cached(SOURCE + "\nthis is not C++;\n", NAME)


def test_nvcc_and_nvrtc_agree_on_kernel_name(cache_dir):
    nvrtc = _compiler_or_skip("nvrtc")
    try:
        nvcc = get_compiler("nvcc")
    except CompilerUnavailable as e:
        pytest.skip(f"nvcc missing: {e}")
    a = nvrtc.compile(SOURCE, NAME, (), (), "sm_90a")
    b = nvcc.compile(SOURCE, NAME, (), (), "sm_90a")
    assert a.kernel_name == b.kernel_name
    assert elf.kernel_names(a.cubin) == elf.kernel_names(b.cubin) == [a.kernel_name]


def test_compiler_setting_is_validated(monkeypatch):
    monkeypatch.setenv("FP8GEMM_JIT_COMPILER", "clang")
    with pytest.raises(ValueError, match="FP8GEMM_JIT_COMPILER"):
        get_compiler()


def test_elf_rejects_garbage():
    assert not elf.is_elf(b"\x7fELF")
    with pytest.raises(ValueError):
        elf.section_names(b"\x7fELF\x02\x01" + bytes(100))


def test_tma_encode_validates_before_the_driver():
    import torch

    with pytest.raises(ValueError, match="16-byte aligned"):
        jit.encode_tiled(torch.uint8, 8, (128, 128), (128,), (128, 64), jit.Swizzle.B128)
    with pytest.raises(ValueError, match="multiples of 16"):
        jit.encode_tiled(torch.uint8, 256, (100, 128), (100,), (64, 64))
    with pytest.raises(ValueError, match="1..256"):
        jit.encode_tiled(torch.uint8, 256, (512, 512), (512,), (512, 64))
    with pytest.raises(ValueError, match="swizzle"):
        jit.encode_tiled(torch.bfloat16, 256, (512, 512), (1024,), (128, 64), jit.Swizzle.B128)

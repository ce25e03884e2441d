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
from fp8gemm.jit.compiler import get_compiler
from helpers import compiler_or_skip

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
    k1 = jit.cache_key(**base)
    assert k1 != k0
    # A new header file too.
    (inc / "b.cuh").write_text("// new\n")
    assert jit.cache_key(**base) not in (k0, k1)


# --- disk entries ------------------------------------------------------------------------------------
def _fake_cubin(kernel: str) -> bytes:
    """A minimal ELF64 whose sections say it holds one kernel: .text.<kernel>, .nv.info.<kernel>,
    plus a NOBITS .nv.shared.<kernel> whose size lies past the end of the file."""
    import struct

    names = ["", ".shstrtab", f".text.{kernel}", f".nv.info.{kernel}", f".nv.shared.{kernel}"]
    strtab = b"".join(n.encode() + b"\0" for n in names)
    offsets = [sum(len(n) + 1 for n in names[:i]) for i in range(len(names))]
    body_off = 64
    text = b"\0" * 16
    sh_off = body_off + len(strtab) + len(text)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, sh_off)
    struct.pack_into("<HHH", head, 0x3A, 64, len(names), 1)
    # (name offset, type, file offset, size): PROGBITS = 1, STRTAB = 3, NOBITS = 8
    sections = [(0, 0, 0, 0), (offsets[1], 3, body_off, len(strtab)),
                (offsets[2], 1, body_off + len(strtab), len(text)), (offsets[3], 1, body_off, 0),
                (offsets[4], 8, 1 << 20, 4096)]
    table = b""
    for name, sh_type, off, size in sections:
        sh = bytearray(64)
        struct.pack_into("<II", sh, 0, name, sh_type)
        struct.pack_into("<QQ", sh, 0x18, off, size)
        table += bytes(sh)
    return bytes(head) + strtab + text + table


FAKE_CUBIN = _fake_cubin("kern")


def test_fake_cubin_reads_as_one_kernel():
    assert elf.kernel_names(FAKE_CUBIN) == ["kern"]


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
    # A header whose kernel name is not in the (intact) cubin: the header has no checksum.
    cache.write_entry(path, FAKE_CUBIN, "other_kernel", {"compiler": "x"})
    assert cache.read_entry(path) is None and not path.exists()


def _compile_in_child(args):
    cache_dir, source, name = args
    os.environ["FP8GEMM_CACHE_DIR"] = cache_dir
    from fp8gemm import jit as j

    key, compiled, path, cached = j.compile_cached(source, name)
    return key, compiled.kernel_name, str(path), len(compiled.cubin)


def test_concurrent_compiles_share_one_valid_entry(cache_dir):
    compiler_or_skip()
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
    compiler_or_skip()
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
    compiler_or_skip()
    with pytest.raises(jit.CompileError, match="error"):
        jit.compile_cached(SOURCE + "\nthis is not C++;\n", NAME)


def test_nvcc_and_nvrtc_agree_on_kernel_name(cache_dir):
    nvrtc, nvcc = compiler_or_skip("nvrtc"), compiler_or_skip("nvcc")
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
    with pytest.raises(ValueError, match="dims"):
        jit.encode_tiled(torch.uint8, 256, (128, 0), (128,), (128, 64))
    with pytest.raises(ValueError, match="multiples of 16"):  # an expanded row: stride 0
        jit.encode_tiled(torch.uint8, 256, (128, 1), (0,), (128, 64))


# --- what else shapes a binary; failure paths ------------------------------------
def test_cache_ident_covers_fixed_options_and_nvcc_env(monkeypatch):
    """The options every compile passes, and nvcc's flag variables, are part of the cache key:
    editing them must not reuse a binary built without them."""
    from fp8gemm.jit.compiler import NVCC_OPTIONS, NVRTC_OPTIONS, Compiler

    nvrtc = Compiler("nvrtc", "nvrtc 13.0")
    assert all(o in nvrtc.cache_ident for o in NVRTC_OPTIONS)
    nvcc = Compiler("nvcc", "nvcc 13.0")
    assert all(o in nvcc.cache_ident for o in NVCC_OPTIONS)
    monkeypatch.delenv("NVCC_APPEND_FLAGS", raising=False)
    monkeypatch.delenv("NVCC_PREPEND_FLAGS", raising=False)
    plain = nvcc.cache_ident
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")
    assert nvcc.cache_ident != plain


def test_nvrtc_ident_names_the_loaded_library():
    from fp8gemm.jit.compiler import nvrtc_ident

    ident = nvrtc_ident()
    if ident is None:
        pytest.skip("no NVRTC here")
    if Path("/proc/self/maps").exists():
        assert "libnvrtc.so" in ident, ident


def test_unwritable_cache_dir_warns_and_still_compiles(tmp_path, monkeypatch):
    compiler_or_skip()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        _, compiled, _, cached = jit.compile_cached(SOURCE, NAME)
    assert not cached and elf.is_elf(compiled.cubin)


def test_compile_error_names_the_kernel(cache_dir):
    compiler_or_skip()
    with pytest.raises(jit.CompileError, match="scale_kernel<3>"):
        jit.compile_cached(SOURCE + "\nthis is not C++;\n", NAME)


def test_launch_config_hands_out_the_struct_with_its_address():
    """The launch keeps the struct alive while the driver reads it (no GPU needed to build)."""
    import ctypes

    cfg = jit.LaunchConfig((4, 1, 1), (128, 1, 1), 1024, (2, 1, 1))
    struct_, address = cfg.for_stream(1234)
    assert address == ctypes.addressof(struct_)
    assert (struct_.gridDimX, struct_.blockDimX, struct_.sharedMemBytes) == (4, 128, 1024)
    assert struct_.numAttrs == 1 and struct_.hStream == 1234
    assert cfg.for_stream(1234)[1] == address and cfg.for_stream(0)[1] != address
    assert jit.LaunchConfig((4, 1, 1), (128, 1, 1), 0).for_stream(0)[0].numAttrs == 0
    with pytest.raises(ValueError, match="multiple of the cluster"):
        jit.LaunchConfig((3, 1, 1), (128, 1, 1), 0, (2, 1, 1))


@pytest.mark.parametrize("cluster", [(1, 1, 1), (2, 1, 1)])
def test_launch_config_programmatic_serialization(cluster):
    """pdl adds cuda.h's CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) with the value
    1 beside the cluster dimension, if any."""
    from fp8gemm.jit import driver

    struct_, _ = jit.LaunchConfig((4, 1, 1), (128, 1, 1), 0, cluster, pdl=True).for_stream(7)
    attrs = {struct_.attrs[i].id: struct_.attrs[i] for i in range(struct_.numAttrs)}
    assert driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert set(attrs) == {6} | ({driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION}
                                if cluster != (1, 1, 1) else set())
    assert attrs[6].value.programmaticStreamSerializationAllowed == 1
    if cluster != (1, 1, 1):
        dim = attrs[driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION].value.clusterDim
        assert (dim.x, dim.y, dim.z) == cluster
    off, _ = jit.LaunchConfig((4, 1, 1), (128, 1, 1), 0, cluster, pdl=False).for_stream(7)
    assert off.numAttrs == (cluster != (1, 1, 1))
    try:
        from cuda.bindings import driver as cuda_driver
    except ImportError:
        return
    ids = cuda_driver.CUlaunchAttributeID
    assert int(ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) == 6


def test_pdl_setting_is_on_unless_turned_off(monkeypatch):
    from fp8gemm import settings

    monkeypatch.delenv("FP8GEMM_PDL", raising=False)
    assert settings.pdl
    for off in ("0", "false", "off", "no"):
        monkeypatch.setenv("FP8GEMM_PDL", off)
        assert not settings.pdl
    monkeypatch.setenv("FP8GEMM_PDL", "1")
    assert settings.pdl

"""Build (compile or fetch from cache), load and launch kernels.

    kernel = build(source, name_expr, include_dirs=(...,))      # cached in-process and on disk
    kernel.set_max_dynamic_smem(nbytes, device_index)
    launch = LaunchConfig(grid=(132, 1, 1), block=(384, 1, 1), smem=nbytes, cluster=(2, 1, 1))
    params = ParamPack([ctypes.c_uint64(ptr), ctypes.c_uint32(m), tensor_map, ...])
    kernel.launch(launch, stream, params)                         # stream: raw cudaStream_t int

Loading uses `cuLibraryLoadData`, which is context-independent: the driver resolves the kernel
in the context of the launch stream, or, for the NULL/legacy/per-thread stream, in the thread's
current context, which the caller must make the tensors' device (see cuLaunchKernelEx in cuda.h).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .._settings import settings
from . import cache, driver
from .compiler import CompiledCubin, get_compiler
from .tma import TensorMap

__all__ = ["Kernel", "LaunchConfig", "ParamPack", "build", "cache_key", "clear_memory_cache",
           "cuobjdump_path", "disassemble"]

DEFAULT_ARCH = "sm_90a"
_memory_cache: dict[tuple, Kernel] = {}
_lock = threading.Lock()


# --- cache keys ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _include_digest(include_dir: str, stamp: tuple) -> str:
    """SHA-256 over every file below an include directory (names and contents)."""
    h = hashlib.sha256()
    root = Path(include_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _dir_stamp(include_dir: str) -> tuple:
    root = Path(include_dir)
    return tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                        for p in root.rglob("*") if p.is_file()))


def cache_key(source: str, name_expr: str, include_dirs: tuple[str, ...], flags: tuple[str, ...],
              arch: str, compiler_ident: str) -> str:
    """Hash of everything that shapes the binary: source (template values included), every
    header reachable through the include dirs, compiler and exact version, flags, arch."""
    headers = {d: _include_digest(d, _dir_stamp(d)) for d in include_dirs}
    return cache.hash_key({"v": 1, "source": source, "name": name_expr, "headers": headers,
                           "flags": list(flags), "arch": arch, "compiler": compiler_ident})


# --- launching -------------------------------------------------------------------------------------
class ParamPack:
    """Kernel arguments as the driver wants them: an array of pointers to each value. Values are
    ctypes scalars or TensorMaps (passed by value: 128 bytes). Build once, launch many times."""

    __slots__ = ("_values", "array", "address")

    def __init__(self, values: list) -> None:
        self._values = list(values)  # keep every pointee alive
        addrs = [v.address if isinstance(v, TensorMap) else ctypes.addressof(v) for v in values]
        self.array = (ctypes.c_void_p * max(len(addrs), 1))(*addrs)
        self.address = ctypes.addressof(self.array)  # what the launch passes


class LaunchConfig:
    """A prebuilt CUlaunchConfig (grid, block, dynamic smem, cluster, programmatic dependent
    launch) per stream.

    pdl: launch with programmatic stream serialization, so the kernel may start while the kernel
    before it in the stream still runs, once that one lets it (`griddepcontrol.launch_dependents`
    or its exit). Only for kernels that execute `griddepcontrol.wait` before touching memory an
    earlier kernel may write."""

    __slots__ = ("grid", "block", "smem", "cluster", "pdl", "_attrs", "_num_attrs", "_per_stream")

    def __init__(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                 cluster: tuple[int, int, int] = (1, 1, 1), pdl: bool = False) -> None:
        if any(g % c for g, c in zip(grid, cluster)):
            raise ValueError(f"grid {grid} must be a multiple of the cluster {cluster}")
        self.grid, self.block, self.smem, self.cluster, self.pdl = grid, block, smem, cluster, pdl
        attrs = []
        if cluster != (1, 1, 1):
            a = driver.CUlaunchAttribute()
            a.id = driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
            attrs.append(a)
        if pdl:
            a = driver.CUlaunchAttribute()
            a.id = driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        self._attrs = (driver.CUlaunchAttribute * max(len(attrs), 1))(*attrs)
        self._num_attrs = len(attrs)
        self._per_stream: dict[int, tuple[driver.CUlaunchConfig, int]] = {}

    def for_stream(self, stream: int) -> tuple:
        """(CUlaunchConfig, its address) for `stream`. The caller keeps the tuple while the
        driver reads the struct: another thread may drop it from the table meanwhile."""
        # NOTE: one immutable struct per stream, so threads launching on different streams never
        # see each other's writes (ctypes drops the GIL inside the call).
        entry = self._per_stream.get(stream)
        if entry is None:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
            cfg.sharedMemBytes = self.smem
            cfg.hStream = stream or None
            cfg.attrs = self._attrs if self._num_attrs else None
            cfg.numAttrs = self._num_attrs
            entry = (cfg, ctypes.addressof(cfg))
            if len(self._per_stream) > 64:
                self._per_stream.clear()
            self._per_stream[stream] = entry
        return entry


class Kernel:
    """One loaded kernel of a cubin."""

    def __init__(self, key: str, compiled: CompiledCubin, path: Path | None) -> None:
        from cuda.bindings import driver as cu

        self.key, self.name, self.path = key, compiled.kernel_name, path
        self.log, self.compile_seconds = compiled.log, compiled.seconds
        self.load_seconds = 0.0
        start = time.perf_counter()
        driver.check(cu.cuInit(0), "cuInit")
        self._library = driver.check(cu.cuLibraryLoadData(compiled.cubin, [], [], 0, [], [], 0),
                                     "cuLibraryLoadData")
        self._kernel = driver.check(cu.cuLibraryGetKernel(self._library, self.name.encode()),
                                    f"cuLibraryGetKernel({self.name})")
        self.handle = int(self._kernel)
        self.load_seconds = time.perf_counter() - start
        # NOTE: bound once: a launch costs a few microseconds of host time, and looking the
        # symbol up again (driver.lib(), attribute) on each one is a measurable part of it.
        self._launch_kernel_ex = driver.lib().cuLaunchKernelEx
        self._smem_set: dict[int, int] = {}

    def set_max_dynamic_smem(self, nbytes: int, device_index: int) -> None:
        """Raise the dynamic shared-memory limit (above 48 KB needs an explicit opt-in)."""
        if self._smem_set.get(device_index, -1) >= nbytes:
            return
        from cuda.bindings import driver as cu

        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.check(cu.cuKernelSetAttribute(attr, nbytes, self._kernel, cu.CUdevice(device_index)),
                     f"cuKernelSetAttribute(max dynamic smem = {nbytes})")
        self._smem_set[device_index] = nbytes

    def prefer_max_shared(self, device_index: int) -> None:
        """Ask for the largest shared-memory carveout of the SM's unified L1 / shared memory (the
        driver may otherwise pick one that fits fewer resident blocks than the kernel is built
        for)."""
        from cuda.bindings import driver as cu

        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        driver.check(cu.cuKernelSetAttribute(
            attr, int(cu.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED), self._kernel,
            cu.CUdevice(device_index)), "cuKernelSetAttribute(shared memory carveout)")

    def max_active_blocks(self, threads: int, dynamic_smem: int) -> int:
        """Blocks of `threads` threads and `dynamic_smem` bytes that can be resident on one SM
        of the current context's device at once."""
        from cuda.bindings import driver as cu

        func = driver.check(cu.cuKernelGetFunction(self._kernel), "cuKernelGetFunction")
        return int(driver.check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            func, threads, dynamic_smem), "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def launch(self, config: LaunchConfig, stream: int, params: ParamPack) -> None:
        # NOTE: for_stream's table lookup inline (a Python call less per launch); the tuple is
        # held until the driver has read the struct.
        cfg = config._per_stream.get(stream) or config.for_stream(stream)
        rc = self._launch_kernel_ex(cfg[1], self.handle, params.address, None)
        if rc != 0:
            raise driver.DriverError(f"cuLaunchKernelEx({self.name}, grid={config.grid}, "
                                     f"block={config.block}, smem={config.smem}, "
                                     f"cluster={config.cluster}) failed: {driver.error_name(rc)}")


# --- build -------------------------------------------------------------------------------------------
def cuobjdump_path() -> str | None:
    """cuobjdump from the CUDA toolkit, else the copy inside Triton's wheel."""
    import shutil

    found = shutil.which("cuobjdump")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/cuobjdump",):
        if Path(candidate).is_file():
            return candidate
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    return None


def disassemble(cubin: bytes) -> subprocess.CompletedProcess | None:
    """`cuobjdump -sass` of a cubin (text output); None without cuobjdump."""
    tool = cuobjdump_path()
    if tool is None:
        return None
    # NOTE: a private temporary file: processes compiling the same kernel dump it at once.
    with tempfile.TemporaryDirectory(prefix="fp8gemm-sass-") as tmp_dir:
        tmp = Path(tmp_dir) / "kernel.cubin"
        tmp.write_bytes(cubin)
        return subprocess.run([tool, "-sass", str(tmp)], capture_output=True, text=True)


def _dump_sass(path: Path, cubin: bytes) -> None:
    out = disassemble(cubin)
    if out is None:
        print("[fp8gemm.jit] FP8GEMM_DUMP_SASS: no cuobjdump found", flush=True)
        return
    cache.write_text_atomic(path.with_suffix(".sass"), out.stdout + out.stderr)


def compile_cached(source: str, name_expr: str, include_dirs: tuple[str, ...] = (),
                   flags: tuple[str, ...] = (), arch: str = DEFAULT_ARCH,
                   compiler: str | None = None) -> tuple[str, CompiledCubin, Path, bool]:
    """Compile (or read from the disk cache) without loading: (key, cubin, path, was_cached).
    Needs no GPU, so CI can build every kernel."""
    comp = get_compiler(compiler)
    include_dirs = tuple(str(Path(d).resolve()) for d in include_dirs)
    key = cache_key(source, name_expr, include_dirs, tuple(flags), arch, comp.cache_ident)
    path = cache.entry_path(settings.cache_dir, key)
    entry = cache.read_entry(path)
    if entry is not None:
        if settings.jit_debug:
            print(f"[fp8gemm.jit] disk cache hit {path}", flush=True)
        log = entry.meta.get("log", "")
        return key, CompiledCubin(entry.cubin, entry.kernel_name, log, 0.0), path, True
    compiled = comp.compile(source, name_expr, include_dirs, tuple(flags), arch)
    try:
        cache.write_entry(path, compiled.cubin, compiled.kernel_name,
                          {"compiler": comp.ident, "arch": arch, "seconds": compiled.seconds,
                           "name_expr": name_expr, "log": compiled.log})
    except OSError as e:
        # NOTE: a read-only or full cache directory costs a compile per process, not the call.
        _warn_unwritable(str(settings.cache_dir), e)
        return key, compiled, path, False
    if settings.jit_debug:
        print(f"[fp8gemm.jit] compiled {name_expr} with {comp.name} in {compiled.seconds:.2f} s "
              f"-> {path}\n{compiled.log.strip()}", flush=True)
    if settings.dump_sass:
        _dump_sass(path, compiled.cubin)
    return key, compiled, path, False


_warned_dirs: set[str] = set()


def _warn_unwritable(cache_dir: str, error: OSError) -> None:
    """One warning per cache directory."""
    if cache_dir in _warned_dirs:
        return
    _warned_dirs.add(cache_dir)
    warnings.warn(f"fp8gemm: cannot write the kernel cache under {cache_dir} ({error}); kernels "
                  f"are compiled again in every process. Set FP8GEMM_CACHE_DIR to a writable "
                  f"directory.", RuntimeWarning, stacklevel=3)


def build(source: str, name_expr: str, include_dirs: tuple[str, ...] = (),
          flags: tuple[str, ...] = (), arch: str = DEFAULT_ARCH, compiler: str | None = None) -> Kernel:
    """The loaded kernel for this source: from memory, else the disk cache, else compiled."""
    # NOTE: the in-process key is the inputs themselves; hashing headers happens once per kernel.
    mem_key = (source, name_expr, tuple(include_dirs), tuple(flags), arch, compiler or settings.jit_compiler)
    kernel = _memory_cache.get(mem_key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _memory_cache.get(mem_key)
        if kernel is None:
            key, compiled, path, _ = compile_cached(source, name_expr, include_dirs, flags, arch, compiler)
            kernel = Kernel(key, compiled, path)
            if settings.jit_debug:
                print(f"[fp8gemm.jit] loaded {kernel.name} in {kernel.load_seconds * 1e3:.1f} ms",
                      flush=True)
            _memory_cache[mem_key] = kernel
    return kernel


def clear_memory_cache() -> None:
    """Forget loaded kernels (tests use this to exercise the disk cache)."""
    with _lock:
        _memory_cache.clear()

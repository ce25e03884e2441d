"""CUDA C++ -> cubin, with NVRTC (through `cuda.bindings.nvrtc`) or nvcc.

Nothing here knows what the kernel computes: a caller hands over source text, the C++ expression
naming the one `__global__` function to keep (e.g. ``&ns::kernel<128, true>``), include
directories and extra flags.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .._settings import settings
from . import elf

__all__ = ["CompileError", "CompilerUnavailable", "CompiledCubin", "Compiler", "get_compiler",
           "nvrtc_available", "nvrtc_ident", "nvcc_path"]


class CompileError(RuntimeError):
    """The compiler rejected the source; the message carries its log."""


class CompilerUnavailable(RuntimeError):
    """Neither NVRTC nor nvcc can be used here."""


@dataclass(frozen=True)
class CompiledCubin:
    cubin: bytes
    kernel_name: str  # the lowered (mangled) symbol to look up in the cubin
    log: str  # compiler + ptxas messages (ptxas -v: registers, spills)
    seconds: float


# NOTE: options every compile passes besides the caller's flags; `Compiler.cache_ident` puts them
# in the cache key, so editing them here invalidates old entries instead of reusing them.
# NOTE: -default-device: NVRTC takes a generic lambda's call operator (a template without an
# execution space) for a host function, also inside a kernel; nvcc derives it from the enclosing
# function. With the flag NVRTC does the same.
NVRTC_OPTIONS = ("-std=c++17", "--ptxas-options=-v", "-default-device")
NVCC_OPTIONS = ("-cubin", "-std=c++17", "-Xptxas=-v")
# nvcc adds these environment variables' flags to every command line: they shape the binary.
NVCC_ENV_FLAGS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")


@dataclass(frozen=True)
class Compiler:
    """One compiler. `ident` names it and its exact version."""

    name: str  # "nvrtc" or "nvcc"
    ident: str

    @property
    def cache_ident(self) -> str:
        """`ident` plus everything else of this compiler that shapes a binary: the fixed options
        and, for nvcc, its flag environment variables. Part of every cache key."""
        if self.name == "nvrtc":
            return f"{self.ident} {' '.join(NVRTC_OPTIONS)}"
        env = " ".join(f"{v}={os.environ.get(v, '')}" for v in NVCC_ENV_FLAGS)
        return f"{self.ident} {' '.join(NVCC_OPTIONS)} {env}"

    def compile(self, source: str, name_expr: str, include_dirs: tuple[str, ...],
                flags: tuple[str, ...], arch: str) -> CompiledCubin:
        if self.name == "nvrtc":
            return _compile_nvrtc(source, name_expr, include_dirs, flags, arch)
        return _compile_nvcc(source, name_expr, include_dirs, flags, arch)


# --- NVRTC -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def nvrtc_ident() -> str | None:
    """The NVRTC this process compiles with (version, wheel, loaded library), or None."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # the library itself is missing (pip wheel without nvidia-cuda-nvrtc)
        return None
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return None
    # NOTE: nvrtcVersion gives only major.minor; the wheel's version pins the exact build, and
    # the library actually loaded (a system libnvrtc may be loaded while a wheel of another
    # version is installed, or no wheel at all) is named by its path and size.
    build = ""
    try:
        from importlib.metadata import version

        for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc-cu13"):
            try:
                build = f"+{dist}=={version(dist)}"
                break
            except Exception:
                continue
    except ImportError:
        pass
    return f"nvrtc {major}.{minor}{build}{_loaded_library('libnvrtc.so')}"


def _loaded_library(stem: str) -> str:
    """' <path>:<size>' of the shared library `stem` mapped into this process (Linux), else ''."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if stem in line
                     and len(line.split(None, 5)) == 6}
    except OSError:
        return ""
    for path in sorted(paths):
        if Path(path).name.startswith(stem):
            try:
                return f" {path}:{os.path.getsize(path)}"
            except OSError:
                return f" {path}"
    return ""


def nvrtc_available() -> bool:
    return nvrtc_ident() is not None


def _nvrtc_check(nvrtc, result, prog=None, what: str = "") -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _nvrtc_log(nvrtc, prog) if prog is not None else ""
        raise CompileError(f"NVRTC {what} failed: {err}\n{log}")


def _nvrtc_log(nvrtc, prog) -> str:
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\x00 ").decode(errors="replace")


def _compile_nvrtc(source: str, name_expr: str, include_dirs, flags, arch) -> CompiledCubin:
    from cuda.bindings import nvrtc

    start = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"fp8gemm_jit.cu", 0, [], [])
    _nvrtc_check(nvrtc, err, what="nvrtcCreateProgram")
    try:
        expr = name_expr.encode()
        _nvrtc_check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, expr), what="nvrtcAddNameExpression")
        opts = [f"--gpu-architecture={arch}", *NVRTC_OPTIONS,
                *(f"-I{d}" for d in include_dirs), *flags]
        if settings.jit_debug:
            print(f"[fp8gemm.jit] nvrtc {' '.join(opts)}", flush=True)
        bopts = [o.encode() for o in opts]
        result = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        log = _nvrtc_log(nvrtc, prog)
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC compile of {name_expr} failed ({result[0]}), options "
                               f"{' '.join(opts)}:\n{log}")
        err, lowered = nvrtc.nvrtcGetLoweredName(prog, expr)
        _nvrtc_check(nvrtc, err, prog, "nvrtcGetLoweredName")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _nvrtc_check(nvrtc, err, prog, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), prog, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    name = lowered.decode() if isinstance(lowered, bytes) else str(lowered)
    return CompiledCubin(bytes(cubin), name, log, time.perf_counter() - start)


# --- nvcc ------------------------------------------------------------------------------------------
def nvcc_path() -> str | None:
    candidates = [shutil.which("nvcc")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(str(Path(os.environ[env]) / "bin" / "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


@functools.lru_cache(maxsize=4)
def _nvcc_ident(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    # e.g. "Cuda compilation tools, release 13.0, V13.0.88" plus the build line
    lines = [ln.strip() for ln in out.stdout.splitlines() if "release" in ln or ln.startswith("Build")]
    return f"nvcc {path} {' '.join(lines)}"


def _compile_nvcc(source: str, name_expr: str, include_dirs, flags, arch) -> CompiledCubin:
    path = nvcc_path()
    if path is None:
        raise CompilerUnavailable("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda/bin)")
    if not arch.startswith("sm_"):
        raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
    compute = "compute_" + arch[3:]
    # NOTE: a host function taking the kernel's address instantiates the template under nvcc,
    # which (unlike NVRTC) has no name expressions.
    text = source + f"\nstatic void* fp8gemm_jit_instantiate() {{ return (void*)({name_expr}); }}\n"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fp8gemm-nvcc-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        src.write_text(text)
        # NOTE: the -gencode form assembles wgmma/setmaxnreg; the -arch=sm_90a shorthand also runs
        # a plain sm_90 pass on some nvcc versions, which rejects them.
        cmd = [path, *NVCC_OPTIONS, f"-gencode=arch={compute},code={arch}",
               *(f"-I{d}" for d in include_dirs), *flags, "-o", str(out), str(src)]
        if settings.jit_debug:
            print(f"[fp8gemm.jit] {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"nvcc compile of {name_expr} failed ({proc.returncode}): "
                               f"{' '.join(cmd)}\n{log}")
        cubin = out.read_bytes()
    kernels = elf.kernel_names(cubin)
    if len(kernels) != 1:
        raise CompileError(f"expected exactly one kernel in the nvcc cubin, found {kernels}")
    return CompiledCubin(cubin, kernels[0], log, time.perf_counter() - start)


# --- choice ----------------------------------------------------------------------------------------
def get_compiler(requested: str | None = None) -> Compiler:
    """The compiler FP8GEMM_JIT_COMPILER asks for: "nvrtc", "nvcc", or "auto" (NVRTC when it
    can be imported, else nvcc)."""
    requested = (requested or settings.jit_compiler).lower()
    if requested not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"FP8GEMM_JIT_COMPILER must be 'auto', 'nvrtc' or 'nvcc', got {requested!r}")
    if requested in ("auto", "nvrtc"):
        ident = nvrtc_ident()
        if ident is not None:
            return Compiler("nvrtc", ident)
        if requested == "nvrtc":
            raise CompilerUnavailable("NVRTC requested but cuda.bindings.nvrtc / libnvrtc is "
                                      "missing: pip install cuda-bindings nvidia-cuda-nvrtc")
    path = nvcc_path()
    ident = _nvcc_ident(path) if path else None
    if ident is None:
        raise CompilerUnavailable("no CUDA compiler: install cuda-bindings + nvidia-cuda-nvrtc, "
                                  "or put nvcc on PATH")
    return Compiler("nvcc", ident)

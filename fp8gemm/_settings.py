"""Environment settings: the one place fp8gemm reads its environment variables.

Every value is read when asked, so tests and long-running servers see changes without a restart.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["settings", "hot_env"]

# NOTE: os.environ.get costs ~0.7 us (it encodes the key on every call). The per-call fast path
# of the ops reads the dict os.environ keeps in step with every change made through it.
_RAW_ENV = getattr(os.environ, "_data", None) if os.name == "posix" else None


def hot_env() -> tuple:
    """The raw values of the variables that change what a call does (backend, value checks):
    cheap enough for every call, and part of the ops' per-call cache key."""
    if _RAW_ENV is None:
        return (os.environ.get("FP8GEMM_BACKEND"), os.environ.get("FP8GEMM_CHECK_VALUES"))
    return (_RAW_ENV.get(b"FP8GEMM_BACKEND"), _RAW_ENV.get(b"FP8GEMM_CHECK_VALUES"))


def _flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no", "off")


class _Settings:
    """Read-only view of the FP8GEMM_* environment variables (see README.md)."""

    @property
    def backend(self) -> str:
        """FP8GEMM_BACKEND: force a backend ("reference", "triton", "cuda"); default "auto"."""
        return os.environ.get("FP8GEMM_BACKEND", "auto").strip().lower() or "auto"

    @property
    def print_configs(self) -> bool:
        """FP8GEMM_PRINT_CONFIGS=1: print the backend and config chosen for each new problem."""
        return _flag("FP8GEMM_PRINT_CONFIGS")

    @property
    def check_values(self) -> bool:
        """FP8GEMM_CHECK_VALUES=1: also check tensor *values* of CUDA inputs (finite scales, group
        indices in range). This reads device memory and so synchronises; CPU inputs are always
        checked."""
        return _flag("FP8GEMM_CHECK_VALUES")

    @property
    def cache_dir(self) -> Path:
        """FP8GEMM_CACHE_DIR: where compiled kernels and autotune results live."""
        default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8gemm"
        return Path(os.environ.get("FP8GEMM_CACHE_DIR", str(default))).expanduser()

    @property
    def jit_debug(self) -> bool:
        """FP8GEMM_JIT_DEBUG=1: print compiler commands, times and cache hits."""
        return _flag("FP8GEMM_JIT_DEBUG")

    @property
    def jit_compiler(self) -> str:
        """FP8GEMM_JIT_COMPILER: "nvrtc", "nvcc" or "auto" (NVRTC, nvcc when NVRTC is missing)."""
        return os.environ.get("FP8GEMM_JIT_COMPILER", "auto").strip().lower() or "auto"

    @property
    def dump_sass(self) -> bool:
        """FP8GEMM_DUMP_SASS=1: write the SASS of each newly compiled kernel beside its cubin."""
        return _flag("FP8GEMM_DUMP_SASS")

    @property
    def pdl(self) -> bool:
        """FP8GEMM_PDL=0: launch the CUDA kernels without programmatic dependent launch. With it
        (the default) a kernel may start its prologue, and the GEMMs their L2 prefetch of the
        weights, while the kernel before it in the stream finishes. Read when a kernel's launch
        configuration is built (a problem's first call)."""
        return _flag("FP8GEMM_PDL", default="1")

    @property
    def autotune(self) -> bool:
        """FP8GEMM_AUTOTUNE=1: time candidate configs on first use and store the winner."""
        return _flag("FP8GEMM_AUTOTUNE")


settings = _Settings()

"""Run-time compilation for CUDA kernels: knows nothing about GEMM.

- `compiler`: CUDA C++ -> cubin with NVRTC (`cuda.bindings.nvrtc`) or nvcc (FP8GEMM_JIT_COMPILER).
- `cache`: cubins on disk under FP8GEMM_CACHE_DIR, keyed by a hash of everything that shapes them,
  written atomically, checked (SHA-256, ELF header) when read.
- `runtime`: in-process cache, `cuLibraryLoadData`, launches through `cuLaunchKernelEx` with
  cluster dimensions and prebuilt argument packs.
- `tma`: `cuTensorMapEncodeTiled` descriptors, cached while pointer, shape and strides hold.

FP8GEMM_JIT_DEBUG=1 prints compiler commands, times and cache hits; FP8GEMM_DUMP_SASS=1 writes the
SASS of each newly compiled kernel beside its cache entry.
"""

from .compiler import CompileError, CompilerUnavailable, CompiledCubin, get_compiler, nvrtc_available
from .runtime import (Kernel, LaunchConfig, ParamPack, build, cache_key, clear_memory_cache,
                      compile_cached, cuobjdump_path, disassemble)
from .tma import Swizzle, TensorMap, TensorMapCache, encode_tiled

__all__ = ["CompileError", "CompilerUnavailable", "CompiledCubin", "get_compiler", "nvrtc_available",
           "Kernel", "LaunchConfig", "ParamPack", "build", "cache_key", "clear_memory_cache",
           "compile_cached", "cuobjdump_path", "disassemble", "Swizzle", "TensorMap", "TensorMapCache",
           "encode_tiled"]

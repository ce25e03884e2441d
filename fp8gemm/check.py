"""`python -m fp8gemm --check`: what a user debugging an install needs to see, with fixes."""

from __future__ import annotations

import os
import platform
import re
import tempfile

MIN_TRITON = (3, 2)  # first release whose tl.dot takes fp8 with the block-scaled recipe we use


def version_tuple(v: str) -> tuple[int, ...]:
    """'3.6.0+git' -> (3, 6, 0); compare versions as numbers, never as text."""
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _line(ok: bool | None, what: str, detail: str, fix: str = "") -> bool:
    mark = {True: "ok  ", False: "FAIL", None: "--  "}[ok]
    print(f"[{mark}] {what:<18} {detail}")
    if fix and ok is not True:
        print(f"{'':<25} -> {fix}")
    return ok is not False


def report() -> int:
    ok = True
    print(f"python {platform.python_version()} on {platform.machine()} ({platform.system()})")
    try:
        import torch
    except ImportError:
        _line(False, "torch", "not installed", "pip install torch (>= 2.4)")
        return 1
    import fp8gemm

    print(f"fp8gemm {fp8gemm.__version__} at {os.path.dirname(fp8gemm.__file__)}")
    tv = version_tuple(torch.__version__)
    ok &= _line(tv >= (2, 4), "torch", f"{torch.__version__} (CUDA {torch.version.cuda})",
                "pip install 'torch>=2.4'")
    hopper = False
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        hopper = cc == (9, 0)
        props = torch.cuda.get_device_properties(0)
        detail = (f"{name}, sm_{cc[0]}{cc[1]}{'a' if hopper else ''}, "
                  f"{props.multi_processor_count} SMs")
        _line(True if hopper else None, "GPU", detail,
              "the CUDA backend needs sm_90 (H100/H200/H800); Triton runs on sm_89+, "
              "the reference anywhere")
    else:
        _line(None, "GPU", "no CUDA device visible: only the reference backend and Triton's CPU "
              "interpreter (TRITON_INTERPRET=1) run",
              "on a GPU machine install a CUDA build of torch and check nvidia-smi")
    try:
        import triton

        ok &= _line(version_tuple(triton.__version__) >= MIN_TRITON, "triton", triton.__version__,
                    f"pip install 'triton>={'.'.join(map(str, MIN_TRITON))}'")
    except ImportError:
        _line(None, "triton", "not installed: the Triton backend is off",
              "pip install 'fp8gemm[triton]'")
    from .jit.compiler import nvcc_path, nvrtc_ident

    nvrtc, nvcc = nvrtc_ident(), nvcc_path()
    _line(True if nvrtc else None, "NVRTC", nvrtc or "not found",
          "pip install 'fp8gemm[cuda]' (cuda-bindings + nvidia-cuda-nvrtc)")
    _line(True if nvcc else None, "nvcc",
          nvcc or "not on PATH, in $CUDA_HOME/bin or /usr/local/cuda",
          "only needed when NVRTC is missing (FP8GEMM_JIT_COMPILER=nvcc)")
    if hopper and not (nvrtc or nvcc):
        ok &= _line(False, "CUDA JIT", "no compiler for the CUDA backend",
                    "pip install 'fp8gemm[cuda]'")
    cache = fp8gemm.settings.cache_dir
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache):
            pass
        _line(True, "cache dir", str(cache))
    except OSError as e:
        ok &= _line(False, "cache dir", f"{cache} not writable ({e.strerror})",
                    "set FP8GEMM_CACHE_DIR to a writable directory")
    from fp8gemm.backends import NAMES, get_backend, load_error

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in NAMES:
        mod = get_backend(name)
        if mod is None:
            _line(None, f"backend {name}", f"not importable ({load_error(name)})")
        else:
            avail = mod.is_available(dev)
            how = (" (Triton's CPU interpreter, TRITON_INTERPRET=1)"
                   if name == "triton" and dev.type == "cpu" and avail else "")
            why = ("not available on cpu: Triton runs on the CPU only under TRITON_INTERPRET=1 "
                   "(python -m fp8gemm sets it when there is no GPU)"
                   if name == "triton" and dev.type == "cpu" else f"not available on {dev}")
            _line(True if avail else None, f"backend {name}",
                  f"available on {dev}{how}" if avail else why)
    print("all good" if ok else "some checks failed: see the lines marked FAIL")
    return 0 if ok else 1

"""The Gluon kernel compiled for sm_90 on the CPU (no GPU needed): every kind and output
dtype the backend launches must compile without register spills and without ptxas
serialising the wgmmas (C7514 / C7515: the two accumulators in flight would then gain
nothing). Uses the ptxas that Triton ships, the one it runs on the GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fp8gemm.backends.triton import config, gluon_fp8_gemm  # noqa: E402
from fp8gemm.problem import GemmKind, GemmProblem, Recipe  # noqa: E402

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_H200 = config.DeviceFacts("H200", (9, 0), 132, 232448, 60 << 20)
_GL = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _compile(kind: int, out: torch.dtype, stages: int):
    la, lb, lo = gluon_fp8_gemm.gluon_layouts(torch.float8_e4m3fn, torch.float8_e5m2, out,
                                              128, 128, 128)
    fn = gluon_fp8_gemm._gluon_fp8_gemm_kernel
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(a_desc=f"tensordesc<fp8e4nv[128, 128],{la!r}>",
               b_desc=f"tensordesc<fp8e5[128, 128],{lb!r}>",
               out_desc=f"tensordesc<{_GL[out]}[64, 128],{lo!r}>", out_ptr=f"*{_GL[out]}",
               sa_ptr="*fp32", sb_ptr="*fp32", idx_ptr="*i32")
    consts = dict(KIND=kind, GROUP_M=8, STAGES=stages, num_warps=4)
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=gluon_fp8_gemm._MAXNREG))


@pytest.mark.skipif(not _PTXAS.exists(), reason="Triton without its ptxas")
@pytest.mark.parametrize("kind", [GemmKind.DENSE, GemmKind.CONTIGUOUS, GemmKind.MASKED],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=lambda d: _GL[d])
def test_gluon_kernel_compiles_without_spills(kind, out, tmp_path):
    prob = GemmProblem(kind, 4096, 4096, 7168, 4, torch.float8_e4m3fn, torch.float8_e5m2,
                       Recipe.GROUP, Recipe.BLOCK, out, expected_m=1024)
    cfg = config.choose_config(prob, _H200)
    assert cfg.gluon
    k = _compile({GemmKind.DENSE: 0, GemmKind.CONTIGUOUS: 1, GemmKind.MASKED: 3}[kind], out,
                 cfg.num_stages)
    assert k.metadata.shared <= _H200.smem_per_block
    ptx = tmp_path / "k.ptx"
    ptx.write_text(k.asm["ptx"])
    log = subprocess.run([str(_PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True,
                         check=True).stderr
    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
    assert "C7514" not in log and "C7515" not in log and "serialized" not in log, log
    assert "QGMMA" in _sass(k.asm["cubin"], tmp_path)


def _sass(cubin: bytes, tmp_path: Path) -> str:
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(_PTXAS.parent / "cuobjdump"), "-sass", str(path)],
                          capture_output=True, text=True, check=True).stdout

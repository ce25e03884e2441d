"""The Gluon kernel compiled for sm_90a on the CPU (no GPU needed), as its family launches it for
the configs the heuristic picks: every kind and output dtype must compile without register
spills and without ptxas serialising the wgmmas (C7514 / C7515: the two accumulators in flight
would then gain nothing), and use the FP8 tensor-core instruction (QGMMA). Uses the ptxas that
Triton ships, the one it runs on the GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import fp8gemm.backends.triton as tb  # noqa: E402
from fp8gemm.backends.family import DeviceFacts  # noqa: E402
from fp8gemm.backends.triton import gluon_fp8_gemm  # noqa: E402
from fp8gemm.problem import GemmKind, GemmProblem, Recipe  # noqa: E402

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_H200 = DeviceFacts("NVIDIA H200", (9, 0), 132, 232448)
_GL = {torch.bfloat16: "bf16", torch.float32: "fp32"}


@pytest.mark.skipif(not _PTXAS.exists(), reason="Triton without its ptxas")
@pytest.mark.parametrize("kind", [GemmKind.DENSE, GemmKind.CONTIGUOUS, GemmKind.MASKED],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=lambda d: _GL[d])
def test_gluon_kernel_compiles_without_spills(kind, out, tmp_path):
    prob = GemmProblem(kind, 4096, 4096, 7168, 4, torch.float8_e4m3fn, torch.float8_e5m2,
                       Recipe.GROUP, Recipe.BLOCK, out, expected_m=1024)
    family = tb.family_for(prob, _H200)
    assert family is gluon_fp8_gemm.FAMILY
    cfg = family.select_config(prob, _H200)
    k = gluon_fp8_gemm.compile_config(cfg, prob, GPUTarget("cuda", 90, 32))
    # launched with num_warps = 4 (the default partition); with the workers' 4 + 1 warps the
    # kernel holds three warpgroups
    assert cfg.num_warps == 4 and k.metadata.num_warps == 12
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

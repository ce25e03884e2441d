#!/usr/bin/env python3
"""One warm-up call, then one call inside the NVTX range "profiled", of an implementation of the
bench on one shape: what scripts/ncu_dense.sh profiles.

    python scripts/ncu_call.py SHAPE IMPL OP

SHAPE is MxNxK (grouped: GxMxNxK, sGxMxNxK for the moe-skewed suite's skewed sizes), OP the
bench's op (dense, dgrad, wgrad, contiguous, offsets, masked). IMPL is a bench implementation
(fp8gemm-cuda, deepgemm, cublas-block, ...) or `fp8gemm-cuda:VARIANT`: a config of the CUDA
family that takes the problem, VARIANT in scripts/cuda_tiles.py's syntax, run through the
family's `run`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import cuda_tiles as ct  # noqa: E402
from fp8gemm.backends.cuda import family_for  # noqa: E402
from fp8gemm.backends.family import DeviceFacts  # noqa: E402
from fp8gemm.bench.impls import make_data, make_impl  # noqa: E402
from fp8gemm.bench.suites import Case, skewed_sizes  # noqa: E402
from fp8gemm.problem import GemmKind  # noqa: E402


def variant_call(spec: str, op: str, data, g: int, m: int, n: int, k: int):
    """(call, out): the call of the CUDA family's config `spec` for the bench's data of `op`, and
    the output it writes."""
    wgrad = op == "wgrad"
    if op in ("dense", "dgrad", "wgrad"):
        problem = ct.wgrad_problem(m, n, k) if wgrad else ct.dense_problem(m, n, k)
        index = None
    else:
        kind = GemmKind(op)
        problem = ct.grouped_problem(kind, data, g, m, n, k)
        index = {GemmKind.CONTIGUOUS: data.m_indices, GemmKind.OFFSETS: data.offsets,
                 GemmKind.MASKED: data.masked_m}[kind]
    fam = family_for(problem)
    dev = data.a.device
    facts = DeviceFacts.of(dev)
    base = fam.select_config(problem, facts)
    stages = max(c.num_stages for c in fam.candidate_configs(problem, facts) + [base])
    cfg = ct.derive(base, ct.parse_variant(spec, fam.Config), problem, facts, stages)
    if cfg is None:
        raise SystemExit(f"{spec}: no stage count fits {facts.smem_per_block} bytes")
    print(f"{fam.name} {cfg}", flush=True)
    out = torch.zeros(data.a.shape[:-1] + (n,), dtype=torch.float32 if wgrad else torch.bfloat16,
                      device=dev)
    return (lambda: fam.run(cfg, problem, data.a, data.sa, data.b, data.sb, out,
                            out if wgrad else None, index)), out


def shape_data(shape: str, op: str, name: str):
    """(data, g, m, n, k): the bench's data of `op` for SHAPE as this script takes it (MxNxK,
    GxMxNxK, sGxMxNxK for the moe-skewed suite's skewed sizes), on the GPU."""
    dims = [int(v) for v in shape.lstrip("s").split("x")]
    g, (m, n, k) = (dims[0], dims[1:]) if len(dims) == 4 else (1, dims)
    sizes = skewed_sizes(g * m, g) if shape.startswith("s") else ()
    data = make_data(Case(name, op, m, n, k, groups=g, sizes=sizes), torch.device("cuda"))
    return data, g, m, n, k


def main() -> None:
    shape, impl, op = sys.argv[1:4]
    data, g, m, n, k = shape_data(shape, op, "ncu")
    name, _, spec = impl.partition(":")
    fn = variant_call(spec, op, data, g, m, n, k)[0] if spec else make_impl(impl, data).fn
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

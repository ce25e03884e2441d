"""The public ops as `torch.library` custom ops, so `torch.compile` traces them as single nodes.

    y = torch.ops.fp8gemm.fp8_gemm_nt(a, sa, b, sb)                 # c=None, out_dtype=bf16
    q, s = torch.ops.fp8gemm.quantize_per_token(x)

`import fp8gemm` registers them, and the public functions (`fp8gemm.fp8_gemm_nt`,
`fp8gemm.quantize_per_token`, ...) call them while torch.compile traces, so a compiled function
written with the public API has one node per op and gives eager's bits. The arguments and their
defaults are the public functions' (operands as separate tensors; no `out=`: the functional
form compilers want; grouped ops return zeros in rows no group writes).

Each op has a fake implementation: it runs the public op's own checks on the fake tensors (shape,
dtype, device and scale-shape errors surface while tracing, with the eager messages) and gives
the output's shape, dtype and strides. Checks of values (finite scales, indices in range) need
data, so they do not run while tracing; on the CPU the compiled graph's ops run them when called.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import quant
from .ops import gemm as _gemm
from .ops import grouped as _grouped
from .ops import k_grouped as _k_grouped

__all__ = ["fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked", "k_grouped_fp8_gemm_nt_contiguous",
           "quantize_per_token", "silu_mul_quantize_per_token", "quantize_per_block"]

_LIB = "fp8gemm"


@torch.library.custom_op(f"{_LIB}::fp8_gemm_nt", mutates_args=())
def fp8_gemm_nt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                c: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                backend: str = "auto") -> torch.Tensor:
    return _gemm.fp8_gemm_nt((a, sa), (b, sb), c=c, out_dtype=out_dtype, backend=backend)


@fp8_gemm_nt.register_fake
def _(a, sa, b, sb, c=None, out_dtype=None, backend="auto"):
    *_, (m, n, _k), dtype = _gemm.check_dense((a, sa), (b, sb), None, c, out_dtype)
    return a.new_empty((m, n), dtype=dtype)


@torch.library.custom_op(f"{_LIB}::m_grouped_fp8_gemm_nt_contiguous", mutates_args=())
def m_grouped_fp8_gemm_nt_contiguous(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                     sb: torch.Tensor, m_indices: torch.Tensor,
                                     out_dtype: Optional[torch.dtype] = None,
                                     backend: str = "auto") -> torch.Tensor:
    return _grouped.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), None, m_indices,
                                                     out_dtype=out_dtype, backend=backend)


@m_grouped_fp8_gemm_nt_contiguous.register_fake
def _(a, sa, b, sb, m_indices, out_dtype=None, backend="auto"):
    *_, (m, n, _k, _g), _dev, dtype = _grouped.check_contiguous((a, sa), (b, sb), None,
                                                                m_indices, out_dtype)
    return a.new_empty((m, n), dtype=dtype)


@torch.library.custom_op(f"{_LIB}::m_grouped_fp8_gemm_nt_offsets", mutates_args=())
def m_grouped_fp8_gemm_nt_offsets(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                  sb: torch.Tensor, offsets: torch.Tensor,
                                  out_dtype: Optional[torch.dtype] = None,
                                  backend: str = "auto") -> torch.Tensor:
    return _grouped.m_grouped_fp8_gemm_nt_offsets((a, sa), (b, sb), None, offsets,
                                                  out_dtype=out_dtype, backend=backend)


@m_grouped_fp8_gemm_nt_offsets.register_fake
def _(a, sa, b, sb, offsets, out_dtype=None, backend="auto"):
    *_, (m, n, _k, _g), _dev, dtype = _grouped.check_offsets((a, sa), (b, sb), None, offsets,
                                                             out_dtype)
    return a.new_empty((m, n), dtype=dtype)


@torch.library.custom_op(f"{_LIB}::m_grouped_fp8_gemm_nt_masked", mutates_args=())
def m_grouped_fp8_gemm_nt_masked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                 sb: torch.Tensor, masked_m: torch.Tensor,
                                 expected_m: Optional[int] = None,
                                 out_dtype: Optional[torch.dtype] = None,
                                 backend: str = "auto") -> torch.Tensor:
    return _grouped.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), None, masked_m, expected_m,
                                                 out_dtype=out_dtype, backend=backend)


@m_grouped_fp8_gemm_nt_masked.register_fake
def _(a, sa, b, sb, masked_m, expected_m=None, out_dtype=None, backend="auto"):
    *_, (g, mmax, n, _k), _dev, dtype, _em = _grouped.check_masked(
        (a, sa), (b, sb), None, masked_m, expected_m, out_dtype)
    return a.new_empty((g, mmax, n), dtype=dtype)


@torch.library.custom_op(f"{_LIB}::k_grouped_fp8_gemm_nt_contiguous", mutates_args=())
def k_grouped_fp8_gemm_nt_contiguous(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                     sb: torch.Tensor, ks: torch.Tensor,
                                     c: Optional[torch.Tensor] = None,
                                     backend: str = "auto") -> torch.Tensor:
    return _k_grouped.k_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), None, ks, c=c,
                                                       backend=backend)


@k_grouped_fp8_gemm_nt_contiguous.register_fake
def _(a, sa, b, sb, ks, c=None, backend="auto"):
    *_, (g, m, n, _k, _kb), _dev = _k_grouped.check_k_grouped((a, sa), (b, sb), None, ks, c)
    return a.new_empty((g, m, n), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor, fmt: str = "e4m3", pow2_scales: bool = False,
                       col_major_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.quantize_per_token(x, fmt, pow2_scales=pow2_scales,
                                    col_major_scales=col_major_scales)


@quantize_per_token.register_fake
def _(x, fmt="e4m3", pow2_scales=False, col_major_scales=True):
    quant._check_input(x, 2)
    return quant.per_token_torch(x, fmt, pow2_scales, col_major_scales)


@torch.library.custom_op(f"{_LIB}::silu_mul_quantize_per_token", mutates_args=())
def silu_mul_quantize_per_token(x: torch.Tensor, fmt: str = "e4m3", pow2_scales: bool = False,
                                col_major_scales: bool = True,
                                masked_m: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.silu_mul_quantize_per_token(x, fmt, pow2_scales=pow2_scales,
                                             col_major_scales=col_major_scales, masked_m=masked_m)


@silu_mul_quantize_per_token.register_fake
def _(x, fmt="e4m3", pow2_scales=False, col_major_scales=True, masked_m=None):
    quant._check_input(x, 2)
    if x.shape[-1] % 2:
        raise ValueError(f"x must be [..., T, 2I] with an even last dim, got {list(x.shape)}")
    if masked_m is not None:
        quant._check_masked_m(x, masked_m)
    return quant.silu_mul_per_token_torch(x, fmt, pow2_scales, col_major_scales)


@torch.library.custom_op(f"{_LIB}::quantize_per_block", mutates_args=())
def quantize_per_block(w: torch.Tensor, fmt: str = "e4m3",
                       pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.quantize_per_block(w, fmt, pow2_scales=pow2_scales)


@quantize_per_block.register_fake
def _(w, fmt="e4m3", pow2_scales=False):
    quant._check_input(w, 2)
    return quant.per_block_torch(w, fmt, pow2_scales)

"""The public ops as `torch.library` custom ops, so `torch.compile` traces them as single nodes.

    y = torch.ops.fp8gemm.fp8_gemm_nt(a, sa, b, sb, None, torch.bfloat16)

Each op has a fake (meta) implementation giving output shapes, dtypes and strides, so graphs
compile without running kernels. They return new tensors (no `out=`): the functional form that
compilers want.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops, quant

__all__ = ["fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked", "quantize_per_token", "silu_mul_quantize_per_token",
           "quantize_per_block"]

_LIB = "fp8gemm"


@torch.library.custom_op(f"{_LIB}::fp8_gemm_nt", mutates_args=())
def fp8_gemm_nt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                c: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return ops.fp8_gemm_nt((a, sa), (b, sb), c=c, out_dtype=out_dtype)


@fp8_gemm_nt.register_fake
def _(a, sa, b, sb, c, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::m_grouped_fp8_gemm_nt_contiguous", mutates_args=())
def m_grouped_fp8_gemm_nt_contiguous(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                     sb: torch.Tensor, m_indices: torch.Tensor,
                                     out_dtype: torch.dtype) -> torch.Tensor:
    return ops.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), None, m_indices,
                                                out_dtype=out_dtype)


@m_grouped_fp8_gemm_nt_contiguous.register_fake
def _(a, sa, b, sb, m_indices, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::m_grouped_fp8_gemm_nt_offsets", mutates_args=())
def m_grouped_fp8_gemm_nt_offsets(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                  sb: torch.Tensor, offsets: torch.Tensor,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    return ops.m_grouped_fp8_gemm_nt_offsets((a, sa), (b, sb), None, offsets, out_dtype=out_dtype)


@m_grouped_fp8_gemm_nt_offsets.register_fake
def _(a, sa, b, sb, offsets, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::m_grouped_fp8_gemm_nt_masked", mutates_args=())
def m_grouped_fp8_gemm_nt_masked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor,
                                 sb: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                 out_dtype: torch.dtype) -> torch.Tensor:
    return ops.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), None, masked_m, expected_m,
                                            out_dtype=out_dtype)


@m_grouped_fp8_gemm_nt_masked.register_fake
def _(a, sa, b, sb, masked_m, expected_m, out_dtype):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor, fmt: str = "e4m3",
                       pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quant.quantize_per_token(x, fmt, pow2_scales=pow2_scales)
    return q, s


@quantize_per_token.register_fake
def _(x, fmt="e4m3", pow2_scales=False):
    return _fake_per_token(x, x.shape[-1], fmt)


@torch.library.custom_op(f"{_LIB}::silu_mul_quantize_per_token", mutates_args=())
def silu_mul_quantize_per_token(x: torch.Tensor, fmt: str = "e4m3",
                                pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quant.silu_mul_quantize_per_token(x, fmt, pow2_scales=pow2_scales)
    return q, s


@silu_mul_quantize_per_token.register_fake
def _(x, fmt="e4m3", pow2_scales=False):
    return _fake_per_token(x, x.shape[-1] // 2, fmt)


def _fake_per_token(x: torch.Tensor, k: int, fmt: str):
    from .layout import get_tma_aligned_size
    from .problem import ceil_div

    dtype, _ = quant.fp8_dtype(fmt)
    *lead, m, _ = x.shape
    kb, mp = ceil_div(k, 128), get_tma_aligned_size(m, 4)
    lead_strides = []
    step = kb * mp
    for d in reversed(lead):
        lead_strides.insert(0, step)
        step *= d
    s = x.new_empty_strided((*lead, m, kb), (*lead_strides, 1, mp), dtype=torch.float32)
    return x.new_empty((*lead, m, k), dtype=dtype), s


@torch.library.custom_op(f"{_LIB}::quantize_per_block", mutates_args=())
def quantize_per_block(w: torch.Tensor, fmt: str = "e4m3",
                       pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.quantize_per_block(w, fmt, pow2_scales=pow2_scales)


@quantize_per_block.register_fake
def _(w, fmt="e4m3", pow2_scales=False):
    from .problem import ceil_div

    dtype, _ = quant.fp8_dtype(fmt)
    *lead, n, k = w.shape
    return (w.new_empty(w.shape, dtype=dtype),
            w.new_empty((*lead, ceil_div(n, 128), ceil_div(k, 128)), dtype=torch.float32))

"""Public ops: validate inputs, build the problem, pick a backend, call it."""

from .gemm import fp8_gemm_nt
from .grouped import (m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked,
                      m_grouped_fp8_gemm_nt_offsets)

__all__ = ["fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked"]

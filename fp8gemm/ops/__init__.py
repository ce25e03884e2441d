"""Public ops: validate inputs, build the problem, pick a backend, call it."""

from .gemm import fp8_gemm_nt
from .grouped import (m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked,
                      m_grouped_fp8_gemm_nt_offsets)
from .k_grouped import k_grouped_fp8_gemm_nt_contiguous

__all__ = ["fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
           "m_grouped_fp8_gemm_nt_masked", "k_grouped_fp8_gemm_nt_contiguous"]

"""fp8gemm: FP8 matrix multiplications with fine-grained scaling for NVIDIA Hopper GPUs.

    a, sa = fp8gemm.quantize_per_token(x)        # [M, K] -> fp8 + [M, ceil(K/128)] scales
    b, sb = fp8gemm.quantize_per_block(w)        # [N, K] -> fp8 + [ceil(N/128), ceil(K/128)]
    y = fp8gemm.fp8_gemm_nt((a, sa), (b, sb))    # bf16 [M, N], FP32 accumulation
"""

from ._settings import settings
from .layout import (get_col_major_tma_aligned_tensor, get_m_alignment_for_contiguous_layout,
                     get_num_sms, get_tma_aligned_size, set_num_sms)
from .moe import (ContiguousLayout, MaskedLayout, moe_combine_contiguous, moe_combine_masked,
                  moe_dispatch_contiguous, moe_dispatch_masked)
from .ops import (fp8_gemm_nt, k_grouped_fp8_gemm_nt_contiguous,
                  m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked,
                  m_grouped_fp8_gemm_nt_offsets)
from .problem import GemmKind, GemmProblem, Recipe
from .quant import (DelayedScaling, calc_diff, dequantize_per_block, quantize_per_block,
                    quantize_per_block_transposed, quantize_per_channel, quantize_per_tensor,
                    quantize_per_token, quantize_per_token_transposed, silu_mul_quantize_per_token)

from . import torch_ops  # noqa: E402  (registers torch.ops.fp8gemm.*, used while compiling)
from . import nn  # noqa: E402  (fp8gemm.nn: Fp8Linear, Fp8MoE, convert)

__version__ = "0.1.0"

__all__ = [
    "fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_offsets",
    "m_grouped_fp8_gemm_nt_masked", "k_grouped_fp8_gemm_nt_contiguous",
    "quantize_per_token", "quantize_per_block", "dequantize_per_block", "quantize_per_tensor",
    "quantize_per_channel",
    "silu_mul_quantize_per_token", "quantize_per_token_transposed", "quantize_per_block_transposed",
    "DelayedScaling", "calc_diff",
    "get_tma_aligned_size", "get_col_major_tma_aligned_tensor",
    "get_m_alignment_for_contiguous_layout", "set_num_sms", "get_num_sms",
    "ContiguousLayout", "MaskedLayout", "moe_dispatch_contiguous", "moe_combine_contiguous",
    "moe_dispatch_masked", "moe_combine_masked",
    "GemmKind", "GemmProblem", "Recipe", "settings", "nn", "torch_ops", "__version__",
]
